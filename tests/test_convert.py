"""python -m convert: diffusers folders and hub ids into sdx model folders, strictly.

The pipelines are the tiny random-weight ones of tests/tiny_models.py, saved by diffusers'
save_pretrained; the hub is a local folder served through monkeypatched huggingface_hub calls, or a
hand-made huggingface_hub cache read with HF_HUB_OFFLINE.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
import pytest
from safetensors.numpy import load_file, save_file

from convert import cli, diffusers_folder, hub, library, sources
from convert.sdx_folder import read_sdx_folder
from sdx import model_folder
from sdx.errors import SdxError

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from tests.tiny_models import make_tiny_pipeline  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
UNET_FILE = "unet/diffusion_pytorch_model.safetensors"
VAE_FILE = "vae/diffusion_pytorch_model.safetensors"
TE_FILE = "text_encoder/model.safetensors"


@pytest.fixture(scope="module")
def sd15(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("src") / "sd15"
    make_tiny_pipeline("sd15", folder)
    return folder


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("src") / "sdxl"
    make_tiny_pipeline("sdxl", folder)
    return folder


@pytest.fixture(scope="module")
def sdxl_out(sdxl, tmp_path_factory) -> Path:
    return library.convert(sdxl, tmp_path_factory.mktemp("out") / "sdxl")


def _copy(src: Path, tmp_path: Path, name: str = "copy") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _torch_state(folder: Path, name: str) -> dict[str, np.ndarray]:
    """A component's state dict as the reference libraries load it."""
    if name in ("text_encoder", "text_encoder_2"):
        arch = json.loads((folder / name / "config.json").read_text())["architectures"][0]
        model = getattr(transformers, arch).from_pretrained(folder / name)
        state = {("text_model." + k if not k.startswith(("text_model.", "text_projection")) else k): v
                 for k, v in model.state_dict().items()}
    else:
        cls = diffusers.UNet2DConditionModel if name == "unet" else diffusers.AutoencoderKL
        state = cls.from_pretrained(folder / name).state_dict()
    return {k: v.float().numpy() for k, v in state.items() if not k.endswith("position_ids")}


# --------------------------------------------------------------------------------------------------
# Parity: the sdx folder's models reproduce diffusers/transformers in float32


def test_sdxl_folder_reproduces_diffusers(sdxl, sdxl_out):
    spec = model_folder.read_spec(sdxl_out)
    assert spec["pipeline_class"] == "StableDiffusionXLPipeline" and spec["dtype"] == "float32"
    assert spec["extra"] == {"force_zeros_for_empty_prompt": True}
    assert set(spec["components"]) == {"unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"}
    assert model_folder.scheduler_config(sdxl_out) == json.loads((sdxl / "scheduler/scheduler_config.json").read_text())
    for tok in ("tokenizer", "tokenizer_2"):  # copied byte for byte
        for f in (sdxl / tok).iterdir():
            assert (sdxl_out / tok / f.name).read_bytes() == f.read_bytes()

    models = {n: model_folder.load_component(sdxl_out, n) for n in ("unet", "vae", "text_encoder", "text_encoder_2")}
    rng = np.random.default_rng(0)

    ids = np.asarray(rng.integers(0, 49408, (2, 77)))
    for name in ("text_encoder", "text_encoder_2"):
        arch = json.loads((sdxl / name / "config.json").read_text())["architectures"][0]
        ref_model = getattr(transformers, arch).from_pretrained(sdxl / name).eval()
        with torch.no_grad():
            ref = ref_model(torch.tensor(ids), output_hidden_states=True)
        out = nnx.jit(lambda m, i: m(i))(models[name], jnp.asarray(ids, jnp.int32))
        assert len(out.hidden_states) == len(ref.hidden_states)
        for ours, theirs in zip(out.hidden_states, ref.hidden_states, strict=True):
            np.testing.assert_allclose(np.asarray(ours), theirs.numpy(), atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(out.last_hidden_state), ref.last_hidden_state.numpy(), atol=1e-4, rtol=1e-4)
        if name == "text_encoder_2":
            np.testing.assert_allclose(np.asarray(out.text_embeds), ref.text_embeds.numpy(), atol=1e-4, rtol=1e-4)

    unet = diffusers.UNet2DConditionModel.from_pretrained(sdxl / "unet").eval()
    c = unet.config
    x = rng.standard_normal((1, c.in_channels, 8, 8)).astype(np.float32)
    ctx = rng.standard_normal((1, 8, c.cross_attention_dim)).astype(np.float32)
    text = rng.standard_normal((1, c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim))
    time_ids = np.array([[64, 64, 0, 0, 64, 64]], np.float32)
    with torch.no_grad():
        ref = unet(
            torch.tensor(x), 700, torch.tensor(ctx),
            added_cond_kwargs={"text_embeds": torch.tensor(text, dtype=torch.float32), "time_ids": torch.tensor(time_ids)},
        ).sample.numpy()
    out = nnx.jit(lambda m, *a: m(*a))(
        models["unet"], jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray([700.0]), jnp.asarray(ctx),
        {"text_embeds": jnp.asarray(text, jnp.float32), "time_ids": jnp.asarray(time_ids)},
    )
    np.testing.assert_allclose(np.asarray(out).transpose(0, 3, 1, 2), ref, atol=2e-4, rtol=1e-4)

    vae = diffusers.AutoencoderKL.from_pretrained(sdxl / "vae").eval()
    z = rng.standard_normal((1, 4, 4, 4)).astype(np.float32)
    with torch.no_grad():
        ref = vae.decode(torch.tensor(z)).sample.numpy()
    out = nnx.jit(lambda m, z: m.decode(z))(models["vae"], jnp.asarray(z.transpose(0, 2, 3, 1)))
    np.testing.assert_allclose(np.asarray(out).transpose(0, 3, 1, 2), ref, atol=2e-4, rtol=1e-4)


