"""The Python API starts where the command does: `Pipeline.load` takes every name `--model` takes, a request's
open settings are the model's defaults (diffusers' pipelines' own, read from their signatures), and a loaded
pipeline's models can be replaced."""

from __future__ import annotations

import inspect

import diffusers
import numpy as np
import pytest

from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx.errors import SdxError


@pytest.fixture(scope="module")
def cache(demo_models):
    """A cache where the demo models are already built (once per test run) and found by name."""
    for name in ("tiny", "tiny_xl"):
        demo_models(name)
    return demo_models.cache


@pytest.mark.parametrize("name", ["default", "default-edit", "tiny", "tiny_xl"])
def test_every_model_name_the_command_takes_loads(cache, name):
    pipe = Pipeline.load(name, cache=cache)
    assert pipe.name == name and set(pipe.models) >= {"unet", "vae", "text_encoder"}


def test_a_diffusers_folder_loads_through_the_converter(cache, tmp_path):
    from tests.tiny_models import make_tiny_pipeline

    make_tiny_pipeline("sd15", tmp_path / "sd15").save_pretrained(tmp_path / "sd15")
    pipe = Pipeline.load(tmp_path / "sd15", cache=cache)
    assert not pipe.family.xl and (cache / "models").is_dir()


def _default(pipeline_class, name: str):
    return inspect.signature(pipeline_class.__call__).parameters[name].default


def test_what_a_request_leaves_open_is_the_model_s_default_as_in_diffusers(cache):
    sd, xl = Pipeline.load("tiny", cache=cache), Pipeline.load("tiny_xl", cache=cache)
    image, mask = np.zeros((1, 48, 40, 3), np.float32), np.ones((1, 48, 40, 1), np.float32)
    for pipe, text, img2img, inpaint in (
        (sd, diffusers.StableDiffusionPipeline, diffusers.StableDiffusionImg2ImgPipeline,
         diffusers.StableDiffusionInpaintPipeline),
        (xl, diffusers.StableDiffusionXLPipeline, diffusers.StableDiffusionXLImg2ImgPipeline,
         diffusers.StableDiffusionXLInpaintPipeline),
    ):
        plain = pipe.complete(Request(prompts=["x"]))
        assert (plain.height, plain.width) == (pipe.default_size, pipe.default_size)
        assert plain.guidance_scale == _default(text, "guidance_scale")
        edit = pipe.complete(Request(prompts=["x"], image=image))
        assert (edit.height, edit.width) == (48, 40) and edit.strength == _default(img2img, "strength")
        assert pipe.complete(Request(prompts=["x"], image=image, mask=mask)).strength == _default(inpaint, "strength")
        given = pipe.complete(Request(prompts=["x"], height=16, width=24, guidance_scale=2.0, strength=0.5))
        assert (given.height, given.width, given.guidance_scale, given.strength) == (16, 24, 2.0, 0.5)
    noise = np.zeros((1, 4, 3, 5), np.float32)  # the diffusers layout: the size is the VAE's factor times the latents'
    sized = sd.complete(Request(prompts=["x"], latents=noise))
    assert (sized.height, sized.width) == (3 * sd.factor, 5 * sd.factor)


def test_replace_swaps_a_model_and_shares_the_others(cache):
    pipe = Pipeline.load("tiny", cache=cache)
    other = Pipeline.load("tiny", cache=cache)
    swapped = pipe.replace(vae=other.models["vae"])
    assert swapped.models["vae"] is other.models["vae"] and swapped.models["unet"] is pipe.models["unet"]
    assert pipe.models["vae"] is not other.models["vae"]  # the original pipeline is left as it was
    with pytest.raises(SdxError, match="no model named unett"):
        pipe.replace(unett=other.models["unet"])
