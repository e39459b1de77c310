"""The sdx model folder (sdx/model_folder.py) and the file I/O under it (sdx/io.py).

No torch here: folders are written from random arrays shaped by the `tiny` preset's abstract models.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from sdx import io, model_folder, presets, weights
from sdx.errors import SdxError
from sdx.layers import Compute
from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]


def _random_parts(preset: str, seed: int = 0) -> dict[str, model_folder.ModelPart]:
    p = presets.get(preset)
    rng = np.random.default_rng(seed)
    parts = {}
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        if name not in p.configs:
            continue
        kind = model_folder.MODEL_KINDS[name]
        config = kind.config_from_diffusers(p.configs[name])
        shapes = weights.param_shapes(kind.abstract(config))
        arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
        cls = p.configs[name].get("_class_name") or p.configs[name]["architectures"][0]
        parts[name] = model_folder.ModelPart(cls=cls, config=config, arrays=arrays, source_config=p.configs[name])
    return parts


def _write(out: Path, preset: str = "tiny", **kw) -> Path:
    from sdx.tokenizer import write_builtin_folder

    p = presets.get(preset)
    toks = {t: write_builtin_folder(out.parent / f"{out.name}-src-{t}") for t in p.tokenizers}
    return model_folder.write_model_folder(
        out, pipeline_class=p.pipeline_class, models=kw.pop("models", None) or _random_parts(preset),
        tokenizers=toks, scheduler=p.configs["scheduler"], extra=p.extra, **kw,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("m") / "tiny")


def _params(model) -> dict[str, jax.Array]:
    return {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# --------------------------------------------------------------------------------------------------
# Loading


def test_load_component_as_stored_cast_and_placed(tiny):
    stored = model_folder.read_arrays(tiny, "vae")
    vae = model_folder.load_component(tiny, "vae")
    params = _params(vae)
    assert set(params) == set(stored)
    for k, v in params.items():
        assert v.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(v), stored[k])

    vae16 = model_folder.load_component(tiny, "vae", dtype="bfloat16")
    assert {v.dtype for v in _params(vae16).values()} == {jnp.dtype(jnp.bfloat16)}
    assert vae16.compute.param_dtype == jnp.bfloat16 and vae16.compute.dtype == jnp.bfloat16

    run_f32 = Compute(dtype=jnp.float32)
    vae_mixed = model_folder.load_component(tiny, "vae", dtype=jnp.bfloat16, compute=run_f32)
    assert vae_mixed.compute.dtype == jnp.float32 and vae_mixed.compute.param_dtype == jnp.bfloat16

    device = jax.devices()[0]
    single = jax.sharding.SingleDeviceSharding(device)
    te = model_folder.load_component(tiny, "text_encoder", sharding=single)
    assert all(v.sharding == single for v in _params(te).values())
    seen = []

    def rule(path, shape):
        seen.append((path, shape))
        return single

    te = model_folder.load_component(tiny, "text_encoder", sharding=rule)
    stored = model_folder.read_arrays(tiny, "text_encoder")
    assert dict(seen) == {k: v.shape for k, v in stored.items()}
    for k, v in _params(te).items():
        np.testing.assert_array_equal(np.asarray(v), stored[k])


def test_folder_parts(tiny):
    """Configs, tokenizers and the scheduler config come back as written; a missing component is named."""
    from sdx.tokenizer import CLIPTokenizer

    spec = model_folder.read_spec(tiny)
    assert spec["pipeline_class"] == "StableDiffusionPipeline" and spec["dtype"] == "float32"
    for name in ("unet", "vae", "text_encoder"):
        want = model_folder.MODEL_KINDS[name].config_from_diffusers(presets.get("tiny").configs[name])
        assert model_folder.model_config(tiny, name, spec=spec) == want
    assert isinstance(model_folder.load_tokenizer(tiny, spec=spec), CLIPTokenizer)
    assert model_folder.scheduler_config(tiny, spec=spec) == presets.get("tiny").configs["scheduler"]
    te = model_folder.load_component(tiny, "text_encoder", spec=spec)
    assert te(jnp.zeros((1, 77), jnp.int32)).last_hidden_state.shape == (1, 77, 32)
    with pytest.raises(SdxError, match="no component 'text_encoder_2'"):
        model_folder.load_component(tiny, "text_encoder_2", spec=spec)


def test_param_shapes_are_shared_read_only():
    kind = model_folder.MODEL_KINDS["vae"]
    config = kind.config_from_diffusers(presets.get("tiny").configs["vae"])
    shapes = kind.param_shapes(config)
    assert shapes is kind.param_shapes(config)
    with pytest.raises(TypeError):
        shapes["quant_conv.bias"] = (1,)


def test_sharded_load_over_fake_devices(tiny):
    """FSDP-sharded loading over 4 fake CPU devices: each device gets its slice; values intact."""
    code = textwrap.dedent(f"""
        import numpy as np, jax
        from sdx import mesh, model_folder
        from flax import nnx
        assert len(jax.devices()) == 4
        m = mesh.make_mesh(fsdp=4)
        unet = model_folder.load_component({str(tiny)!r}, "unet", sharding=mesh.param_sharding(m, min_size=1024))
        stored = model_folder.read_arrays({str(tiny)!r}, "unet")
        split = 0
        for p, v in nnx.to_flat_state(nnx.state(unet, nnx.Param)):
            a = v.get_value()
            key = ".".join(map(str, p))
            np.testing.assert_array_equal(np.asarray(a), stored[key])
            if a.addressable_shards[0].data.shape != a.shape:
                split += 1
        assert split > 10, split
        print("ok", split)
    """)
    env = child_env(devices=4)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")


def _edit_file(folder: Path, name: str, edit) -> Path:
    path = folder / f"{name}.safetensors"
    arrays = {k: np.array(v) for k, v in io.read_safetensors(path).items()}
    edit(arrays)
    io.write_safetensors(path, arrays, metadata={"component": name})
    return path


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda a: a.pop("decoder.conv_out.bias"), ["missing", "decoder.conv_out.bias"]),
        (lambda a: a.update({"decoder.extra.kernel": np.zeros(2, np.float32)}), ["'decoder.extra.kernel'", "unexpected"]),
        (lambda a: a.update({"decoder.conv_out.bias": np.zeros(2, np.float32)}), ["'decoder.conv_out.bias'", "(2,)"]),
    ],
    ids=["missing", "extra", "misshapen"],
)
def test_load_is_strict(tiny, tmp_path, edit, words):
    folder = tmp_path / "m"
    model_folder.resave(tiny, folder, dtype="float32")
    path = _edit_file(folder, "vae", edit)
    with pytest.raises(SdxError) as info:
        model_folder.load_component(folder, "vae")
    for w in [str(path), *words]:
        assert w in str(info.value)


def test_spec_is_checked(tiny, tmp_path):
    folder = tmp_path / "m"
    model_folder.resave(tiny, folder, dtype="float32")
    spec = json.loads((folder / "sdx.json").read_text())
    (folder / "sdx.json").write_text(json.dumps({**spec, "format_version": 99}))
    with pytest.raises(SdxError, match="format_version 99"):
        model_folder.load_component(folder, "vae")
    (folder / "sdx.json").write_text(json.dumps({**spec, "pipeline_class": "FluxPipeline"}))
    with pytest.raises(SdxError, match="unknown pipeline class 'FluxPipeline'"):
        model_folder.read_spec(folder)
    (folder / "sdx.json").write_text(json.dumps(spec))
    (folder / "unet.safetensors").rename(folder / "vae.safetensors")
    with pytest.raises(SdxError, match="holds component 'unet'"):
        model_folder.load_component(folder, "vae")
    with pytest.raises(SdxError, match="not an sdx model folder"):
        model_folder.read_spec(tmp_path)


# --------------------------------------------------------------------------------------------------
# Writing


def test_write_is_atomic_and_strict(tmp_path):
    parts = _random_parts("tiny")
    parts["vae"].arrays.pop("quant_conv.bias")
    with pytest.raises(SdxError, match="quant_conv.bias"):
        _write(tmp_path / "out", models=parts)
    assert not [p for p in tmp_path.iterdir() if p.name == "out" or p.name.startswith("out.")]
    good = _random_parts("tiny")
    out = _write(tmp_path / "out", models=good, dtype="float16")
    assert oct(out.stat().st_mode & 0o777) == oct(io.default_mode(folder=True))
    assert oct((out / "unet.safetensors").stat().st_mode & 0o777) == oct(io.default_mode())
    with pytest.raises(SdxError, match="not empty"):
        _write(tmp_path / "out", models=good)


def test_module_arrays_round_trip(tiny, tmp_path):
    """A trainer saves live models with module_arrays + write_model_folder; loading gives them back."""
    unet = model_folder.load_component(tiny, "unet")
    parts = _random_parts("tiny")
    parts["unet"].arrays = model_folder.module_arrays(unet)
    out = _write(tmp_path / "out", models=parts)
    again = model_folder.load_component(out, "unet")
    for (k, a), (k2, b) in zip(sorted(_params(unet).items()), sorted(_params(again).items()), strict=True):
        assert k == k2
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_sdxl_layout_and_torch_state(tmp_path):
    out = _write(tmp_path / "xl", preset="tiny_xl")
    spec = model_folder.read_spec(out)
    assert spec["components"]["text_encoder_2"]["class"] == "CLIPTextModelWithProjection"
    assert spec["extra"] == {"force_zeros_for_empty_prompt": True}
    assert sorted(p.name for p in out.iterdir()) == [
        "sdx.json", "text_encoder.safetensors", "text_encoder_2.safetensors", "tokenizer", "tokenizer_2",
        "unet.safetensors", "vae.safetensors",
    ]
    state = model_folder.torch_state(out, "text_encoder_2")
    arrays = model_folder.read_arrays(out, "text_encoder_2")
    np.testing.assert_array_equal(state["text_projection.weight"], arrays["text_projection.kernel"].T)
    assert "text_model.final_layer_norm.weight" in state


# --------------------------------------------------------------------------------------------------
# sdx.weights


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.emb = nnx.Embed(10, 4, rngs=rngs)
        self.lin = nnx.Linear(4, 3, rngs=rngs)
        self.conv = nnx.Conv(3, 5, (3, 2), rngs=rngs)
        self.norm = nnx.LayerNorm(5, rngs=rngs)


def test_torch_mapping_is_bidirectional():
    rng = np.random.default_rng(0)
    torch_state = {
        "emb.weight": rng.standard_normal((10, 4)), "lin.weight": rng.standard_normal((3, 4)), "lin.bias": rng.standard_normal(3),
        "conv.weight": rng.standard_normal((5, 3, 3, 2)), "conv.bias": rng.standard_normal(5),
        "norm.weight": rng.standard_normal(5), "norm.bias": rng.standard_normal(5),
    }
    model = weights.abstract(_Tiny)
    sdx = weights.from_torch_keys(weights.param_shapes(model), torch_state, where="t")
    assert sdx["emb.embedding"].shape == (10, 4) and sdx["lin.kernel"].shape == (4, 3)
    assert sdx["conv.kernel"].shape == (3, 2, 3, 5) and "norm.scale" in sdx
    back = weights.to_torch_keys(sdx)
    assert set(back) == set(torch_state)
    for k in torch_state:
        np.testing.assert_array_equal(back[k], torch_state[k])
    live = weights.materialize(model, sdx)
    x = jnp.asarray(rng.standard_normal((1, 4, 4, 3)), jnp.float32)
    ref = jax.lax.conv_general_dilated(  # torch semantics: OIHW kernel, cross-correlation, SAME padding
        x.transpose(0, 3, 1, 2), jnp.asarray(torch_state["conv.weight"], jnp.float32), (1, 1), "SAME",
    ).transpose(0, 2, 3, 1) + torch_state["conv.bias"]
    np.testing.assert_allclose(np.asarray(live.conv(x)), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_abstract_matches_a_real_build():
    """`abstract` uses constant-key Rngs for speed; shapes and dtypes must equal a normal build's."""
    for preset, names in (("tiny", ("unet", "vae", "text_encoder")), ("tiny_xl", ("text_encoder_2",))):
        for name, part in _random_parts(preset).items():
            if name not in names:
                continue
            kind = model_folder.MODEL_KINDS[name]
            cp = Compute(param_dtype=jnp.bfloat16)
            ours = nnx.state(kind.abstract(part.config, cp))
            ref = nnx.state(nnx.eval_shape(lambda k=kind, c=part.config, cp=cp: k.build(c, cp, nnx.Rngs(0))), nnx.Param)
            flat = lambda s: {p: (v.get_value().shape, v.get_value().dtype) for p, v in nnx.to_flat_state(s)}  # noqa: E731
            assert flat(ours) == flat(ref), (preset, name)


