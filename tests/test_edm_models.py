"""Models trained in the EDM formulation, end to end through `python -m sdx.sample` against diffusers, same noise:

- Playground v2.5: an SDXL whose VAE normalises its latents per channel (`latents_mean`/`latents_std` in
  vae/config.json) and whose scheduler is EDM's DPM-Solver++ (EDMDPMSolverMultistepScheduler, as
  playgroundai/playground-v2.5-1024px-aesthetic ships it), text-to-image and img2img;
- CosXL and CosXL Edit: EDM v-prediction (EDMEulerScheduler, sigma_data 1, sigmas 0.002..120 evenly spaced in log
  sigma, the setting diffusers gives for them), shipped as single files whose only record of it is their
  sampling markers (`edm_vpred.sigma_max`/`sigma_min`, `convert.sampling_markers`).

A single file written by `python -m convert --format single-file` carries the markers; read back with a config
folder that says Euler and no latent statistics, it still samples as the EDM model does."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from convert import cli
from convert.single_file import load_tensors
from tests.test_pipelines import (  # noqa: F401 (tiny: the fixture)
    STEPS,
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
# CosXL's scheduler as diffusers' documentation builds it (stabilityai/cosxl ships single files only)
COSXL = {"_class_name": "EDMEulerScheduler", "num_train_timesteps": 1000, "prediction_type": "v_prediction",
         "rho": 7.0, "sigma_data": 1.0, "sigma_max": 120.0, "sigma_min": 0.002, "sigma_schedule": "exponential"}


def edm_folder(source, out, scheduler, vae=None, **index_fields):
    """A copy of the diffusers folder `source` with `scheduler`, the VAE config fields `vae` and the
    model_index.json fields `index_fields`."""
    shutil.copytree(source, out)
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    index = json.loads((out / "model_index.json").read_text())  # what diffusers' from_pretrained builds
    index.update(scheduler=["diffusers", scheduler["_class_name"]], **index_fields)
    (out / "model_index.json").write_text(json.dumps(index))
    if vae:
        vae_config = json.loads((out / "vae" / "config.json").read_text())
        (out / "vae" / "config.json").write_text(json.dumps({**vae_config, **vae}))
    return out


def single_file(folder, path):
    """`python -m convert FOLDER PATH --format single-file`, and the file's tensors."""
    assert cli.main([str(folder), str(path), "--format", "single-file", "-q"]) == 0
    return load_tensors(path)


@pytest.fixture(scope="module")
def playground(tiny, tmp_path_factory):
    """(diffusers pipeline, its folder): the tiny SDXL with Playground's scheduler and VAE statistics."""
    import diffusers

    _, folder = tiny("sdxl")
    out = edm_folder(folder, tmp_path_factory.mktemp("playground") / "model", SCHEDULER,
                     {"latents_mean": LATENTS_MEAN, "latents_std": LATENTS_STD})
    return diffusers.StableDiffusionXLPipeline.from_pretrained(out), out


@pytest.fixture(scope="module")
def cosxl(tiny, tmp_path_factory):
    """(diffusers pipeline, its folder): the tiny SDXL with CosXL's scheduler."""
    import diffusers

    _, folder = tiny("sdxl")
    out = edm_folder(folder, tmp_path_factory.mktemp("cosxl") / "model", COSXL)
    return diffusers.StableDiffusionXLPipeline.from_pretrained(out), out


@pytest.mark.parametrize("model", ["playground", "cosxl"])
def test_text_to_image(request, tiny, tmp_path, model):
    pipe, folder = request.getfixturevalue(model)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(latents=noise, num_inference_steps=4, guidance_scale=3.0)
    ref = reference(pipe, "a lighthouse", **run)
    ours = sample(tmp_path, folder, "--prompt", "a lighthouse", "--steps", "4", "--guidance-scale", "3",
                  "--latents", str(path))
    assert_parity(ours, ref)
    plain, plain_folder = tiny("sdxl")  # the same weights, with SDXL's Euler schedule and no statistics
    assert_effect(f"{model}'s EDM scheduler" + " and the VAE's latents_mean/latents_std" * (model == "playground"),
                  ref, reference(plain, "a lighthouse", **run))

    # as a single file: its sampling markers, not the config folder's Euler, say how it is sampled
    tensors = single_file(folder, tmp_path / "model.safetensors")
    if model == "cosxl":
        assert tensors["edm_vpred.sigma_max"].shape == () and tensors["edm_vpred.sigma_max"] == np.float32(120.0)
        assert tensors["edm_vpred.sigma_min"] == np.float32(0.002)
    else:
        assert np.array_equal(tensors["edm_mean"].ravel(), np.float32(LATENTS_MEAN))
        assert np.array_equal(tensors["edm_std"].ravel(), np.float32(LATENTS_STD))
    theirs = type(pipe).from_single_file(str(tmp_path / "model.safetensors"), config=str(plain_folder),
                                         local_files_only=True)  # diffusers passes over the markers
    assert all(np.array_equal(v.numpy(), pipe.unet.state_dict()[k].numpy()) for k, v in theirs.unet.state_dict().items())
    (tmp_path / "file").mkdir()
    ours = sample(tmp_path / "file", tmp_path / "model.safetensors", "--config", str(plain_folder), "--prompt", "a lighthouse",
                  "--steps", "4", "--guidance-scale", "3", "--latents", str(path))
    assert_parity(ours, ref)


def test_cosxl_edit_single_file(tiny, tmp_path):
    """CosXL Edit: an InstructPix2Pix SDXL with CosXL's scheduler whose image latents are scaled by the VAE's
    factor; its single file's markers say both (diffusers needs `is_cosxl_edit=True` and the scheduler by hand)."""
    import diffusers

    pipe, folder = tiny("sdxl_pix2pix")
    cosxl_edit = edm_folder(folder, tmp_path / "cosxl_edit", COSXL, is_cosxl_edit=True)
    edit = diffusers.StableDiffusionXLInstructPix2PixPipeline.from_pretrained(cosxl_edit)
    assert edit.is_cosxl_edit and type(edit.scheduler).__name__ == "EDMEulerScheduler"
    image_path, image = input_image(tmp_path)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(image=image, num_inference_steps=STEPS, guidance_scale=7.0, image_guidance_scale=1.7, latents=noise)
    ref = reference(edit, "make it snowy", **run)
    args = ("--prompt", "make it snowy", "--image", str(image_path), "--steps", str(STEPS), "--guidance-scale", "7",
            "--image-guidance-scale", "1.7", "--latents", str(path))
    assert_parity(sample(tmp_path, cosxl_edit, *args), ref)
    single_file(cosxl_edit, tmp_path / "edit.safetensors")
    (tmp_path / "file").mkdir()
    assert_parity(sample(tmp_path / "file", tmp_path / "edit.safetensors", "--config", str(folder), *args), ref)
    assert_effect("CosXL's scheduler and is_cosxl_edit", ref, reference(pipe, "make it snowy", **run))


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
