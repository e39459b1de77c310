"""A Playground v2.5-style model end to end: an SDXL whose VAE normalises its latents per channel
(`latents_mean`/`latents_std` in vae/config.json) and whose scheduler is EDM's DPM-Solver++
(EDMDPMSolverMultistepScheduler, as playgroundai/playground-v2.5-1024px-aesthetic ships it), through
`python -m sdx.sample` against diffusers' StableDiffusionXLPipeline and its img2img pipeline, same noise."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.test_pipelines import (  # noqa: F401 (tiny: the fixture)
    diffusers_noise,
    input_image,
    latent_shape,
    noise_file,
    reference,
    sample,
    tiny,
)
from tests.tiny_models import assert_effect, assert_parity

# playground-v2.5-1024px-aesthetic's scheduler/scheduler_config.json and its VAE's latent statistics
SCHEDULER = {"_class_name": "EDMDPMSolverMultistepScheduler", "algorithm_type": "dpmsolver++", "dynamic_thresholding_ratio": 0.995,
             "euler_at_final": False, "final_sigmas_type": "zero", "lower_order_final": True, "num_train_timesteps": 1000,
             "prediction_type": "epsilon", "rho": 7.0, "sample_max_value": 1.0, "sigma_data": 0.5, "sigma_max": 80.0,
             "sigma_min": 0.002, "solver_order": 2, "solver_type": "midpoint", "thresholding": False}
LATENTS_MEAN = [-1.6574, 1.886, -1.383, 2.5155]
LATENTS_STD = [8.4927, 5.9022, 6.8341, 5.4722]


@pytest.fixture(scope="module")
def playground(tiny, tmp_path_factory):
    """(diffusers pipeline, its folder): the tiny SDXL with Playground's scheduler and VAE statistics."""
    import diffusers

    pipe, folder = tiny("sdxl")
    out = tmp_path_factory.mktemp("playground") / "model"
    shutil.copytree(folder, out)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER))
    index = json.loads((out / "model_index.json").read_text())  # what diffusers' from_pretrained builds
    (out / "model_index.json").write_text(json.dumps({**index, "scheduler": ["diffusers", SCHEDULER["_class_name"]]}))
    vae_config = json.loads((out / "vae" / "config.json").read_text())
    (out / "vae" / "config.json").write_text(json.dumps({**vae_config, "latents_mean": LATENTS_MEAN,
                                                          "latents_std": LATENTS_STD}))
    return diffusers.StableDiffusionXLPipeline.from_pretrained(out), out


def test_text_to_image(playground, tiny, tmp_path):
    pipe, folder = playground
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    ref = reference(pipe, "a lighthouse", latents=noise, num_inference_steps=4, guidance_scale=3.0)
    ours = sample(tmp_path, folder, "--prompt", "a lighthouse", "--steps", "4", "--guidance-scale", "3",
                  "--latents", str(path))
    assert_parity(ours, ref)
    plain, _ = tiny("sdxl")  # the same UNet, VAE weights and text encoders, without the statistics or EDM
    assert_effect("the EDM scheduler and the VAE's latents_mean/latents_std", ref,
                  reference(plain, "a lighthouse", latents=noise, num_inference_steps=4, guidance_scale=3.0))


def test_img2img_normalises_the_image_s_latents(playground, tmp_path):
    import diffusers
    import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_img2img as module

    pipe, folder = playground
    img2img = diffusers.StableDiffusionXLImg2ImgPipeline(**pipe.components)
    image_path, image = input_image(tmp_path)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = lambda: reference(img2img, "a harbour", image=image, strength=0.6, num_inference_steps=5, guidance_scale=3.0)
    with diffusers_noise(module, noise):
        ref = run()
        img2img.vae.register_to_config(latents_mean=None, latents_std=None)
        without = run()
        img2img.vae.register_to_config(latents_mean=LATENTS_MEAN, latents_std=LATENTS_STD)
    ours = sample(tmp_path, folder, "--prompt", "a harbour", "--image", str(image_path), "--strength", "0.6",
                  "--steps", "5", "--guidance-scale", "3", "--latents", str(path))
    assert_parity(ours, ref)
    assert_effect("the VAE's latents_mean/latents_std", ref, without)
