"""The sampler's contracts: sharded equals single-device, traced inputs never recompile, progress is
reported per model call, a warm start loads the programs from disk without tracing them, the compute
dtype is the model's,
bad input is one line.

These run on the embedded demo models (random weights, built once into a temporary cache).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from pipelines import cpu_kernels, executables, guidance, sampler
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from pipelines.sampler import _decode
from sdx import mesh as meshlib
from sdx.errors import SdxError
from sdx.layers import Compute, SkipBlankRows
from sdx.sample import main
from sdx.unet import UNet2DConditionModel
from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_xl(tmp_path_factory, demo_build) -> Path:
    return demo_build("tiny_xl", tmp_path_factory.mktemp("demo"))


def test_prompt_seed_guidance_changes_do_not_recompile(tiny_xl, jax_events):
    backend_compiles = jax_events("backend_compile")
    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    base = Request(prompts=["a lighthouse"], height=64, width=64, steps=3, seed=0, guidance_scale=5.0)
    bar = Bar()
    first = pipe(base, bar)
    assert pipe.sampler.compilations == 1
    assert bar.total == 3 and bar.updates == [1, 1, 1]  # one report per model call, as each finishes
    compiled_before = len(backend_compiles)
    variants = [
        Request(prompts=["a very different prompt, longer"], negative_prompts=["fog"], height=64, width=64, steps=3,
                seed=1, guidance_scale=9.0, guidance_rescale=0.5),
        Request(prompts=["a lighthouse"], height=64, width=64, steps=3, seed=0, guidance_scale=5.0,
                original_size=(128, 96), crops_coords_top_left=(8, 4)),
    ]
    outs = [pipe(r) for r in variants]
    assert pipe.sampler.compilations == 1
    assert len(backend_compiles) == compiled_before, "XLA compiled again for a traced input's new value"
    assert not np.allclose(first, outs[0]) and not np.allclose(first, outs[1])  # the new values were used


def test_sdxl_without_a_negative_prompt_skips_the_negative_rows_cross_attentions(tiny_xl, monkeypatch):
    """force_zeros_for_empty_prompt: the negative branch reads zeros, so every attention that reads the
    text is traced with its shortcut for the blank rows (`sdx.layers.SkipBlankRows._skip`); a run
    without guidance has no negative branch, and no shortcut; nor has a request planned on a backend left
    out of `BLANK_ROWS_PLATFORMS` (the plan holds it, so the same pipeline compiles that program anew),
    whose image is the same."""
    traced = []
    shortcut = SkipBlankRows._skip
    monkeypatch.setattr(SkipBlankRows, "_skip", lambda self, call: traced.append(call.path) or shortcut(self, call))
    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    assert pipe.family.force_zeros
    pipe(Request(prompts=["a lighthouse"], height=32, width=32, steps=2, guidance_scale=1.0))
    assert traced == []
    guided = Request(prompts=["a lighthouse"], height=32, width=32, steps=2, guidance_scale=5.0)
    skipped = pipe(guided)
    reading = {m.key for _, m in pipe.sampler.models["unet"]._reading_text()}
    assert reading and set(traced) == reading

    traced.clear()
    monkeypatch.setattr(sampler, "BLANK_ROWS_PLATFORMS", ())
    computed = pipe(guided)
    assert traced == []
    np.testing.assert_allclose(skipped, computed, atol=1e-5)
    assert not np.array_equal(skipped, pipe(dataclasses.replace(guided, guidance_scale=4.0)))  # the images see guidance


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, demo_build) -> Path:
    return demo_build("tiny", tmp_path_factory.mktemp("demo-sd"))


def test_sd_guidance_branches_share_what_precedes_the_text(tiny, monkeypatch):
    """SD 1.x's classifier-free guidance branches read the same latents: the UNet computes what comes
    before its first text-reading attention once per image (`Guidance.shared`), fewer FLOPs than on the
    whole guidance batch for the same images."""
    request = Request(prompts=["a lighthouse", "a boat"], height=32, width=32, steps=2, guidance_scale=5.0)

    def run():
        pipe = Pipeline.load(tiny, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
        return pipe(request), sum(pipe.sampler.flops().values())

    shared, shared_flops = run()
    monkeypatch.setattr(guidance.ClassifierFree, "shared", lambda self, family: 1)
    whole, whole_flops = run()
    print(f"FLOPs of the run: {shared_flops:.4g} shared, {whole_flops:.4g} not")
    np.testing.assert_allclose(shared, whole, atol=1e-5)
    assert shared_flops < 0.97 * whole_flops


def test_flop_count_grows_by_one_unet_call_per_step(tiny_xl):
    """Sampler.flops (benchmarks/sample.py's FLOP/s): XLA's count of a run, each denoise program counted
    once per model call, against the UNet's own count on the guidance batch compiled alone, reading its
    `text_context` as the sampler's calls do."""
    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    for steps in (2, 5):
        pipe(Request(prompts=["a lighthouse"], height=32, width=32, steps=steps, guidance_scale=5.0))
    two, five = sorted(pipe.sampler.flops().values())
    unet = pipe.sampler.models["unet"]
    c, side = unet.config, 32 // pipe.factor
    added = {"text_embeds": jnp.zeros((2, c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim)),
             "time_ids": jnp.zeros((2, 6))}
    x, t, context = jnp.zeros((2, side, side, c.in_channels)), jnp.zeros((2,)), jnp.zeros((2, 77, c.cross_attention_dim[0]))
    flops = lambda f, *a: jax.jit(f).lower(*a).compile().cost_analysis()["flops"]
    one_call = flops(lambda m, x, t, text: m(x, t, text, added), unet, x, t, unet.text_context(context))
    assert (five - two) / 3 == pytest.approx(one_call, rel=0.02)
    assert two > 2 * one_call  # and the text encoders and the VAE decode on top
    # each call reads the text's projections made once by the prepare program: a plain call makes them
    projections = flops(lambda m, c: m.text_context(c), unet, context)
    assert projections > 0.01 * one_call
    assert flops(lambda m, x, t, c: m(x, t, c, added), unet, x, t, context) == pytest.approx(one_call + projections, rel=0.01)


class Bar:
    """The part of tqdm's interface the pipeline uses."""

    def __init__(self):
        self.total, self.updates = 0, []

    def refresh(self):
        pass

    def update(self, n):
        self.updates.append(n)


def test_a_warm_start_loads_every_program_without_tracing_it(tiny_xl, tmp_path):
    """Three fresh processes. The first keeps its programs in JAX's persistent cache only (sdx's own cache
    off); the second finds them there, but compiles its own copies afresh to keep (a copy of what JAX's
    cache loaded would lack its kernels); the third traces and compiles none of the three and makes the
    same image, nor builds an abstract model (read back as `executables.abstract_model` kept them). No
    program holds a host callback, or no cache would keep it."""
    cache = tmp_path / "jax"
    script = textwrap.dedent(
        f"""
        import json, sys, jax, numpy as np
        from pipelines import executables
        from pipelines.pipeline import Pipeline
        from pipelines.request import Request
        from pipelines.sampler import enable_compilation_cache
        from sdx import mesh as meshlib
        from sdx.model_folder import ModelKind
        enable_compilation_cache({str(cache)!r}, min_compile_secs=0)
        if sys.argv[1] == "jax-only":
            executables.folder = lambda: None
        built, build = [], ModelKind.abstract.__code__  # counted, not patched: a patch turns the disk cache off
        count = lambda frame, event, _: built.append(1) if event == "call" and frame.f_code is build else None
        programs = {{name for p in ("_prepare", "_denoise", "_decode") for name in (p, f"jit({{p}})")}}
        events = []
        jax.monitoring.register_event_duration_secs_listener(
            lambda event, _secs, fun_name="", **_: events.append(event) if fun_name in programs else None)
        sys.setprofile(count)
        pipe = Pipeline.load({str(tiny_xl)!r}, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
        sys.setprofile(None)
        images = pipe(Request(prompts=["a lighthouse"], height=32, width=32, steps=2, guidance_scale=5.0))
        np.save({str(tmp_path)!r} + "/" + sys.argv[1] + ".npy", np.asarray(images))
        print(json.dumps({{"traced": events.count("/jax/core/compile/jaxpr_trace_duration"),
                          "compiled": events.count("/jax/core/compile/backend_compile_duration"), "built": len(built)}}))
        """
    )
    runs = {}
    for name in ("jax-only", "second", "third"):
        proc = subprocess.run([sys.executable, "-c", script, name], cwd=REPO, env=child_env(), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[name] = json.loads(proc.stdout.splitlines()[-1])
    print(runs)
    assert runs["jax-only"] == {"traced": 3, "compiled": 3, "built": 4}  # UNet, VAE, two text encoders
    assert runs["second"] == {"traced": 3, "compiled": 3, "built": 4}
    assert runs["third"] == {"traced": 0, "compiled": 0, "built": 0}
    kept = [f.name.split("-")[0] for f in (cache / "executables").iterdir()]
    # the three programs, the four abstract models and what the source files define (`pipelines.source_check`)
    assert set(kept) == {"_prepare", "_denoise", "_decode", "model", "source"} and kept.count("model") == 4
    first = np.load(tmp_path / "jax-only.npy")
    for name in ("second", "third"):
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), first)