def test_abstract_is_built_once_and_each_call_gets_its_own_copy(monkeypatch):
    """The second `abstract` for the same arguments builds nothing (the first one's parts are kept), and what
    is done to one copy in place (a load fills its variables) leaves the other abstract."""
    kind = model_folder.MODEL_KINDS["vae"]
    config = kind.config_from_diffusers(presets.get("tiny").configs["vae"])
    cp = Compute(attention_chunk=17)  # arguments no other test asks for: the first call here builds
    builds = []
    real = model_folder.ModelKind.build
    monkeypatch.setattr(model_folder.ModelKind, "build", lambda self, *a, **k: builds.append(a) or real(self, *a, **k))
    a, b = kind.abstract(config, cp), kind.abstract(config, cp)
    assert len(builds) == 1
    assert nnx.graphdef(a) == nnx.graphdef(b)
    params = lambda m: dict(nnx.to_flat_state(nnx.state(m, nnx.Param)))  # noqa: E731
    path, var = next(iter(params(a).items()))
    var.set_value(jnp.ones(var.get_value().shape, var.get_value().dtype))
    assert isinstance(params(b)[path].get_value(), jax.ShapeDtypeStruct)
    assert isinstance(params(kind.abstract(config, cp))[path].get_value(), jax.ShapeDtypeStruct)
    assert len(builds) == 1


