"""Image j's randomness comes from its own key, that of seed + j (`pipelines.request.image_keys`): its initial noise, every
stochastic sampler step's noise and img2img's VAE posterior sample. So image j is the same at any batch
size, with or without guidance, on one device or split over four (fake CPU devices, in a subprocess).
The cases compare the final latents (`output_latents`): every draw is made before them, and decoding them
is deterministic per image (its own tests), so the VAE's decode programs are not compiled here.

The cases run on the embedded `tiny` demo model (random weights); InstructPix2Pix on the same model with
its UNet widened to 8 input channels.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import mesh as meshlib
from sdx.unet import UNet2DConditionModel
from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]
BATCH_SIZES = (1, 3)  # 3 of 4 images: another batch size, and a last batch padded


def _image() -> np.ndarray:
    yy, xx = np.mgrid[0:32, 0:32] / 32
    return np.stack([yy, xx, np.sin(6 * xx * yy)], -1)[None].astype(np.float32) * 2 - 1  # (1, 32, 32, 3) in [-1, 1]


# case -> (scheduler, what the request adds); every one draws something from the image keys (every stochastic
# scheduler, DDPM included, takes its step noise from the sampler's per-image stream these cases test)
CASES = {
    "euler_a": ("euler_a", {}),
    "euler_a_unguided": ("euler_a", {"guidance_scale": 1.0}),
    "ddim_eta_1": ("ddim", {}),
    "dpmpp_sde": ("dpmpp_sde", {}),  # its Brownian path from the image's key (Scheduler.draw_noise)
    "img2img": ("euler", {"image": "image", "strength": 0.7}),  # a deterministic sampler: the posterior sample alone
    "pix2pix": ("euler_a", {"image": "image"}),
}


def pipelines(folder: Path, mesh) -> dict[str, Pipeline]:
    """case -> its pipeline on `mesh` (DDIM with eta = 1; InstructPix2Pix with an 8-channel UNet made from the
    demo's: no random initialisation to compile)."""
    out = {}
    for case, (scheduler, _) in CASES.items():
        pipe = Pipeline.load(folder, scheduler=scheduler, mesh=mesh)
        if case == "ddim_eta_1":
            pipe = dataclasses.replace(pipe, scheduler=dataclasses.replace(pipe.scheduler, eta=1.0))
        if case == "pix2pix":  # the demo UNet, its conv_in widened to 8 input channels (the image's: half its kernel)
            unet = pipe.sampler.models["unet"]
            wide = nnx.eval_shape(lambda: UNet2DConditionModel(dataclasses.replace(unet.config, in_channels=8),
                                                               unet.compute, rngs=nnx.Rngs(0)))
            state = nnx.to_pure_dict(nnx.state(unet))
            kernel = state["conv_in"]["kernel"]  # (3, 3, 4, C)
            state["conv_in"]["kernel"] = jnp.concatenate([kernel, 0.5 * kernel], axis=2)  # (3, 3, 8, C)
            nnx.update(wide, jax.device_put(state, meshlib.replicated(mesh)))
            pipe = Pipeline.from_models({**pipe.sampler.models, "unet": wide}, family=dataclasses.replace(pipe.family, pix2pix=True),
                                        scheduler=pipe.scheduler, tokenizers=pipe.tokenizers, mesh=mesh, name="tiny-pix2pix")
        out[case] = pipe
    return out


def image_one(pipes: dict[str, Pipeline], batch_size: int) -> dict[str, np.ndarray]:
    """case -> the latents of image 1 of four (two prompts, two images each), generated `batch_size` at a time."""
    out = {}
    for case, (_, extra) in CASES.items():
        fields = dict(prompts=["a red fox", "a blue boat"], num_images_per_prompt=2, height=32, width=32, steps=3,
                      seed=7, guidance_scale=5.0, batch_size=batch_size, output_latents=True)
        fields.update({k: _image() if v == "image" else v for k, v in extra.items()})
        request = Request(**fields)
        out[case] = pipes[case](request)[1]
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory, demo_build) -> Path:
    return demo_build("tiny", tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def one_device(folder) -> dict[int, dict[str, np.ndarray]]:
    pipes = pipelines(folder, meshlib.make_mesh(devices=jax.devices()[:1]))
    assert all(p.scheduler.stochastic for c, p in pipes.items() if c != "img2img")
    return {b: image_one(pipes, b) for b in BATCH_SIZES}


@pytest.fixture(scope="module")
def four_devices(folder, tmp_path_factory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("sharded") / "images.npz"
    script = textwrap.dedent(
        f"""
        import jax, numpy as np
        from pathlib import Path
        from sdx import mesh as meshlib
        from tests.test_randomness import image_one, pipelines
        assert jax.device_count() == 4, jax.devices()
        np.savez({str(out)!r}, **image_one(pipelines(Path({str(folder)!r}), meshlib.make_mesh()), 4))
        """
    )
    env = child_env(devices=4)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(np.load(out))


@pytest.mark.parametrize("case", CASES)
def test_an_image_is_the_same_at_any_batch_size_and_on_any_mesh(case, one_device, four_devices):
    # latents reach about 10 in magnitude: float32 rounding of another batch layout moves them by up to 3e-5;
    # a draw from another key moves them by about 1
    alone = one_device[1][case]
    for batch_size in BATCH_SIZES[1:]:
        np.testing.assert_allclose(one_device[batch_size][case], alone, atol=1e-4, err_msg=f"batch size {batch_size}")
    np.testing.assert_allclose(four_devices[case], alone, atol=1e-4, err_msg="4 devices")

