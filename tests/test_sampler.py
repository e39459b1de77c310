"""The sampler's contracts: sharded equals single-device, traced inputs never recompile, bad input is one line.

These run on the embedded demo models (random weights, built once into a temporary cache).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from pipelines.demo import demo_folder
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import mesh as meshlib
from sdx.sample import main

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_xl(tmp_path_factory) -> Path:
    return demo_folder("tiny_xl", tmp_path_factory.mktemp("demo"))


def test_prompt_seed_guidance_changes_do_not_recompile(tiny_xl):
    backend_compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: backend_compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None
    )
    pipe = Pipeline.load(tiny_xl, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    base = Request(prompts=["a lighthouse"], height=64, width=64, steps=3, seed=0, guidance_scale=5.0)
    first = pipe(base)
    assert pipe.sampler.compilations == 1
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


def test_sharded_equals_single_device(tiny_xl, tmp_path):
    script = textwrap.dedent(
        f"""
        import jax, numpy as np
        from pipelines.pipeline import Pipeline
        from pipelines.request import Request
        from sdx import mesh as meshlib
        assert jax.device_count() == 4, jax.devices()
        req = Request(prompts=["a red fox", "a boat"], num_images_per_prompt=2, height=64, width=64, steps=3, seed=3)
        single = Pipeline.load({str(tiny_xl)!r}, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))(req)
        data = Pipeline.load({str(tiny_xl)!r}, mesh=meshlib.make_mesh())(req)
        fsdp = Pipeline.load({str(tiny_xl)!r}, mesh=meshlib.make_mesh(fsdp=2))(req)
        sharded_params = [
            leaf for leaf in jax.tree.leaves(Pipeline.load({str(tiny_xl)!r}, mesh=meshlib.make_mesh(fsdp=4)).sampler.params)
            if len(leaf.sharding.device_set) == 4 and not leaf.sharding.is_fully_replicated
        ]
        print("data", np.abs(data - single).max(), "fsdp", np.abs(fsdp - single).max(), "split params", len(sharded_params))
        np.testing.assert_allclose(data, single, atol=2e-5)
        np.testing.assert_allclose(fsdp, single, atol=2e-5)
        """
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
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
        (["--scheduler", "warp"], "invalid choice"),
        (["--image", "/nonexistent/input.png"], "cannot read the image"),
        (["--latents", "/nonexistent/noise.npy"], "cannot read a .npy"),
        (["--num-images", "2", "--output", "one.png"], "one file but 2 images"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tiny_xl, tmp_path, capsys, args, expected):
    message = cli_error(capsys, "--model", str(tiny_xl), "--prompt", "x", "--quiet", "--cache", str(tmp_path),
                        "--output", str(tmp_path / "out"), *args)
    assert expected in message


def test_missing_model_is_one_line(tmp_path, capsys):
    message = cli_error(capsys, "--model", str(tmp_path / "no-such-model"), "--prompt", "x", "--quiet", "--cache", str(tmp_path))
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