def _file_pages() -> int:
    """Bytes of file-backed memory this process has mapped (Linux)."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status["RssFile"].split()[0]) * 1024


def _big_file(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((2048, 4096)).astype(np.float32),
               "b": rng.standard_normal((2048, 4096)).astype(np.float32)}  # 32 MiB each
    io.write_safetensors(tmp_path / "big.safetensors", tensors)
    return tmp_path / "big.safetensors", tensors


def test_a_copied_tensor_leaves_its_file_pages(tmp_path):
    """A tensor read through the memory map (a transposed or strided view) leaves it once copied: its file
    pages stay in the OS page cache, not in the process, so a load never holds the whole file and all the
    copies at once."""
    path, tensors = _big_file(tmp_path)
    arrays = io.read_safetensors(path)
    before = _file_pages()
    assert float(arrays["a"].sum()) == pytest.approx(float(tensors["a"].sum()), rel=1e-4)
    assert _file_pages() - before > 30 * 2**20
    io.drop_pages(arrays["a"])
    assert _file_pages() - before < 2 * 2**20
    np.testing.assert_array_equal(arrays["a"], tensors["a"])  # read back from the page cache
    io.drop_pages(arrays["a"])
    for view, expected in ((arrays["a"].T, tensors["a"].T), (arrays["b"][:, 1000:3000], tensors["b"][:, 1000:3000])):
        copy = io.host_copy(view)
        assert copy.flags.c_contiguous
        np.testing.assert_array_equal(copy, expected)
        assert _file_pages() - before < 2 * 2**20, "a strided view's pages (from its first byte to its last) are dropped"
    io.drop_pages(np.ones(3))  # not a memory map: left alone
    heap = np.ones(2**20)
    assert not io.unmap(heap.ctypes.data, heap.nbytes) and heap.all()


def test_loading_reads_a_tensor_from_its_file_into_memory_a_cpu_uses_in_place(tmp_path):
    """`weights.materialize` reads each tensor with `io.host_copy`: from the file, never mapping its pages, into
    a buffer aligned so that XLA:CPU keeps it as the device buffer (no second copy); a cast reads the file's
    dtype and converts."""
    path, tensors = _big_file(tmp_path)
    arrays = io.read_safetensors(path)
    before = _file_pages()
    copy = io.host_copy(arrays["b"])
    assert _file_pages() - before < 2 * 2**20, "read with preadv, not through the map"
    np.testing.assert_array_equal(copy, tensors["b"])
    assert copy.ctypes.data % io.ALIGNMENT == 0 and copy.flags.c_contiguous and copy.flags.writeable
    halves = io.host_copy(arrays["a"], ml_dtypes.bfloat16)
    np.testing.assert_array_equal(halves, tensors["a"].astype(ml_dtypes.bfloat16))
    assert halves.ctypes.data % io.ALIGNMENT == 0 and _file_pages() - before < 2 * 2**20

    placed = weights._place(weights._read(arrays["b"], np.float32, None), np.float32, None)
    np.testing.assert_array_equal(np.asarray(placed), tensors["b"])
    if jax.default_backend() == "cpu":
        host = io.host_copy(arrays["a"])
        assert jax.device_put(host).unsafe_buffer_pointer() == host.ctypes.data, "used in place"
        off = np.empty(host.nbytes + 2 * io.ALIGNMENT, np.uint8)
        start = -off.ctypes.data % io.ALIGNMENT + 16
        misaligned = off[start:start + host.nbytes].view(np.float32).reshape(host.shape)
        assert jax.device_put(misaligned).unsafe_buffer_pointer() != misaligned.ctypes.data, (
            "16-byte alignment (numpy's own) is copied: what ALIGNMENT is for")


def test_written_tensors_are_aligned_so_a_cpu_uses_their_file_pages_in_place(tmp_path):
    """`write_safetensors` starts the data at a multiple of `io.ALIGNMENT` bytes and writes the tensors whose
    size is a multiple of it first: each of those is then used in place by a CPU (the parameter's device
    buffer is the file's page), the others are read into aligned copies."""
    from safetensors.numpy import load_file

    rng = np.random.default_rng(0)
    tensors = {"odd": rng.standard_normal(3).astype(np.float32), "w": rng.standard_normal((64, 32)).astype(np.float32),
               "odd2": rng.standard_normal(5).astype(np.float32), "b": rng.standard_normal(48).astype(np.float32)}
    io.write_safetensors(tmp_path / "m.safetensors", tensors, metadata={"component": "x"})
    arrays = io.read_safetensors(tmp_path / "m.safetensors")
    assert [k for k, _ in sorted(arrays.items(), key=lambda kv: kv[1].ctypes.data)] == ["w", "b", "odd", "odd2"]
    assert io.in_place(arrays["w"]) and io.in_place(arrays["b"]) and io.in_place(arrays["odd"])
    assert not io.in_place(arrays["odd2"]), "12 bytes after an aligned start"
    assert not io.in_place(arrays["w"].T) and not io.in_place(np.ones(16, np.float32))
    for k, v in load_file(tmp_path / "m.safetensors").items():
        np.testing.assert_array_equal(v, tensors[k])

    placed = {k: weights._place(weights._read(v, np.float32, None), np.float32, None) for k, v in arrays.items()}
    for k, v in arrays.items():
        np.testing.assert_array_equal(np.asarray(placed[k]), tensors[k])
    if jax.default_backend() == "cpu":
        assert placed["w"].unsafe_buffer_pointer() == arrays["w"].ctypes.data, "the file's pages, in place"
        assert placed["odd2"].unsafe_buffer_pointer() != arrays["odd2"].ctypes.data
    cast = weights._place(weights._read(arrays["w"], ml_dtypes.bfloat16, None), ml_dtypes.bfloat16, None)
    np.testing.assert_array_equal(np.asarray(cast), tensors["w"].astype(ml_dtypes.bfloat16))


def _cached(array: np.ndarray) -> float:
    """The share of `array`'s pages (a view into a memory map) that are in the OS page cache (Linux `mincore`)."""
    first = array.ctypes.data - array.ctypes.data % mmap.PAGESIZE
    pages = -(-(array.ctypes.data + array.nbytes - first) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert ctypes.CDLL(None).mincore(ctypes.c_void_p(first), ctypes.c_size_t(pages * mmap.PAGESIZE), vec) == 0
    return sum(v & 1 for v in vec) / pages


@pytest.mark.allow_skip
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="tensors are used in place on a CPU only")
def test_a_tensor_used_in_place_is_read_ahead_unmapped_unless_it_is_an_embedding_table(tmp_path):
    """Loading has the OS read an in-place tensor's file pages into its page cache (several tensors at once:
    its first use does not wait for the disk) without mapping them into the process, which maps them as it
    uses them; an embedding table's, of which a generation gathers a few rows, are not read ahead at all."""
    path, tensors = _big_file(tmp_path)
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    arrays = io.read_safetensors(path)
    if max(_cached(arrays["a"]), _cached(arrays["b"])) > 0.5:
        pytest.skip("this file system keeps the file in memory (tmpfs?): nothing to read ahead")
    before = _file_pages()
    assert weights._read(arrays["a"], np.float32, None, on_use=True) is arrays["a"]
    assert weights._read(arrays["b"], np.float32, None) is arrays["b"]
    deadline = time.monotonic() + 30
    while _cached(arrays["b"]) < 1 and time.monotonic() < deadline:  # the last requests may still be in flight
        time.sleep(0.01)
    assert _cached(arrays["b"]) == 1 and _cached(arrays["a"]) < 0.5
    assert _file_pages() - before < 2 * 2**20, "read into the page cache, not mapped into the process"
    placed = weights._place(arrays["b"], np.float32, None)
    np.testing.assert_array_equal(np.asarray(placed), tensors["b"])
    assert _file_pages() - before > 30 * 2**20, "mapped once used"


@pytest.mark.allow_skip
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="tensors are used in place on a CPU only")
def test_loading_a_vae_reads_the_decoder_s_pages_ahead_and_the_encoder_s_on_use(tmp_path, monkeypatch):
    """Text-to-image never runs the VAE's encoder (`AutoencoderKL.READ_ON_USE`): its parameters are used in
    place like the rest, their pages left to be read on first use; the decoder's are read ahead. Encoding and
    decoding then give what the model they came from gives."""
    from sdx.vae import AutoencoderKL, VAEConfig

    config = VAEConfig.from_diffusers_config(presets.get("tiny").configs["vae"])
    live = AutoencoderKL(config, rngs=nnx.Rngs(0))
    flat = {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(live, nnx.Param))}
    io.write_safetensors(tmp_path / "vae.safetensors", flat)
    arrays = io.read_safetensors(tmp_path / "vae.safetensors")
    read_ahead, read = [], io.read_ahead
    monkeypatch.setattr(io, "read_ahead", lambda a: (read_ahead.append(a.ctypes.data), read(a)))
    loaded = weights.materialize(nnx.eval_shape(lambda: AutoencoderKL(config, rngs=nnx.Rngs(0))), arrays)
    read_in = {k for k, a in arrays.items() if a.ctypes.data in read_ahead}
    assert read_in and all(k.startswith(("decoder.", "post_quant_conv.")) for k in read_in), sorted(read_in)
    assert any(io.in_place(arrays[k]) for k in flat if k.startswith(AutoencoderKL.READ_ON_USE))  # used in place
    image = jax.random.uniform(jax.random.key(1), (1, 16, 16, 3), minval=-1.0, maxval=1.0)
    np.testing.assert_array_equal(loaded.encode(image).mean, live.encode(image).mean)
    np.testing.assert_array_equal(loaded.decode(live.encode(image).mean), live.decode(live.encode(image).mean))


