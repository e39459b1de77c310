"""FreeU, PAG and SAG keep what the sampler promises (tests/test_randomness.py's cases, on the `tiny` demo
model): image 1 of four is the same at any batch size and on four devices (fake CPU devices, in a
subprocess) as alone, with stochastic samplers; and a new FreeU, PAG or SAG scale compiles nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

from pipelines.pag import PerturbedAttention
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from pipelines.sag import SelfAttention
from sdx import mesh as meshlib
from sdx.freeu import FreeU
from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]
BATCH_SIZES = (1, 3)


def _asked(case: str, scale: float) -> dict:
    """The request fields of `case` at `scale` (every scale of the case moves with it)."""
    if case == "freeu_pag":  # classifier-free guidance, so the batch is [uncond, text, perturbed] per image
        return {"guidance": PerturbedAttention(("mid_block", "up_blocks.1"), scale, scale / 1000),
                "interventions": (FreeU(1 + scale / 10, 1.4, 0.9, 0.2),)}
    return {"guidance": SelfAttention(scale)}


CASES = {"freeu_pag": "euler_a", "sag": "ddpm"}  # stochastic samplers, SAG's with integer timesteps


def pipelines(folder: Path, mesh) -> dict[str, Pipeline]:
    return {case: Pipeline.load(folder, scheduler=scheduler, mesh=mesh) for case, scheduler in CASES.items()}


def image_one(pipes: dict[str, Pipeline], batch_size: int, scale: float = 2.0) -> dict[str, np.ndarray]:
    """case -> the latents of image 1 of four (two prompts, two images each), generated `batch_size` at a time."""
    return {case: pipe(Request(prompts=["a red fox", "a blue boat"], num_images_per_prompt=2, height=32, width=32,
                               steps=3, seed=7, guidance_scale=5.0, batch_size=batch_size, output_latents=True,
                               **_asked(case, scale)))[1]
            for case, pipe in pipes.items()}


@pytest.fixture(scope="module")
def folder(tmp_path_factory, demo_build) -> Path:
    return demo_build("tiny", tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def one_device(folder):
    pipes = pipelines(folder, meshlib.make_mesh(devices=jax.devices()[:1]))
    return pipes, {b: image_one(pipes, b) for b in BATCH_SIZES}


@pytest.fixture(scope="module")
def four_devices(folder, tmp_path_factory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("sharded") / "images.npz"
    script = textwrap.dedent(
        f"""
        import jax, numpy as np
        from pathlib import Path
        from sdx import mesh as meshlib
        from tests.test_research_sampling import image_one, pipelines
        assert jax.device_count() == 4, jax.devices()
        np.savez({str(out)!r}, **image_one(pipelines(Path({str(folder)!r}), meshlib.make_mesh()), 4))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=child_env(devices=4), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return dict(np.load(out))


@pytest.mark.parametrize("case", CASES)
def test_an_image_is_the_same_at_any_batch_size_and_on_any_mesh(case, one_device, four_devices):
    _, images = one_device
    alone = images[1][case]
    for batch_size in BATCH_SIZES[1:]:
        np.testing.assert_allclose(images[batch_size][case], alone, atol=1e-4, err_msg=f"batch size {batch_size}")
    np.testing.assert_allclose(four_devices[case], alone, atol=1e-4, err_msg="4 devices")


def test_a_new_scale_compiles_nothing(one_device, jax_events):
    """Every FreeU, PAG (and its adaptive scale) and SAG scale is a program input: new ones change the image and
    XLA compiles nothing."""
    pipes, images = one_device
    compiled = jax_events("backend_compile")
    again = image_one(pipes, 1, scale=0.5)
    assert compiled == [], compiled
    for case in CASES:
        moved = float(np.abs(again[case] - images[1][case]).max())
        print(f"{case}: the new scales move image 1's latents by {moved:.3f}")
        assert moved > 1e-2