def test_sd15_tensors_round_trip_exactly(sd15, tmp_path):
    out = library.convert(sd15, tmp_path / "out")
    ckpt = read_sdx_folder(out)
    assert ckpt.pipeline_class == "StableDiffusionPipeline"
    assert set(ckpt.tensors) == {"unet", "vae", "text_encoder"}
    for name, tensors in ckpt.tensors.items():
        ref = _torch_state(sd15, name)
        assert set(tensors) == set(ref), name
        for key, value in ref.items():
            np.testing.assert_array_equal(tensors[key], value, err_msg=f"{name}: {key}")
        assert ckpt.configs[name] == json.loads((sd15 / name / "config.json").read_text())
    assert ckpt.tokenizers["tokenizer"] == out / "tokenizer"
    # the sdx file itself: sdx paths, Flax layout (a conv kernel HWIO)
    arrays = model_folder.read_arrays(out, "unet")
    torch_kernel = _torch_state(sd15, "unet")["conv_in.weight"]
    np.testing.assert_array_equal(arrays["conv_in.kernel"], torch_kernel.transpose(2, 3, 1, 0))


# --------------------------------------------------------------------------------------------------
# Variants, shards, dtypes, sdx -> sdx


def test_fp16_variant_is_read_for_16_bit_dtypes(sd15, tmp_path):
    src = _copy(sd15, tmp_path, "variant")
    unet = diffusers.UNet2DConditionModel.from_pretrained(src / "unet")
    with torch.no_grad():
        unet.conv_in.bias.add_(1.0)  # so that the variant's values tell which file was read
    unet.to(torch.float16).save_pretrained(src / "unet", variant="fp16")
    assert (src / "unet/diffusion_pytorch_model.fp16.safetensors").is_file()
    plain = load_file(src / UNET_FILE)["conv_in.bias"]
    fp16 = load_file(src / "unet/diffusion_pytorch_model.fp16.safetensors")["conv_in.bias"]

    out16 = library.convert(src, tmp_path / "out16", dtype="float16")
    np.testing.assert_array_equal(model_folder.read_arrays(out16, "unet")["conv_in.bias"], fp16)
    outbf = library.convert(src, tmp_path / "outbf", dtype="bfloat16")
    got = model_folder.read_arrays(outbf, "unet")["conv_in.bias"]
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, fp16.astype(jnp.bfloat16))
    out32 = library.convert(src, tmp_path / "out32", dtype="float32")
    np.testing.assert_array_equal(model_folder.read_arrays(out32, "unet")["conv_in.bias"], plain)
    # an explicit variant wins over the dtype's default
    out_v = library.convert(src, tmp_path / "out_v", dtype="float32", variant="fp16")
    np.testing.assert_array_equal(model_folder.read_arrays(out_v, "unet")["conv_in.bias"], fp16.astype(np.float32))