def test_a_file_replaced_while_loading_is_refused(tmp_path):
    path, tensors = _big_file(tmp_path)
    arrays = io.read_safetensors(path)
    io.write_safetensors(path, {k: v + 1 for k, v in tensors.items()})  # a new file in its place (a new conversion)
    with pytest.raises(SdxError, match="changed while it was being loaded"):
        io.host_copy(arrays["a"])


def test_safetensors_io_matches_the_library(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    tensors = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones((2, 2), ml_dtypes.bfloat16),
        "c": np.array([1, 2], np.int64), "d": np.full((), 3.0, np.float16), "e": np.zeros((0, 3), np.float32),
        "t": np.arange(6, dtype=np.float32).reshape(2, 3).T,  # not contiguous
    }
    io.write_safetensors(tmp_path / "ours.safetensors", tensors, metadata={"component": "x"})
    with safe_open(tmp_path / "ours.safetensors", framework="numpy") as f:
        assert f.metadata() == {"component": "x"}
        for k, v in tensors.items():
            np.testing.assert_array_equal(f.get_tensor(k), v)
            assert f.get_tensor(k).dtype == v.dtype
    save_file({k: v.copy(order="C") for k, v in tensors.items()}, tmp_path / "lib.safetensors")
    for path in (tmp_path / "ours.safetensors", tmp_path / "lib.safetensors"):
        got = io.read_safetensors(path)
        assert set(got) == set(tensors)
        for k, v in tensors.items():
            np.testing.assert_array_equal(got[k], v)
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
    assert io.read_safetensors_metadata(tmp_path / "ours.safetensors") == {"component": "x"}

    data = (tmp_path / "lib.safetensors").read_bytes()
    bad = tmp_path / "bad.safetensors"
    for blob, words in [
        (data[:-4], "truncated file: tensor"),
        (data + b"\0" * 8, "trailing bytes"),
        (data[:5], "too short"),
        ((2**40).to_bytes(8, "little") + data[8:], "truncated or not a safetensors file"),
        (data[:8] + b"x" + data[9:], "not JSON"),
    ]:
        bad.write_bytes(blob)
        with pytest.raises(SdxError, match=words) as info:
            io.read_safetensors(bad)
        assert str(bad) in str(info.value)
