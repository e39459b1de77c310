"""ControlNet-Union through `python -m sdx.sample --controlnet --control-image --control-mode` and through
`Pipeline`, against diffusers' StableDiffusionXLControlNetUnionPipeline (and its MultiControlNetUnionModel) on the
tiny SDXL pipeline, from the same initial noise.

Each union is `tests.test_controlnet_union.union_from_unet` of the tiny pipeline's UNet (every parameter moved
off its init, real weights in the zero-initialised layers), saved as a diffusers folder. Latents and images are
compared as in test_pipelines.py (`tests.tiny_models.assert_parity`), and each test shows that what it exercises
(a type, a scale, a window, a second image, guess mode) moves the result (`assert_effect`, on diffusers' side).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from PIL import Image

from convert.library import ensure_sdx_folder
from pipelines.control import Control
from pipelines.control_union import UnionControl, mode_index
from pipelines.pipeline import Pipeline, to_uint8
from pipelines.request import Request
from sdx import mesh as meshlib
from sdx.errors import SdxError
from sdx.sample import main
from tests.test_controlnet_pipelines import control_image, controlnet  # noqa: F401 (controlnet: the fixture)
from tests.test_controlnet_union import TINY, union_from_unet
from tests.test_pipelines import decoded_latents, latent_shape, noise_file, reference, sample, tiny  # noqa: F401
from tests.tiny_models import Output, assert_effect, assert_parity

diffusers = pytest.importorskip("diffusers")

STEPS = 5


@pytest.fixture(scope="module")
def union(tiny, tmp_path_factory):
    """seed -> (diffusers ControlNetUnionModel from the tiny SDXL UNet, its folder), made on first use."""
    made = {}

    def get(seed: int = 0):
        if seed not in made:
            pipe, _ = tiny("sdxl")
            stages = int(np.log2(pipe.vae_scale_factor)) + 1  # the image embedding shrinks by the VAE's factor
            net = union_from_unet(pipe.unet, [8, 16, 16, 32][:stages], seed, **TINY)
            folder = tmp_path_factory.mktemp(f"union-{seed}")
            net.save_pretrained(folder)
            made[seed] = (net, folder)
        return made[seed]

    return get


def _unions(pipe, *nets):
    """diffusers' union pipeline over the tiny SDXL pipeline's components (several nets: MultiControlNetUnionModel)."""
    return diffusers.StableDiffusionXLControlNetUnionPipeline(**pipe.components,
                                                             controlnet=list(nets) if len(nets) > 1 else nets[0])


def test_one_type_with_guidance_and_a_window(tiny, union, tmp_path):
    pipe, folder = tiny("sdxl")
    net, net_folder = union()
    path, picture = control_image(tmp_path, (64, 64))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    guided = _unions(pipe, net)
    run = dict(prompt="a lighthouse", latents=noise, num_inference_steps=STEPS, guidance_scale=5.0, height=64, width=64)
    control = dict(control_image=[picture], control_mode=[1], controlnet_conditioning_scale=0.7,
                   control_guidance_start=0.2, control_guidance_end=0.8)
    ref = reference(guided, **run, **control)
    ours = sample(tmp_path, folder, "--prompt", "a lighthouse", "--controlnet", str(net_folder), "--control-image", path,
                  "--control-mode", "depth", "--controlnet-conditioning-scale", "0.7", "--control-guidance-start", "0.2",
                  "--control-guidance-end", "0.8", "--steps", str(STEPS), "--latents", str(latents))
    assert_parity(ours, ref)
    meta = json.loads(Image.open(next((tmp_path / "out").glob("*.png"))).text["sdx"])
    assert meta["control_mode"] == ["depth"] and meta["controlnet_conditioning_scale"] == [0.7]
    changed = lambda **what: reference(guided, **run, **{**control, **what})  # noqa: E731
    assert_effect("--control-mode depth (against canny's 3)", ref, changed(control_mode=[3]))
    assert_effect("--controlnet-conditioning-scale 0.7 (against 1)", ref, changed(controlnet_conditioning_scale=1.0))
    assert_effect("--control-guidance-start 0.2 --control-guidance-end 0.8 (against 0 and 1)", ref,
                  changed(control_guidance_start=0.0, control_guidance_end=1.0))


def test_two_types_at_once_without_guidance(tiny, union, tmp_path):
    """One union, two images (one resized) with their types by name and index, a scale each; guidance off."""
    pipe, folder = tiny("sdxl")
    net, net_folder = union()
    path_a, picture_a = control_image(tmp_path, (64, 64))
    path_b, picture_b = control_image(tmp_path, (48, 80), seed=1, name="control_b.png")  # resized to 64x64
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    guided = _unions(pipe, net)
    run = dict(prompt="a bridge", latents=noise, num_inference_steps=STEPS, guidance_scale=1.0, height=64, width=64)
    control = dict(control_image=[picture_a, picture_b], control_mode=[0, 3], controlnet_conditioning_scale=[1.2, 0.6])
    ref = reference(guided, **run, **control)
    ours = sample(tmp_path, folder, "--prompt", "a bridge", "--controlnet", str(net_folder),
                  "--control-image", path_a, "--control-mode", "openpose", "--control-image", path_b, "--control-mode", "3",
                  "--controlnet-conditioning-scale", "1.2", "0.6", "--guidance-scale", "1", "--steps", str(STEPS),
                  "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("the second image and type (against the first alone)", ref,
                  reference(guided, **run, control_image=[picture_a], control_mode=[0], controlnet_conditioning_scale=1.2))
    assert_effect("the scales 1.2 and 0.6 (against 0.6 and 1.2)", ref,
                  reference(guided, **run, **{**control, "controlnet_conditioning_scale": [0.6, 1.2]}))


def _rows_kept(net):
    """`net` with diffusers' union pipelines' guess-mode fault mended: with guidance they hand the net the control
    types of both branches' rows while it runs the text branch's alone (its time embedding then fails to
    multiply); the net gets the rows it runs. Every row's types are the same."""
    forward = net.forward

    def mended(sample, *args, control_type, **kwargs):
        return forward(sample, *args, control_type=control_type[: sample.shape[0]], **kwargs)

    net.forward = mended
    return net


