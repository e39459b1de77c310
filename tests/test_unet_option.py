"""--unet: a pipeline with another UNet, as the few-step models ship theirs, through `python -m sdx.sample`
against diffusers given the same UNet (tests.tiny_models.assert_parity):

- SDXL-Lightning's form: a weights file for SDXL base's UNet, in diffusers keys (and ComfyUI's, original keys);
- LCM's form (latent-consistency/lcm-sdxl): a UNet folder whose config adds the guidance embedding
  (`time_cond_proj_dim`), sampled with LCMScheduler and no classifier-free guidance branch, as diffusers'
  StableDiffusionXLPipeline runs such a UNet.
"""

from __future__ import annotations

import re

import diffusers
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from convert import library
from convert.single_file import load_tensors
from convert.single_file_keys import UNET_PREFIX
from convert.unet_source import read_unet_source
from sdx.sample import main
from tests.test_lcm import lcm_unet, with_sdx_noise
from tests.test_pipelines import latent_shape, noise_file, reference, sample, tiny  # noqa: F401 (tiny: the fixture)
from tests.tiny_models import assert_effect, assert_parity, make_tiny_pipeline

PROMPT = "a lighthouse at dusk"
SIZE = ("--height", "64", "--width", "64")


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """(a tiny SDXL of the same architecture with other weights, its UNet's diffusers-keyed weights file, its
    folder)."""
    folder = tmp_path_factory.mktemp("other")
    pipe = make_tiny_pipeline("sdxl", folder / "model", seed=3)
    path = folder / "unet.safetensors"
    save_file({k: v.contiguous() for k, v in pipe.unet.state_dict().items()}, str(path))
    return pipe, path, folder / "model"


def test_a_weights_file_replaces_the_unet(tiny, other, tmp_path):
    pipe, folder = tiny("sdxl")
    other_pipe, file, _ = other
    swapped = diffusers.StableDiffusionXLPipeline(**{**pipe.components, "unet": other_pipe.unet})
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(latents=noise, num_inference_steps=4, guidance_scale=5.0, height=64, width=64)
    ref = reference(swapped, PROMPT, **run)
    ours = sample(tmp_path, folder, "--unet", str(file), "--prompt", PROMPT, "--steps", "4", "--guidance-scale", "5",
                  "--latents", str(path), *SIZE)
    assert_parity(ours, ref)
    assert_effect("--unet (another UNet's weights)", ref, reference(pipe, PROMPT, **run))


def test_original_keys_read_as_diffusers_keys(tiny, other, tmp_path):
    """ComfyUI's UNet files: the SGM keys, with or without `model.diffusion_model.`."""
    pipe, folder = tiny("sdxl")
    other_pipe, _, other_folder = other
    whole = tmp_path / "whole.safetensors"
    library.convert(other_folder, whole, fmt="single-file")
    unet = {k: v for k, v in load_tensors(whole).items() if k.startswith(UNET_PREFIX)}
    want = {k: v.numpy() for k, v in other_pipe.unet.state_dict().items()}
    config = dict(pipe.unet.config)
    for name, tensors in (("prefixed", unet), ("bare", {k[len(UNET_PREFIX):]: v for k, v in unet.items()})):
        path = tmp_path / f"{name}.safetensors"
        save_file({k: torch.from_numpy(np.array(v)) for k, v in tensors.items()}, str(path))
        _, got = read_unet_source(path, config, want)
        assert set(got) == set(want), name
        assert all(np.array_equal(np.asarray(got[k]), want[k]) for k in want), name


def test_an_lcm_unet_folder_embeds_the_guidance_scale(tiny, tmp_path):
    pipe, folder = tiny("sdxl")
    lcm = lcm_unet(pipe.unet)
    lcm.save_pretrained(tmp_path / "lcm-unet")
    scheduler = diffusers.LCMScheduler.from_config(pipe.scheduler.config)
    swapped = diffusers.StableDiffusionXLPipeline(**{**pipe.components, "unet": lcm, "scheduler": scheduler})
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(latents=noise, num_inference_steps=4, guidance_scale=8.0, height=64, width=64)
    ref = with_sdx_noise(swapped, PROMPT, **run)
    ours = sample(tmp_path, folder, "--unet", str(tmp_path / "lcm-unet"), "--scheduler", "lcm", "--prompt", PROMPT,
                  "--steps", "4", "--guidance-scale", "8", "--latents", str(path), *SIZE)
    assert_parity(ours, ref)
    assert_effect("--guidance-scale 8 (the LCM UNet's embedding, against 3)", ref,
                  with_sdx_noise(swapped, PROMPT, **{**run, "guidance_scale": 3.0}))


def test_a_unet_that_does_not_fit_is_one_error(tiny, other, tmp_path, capsys):
    _, folder = tiny("sdxl")
    _, sd15 = tiny("sd15")
    _, file, _ = other
    short = tmp_path / "short.safetensors"
    tensors = load_tensors(file)
    save_file({k: torch.from_numpy(np.array(v)) for k, v in tensors.items() if k != "conv_out.bias"}, str(short))
    cases = {
        str(tmp_path / "nope"): "no such file or folder",
        str(short): "does not hold the model's UNet: 1 tensor(s) missing: conv_out.bias",
        str(sd15 / "unet"): "does not fit the model: cross_attention_dim 32 (the model's: 96)",
    }
    for spec, message in cases.items():
        argv = ["--model", str(folder), "--unet", spec, "--prompt", "x", "--steps", "1", "--output",
                str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--quiet"]
        assert main(argv) == 2, spec
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and re.search(re.escape(message), errors[0]) and "Traceback" not in err, err