def test_a_prepare_without_a_key_still_keeps_the_unet_and_the_vae(tiny_xl, tmp_path, monkeypatch, jax_events):
    """A researcher's own text encoder class (from a module no key covers) leaves `prepare` uncachable
    here; denoise and decode, which take its outputs, are then keyed by all their arguments and still
    kept: a second pipeline traces prepare again, but neither of them."""
    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    mesh = meshlib.make_mesh(devices=jax.devices()[:1])
    request = Request(prompts=["a lighthouse"], height=32, width=32, steps=2, guidance_scale=5.0)
    traced = jax_events("jaxpr_trace")
    images = []
    for _ in range(2):
        pipe = Pipeline.load(tiny_xl, mesh=mesh)
        encoder = pipe.sampler.models["text_encoder"]
        own = type("OwnTextEncoder", (type(encoder),), {"__module__": __name__})
        encoder.__class__ = own
        own_pipe = Pipeline.from_models(pipe.sampler.models, family=pipe.family, scheduler=pipe.scheduler,
                                        tokenizers=pipe.tokenizers, mesh=mesh, name="own")
        traced.clear()
        images.append(own_pipe(request))
    assert {f.name.split("-")[0] for f in tmp_path.iterdir()} == {"_denoise", "_decode", "model"}
    assert traced.count("_prepare") == 1 and traced.count("_denoise") == traced.count("_decode") == 0, traced
    np.testing.assert_array_equal(images[1], images[0])