def test_several_unions_in_guess_mode(tiny, union, tmp_path):
    """Two unions, one image each (diffusers' MultiControlNetUnionModel), their residuals summed; guess mode with
    guidance runs them on the text branch alone."""
    pipe, folder = tiny("sdxl")
    (net_a, folder_a), (net_b, folder_b) = union(), union(seed=1)
    path_a, picture_a = control_image(tmp_path, (64, 64))
    path_b, picture_b = control_image(tmp_path, (64, 64), seed=1, name="control_b.png")
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    guided = _unions(pipe, _rows_kept(net_a), _rows_kept(net_b))
    run = dict(prompt="a bridge", negative_prompt="rain", latents=noise, num_inference_steps=STEPS, guidance_scale=6.0,
               height=64, width=64, control_image=[picture_a, picture_b], control_mode=[2, 5], guess_mode=True,
               controlnet_conditioning_scale=[1.1, 0.7], control_guidance_start=[0.0, 0.4])
    ref = reference(guided, **run)
    ours = sample(tmp_path, folder, "--prompt", "a bridge", "--negative-prompt", "rain",
                  "--controlnet", str(folder_a), "--control-image", path_a, "--control-mode", "scribble",
                  "--controlnet", str(folder_b), "--control-image", path_b, "--control-mode", "segment",
                  "--controlnet-conditioning-scale", "1.1", "0.7", "--control-guidance-start", "0", "0.4", "--guess-mode",
                  "--guidance-scale", "6", "--steps", str(STEPS), "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("--guess-mode", ref, reference(guided, **{**run, "guess_mode": False}))
    assert_effect("the second union (against its scale 0)", ref,
                  reference(guided, **{**run, "controlnet_conditioning_scale": [1.1, 0.0]}))


def test_pipeline_takes_a_new_type_or_scale_without_compiling(tiny, union, tmp_path):
    """Through `Pipeline`: a UnionControl equals diffusers, a new scale, window or type compiles nothing, and an
    image is the same in a batch of two (each image's rows attend to each other only)."""
    pipe, folder = tiny("sdxl")
    net, net_folder = union()
    _, picture = control_image(tmp_path, (64, 64))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    guided = _unions(pipe, net)
    ours = Pipeline.load(ensure_sdx_folder(folder, cache_dir=tmp_path), controlnets=(str(net_folder),),
                         mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    image = np.asarray(picture, np.float32)[None] / 255.0
    request = Request(prompts=["a kite"], steps=STEPS, guidance_scale=5.0, latents=noise.numpy())
    first = UnionControl((image,), ("normal",), scale=0.9)
    for control in (first, dataclasses.replace(first, modes=(6,), scale=1.3, start=0.2)):
        with decoded_latents() as seen:
            images = ours(dataclasses.replace(request, conditioning=[control]))
        ref = reference(guided, "a kite", latents=noise, num_inference_steps=STEPS, guidance_scale=5.0, height=64,
                        width=64, control_image=[picture], control_mode=[mode_index(control.modes[0])],
                        controlnet_conditioning_scale=control.scale, control_guidance_start=control.start)
        assert_parity(Output(to_uint8(images), seen[0]), ref)
    assert ours.sampler.compilations == 1
    pair = ours(dataclasses.replace(request, prompts=["a kite", "a kite at dusk"], batch_size=2, conditioning=[control]))
    print(f"the image in a batch of two against alone: max abs difference {np.abs(pair[0] - images[0]).max():.1e}")
    np.testing.assert_allclose(pair[0], images[0], atol=1e-4)
    assert np.abs(pair[1] - images[0]).mean() > 1e-3  # the other prompt: another image beside it
    with pytest.raises(SdxError, match="a ControlNet-Union takes a UnionControl"):
        ours(dataclasses.replace(request, conditioning=[Control(image)]))
    with pytest.raises(SdxError, match=r"--control-mode 9 \(type 9\): this ControlNet-Union knows 8 types"):
        ours(dataclasses.replace(request, conditioning=[dataclasses.replace(first, modes=(9,))]))
    with pytest.raises(SdxError, match=r"give one --control-mode per --control-image \(1\), not 2"):
        ours(dataclasses.replace(request, conditioning=[dataclasses.replace(first, modes=(1, 2))]))


@pytest.mark.parametrize("args, words", [
    (["--controlnet", "UNION", "--control-image", "CONTROL", "--control-mode", "sketchy"],
     "--control-mode 'sketchy' is not a control type: give diffusers' index or one of openpose, depth"),
    (["--controlnet", "UNION", "--control-image", "CONTROL", "--control-image", "CONTROL", "--control-mode", "depth"],
     "give one --control-mode per --control-image (2), not 1"),
    (["--controlnet", "UNION", "--controlnet", "UNION", "--control-image", "CONTROL", "--control-mode", "0"],
     "several ControlNet-Unions take one --control-image each: 2 --controlnet, 1 images"),
    (["--control-image", "CONTROL", "--control-mode", "0"], "--control-mode gives a ControlNet-Union's control types"),
    (["--controlnet", "UNION", "--control-image", "CONTROL", "--control-mode", "0", "--control-image", "CONTROL",
      "--control-mode", "1", "--controlnet-conditioning-scale", "1", "2", "3"],
     "--controlnet-conditioning-scale: give one value or one per --control-image (2), not 3"),
])
def test_bad_flags_are_one_error_before_loading(tiny, tmp_path, capsys, args, words):
    """Refused before anything is read: UNION names no model at all."""
    _, folder = tiny("sdxl")
    path, _ = control_image(tmp_path, (64, 64))
    subst = {"UNION": str(tmp_path / "no-such-union"), "CONTROL": path}
    argv = ["--model", str(folder), "--prompt", "x", "--steps", "1", "--output", str(tmp_path / "out"),
            "--cache", str(tmp_path / "cache"), "--quiet", *[subst.get(a, a) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args, words", [
    (["--controlnet", "UNION", "--control-image", "CONTROL"], "a ControlNet-Union takes a UnionControl"),
    (["--controlnet", "UNION", "--control-image", "CONTROL", "--control-mode", "tile", "--controlnet", "PLAIN",
      "--control-image", "CONTROL", "--control-mode", "depth"], "they go with no plain ControlNet"),
    (["--controlnet", "PLAIN", "--control-image", "CONTROL", "--controlnet", "UNION", "--control-image", "CONTROL"],
     "goes with no plain ControlNet (diffusers has no such pipeline)"),
])
def test_bad_pairings_are_one_error(tiny, union, controlnet, tmp_path, capsys, args, words):
    """A union without modes, and a union with a plain ControlNet (either way round), once both are loaded."""
    _, folder = tiny("sdxl")
    path, _ = control_image(tmp_path, (64, 64))
    subst = {"UNION": str(union()[1]), "PLAIN": str(controlnet("sdxl")[1]), "CONTROL": path}
    argv = ["--model", str(folder), "--prompt", "x", "--steps", "1", "--output", str(tmp_path / "out"),
            "--cache", str(tmp_path / "cache"), "--quiet", *[subst.get(a, a) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