def test_bfloat16_is_stored_as_bf16(sd15, tmp_path):
    assert cli.main([str(sd15), str(tmp_path / "out"), "--dtype", "bfloat16", "-q"]) == 0
    spec = model_folder.read_spec(tmp_path / "out")
    assert spec["dtype"] == "bfloat16"
    for name in ("unet", "vae", "text_encoder"):
        raw = (tmp_path / "out" / f"{name}.safetensors").read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    ref = load_file(sd15 / VAE_FILE)["decoder.conv_out.bias"]
    got = model_folder.read_arrays(tmp_path / "out", "vae")["decoder.conv_out.bias"]
    np.testing.assert_array_equal(got, ref.astype(jnp.bfloat16))


def test_sharded_folder_converts_like_the_single_file_one(sd15, tmp_path):
    src = _copy(sd15, tmp_path, "sharded")
    unet = diffusers.UNet2DConditionModel.from_pretrained(src / "unet")
    te = transformers.CLIPTextModel.from_pretrained(src / "text_encoder")
    (src / UNET_FILE).unlink()
    (src / TE_FILE).unlink()
    unet.save_pretrained(src / "unet", max_shard_size="300KB")
    te.save_pretrained(src / "text_encoder", max_shard_size="1MB")
    assert (src / "unet/diffusion_pytorch_model.safetensors.index.json").is_file()
    assert (src / "text_encoder/model.safetensors.index.json").is_file()
    assert not (src / UNET_FILE).exists() and not (src / TE_FILE).exists()
    out = library.convert(src, tmp_path / "out")
    ref = library.convert(sd15, tmp_path / "ref")
    for name in ("unet", "text_encoder"):
        a, b = model_folder.read_arrays(out, name), model_folder.read_arrays(ref, name)
        assert set(a) == set(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_sdx_folder_resaves_in_another_dtype(sdxl_out, tmp_path):
    out = library.convert(sdxl_out, tmp_path / "bf16", dtype="bfloat16")
    spec, ref_spec = model_folder.read_spec(out), model_folder.read_spec(sdxl_out)
    assert spec["dtype"] == "bfloat16"
    assert {k: v for k, v in spec.items() if k != "dtype"} == {k: v for k, v in ref_spec.items() if k != "dtype"}
    a, b = model_folder.read_arrays(out, "text_encoder_2"), model_folder.read_arrays(sdxl_out, "text_encoder_2")
    for k in b:
        np.testing.assert_array_equal(a[k], b[k].astype(jnp.bfloat16))
    assert (out / "tokenizer_2" / "vocab.json").read_bytes() == (sdxl_out / "tokenizer_2" / "vocab.json").read_bytes()


def test_refiner_layout_without_first_text_encoder(sdxl, tmp_path):
    """A refiner's model_index declares text_encoder/tokenizer as [null, null]; they are simply absent."""
    src = _copy(sdxl, tmp_path, "refiner")
    shutil.rmtree(src / "text_encoder")
    shutil.rmtree(src / "tokenizer")
    index = json.loads((src / "model_index.json").read_text())
    index.update(_class_name="StableDiffusionXLImg2ImgPipeline", text_encoder=[None, None], tokenizer=[None, None],
                 requires_aesthetics_score=True, force_zeros_for_empty_prompt=False)
    (src / "model_index.json").write_text(json.dumps(index))
    out = library.convert(src, tmp_path / "out")
    spec = model_folder.read_spec(out)
    assert spec["pipeline_class"] == "StableDiffusionXLImg2ImgPipeline"
    assert set(spec["components"]) == {"unet", "vae", "text_encoder_2", "tokenizer_2", "scheduler"}
    assert spec["extra"] == {"requires_aesthetics_score": True, "force_zeros_for_empty_prompt": False}


def test_known_renames_and_buffers(sd15, tmp_path):
    """Old VAE attention names and the position_ids buffer are handled by their named rules."""
    src = _copy(sd15, tmp_path, "old")
    vae = load_file(src / VAE_FILE)
    old = {}
    for k, v in vae.items():
        for new, was in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"), ("to_out.0", "proj_attn")):
            k = k.replace(f"attentions.0.{new}.", f"attentions.0.{was}.")
        old[k] = v[:, :, None, None] if k.endswith(("query.weight", "key.weight", "value.weight")) else v  # 1x1 conv
    assert any("proj_attn" in k for k in old)
    save_file(old, src / VAE_FILE)
    te = load_file(src / TE_FILE)
    te["text_model.embeddings.position_ids"] = np.arange(77, dtype=np.int64)[None]
    save_file(te, src / TE_FILE)
    out = library.convert(src, tmp_path / "out")
    ref = library.convert(sd15, tmp_path / "ref")
    for name in ("vae", "text_encoder"):
        a, b = model_folder.read_arrays(out, name), model_folder.read_arrays(ref, name)
        assert set(a) == set(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])

    both = dict(old, **{k: v for k, v in vae.items() if ".to_q." in k})
    save_file(both, src / VAE_FILE)
    with pytest.raises(SdxError, match=r"vae/diffusion_pytorch_model\.safetensors.*old and its new name"):
        library.convert(src, tmp_path / "out2")