def test_the_first_request_s_programs_are_read_while_the_weights_load(tiny_xl, tmp_path, monkeypatch, jax_events):
    """`Pipeline.load(first=...)` keys the first request's programs from the abstract models (shapes and
    shardings, no weights) and starts reading them before any weight is read; the loaded pipeline takes them
    from there (so the keys match the loaded arrays'): nothing is traced or compiled, and the image is the
    same. A first request the model refuses is refused before any weight is read."""
    from sdx import weights

    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    mesh = meshlib.make_mesh(devices=jax.devices()[:1])
    request = Request(prompts=["a lighthouse"], height=32, width=32, steps=2, guidance_scale=5.0)
    expected = Pipeline.load(tiny_xl, mesh=mesh)(request)  # keeps the programs

    reading, materialize = [], weights.materialize
    monkeypatch.setattr(weights, "materialize", lambda *a, **k: (
        reading.append(sorted(p.name.split("-")[0] for p in executables._PREFETCHED)), materialize(*a, **k))[1])
    events = jax_events()
    pipe = Pipeline.load(tiny_xl, mesh=mesh, first=lambda shell: dataclasses.replace(request, prompts=["a boat"]))
    assert reading[0] == ["_decode", "_denoise", "_prepare"], reading
    images = pipe(request)
    assert not executables._PREFETCHED, "every prefetched program taken"
    programs = {"_prepare", "_denoise", "_decode", "jit(_prepare)", "jit(_denoise)", "jit(_decode)"}
    assert not [name for name in events if name in programs], events
    np.testing.assert_array_equal(images, expected)

    reading.clear()
    with pytest.raises(SdxError, match="positive multiples of"):
        Pipeline.load(tiny_xl, mesh=mesh, first=lambda shell: dataclasses.replace(request, height=33))
    assert reading == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_abstract_parameters_have_the_keys_of_the_loaded_ones(tiny_xl, dtype):
    """What `Pipeline.load(first=...)` keys the programs by before the weights load (`weights.placed_abstract`)
    is, leaf for leaf, what the loaded parameters are keyed by, in either dtype, with the mesh's shardings."""
    from sdx import model_folder, weights

    mesh = meshlib.make_mesh(devices=jax.devices()[:1])
    rule = meshlib.param_sharding(mesh)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        compute = Compute(dtype=dtype, param_dtype=dtype)
        model = model_folder.abstract_component(tiny_xl, name, dtype=dtype, compute=compute)
        placed = weights.placed_abstract(model, dtype=dtype, sharding=rule)
        loaded = model_folder.load_component(tiny_xl, name, dtype=dtype, compute=compute, sharding=rule)
        assert executables._arguments((nnx.state(placed),)) == executables._arguments((nnx.state(loaded),)), name
        assert executables._text(nnx.graphdef(placed)) == executables._text(nnx.graphdef(loaded)), name


def _ynn_fusions(hlo: str) -> list[tuple[str, ...]]:
    """The operations of each YNNPACK fusion in an optimized HLO text."""
    computations = {}
    for block in re.split(r"\n(?=%|ENTRY)", hlo):
        name = re.match(r"%(\S+) ", block)
        if name:
            computations[name.group(1)] = tuple(re.findall(r"= \S+ ([\w-]+)\(", block))
    return [computations[c] for c in re.findall(r"kind=kCustom, calls=%(\S+?),.*__ynn_fusion", hlo)]


