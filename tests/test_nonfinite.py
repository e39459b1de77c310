"""NaN and inf are caught, never written as black images: the step where an image's latents first went
non-finite is reported, the other images are kept, and a VAE that overflows in float16 decodes again in
float32."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from pipelines.pipeline import NonFiniteImages, Pipeline
from pipelines.request import Request
from sdx import io as sdx_io
from sdx import mesh as meshlib
from sdx.sample import main


@pytest.fixture(scope="module")
def tiny(demo_models):
    return demo_models("tiny")


@pytest.fixture(scope="module")
def mesh():
    return meshlib.make_mesh(devices=jax.devices()[:1])


def test_the_cli_writes_the_finite_images_and_names_the_step_of_the_others(tiny, tmp_path, capsys):
    noise = np.random.default_rng(0).standard_normal((3, 4, 32, 32)).astype(np.float32)  # (images, C, h, w): the tiny VAE halves the size
    noise[1, 2, 3, 4] = np.nan
    np.save(tmp_path / "noise.npy", noise)
    out = tmp_path / "out"
    code = main(["--model", str(tiny), "--prompt", "x", "--num-images", "3", "--steps", "3", "--latents",
                 str(tmp_path / "noise.npy"), "--output", str(out), "--cache", str(tmp_path / "cache"), "--quiet"])
    assert code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "image 1: the latents became NaN or inf at step 1 of 3" in errors[0], errors
    assert sorted(p.name for p in out.iterdir()) == ["0-0000.png", "0-0002.png"]


def test_the_step_counts_in_the_full_schedule(tiny, mesh):
    """A hand-over at denoising_start=0.5 of 4 steps runs calls 3 and 4: a NaN carried in shows at step 3."""
    pipe = Pipeline.load(tiny, mesh=mesh)
    latents = np.zeros((2, 4, 32, 32), np.float32)
    latents[0, 0, 0, 0] = np.inf
    request = Request(prompts=["x"], num_images_per_prompt=2, height=64, width=64, steps=4, init_latents=latents,
                      denoising_start=0.5)
    with pytest.raises(NonFiniteImages) as caught:
        pipe(request)
    assert caught.value.bad == {0: "the latents became NaN or inf at step 3 of 4"}
    assert np.isfinite(caught.value.images[1]).all()


def test_a_vae_that_overflows_in_float16_decodes_again_in_float32(tiny, mesh, tmp_path):
    """The decoder's first convolution scaled by 1e5 overflows float16 (the GroupNorm after it makes float32
    indifferent to the scale): the float16 VAE's images come out as the float32 VAE's do."""
    folder = tmp_path / "loud-vae"
    shutil.copytree(tiny, folder)
    arrays = dict(sdx_io.read_safetensors(tiny / "vae.safetensors"))
    arrays["decoder.conv_in.kernel"] = np.asarray(arrays["decoder.conv_in.kernel"]) * np.float32(1e5)
    sdx_io.write_safetensors(folder / "vae.safetensors", arrays)
    request = Request(prompts=["a boat", "a fox"], height=64, width=64, steps=2, seed=3)
    want = Pipeline.load(folder, mesh=mesh)(request)
    half = Pipeline.load(folder, mesh=mesh, vae_dtype="float16")
    vae = half.sampler.models["vae"]
    assert not np.isfinite(np.asarray(vae.decode(np.zeros((1, 32, 32, 4), np.float32) + 0.5))).all()  # it does overflow
    got = half(request)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-3)