# --------------------------------------------------------------------------------------------------
# Strictness: each failure is one SdxError naming the file and the key


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _fails(src: Path, tmp_path: Path, *patterns: str) -> str:
    with pytest.raises(SdxError) as info:
        library.convert(src, tmp_path / "out")
    msg = str(info.value)
    for p in patterns:
        assert p in msg, (p, msg)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob("out.tmp-*"))
    return msg


def test_missing_tensor(sd15, tmp_path):
    src = _copy(sd15, tmp_path)
    _rewrite(src / VAE_FILE, lambda t: t.pop("decoder.conv_out.bias"))
    _fails(src, tmp_path, str(src / VAE_FILE), "missing", "decoder.conv_out.bias")


def test_extra_tensor(sd15, tmp_path):
    src = _copy(sd15, tmp_path)
    _rewrite(src / UNET_FILE, lambda t: t.update({"down_blocks.0.extra.weight": np.zeros(3, np.float32)}))
    _fails(src, tmp_path, str(src / UNET_FILE), "'down_blocks.0.extra.weight'", "unexpected")


def test_misshapen_tensor(sd15, tmp_path):
    src = _copy(sd15, tmp_path)
    key = next(k for k in load_file(src / TE_FILE) if k.endswith("final_layer_norm.weight"))
    _rewrite(src / TE_FILE, lambda t: t.update({key: np.ones(31, np.float32)}))
    _fails(src, tmp_path, str(src / TE_FILE), "final_layer_norm.weight'", "(31,)")


def test_truncated_safetensors(sd15, tmp_path):
    src = _copy(sd15, tmp_path)
    data = (src / UNET_FILE).read_bytes()
    (src / UNET_FILE).write_bytes(data[:-1000])
    msg = _fails(src, tmp_path, str(src / UNET_FILE), "truncated")
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    assert repr(last) in msg


def test_unknown_layout(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "unet").mkdir()
    _fails(tmp_path / "src", tmp_path, str(tmp_path / "src"), "unknown layout", "model_index.json")