def test_on_a_cpu_ynnpack_computes_the_matrix_products_and_reductions_alone(tiny_xl):
    """pipelines.cpu_kernels: every YNNPACK fusion of the three programs is a dot or a reduction (with the
    elementwise work that feeds it), the dots all on their own in some, never a convolution, where the same
    decode compiled with XLA's defaults also hands YNNPACK convolutions."""
    mesh = meshlib.make_mesh(devices=jax.devices("cpu")[:1])
    pipe = Pipeline.load(tiny_xl, mesh=mesh)
    request = Request(prompts=["a red fox"], height=32, width=32, steps=2, guidance_scale=5.0)
    plan, inputs, _ = pipe._work(request)[0]
    programs = pipe.sampler.compiled(plan, pipe.sampler.place(inputs))
    assert cpu_kernels.compiler_options(mesh) == cpu_kernels.OPTIONS
    for program in (programs.prepare, *programs.denoise.values(), programs.decode):
        fusions = _ynn_fusions(program.as_text())
        assert ("parameter", "parameter", "dot") in fusions and ("parameter", "parameter", "reduce") in fusions
        assert all(("dot" in f or "reduce" in f) and "convolution" not in f for f in fusions), set(fusions)
    latents = jax.ShapeDtypeStruct(programs.prepare.out_info[0].latents.shape, jnp.float32)
    default = jax.jit(functools.partial(_decode, pipe.sampler.graphdefs["vae"], devices=1, tiled=False)).lower(pipe.sampler.params["vae"], latents)
    assert {"convolution", "reduce", "exponential"} <= {op for f in _ynn_fusions(default.compile().as_text()) for op in f}


def test_on_a_cpu_a_bfloat16_unet_call_does_not_hold_float32_copies_of_all_its_weights(tiny_xl):
    """pipelines.cpu_kernels' scheduler: XLA:CPU convolves bfloat16 in float32 copies of the weights (and
    multiplied so before `sdx.products`), and its default schedule makes them all before the first one (this
    model's denoise program: 2.7 MB of temporaries, 3.5 MB before sdx.outline, 8.6 MB before sdx.products,
    more than the UNet's 8.1 MB of weights in float32). The sampler's schedule: 1.4 MB."""
    mesh = meshlib.make_mesh(devices=jax.devices("cpu")[:1])
    if cpu_kernels.SCHEDULER not in cpu_kernels.compiler_options(mesh):
        pytest.skip("this jaxlib's XLA:CPU has no memory-optimized scheduler option")
    pipe = Pipeline.load(tiny_xl, mesh=mesh, dtype="bfloat16")
    request = Request(prompts=["a red fox"], height=32, width=32, steps=2, guidance_scale=5.0)
    plan, inputs, _ = pipe._work(request)[0]
    programs = pipe.sampler.compiled(plan, pipe.sampler.place(inputs))
    float32_copies = sum(leaf.size * 4 for leaf in jax.tree.leaves(pipe.sampler.params["unet"]))
    for program in programs.denoise.values():
        assert program.memory_analysis().temp_size_in_bytes < float32_copies / 4


def test_the_vae_decodes_one_image_per_device_at_a_time(tiny_xl):
    """Four images decode in the working memory of one (XLA's analysis), to the same images as one by one and
    as the whole batch at once (which `devices=4` on one device gives: four images, one turn)."""
    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    graphdef, params = pipe.sampler.graphdefs["vae"], pipe.sampler.params["vae"]
    latents = jax.random.normal(jax.random.key(0), (4, 32, 32, 4))

    def decode(z, devices):
        program = jax.jit(functools.partial(_decode, graphdef, devices=devices, tiled=False)).lower(params, z).compile()
        return program.memory_analysis().temp_size_in_bytes, program(params, z)[0]

    one, first = decode(latents[:1], 1)
    turns, images = decode(latents, 1)
    whole, at_once = decode(latents, 4)
    assert turns < 1.1 * one and whole > 3.5 * one, (one, turns, whole)
    np.testing.assert_array_equal(images[:1], first)
    np.testing.assert_allclose(images, at_once, atol=1e-5)


