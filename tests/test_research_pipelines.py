"""FreeU, Perturbed-Attention Guidance and Self-Attention Guidance through `python -m sdx.sample` against
diffusers (`unet.enable_freeu`, StableDiffusion(XL)PAGPipeline, StableDiffusionSAGPipeline) on tiny random
models, float32, from the same initial noise (`--latents`), at `tests.tiny_models.Bar`; each method's effect
on diffusers' own result is shown to be at least ten times that bar (`assert_effect`).

Methods that can share a run do (FreeU and PAG with classifier-free guidance: each one's effect is measured
on its own, so either one wrong fails the run), for the suite's time: each run is a compile.
"""

from __future__ import annotations

import contextlib

import pytest

from tests.test_controlnet_pipelines import STEPS as CONTROL_STEPS
from tests.test_controlnet_pipelines import _with_noise, control_image, controlnet  # noqa: F401 (a fixture)
from tests.test_inpaint import mask_file
from tests.test_pipelines import input_image, latent_shape, noise_file, reference, sample, tiny  # noqa: F401
from tests.tiny_models import assert_effect, assert_parity

diffusers = pytest.importorskip("diffusers")

STEPS = 4
FREEU = {"b1": 1.5, "b2": 1.6, "s1": 0.9, "s2": 0.2}  # the FreeU authors' SD 1.5 values
FREEU_XL = {"b1": 1.3, "b2": 1.4, "s1": 0.9, "s2": 0.2}


def freeu_flags(values: dict) -> list[str]:
    return ["--freeu", *(str(values[k]) for k in ("b1", "b2", "s1", "s2"))]


@contextlib.contextmanager
def freeu(unet, values: dict | None):
    """diffusers' `unet.enable_freeu(**values)` while the block runs (the tiny pipelines are shared); nothing
    when `values` is None."""
    if values is not None:
        unet.enable_freeu(**values)
    try:
        yield
    finally:
        unet.disable_freeu()


def pag_pipeline(pipe, layers: list[str]):
    """diffusers' PAG pipeline over `pipe`'s components, perturbing `layers`."""
    if "text_encoder_2" in pipe.components:
        return diffusers.StableDiffusionXLPAGPipeline(**pipe.components, pag_applied_layers=layers,
                                                      add_watermarker=False)
    return diffusers.StableDiffusionPAGPipeline(**pipe.components, pag_applied_layers=layers)


@pytest.mark.parametrize("kind, freeu_values, guidance_scale, layers, adaptive", [
    ("sd15", FREEU, 7.5, ["mid", "up_blocks.1.attentions.0"], 0.0),  # FreeU and PAG with classifier-free guidance
    ("sd15", None, 1.0, ["mid"], 0.002),  # PAG alone, no classifier-free guidance, adaptive scale
    ("sdxl", FREEU_XL, 5.0, ["mid"], 0.0),
    ("sdxl", None, 1.0, ["up_blocks.0"], 0.002),
])
def test_freeu_and_pag(tiny, tmp_path, kind, freeu_values, guidance_scale, layers, adaptive):
    pipe, folder = tiny(kind)
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    pag = pag_pipeline(pipe, layers)
    run = dict(prompt="a lighthouse at dawn", negative_prompt="fog" if kind == "sd15" else None, latents=noise,
               num_inference_steps=STEPS, guidance_scale=guidance_scale, height=64, width=64, pag_scale=3.0,
               pag_adaptive_scale=adaptive)
    with freeu(pipe.unet, freeu_values):
        ref = reference(pag, **run)
        no_pag = reference(pag, **{**run, "pag_scale": 0.0})
    negative = ["--negative-prompt", "fog"] if kind == "sd15" else []
    ours = sample(tmp_path, folder, "--prompt", run["prompt"], *negative,
                  "--steps", str(STEPS), "--guidance-scale", str(guidance_scale), "--latents", str(latents),
                  "--height", "64", "--width", "64", "--pag-scale", "3", "--pag-layers", *layers,
                  "--pag-adaptive-scale", str(adaptive), *(freeu_flags(freeu_values) if freeu_values else []))
    assert_parity(ours, ref)
    assert_effect(f"--pag-scale 3 --pag-layers {' '.join(layers)}", ref, no_pag)
    if freeu_values is not None:
        assert_effect("--freeu", ref, reference(pag, **run))  # FreeU off now
    if adaptive:
        assert_effect(f"--pag-adaptive-scale {adaptive}", ref, reference(pag, **{**run, "pag_adaptive_scale": 0.0}))


def test_sag(tiny, tmp_path):
    """SD 1.5's PNDM (integer timesteps, as SAG needs), classifier-free guidance: the degraded call reads the
    negative prompt."""
    pipe, folder = tiny("sd15")
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    sag = diffusers.StableDiffusionSAGPipeline(**pipe.components)
    run = dict(prompt="a lighthouse at dawn", negative_prompt="fog", latents=noise, num_inference_steps=STEPS,
               guidance_scale=7.5, height=64, width=64, sag_scale=0.75)
    ref = reference(sag, **run)
    ours = sample(tmp_path, folder, "--prompt", run["prompt"], "--negative-prompt", "fog", "--steps", str(STEPS),
                  "--guidance-scale", "7.5", "--latents", str(latents), "--height", "64", "--width", "64",
                  "--sag-scale", "0.75")
    assert_parity(ours, ref)
    assert_effect("--sag-scale 0.75", ref, reference(sag, **{**run, "sag_scale": 0.0}))


def test_freeu_with_controlnet_inpainting(tiny, controlnet, tmp_path):
    """FreeU acts on the UNet alone: with a ControlNet, inpainting by blending and img2img's start (strength 0.7)."""
    pipe, folder = tiny("sd15")
    net, net_folder = controlnet("sd15")
    image_path, image = input_image(tmp_path)
    mask_path, mask = mask_file(tmp_path)
    path, picture = control_image(tmp_path, (64, 64))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    inpaint = diffusers.StableDiffusionControlNetInpaintPipeline(**pipe.components, controlnet=net)
    run = lambda: _with_noise(inpaint, "pipeline_controlnet_inpaint", noise, prompt="a pond", image=image,
                              mask_image=mask, control_image=picture, strength=0.7, guidance_scale=7.5)
    with freeu(pipe.unet, FREEU):
        ref = run()
    ours = sample(tmp_path, folder, "--prompt", "a pond", "--image", str(image_path), "--mask", mask_path,
                  "--strength", "0.7", "--controlnet", str(net_folder), "--control-image", path,
                  "--steps", str(CONTROL_STEPS), "--latents", str(latents), *freeu_flags(FREEU))
    assert_parity(ours, ref)
    assert_effect("--freeu", ref, run())