def test_unknown_pipeline_class(sd15, tmp_path):
    src = _copy(sd15, tmp_path)
    index = json.loads((src / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionUpscalePipeline"
    (src / "model_index.json").write_text(json.dumps(index))
    _fails(src, tmp_path, str(src / "model_index.json"), "unknown pipeline class", "StableDiffusionUpscalePipeline")


def test_unknown_component_and_class(sd15, tmp_path):
    src = _copy(sd15, tmp_path)
    index = json.loads((src / "model_index.json").read_text())
    (src / "model_index.json").write_text(json.dumps({**index, "controlnet": ["diffusers", "ControlNetModel"]}))
    _fails(src, tmp_path, "model_index.json", "unknown component 'controlnet'")
    (src / "model_index.json").write_text(json.dumps({**index, "unet": ["diffusers", "UNet2DModel"]}))
    _fails(src, tmp_path, "model_index.json", "'unet'", "UNet2DModel")


def test_bin_only_folder(sd15, tmp_path):
    src = _copy(sd15, tmp_path)
    state = {k: torch.from_numpy(v) for k, v in load_file(src / UNET_FILE).items()}
    torch.save(state, src / "unet" / "diffusion_pytorch_model.bin")
    (src / UNET_FILE).unlink()
    _fails(src, tmp_path, str(src / "unet"), "diffusion_pytorch_model.bin", "safetensors only")


def test_sharded_index_mismatch(sd15, tmp_path):
    src = _copy(sd15, tmp_path)
    vae = diffusers.AutoencoderKL.from_pretrained(src / "vae")
    (src / VAE_FILE).unlink()
    vae.save_pretrained(src / "vae", max_shard_size="300KB")
    index_path = src / "vae/diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"]["decoder.ghost.weight"] = index["weight_map"][key]
    index_path.write_text(json.dumps(index))
    _fails(src, tmp_path, str(index_path), "'decoder.ghost.weight'")


def test_cli_exit_code_and_one_line_error(sd15, tmp_path, capsys):
    src = _copy(sd15, tmp_path)
    _rewrite(src / VAE_FILE, lambda t: t.pop("encoder.conv_in.weight"))
    assert cli.main([str(src), str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "encoder.conv_in.kernel" in err
    assert cli.main([str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert cli.main([str(src), str(tmp_path / "out"), "--dtype", "float8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")


def test_python_m_convert_exits_2_without_traceback(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    proc = subprocess.run(
        [sys.executable, "-m", "convert", str(tmp_path / "src"), str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and "FluxPipeline" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, expected", [
    (["SRC", "/proc/sdx-out"], "OUT /proc/sdx-out: it does not exist and cannot be made in /proc: it is on proc"),
    (["SRC", "/proc/m.safetensors", "--format", "single-file"], "cannot be made in /proc: it is on proc"),
    (["SRC", "FULL"], "FULL exists and is not empty; pass --overwrite"),
    (["SRC", "FULL", "--format", "diffusers"], "not empty; pass --overwrite"),
    (["SRC", "FILE"], "exists and is not a folder"),
    (["SRC", "FILE/out"], "is a file, not a folder"),
    (["SRC", "out.safetensors"], "--format sdx writes a folder; for one .safetensors file pass --format single-file"),
    (["SRC", "out.ckpt", "--format", "single-file"], "name it *.safetensors"),
    (["SRC", "folder.safetensors", "--format", "single-file"], "is a folder; give the path of the .safetensors file"),
    (["SRC", "MINE.safetensors", "--format", "single-file"], "exists; pass --overwrite"),
    (["SRC", "out", "--format", "onnx"], "invalid choice: 'onnx'"),
    (["SRC", "out", "--dtype", "float8"], "invalid choice: 'float8'"),
    (["/nonexistent/model", "out"], "no such file or folder"),
    (["SRC", "SRC"], "must differ from the source"),
    (["SRC", "out", "--lora", "/nonexistent/lora.safetensors"], "--lora /nonexistent/lora.safetensors"),
    (["SRC", "out", "--vae", "/nonexistent/vae"], "--vae /nonexistent/vae"),
    (["SRC", "out", "--config", "/nonexistent/config"], "--config"),
    (["SRC", "out", "--preset", "sd21"], "--preset applies to single-file checkpoints"),
    (["SRC", "out", "--bogus"], "unrecognized arguments: --bogus"),
    (["SRC", "out", "--fromat", "diffusers"], "unrecognized arguments: --fromat diffusers (did you mean --format?)"),
    (["defualt", "out"], "defualt: no such file or folder, nor a built-in model (default, default-edit, tiny, "
                         "tiny_xl) or a hub id (org/name); did you mean default?"),
])
def test_bad_arguments_are_refused_before_reading_and_nothing_is_written(sd15, tmp_path, capsys, monkeypatch, args,
                                                                         expected):
    """Every argument is checked before the source is read: one `error:` line, exit 2, nothing new on disk
    and what was there left byte for byte."""
    fail = lambda *a, **k: pytest.fail("the source was read")
    monkeypatch.setattr(library, "read_source", fail)
    monkeypatch.setattr(model_folder, "resave", fail)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    (tmp_path / "mine.safetensors").write_text("mine")
    (tmp_path / "folder.safetensors").mkdir()
    names = {"SRC": str(sd15), "FULL": str(tmp_path / "full"), "FILE": str(tmp_path / "file"),
             "MINE": str(tmp_path / "mine")}
    for name, value in names.items():
        args = [a.replace(name, value) for a in args]
        expected = expected.replace(name, value)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder.safetensors", "full", "mine.safetensors"]


def test_output_folder_is_never_clobbered(sd15, sdxl_out, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SdxError, match="not empty; pass --overwrite"):
        library.convert(sd15, out)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(SdxError, match="must differ"):
        library.convert(sdxl_out, sdxl_out, overwrite=True)
    library.convert(sd15, out, overwrite=True, dtype="float16")
    assert not (out / "keep.txt").exists() and model_folder.read_spec(out)["dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no tmp-/old- folders left behind
    empty = tmp_path / "empty"
    empty.mkdir()
    library.convert(sd15, empty)  # an empty folder is fine
    assert model_folder.is_model_folder(empty)


# --------------------------------------------------------------------------------------------------
# The hub


class FakeHub:
    """Serves `repo` (a local folder) as hub repo `repo_id`, recording which files are downloaded."""

    def __init__(self, repo_id: str, repo: Path, cache: Path):
        self.repo_id, self.repo, self.cache = repo_id, repo, cache
        self.downloaded: set[str] = set()

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.repo)) for p in self.repo.rglob("*") if p.is_file())

    def _check(self, repo_id):
        if repo_id != self.repo_id:
            import httpx2
            from huggingface_hub.errors import RepositoryNotFoundError

            url = f"https://huggingface.co/api/models/{repo_id}"
            response = httpx2.Response(404, request=httpx2.Request("GET", url))
            raise RepositoryNotFoundError(f"404 Client Error. Repository Not Found for url: {url}", response=response)

    def _get(self, name: str) -> Path:
        self.downloaded.add(name)
        dst = self.cache / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.repo / name, dst)
        return dst

    def list_repo_files(self, repo_id, **kw):
        self._check(repo_id)
        return self.files()

    def hf_hub_download(self, repo_id, filename, **kw):
        self._check(repo_id)
        return str(self._get(filename))

    def snapshot_download(self, repo_id, allow_patterns=None, **kw):
        from huggingface_hub.utils import filter_repo_objects

        self._check(repo_id)
        for name in filter_repo_objects(self.files(), allow_patterns=allow_patterns):
            self._get(name)
        return str(self.cache)


def test_hub_id_fetches_only_the_needed_files(sd15, tmp_path, monkeypatch):
    repo = _copy(sd15, tmp_path, "remote")
    unet = diffusers.UNet2DConditionModel.from_pretrained(repo / "unet")
    unet.to(torch.float16).save_pretrained(repo / "unet", variant="fp16")
    shutil.copy(repo / UNET_FILE, repo / "unet/diffusion_pytorch_model.bin")  # pickles and checkpoints on the side
    (repo / "v1-5-pruned.ckpt").write_bytes(b"not read")
    (repo / "safety_checker").mkdir()
    (repo / "safety_checker/config.json").write_text("{}")
    (repo / "safety_checker/model.safetensors").write_bytes(b"not read")
    index = json.loads((repo / "model_index.json").read_text())
    index.update(safety_checker=["stable_diffusion", "StableDiffusionSafetyChecker"],
                 feature_extractor=["transformers", "CLIPImageProcessor"])
    (repo / "model_index.json").write_text(json.dumps(index))
    fake = FakeHub("org/tiny-sd", repo, tmp_path / "snapshot")
    monkeypatch.setattr(hub, "reachable", lambda: True)  # the hub answers
    for name in ("list_repo_files", "hf_hub_download", "snapshot_download"):
        monkeypatch.setattr(hub, name, getattr(fake, name))

    out = library.convert("org/tiny-sd", tmp_path / "out", dtype="bfloat16")
    assert model_folder.read_spec(out)["dtype"] == "bfloat16"
    tokenizer = sorted(f for f in fake.files() if f.startswith("tokenizer/"))
    assert fake.downloaded == {
        "model_index.json", "scheduler/scheduler_config.json",
        "unet/config.json", "unet/diffusion_pytorch_model.fp16.safetensors",
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors",  # no fp16 variant there: the plain file
        "text_encoder/config.json", "text_encoder/model.safetensors", *tokenizer,
    }
    ref = load_file(repo / "unet/diffusion_pytorch_model.fp16.safetensors")["conv_in.bias"]
    np.testing.assert_array_equal(model_folder.read_arrays(out, "unet")["conv_in.bias"], ref.astype(jnp.bfloat16))

    # float32: the plain weights, never the variant
    fake.downloaded.clear()
    shutil.rmtree(tmp_path / "snapshot")
    library.convert("org/tiny-sd", tmp_path / "out32")
    assert "unet/diffusion_pytorch_model.safetensors" in fake.downloaded
    assert not any(".fp16." in f or f.endswith((".bin", ".ckpt")) for f in fake.downloaded)

    with pytest.raises(SdxError, match=r"hub repo 'org/missing': not found"):
        library.convert("org/missing", tmp_path / "out3")


def _hf_cache(cache: Path, repo_id: str, folder: Path) -> None:
    """A huggingface_hub cache holding `folder` as the main revision of `repo_id`."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    shutil.copytree(folder, storage / "snapshots" / commit)


def test_hub_offline_uses_the_cache(sd15, tmp_path, monkeypatch):
    import huggingface_hub

    cache = tmp_path / "hf"
    _hf_cache(cache, "org/cached-sd", sd15)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = library.convert("org/cached-sd", tmp_path / "out", cache_dir=cache)
    assert model_folder.read_spec(out)["pipeline_class"] == "StableDiffusionPipeline"
    with pytest.raises(SdxError) as info:
        library.convert("org/not-cached", tmp_path / "out2", cache_dir=cache)
    assert "'org/not-cached'" in str(info.value) and "HF_HUB_OFFLINE" in str(info.value)


def test_unreachable_hub_is_one_error_with_the_id(tmp_path, monkeypatch):
    import httpx2

    def unreachable(*a, **kw):
        raise httpx2.ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(hub, "reachable", lambda: True)  # the hub answers
    monkeypatch.setattr(hub, "list_repo_files", unreachable)
    with pytest.raises(SdxError) as info:
        hub.fetch("org/far-away", cache_dir=tmp_path)
    assert "'org/far-away'" in str(info.value) and "could not be reached" in str(info.value)
    assert sources.looks_local("./org/x") and not hub.looks_like_repo_id("a/b/c")


def test_ensure_sdx_folder_converts_once(sd15, tmp_path):
    first = library.ensure_sdx_folder(sd15, dtype="bfloat16", cache_dir=tmp_path)
    assert model_folder.read_spec(first)["dtype"] == "bfloat16"
    stamp = (first / "sdx.json").stat().st_mtime_ns
    assert library.ensure_sdx_folder(sd15, dtype="bfloat16", cache_dir=tmp_path) == first
    assert (first / "sdx.json").stat().st_mtime_ns == stamp
    assert library.ensure_sdx_folder(first) == first  # an sdx folder is used as it is
    assert library.ensure_sdx_folder(sd15, dtype="float32", cache_dir=tmp_path) != first


def test_needed_files_picks_variants_and_shards():
    index = diffusers_folder.parse_model_index(
        {"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],
         "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],
         "tokenizer": ["transformers", "CLIPTokenizer"], "scheduler": ["diffusers", "PNDMScheduler"],
         "safety_checker": [None, None]},
        where="test",
    )
    listing = [
        "model_index.json", "scheduler/scheduler_config.json", "tokenizer/vocab.json", "tokenizer/merges.txt",
        "unet/config.json", "unet/diffusion_pytorch_model.safetensors.index.fp16.json",
        "unet/diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "unet/diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
        "unet/diffusion_pytorch_model.safetensors", "unet/diffusion_pytorch_model.bin",
        "vae/config.json", "vae/diffusion_pytorch_model.fp16.safetensors",
        "text_encoder/config.json", "text_encoder/model.safetensors.index.json",
        "text_encoder/model-00001-of-00002.safetensors", "text_encoder/model-00002-of-00002.safetensors",
        "text_encoder/pytorch_model.bin",
    ]
    fp16 = set(diffusers_folder.needed_files(index, listing, "fp16", where="test"))
    assert fp16 == set(listing) - {"unet/diffusion_pytorch_model.safetensors", "unet/diffusion_pytorch_model.bin",
                                   "text_encoder/pytorch_model.bin"}
    plain = set(diffusers_folder.needed_files(index, listing, None, where="test"))
    assert "unet/diffusion_pytorch_model.safetensors" in plain
    assert "vae/diffusion_pytorch_model.fp16.safetensors" in plain  # the only weights the vae has
    assert not any("fp16" in f for f in plain - {"vae/diffusion_pytorch_model.fp16.safetensors"})