def test_the_model_carries_its_compute_dtype(tiny_xl):
    """float32 parameters computing in bfloat16 (training's master weights): the sampler feeds the UNet
    bfloat16, read from the model's `compute`, not from a kernel's dtype."""
    mesh = meshlib.make_mesh(devices=jax.devices()[:1])
    full = Pipeline.load(tiny_xl, mesh=mesh)
    unet = full.sampler.models["unet"]
    mixed_unet = nnx.eval_shape(lambda: UNet2DConditionModel(
        unet.config, Compute(dtype=jnp.bfloat16, param_dtype=jnp.float32), rngs=nnx.Rngs(0)))
    nnx.update(mixed_unet, nnx.state(unet))
    mixed = Pipeline.from_models({**full.sampler.models, "unet": mixed_unet}, family=full.family, scheduler=full.scheduler,
                                 tokenizers=full.tokenizers, mesh=mesh, name="mixed")
    assert {leaf.dtype for leaf in jax.tree.leaves(mixed.sampler.params["unet"])} == {jnp.dtype("float32")}

    request = Request(prompts=["a red fox", "a boat"], height=64, width=64, steps=4, seed=1, guidance_scale=5.0)
    plan, inputs, _ = mixed._work(request)[0]
    _, fixed = mixed.sampler.compiled(plan, mixed.sampler.place(inputs)).prepare.out_info
    assert fixed.cond.context.dtype == fixed.cond.time_ids.dtype == jnp.bfloat16
    diff = np.abs(mixed(request) - full(request)) * 255
    print(f"bfloat16 compute vs float32, 8-bit: mean {diff.mean():.2f}, max {diff.max():.1f}")
    assert 0 < diff.mean() < 4.0


def test_update_takes_new_weights_of_the_same_structure_only(tiny_xl):
    """Sampler.update (a training run's validation, train/diffusion.py) swaps a model's weights under the
    compiled programs; a model built otherwise is refused (its programs would be other ones)."""
    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    unet = pipe.sampler.models["unet"]
    same = UNet2DConditionModel(unet.config, unet.compute, rngs=nnx.Rngs(5))
    pipe.sampler.update("unet", same)
    assert pipe.sampler.models["unet"] is same
    assert jax.tree.leaves(pipe.sampler.params["unet"])[0] is jax.tree.leaves(nnx.state(same))[0]
    wide = UNet2DConditionModel(dataclasses.replace(unet.config, in_channels=8), unet.compute, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="not built like the old one"):
        pipe.sampler.update("unet", wide)
    assert pipe.sampler.models["unet"] is same


def test_sharded_equals_single_device(tiny_xl, tmp_path):
    """With `chunked` attention blocking every attention, whose blocks take one row of each device's share
    of the batch (`Compute.batch_shards`, the mesh's size)."""
    script = textwrap.dedent(
        f"""
        import jax, numpy as np
        from pipelines.pipeline import Pipeline
        from pipelines.request import Request
        from sdx import attention, mesh as meshlib
        assert jax.device_count() == 4, jax.devices()
        attention.BLOCKED_LOGITS = 1
        req = Request(prompts=["a red fox", "a boat"], num_images_per_prompt=2, height=64, width=64, steps=3, seed=3)
        def generate(mesh):
            pipe = Pipeline.load({str(tiny_xl)!r}, mesh=mesh, attention="chunked")
            shards = {{m.compute.batch_shards for m in pipe.sampler.models.values()}}
            assert shards == {{mesh.devices.size}}, (shards, mesh)
            return pipe(req)
        single = generate(meshlib.make_mesh(devices=jax.devices()[:1]))
        data = generate(meshlib.make_mesh(devices=jax.devices()[:2]))  # 2 turns
        fsdp = generate(meshlib.make_mesh(fsdp=2))
        sharded_params = [
            leaf for leaf in jax.tree.leaves(Pipeline.load({str(tiny_xl)!r}, mesh=meshlib.make_mesh(fsdp=4)).sampler.params)
            if len(leaf.sharding.device_set) == 4 and not leaf.sharding.is_fully_replicated
        ]
        print("data", np.abs(data - single).max(), "fsdp", np.abs(fsdp - single).max(), "split params", len(sharded_params))
        np.testing.assert_allclose(data, single, atol=2e-5)
        np.testing.assert_allclose(fsdp, single, atol=2e-5)
        """
    )
    env = child_env(devices=4)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)


def cli_error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    assert "Traceback" not in "\n".join(err)
    return err[-1]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--height", "63", "--width", "64"], "multiples of"),
        (["--steps", "0"], "positive integer"),
        (["--scheduler", "warp"], "unknown scheduler 'warp'"),
        (["--image", "/nonexistent/input.png"], "cannot read the image"),
        (["--latents", "/nonexistent/noise.npy"], "cannot read a .npy"),
        (["--num-images", "2", "--output", "one.png"], "one file but 2 images"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_xl, tmp_path, capsys, args, expected):
    message = cli_error(capsys, "--model", str(tiny_xl), "--prompt", "x", "--quiet", "--cache", str(tmp_path),
                        "--output", str(tmp_path / "out"), *args)
    assert expected in message


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--height", "0"], "--height 0 must be a positive integer"),
        (["--width", "-64"], "--width -64 must be a positive integer"),
        (["--steps", "-1"], "--steps -1 must be a positive integer"),
        (["--num-images", "0"], "--num-images 0 must be"),
        (["--batch-size", "0"], "--batch-size 0 must be"),
        (["--fsdp", "0"], "--fsdp 0 must be"),
        (["--strength", "1.5", "--image", "PICTURE"], "--strength 1.5 must be in [0, 1]"),
        (["--refiner", "tiny_xl", "--high-noise-frac", "1"], "strictly between 0 and 1"),
        (["--clip-skip", "-1"], "--clip-skip -1 must be >= 0"),
        (["--image", "NOT_AN_IMAGE"], "cannot read the image"),
        (["--image", "TRUNCATED"], "cannot read the image"),  # decoded in full up front, not only its header
        (["--config", "/nonexistent/config"], "not a folder"),
        (["--output", "/proc/sdx-out/image.png"], "cannot be made in /proc: it is on proc, a file system the kernel"),
        (["--output", "/proc/image.png"], "--output /proc: cannot write in /proc: it is on proc, a file system the kernel"),
        (["--output", "/proc/sdx-out"], "cannot be made in /proc: it is on proc"),
        (["--output", "NOT_AN_IMAGE/x.png"], "is a file, not a folder"),
        (["--grid", "/proc/grid.png"], "cannot write in /proc"),
        (["--cache", "/proc/sdx-cache"], "--cache /proc/sdx-cache: it does not exist and cannot be made in /proc"),
        (["--output", "EXISTING"], "exists; pass --overwrite"),
    ],
)
def test_bad_flags_are_refused_before_any_work_and_nothing_is_written(tmp_path, capsys, monkeypatch, args, expected):
    """Checked before a model is resolved (which would load, convert or assemble one): one line, exit 2, no
    progress output, and an existing output left byte for byte."""
    import pipelines.cli

    monkeypatch.setattr(pipelines.cli, "resolve_model", lambda *a, **k: pytest.fail("a model was resolved"))
    Image.new("RGB", (64, 64)).save(tmp_path / "image.png")
    (tmp_path / "text.png").write_text("not an image")
    (tmp_path / "cut.png").write_bytes((tmp_path / "image.png").read_bytes()[:-40])
    existing = tmp_path / "existing.png"
    existing.write_bytes(b"the user's picture")
    files = {"NOT_AN_IMAGE": tmp_path / "text.png", "TRUNCATED": tmp_path / "cut.png", "PICTURE": tmp_path / "image.png",
             "EXISTING": existing}
    for name, path in files.items():
        args = [a.replace(name, str(path)) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = ["--prompt", "x", "--output", str(tmp_path / "out"), *args]
    if "--cache" not in args:
        argv += ["--cache", str(tmp_path / "cache")]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert existing.read_bytes() == b"the user's picture"


def test_model_checks_come_before_the_progress_bar(tiny_xl, tmp_path, capsys):
    """A size the model cannot take is found after loading it, but before any progress output."""
    assert main(["--model", str(tiny_xl), "--prompt", "x", "--height", "63", "--cache", str(tmp_path),
                 "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "denoising" not in err and err.strip().splitlines()[-1].startswith("error: --height 63"), err


def test_the_progress_bar_leaves_the_compile_out_of_its_time_and_rate(tiny_xl, tmp_path, monkeypatch):
    """The bar opens before the programs are compiled: its elapsed time (and so its rate) is the sampling's,
    so its first step does not read as the compile's length. Each program is made 1 s slower to compile
    (three or more programs): the bar's time is at least that much shorter than it was open."""
    import tqdm

    closed = []

    class Recorded(tqdm.tqdm):
        def __init__(self, *a, **k):
            self.opened = time.monotonic()
            super().__init__(*a, **k)

        def close(self):
            if not self.disable:  # still open: tqdm closes a closed bar again when it is collected
                closed.append((dict(self.format_dict), time.monotonic() - self.opened))
            super().close()

    slow = executables.compile
    monkeypatch.setattr(executables, "compile", lambda *a, **k: (time.sleep(1.0), slow(*a, **k))[1])
    monkeypatch.setattr(tqdm, "tqdm", Recorded)
    assert main(["--model", str(tiny_xl), "--prompt", "x", "--height", "32", "--width", "32", "--steps", "2",
                 "--cache", str(tmp_path), "--output", str(tmp_path / "out.png")]) == 0
    ((bar, was_open),) = [(b, s) for b, s in closed if b["prefix"] == "denoising"]
    assert bar["n"] == 2 and bar["elapsed"] < was_open - 2.5, (bar, was_open)


def test_a_mistyped_model_or_flag_is_named_with_the_near_one(tmp_path, capsys):
    message = cli_error(capsys, "--model", "defualt", "--prompt", "x", "--quiet", "--cache", str(tmp_path),
                        "--output", str(tmp_path / "out"))
    assert message == ("error: defualt: no such file or folder, nor a built-in model (default, default-edit, tiny, "
                       "tiny_xl) or a hub id (org/name); did you mean default?")
    assert "did you mean" not in cli_error(capsys, "--model", "zzz", "--prompt", "x", "--cache", str(tmp_path))
    message = cli_error(capsys, "--stpes", "3", "--prompt", "x", "--gudance-scale=2", "--zzz")
    assert message == ("error: unrecognized arguments: --stpes 3 --gudance-scale=2 --zzz (did you mean --steps for "
                       "--stpes, --guidance-scale for --gudance-scale?)")


def test_missing_model_is_one_line(tmp_path, capsys):
    message = cli_error(capsys, "--model", str(tmp_path / "no-such-model"), "--prompt", "x", "--quiet", "--cache", str(tmp_path),
                        "--output", str(tmp_path / "out"))  # not ./outputs, which a run in the checkout may have left
    assert "no-such-model" in message


def test_demo_cli_writes_a_png(tmp_path):
    out = tmp_path / "demo.png"
    assert main(["--model", "tiny", "--prompt", "a lighthouse", "--steps", "2", "--cache", str(tmp_path), "--quiet",
                 "--output", str(out)]) == 0
    assert out.stat().st_size > 0


def test_bfloat16_runs_the_unet_in_bf16_keeps_the_vae_float32_and_stays_close(tiny_xl):
    request = Request(prompts=["a red fox", "a boat"], height=64, width=64, steps=4, seed=1, guidance_scale=5.0)
    mesh = meshlib.make_mesh(devices=jax.devices()[:1])
    full = Pipeline.load(tiny_xl, mesh=mesh)(request)
    half = Pipeline.load(tiny_xl, mesh=mesh, dtype="bfloat16")
    params = half.sampler.params
    assert {leaf.dtype for leaf in jax.tree.leaves(params["unet"])} == {jax.numpy.dtype("bfloat16")}
    assert {leaf.dtype for leaf in jax.tree.leaves(params["text_encoder_2"])} == {jax.numpy.dtype("bfloat16")}
    assert {leaf.dtype for leaf in jax.tree.leaves(params["vae"])} == {jax.numpy.dtype("float32")}
    images = half(request)
    assert np.isfinite(images).all()
    diff = np.abs(images - full) * 255
    print(f"bfloat16 vs float32, 8-bit: mean {diff.mean():.2f}, max {diff.max():.1f}")
    assert diff.mean() < 4.0  # measured 1.25 on this random model; a broken cast is far off


def test_vae_dtype_bfloat16_decodes_in_bfloat16_close_to_float32(tiny_xl, tmp_path):
    """`--vae-dtype bfloat16` changes the image (the VAE computes in bfloat16) by a little, and is recorded."""
    def run(*flags):
        out = tmp_path / "-".join(flags)
        assert main(["--model", str(tiny_xl), "--prompt", "a red fox", "--steps", "3", "--height", "64", "--width", "64",
                     "--dtype", "bfloat16", *flags, "--output", str(out / "x.png"), "--cache", str(tmp_path / "cache"),
                     "--quiet"]) == 0
        png = Image.open(out / "x.png")
        return np.asarray(png.convert("RGB")).astype(int), json.loads(png.text["sdx"])

    f32, meta32 = run()
    bf16, meta16 = run("--vae-dtype", "bfloat16")
    assert (meta32["vae_dtype"], meta16["vae_dtype"]) == ("float32", "bfloat16")
    diff = np.abs(bf16 - f32)
    print(f"bfloat16 VAE against float32, 8-bit: mean {diff.mean():.2f}, max {diff.max()}")
    assert 0 < diff.max() and diff.mean() < 2.0


def test_vae_tiles_that_do_not_line_up_are_refused_before_compiling(tiny_xl, monkeypatch):
    """--vae-tiling with a VAE whose sample_size (its tile) is not a multiple of 4 x its downsample factor:
    one SdxError from the request's checks, before any program is compiled."""
    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    vae = pipe.sampler.models["vae"]
    monkeypatch.setattr(vae, "config", dataclasses.replace(vae.config, sample_size=36))
    monkeypatch.setattr(pipe.sampler, "compiled", lambda *a: pytest.fail("compiled"))
    request = Request(prompts=["a lighthouse"], height=64, width=64, steps=2, vae_tiling=True)
    with pytest.raises(SdxError, match="do not line up"):
        pipe(request)
    with pytest.raises(SdxError, match="do not line up"):
        pipe.prefetch(request)


def test_plans_that_differ_only_in_vae_tiling_share_the_files_of_what_does_not_tile(tiny_xl, tmp_path, monkeypatch):
    """The stored programs' keys (`Sampler._recipe`, nothing compiled) of a plan and its tiled twin: text to
    image shares prepare's and denoise's files and only the decode's differ; img2img, which encodes in
    prepare, has its own prepare, and so its own denoise (keyed after prepare's)."""
    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    text_to_image = Request(prompts=["a lighthouse"], height=64, width=64, steps=2)
    img2img = dataclasses.replace(text_to_image, image=np.zeros((1, 64, 64, 3), np.float32), strength=0.5)
    for request, prepare_tiles in ((text_to_image, False), (img2img, True)):
        recipes = {}
        for tiled in (False, True):
            plan, inputs, _ = pipe._work(dataclasses.replace(request, vae_tiling=tiled))[0]
            recipes[tiled] = pipe.sampler._recipe(plan, pipe.sampler.place(inputs))
        assert recipes[False].decode_path != recipes[True].decode_path
        assert (recipes[False].prepare_path != recipes[True].prepare_path) == prepare_tiles
        assert (recipes[False].denoise_paths != recipes[True].denoise_paths) == prepare_tiles


def test_without_a_batch_size_the_batch_is_what_fits_in_free_memory(tiny_xl, monkeypatch):
    """Four images, with free memory between what batches of 2 and 4 need by XLA's memory analysis: the
    pipeline runs batches of 2, the same programs an explicit --batch-size 2 runs. Each program's memory
    analysis is read once (on a GPU it took 0.3 s of every generation of SDXL's four images)."""
    import pipelines.pipeline

    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    assert meshlib.free_bytes(pipe.sampler.mesh) > 0  # this host's MemAvailable
    request = Request(prompts=["a lighthouse"], num_images_per_prompt=4, height=64, width=64, steps=2)
    need = {}
    for b in (2, 4):
        plan, inputs, _ = pipe._work(dataclasses.replace(request, batch_size=b))[0]
        need[b] = pipe.sampler.compiled(plan, pipe.sampler.place(inputs)).working_bytes()
    assert need[2] < need[4]
    analysed = []
    read = jax.stages.Compiled.memory_analysis
    monkeypatch.setattr(jax.stages.Compiled, "memory_analysis", lambda self: analysed.append(self) or read(self))
    monkeypatch.setattr(pipelines.pipeline.meshlib, "free_bytes",
                        lambda mesh: int((need[2] + need[4]) / 2 / pipelines.pipeline.FREE_SHARE))
    assert pipe.fitting_batch(request) == 2
    auto = pipe(request)
    np.testing.assert_array_equal(auto, pipe(dataclasses.replace(request, batch_size=2)))
    np.testing.assert_array_equal(pipe(request), auto)
    assert analysed == []  # the programs' analyses were read for `need` above
    monkeypatch.setattr(pipelines.pipeline.meshlib, "free_bytes", lambda mesh: None)  # unknown: all at once
    assert pipe.fitting_batch(request) == 4


def test_a_decode_that_does_not_fit_in_free_memory_runs_in_tiles(tiny_xl, monkeypatch):
    """Two images larger than the VAE's tile (tiny_xl's: 128 px), the batch size left open, with free memory
    between what the tiled and the whole decode need by XLA's memory analysis, and enough for everything
    else: the pipeline decodes in tiles, the images an explicit vae_tiling=True request makes, and keeps both
    images in one batch (the whole decode, which tiles replace, does not halve it); with twice the whole
    decode's free, it decodes the whole image. The tiled plan compiles its decode alone: it runs the
    untiled one's prepare and denoise programs."""
    import pipelines.pipeline

    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    request = Request(prompts=["a lighthouse"], num_images_per_prompt=2, height=160, width=160, steps=1)
    programs = {}
    for tiled in (False, True):
        plan, inputs, _ = pipe._work(dataclasses.replace(request, batch_size=2, vae_tiling=tiled))[0]
        programs[tiled] = pipe.sampler.compiled(plan, pipe.sampler.place(inputs))
    assert programs[True].prepare is programs[False].prepare and programs[True].denoise is programs[False].denoise
    need = {tiled: sampler.working_bytes(p.decode) for tiled, p in programs.items()}
    rest = programs[False].working_bytes(decode=False)
    print(f"the decode of 2: {need[False] / 2**20:.1f} MiB whole, {need[True] / 2**20:.1f} MiB in tiles; "
          f"the other programs {rest / 2**20:.1f} MiB")
    assert max(need[True], rest) < 0.8 * need[False]
    free = lambda need: lambda mesh: int(need / pipelines.pipeline.FREE_SHARE)
    monkeypatch.setattr(pipelines.pipeline.meshlib, "free_bytes", free((max(need[True], rest) + need[False]) / 2))
    fitted = pipe.fitted(request)
    assert fitted.vae_tiling and fitted.batch_size == 2
    np.testing.assert_array_equal(pipe(request), pipe(dataclasses.replace(request, vae_tiling=True)))
    monkeypatch.setattr(pipelines.pipeline.meshlib, "free_bytes", free(2 * need[False]))
    fitted = pipe.fitted(request)
    assert not fitted.vae_tiling and fitted.batch_size == 2
