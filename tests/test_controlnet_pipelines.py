"""ControlNet through `python -m sdx.sample --controlnet --control-image` against diffusers'
StableDiffusion(XL)ControlNet(Img2Img/Inpaint)Pipeline and MultiControlNetModel on tiny random models,
from the same initial noise.

Each ControlNet is diffusers' `ControlNetModel.from_unet` of the tiny pipeline's UNet with every
parameter moved off its value and random zero convolutions (so the residuals change the picture, which
each test checks), saved as a diffusers folder. The control image is an edge-like map of another size than the
generation, so the resize and the size rule (text-to-image takes the control image's size, rounded down to a
multiple of the VAE's factor) are covered.
img2img and inpainting draw their VAE posteriors as in test_pipelines.py / test_inpaint.py. Latents and images
are compared as there (`tests.tiny_models.assert_parity`), and each test shows that its ControlNets and their
flags move the result (`assert_effect`, against diffusers' output without them).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from convert.library import ensure_sdx_folder
from pipelines.control import Control
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from pipelines.plugin import model_name
from sdx import mesh as meshlib
from sdx.layers import Attention
from sdx.sample import main
from tests.test_inpaint import mask_file
from tests.test_pipelines import (  # noqa: F401 (tiny: the fixture)
    diffusers_noise,
    input_image,
    latent_shape,
    noise_file,
    reference,
    sample,
    tiny,
)
from tests.tiny_models import Output, assert_effect, assert_parity, perturb

diffusers = pytest.importorskip("diffusers")

STEPS = 5


@pytest.fixture(scope="module")
def controlnet(tiny, tmp_path_factory):
    """(kind, seed) -> (diffusers ControlNetModel, its folder), from the 4-channel tiny UNet of `kind`."""
    made = {}

    def get(kind: str, seed: int = 0):
        if (kind, seed) not in made:
            pipe, _ = tiny(kind)
            torch.manual_seed(seed)
            stages = int(np.log2(pipe.vae_scale_factor)) + 1  # the image embedding shrinks by the VAE's factor
            widths = [8, 16, 16, 32][:stages]
            net = diffusers.ControlNetModel.from_unet(pipe.unet, conditioning_embedding_out_channels=widths)
            generator = torch.Generator().manual_seed(seed + 10)
            perturb(net, generator)
            zero_convs = [*net.controlnet_down_blocks, net.controlnet_mid_block, net.controlnet_cond_embedding.conv_out]
            with torch.no_grad():  # trained-like: the zero-initialised convolutions carry real weights
                for conv in zero_convs:
                    conv.weight.normal_(0.0, 0.3, generator=generator)
            folder = tmp_path_factory.mktemp(f"controlnet-{kind}-{seed}")
            net.eval().save_pretrained(folder)
            made[kind, seed] = (net, folder)
        return made[kind, seed]

    return get


def control_image(tmp_path, size=(90, 75), seed=0, name="control.png") -> tuple[str, Image.Image]:
    """An edge-map-like picture of `size` (W, H): white lines and a circle on black, plus speckle."""
    rng = np.random.default_rng(seed)
    w, h = size
    picture = Image.new("RGB", size, 0)
    draw = ImageDraw.Draw(picture)
    for _ in range(4):
        draw.line([tuple(rng.integers(0, (w, h))) for _ in range(2)], fill=(255, 255, 255), width=2)
    draw.ellipse((w // 4, h // 4, w * 3 // 4, h * 3 // 4), outline=(255, 200, 120), width=2)
    arr = np.asarray(picture).copy()
    arr[rng.random((h, w)) < 0.02] = 255
    picture = Image.fromarray(arr)
    path = tmp_path / name
    picture.save(path)
    return str(path), picture


def _with_noise(pipe, module_name: str, noise, **kwargs) -> Output:
    """`pipe(**kwargs)` drawing `noise` where its module draws (img2img, inpainting) and zeros for the VAE's
    posterior samples (`reference`'s output)."""
    import importlib

    with diffusers_noise(importlib.import_module(f"diffusers.pipelines.controlnet.{module_name}"), noise):
        return reference(pipe, num_inference_steps=STEPS, **kwargs)


def test_sd_text_to_image_takes_the_control_image_size(tiny, controlnet, tmp_path):
    pipe, folder = tiny("sd15")
    net, net_folder = controlnet("sd15")
    path, picture = control_image(tmp_path)  # 90x75: the generation's size, rounded down to the VAE's factor
    f = pipe.vae_scale_factor
    h, w = 75 // f * f, 90 // f * f
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, h, w))
    guided = diffusers.StableDiffusionControlNetPipeline(**pipe.components, controlnet=net)
    run = dict(prompt="a castle", latents=noise, num_inference_steps=STEPS, guidance_scale=7.5)
    window = dict(image=picture, controlnet_conditioning_scale=0.7, control_guidance_start=0.2, control_guidance_end=0.8)
    ref = reference(guided, **run, **window)
    ours = sample(tmp_path, folder, "--prompt", "a castle", "--controlnet", str(net_folder), "--control-image", path,
                  "--controlnet-conditioning-scale", "0.7", "--control-guidance-start", "0.2",
                  "--control-guidance-end", "0.8", "--steps", str(STEPS), "--latents", str(latents))
    assert ours.images.shape == (1, h, w, 3)
    assert_parity(ours, ref)
    scaled = lambda scale: reference(guided, **run, **{**window, "controlnet_conditioning_scale": scale})
    assert_effect("--controlnet (against its scale 0)", ref, scaled(0.0))  # the plain pipeline takes multiples of 8
    assert_effect("--controlnet-conditioning-scale 0.7 (against 1)", ref, scaled(1.0))
    assert_effect("--control-guidance-start 0.2 --control-guidance-end 0.8 (against 0 and 1)", ref,
                  reference(guided, **run, **{**window, "control_guidance_start": 0.0, "control_guidance_end": 1.0}))


def test_sd_multi_controlnet_in_guess_mode(tiny, controlnet, tmp_path):
    """Two ControlNets, each with its image, scale and window, summed; guess mode with guidance runs them on
    the text branch only."""
    pipe, folder = tiny("sd15")
    (net_a, folder_a), (net_b, folder_b) = controlnet("sd15"), controlnet("sd15", seed=1)
    path_a, picture_a = control_image(tmp_path, (64, 64))
    path_b, picture_b = control_image(tmp_path, (48, 80), seed=1, name="control_b.png")  # resized to 64x64
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    multi = diffusers.StableDiffusionControlNetPipeline(**pipe.components, controlnet=[net_a, net_b])
    run = dict(prompt="a bridge", negative_prompt="rain", image=[picture_a, picture_b], height=64, width=64,
               latents=noise, num_inference_steps=STEPS, guidance_scale=6.0, guess_mode=True,
               controlnet_conditioning_scale=[1.2, 0.6], control_guidance_start=[0.0, 0.4],
               control_guidance_end=[0.6, 1.0])
    ref = reference(multi, **run)
    ours = sample(tmp_path, folder, "--prompt", "a bridge", "--negative-prompt", "rain",
                  "--controlnet", str(folder_a), "--control-image", path_a,
                  "--controlnet", str(folder_b), "--control-image", path_b,
                  "--controlnet-conditioning-scale", "1.2", "0.6", "--control-guidance-start", "0", "0.4",
                  "--control-guidance-end", "0.6", "1", "--guess-mode", "--height", "64", "--width", "64",
                  "--guidance-scale", "6", "--steps", str(STEPS), "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("--guess-mode", ref, reference(multi, **{**run, "guess_mode": False}))
    assert_effect("the second ControlNet (against its scale 0)", ref,
                  reference(multi, **{**run, "controlnet_conditioning_scale": [1.2, 0.0]}))


def test_sdxl_text_to_image(tiny, controlnet, tmp_path):
    pipe, folder = tiny("sdxl")
    net, net_folder = controlnet("sdxl")
    path, picture = control_image(tmp_path, (64, 64))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(prompt="a lighthouse", latents=noise, num_inference_steps=STEPS, guidance_scale=5.0)
    ref = reference(diffusers.StableDiffusionXLControlNetPipeline(**pipe.components, controlnet=net), image=picture, **run)
    ours = sample(tmp_path, folder, "--prompt", "a lighthouse", "--controlnet", str(net_folder),
                  "--control-image", path, "--steps", str(STEPS), "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("--controlnet", ref, reference(pipe, **run, height=64, width=64))


def test_sd_img2img_at_diffusers_default_scale(tiny, controlnet, tmp_path):
    pipe, folder = tiny("sd15")
    net, net_folder = controlnet("sd15")
    image_path, image = input_image(tmp_path)
    path, picture = control_image(tmp_path, (64, 64))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    img2img = diffusers.StableDiffusionControlNetImg2ImgPipeline(**pipe.components, controlnet=net)
    run = lambda **scale: _with_noise(img2img, "pipeline_controlnet_img2img", noise, prompt="a meadow", image=image,
                                      control_image=picture, strength=0.6, guidance_scale=7.5, **scale)
    ref = run()  # conditioning scale 0.8
    ours = sample(tmp_path, folder, "--prompt", "a meadow", "--image", str(image_path), "--strength", "0.6",
                  "--controlnet", str(net_folder), "--control-image", path, "--steps", str(STEPS),
                  "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("--controlnet (against its scale 0)", ref, run(controlnet_conditioning_scale=0.0))
    assert_effect("the default scale 0.8 (against 1)", ref, run(controlnet_conditioning_scale=1.0))


def test_sd_inpainting_by_blending(tiny, controlnet, tmp_path):
    pipe, folder = tiny("sd15")
    net, net_folder = controlnet("sd15")
    image_path, image = input_image(tmp_path)
    mask_path, mask = mask_file(tmp_path)
    path, picture = control_image(tmp_path, (64, 64))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    inpaint = diffusers.StableDiffusionControlNetInpaintPipeline(**pipe.components, controlnet=net)
    run = lambda **scale: _with_noise(inpaint, "pipeline_controlnet_inpaint", noise, prompt="a pond", image=image,
                                      mask_image=mask, control_image=picture, strength=0.7, guidance_scale=7.5, **scale)
    ref = run()  # conditioning scale 0.5
    ours = sample(tmp_path, folder, "--prompt", "a pond", "--image", str(image_path), "--mask", mask_path,
                  "--strength", "0.7", "--controlnet", str(net_folder), "--control-image", path,
                  "--steps", str(STEPS), "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("the default scale 0.5 (against 1)", ref, run(controlnet_conditioning_scale=1.0))


def test_sdxl_inpainting_model(tiny, controlnet, tmp_path):
    """A 9-channel SDXL inpainting UNet; the ControlNet reads the 4 latent channels only."""
    pipe, folder = tiny("sdxl_inpaint")
    net, net_folder = controlnet("sdxl")
    image_path, image = input_image(tmp_path)
    mask_path, mask = mask_file(tmp_path)
    path, picture = control_image(tmp_path, (64, 64))
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    inpaint = diffusers.StableDiffusionXLControlNetInpaintPipeline(**pipe.components, controlnet=net)
    run = lambda **scale: _with_noise(inpaint, "pipeline_controlnet_inpaint_sd_xl", noise, prompt="a dune", image=image,
                                      mask_image=mask, control_image=picture, guidance_scale=5.0, **scale)
    ref = run()  # strength 0.9999, scale 1.0
    ours = sample(tmp_path, folder, "--prompt", "a dune", "--image", str(image_path), "--mask", mask_path,
                  "--controlnet", str(net_folder), "--control-image", path, "--steps", str(STEPS),
                  "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("--controlnet (against its scale 0)", ref, run(controlnet_conditioning_scale=0.0))


@pytest.mark.parametrize("model, args, words", [
    ("sd15", ["--control-image", "CONTROL"], "give one --control-image per --controlnet (0), not 1"),
    ("sd15", ["--controlnet", "NET"], "give one --control-image per --controlnet (1), not 0"),
    ("sd15", ["--guess-mode"], "--guess-mode and --controlnet-conditioning-scale act on ControlNets"),
    ("sd15", ["--controlnet", "NET", "--control-image", "CONTROL", "--controlnet-conditioning-scale", "1", "2"],
     "--controlnet-conditioning-scale: give one value or one per --controlnet (1), not 2"),
    ("sd15", ["--controlnet", "NET", "--control-image", "CONTROL", "--control-guidance-start", "0.7",
              "--control-guidance-end", "0.5"], "--control-guidance-start 0.7 / --control-guidance-end 0.5: need"),
    ("sd15", ["--controlnet", "NET", "--control-image", "CONTROL.missing"], "control.png.missing: cannot read the image"),
    ("sd15", ["--controlnet", "NET", "--control-image", "CONTROL", "--refiner", "x"],
     "--controlnet and --refiner do not go together"),
    ("sdxl", ["--controlnet", "NET", "--control-image", "CONTROL"], "made for another UNet; it differs in"),
    ("pix2pix", ["--image", "CONTROL", "--controlnet", "NET", "--control-image", "CONTROL"],
     "ControlNets guide text-to-image, img2img and inpainting models, not InstructPix2Pix"),
])
def test_bad_requests_are_one_error(tiny, controlnet, tmp_path, capsys, model, args, words):
    _, folder = tiny(model)
    _, net_folder = controlnet("sd15")
    path, _ = control_image(tmp_path, (64, 64))
    subst = {"NET": str(net_folder), "CONTROL": path, "CONTROL.missing": path + ".missing"}
    argv = ["--model", str(folder), "--prompt", "x", "--steps", "1", "--output", str(tmp_path / "out"),
            "--cache", str(tmp_path / "cache"), "--quiet", *[subst.get(a, a) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_each_model_call_reads_the_projections_prepare_made(tiny, controlnet, tmp_path, monkeypatch):
    """The ControlNet, like the UNet, reads its `text_context`, made once by the prepare program: tracing a
    run projects the text (77 tokens) once for each attention of either model that reads it, never in the
    denoise program."""
    _, folder = tiny("sd15")
    _, net_folder = controlnet("sd15")
    pipe = Pipeline.load(ensure_sdx_folder(folder, cache_dir=tmp_path), controlnets=(str(net_folder),),
                         mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    projected = []
    keys_values = Attention.keys_values
    monkeypatch.setattr(Attention, "keys_values", lambda m, ctx: projected.append(ctx.shape[1]) or keys_values(m, ctx))
    pipe(Request(prompts=["a lighthouse"], height=32, width=32, steps=3, guidance_scale=5.0,
                 conditioning=[Control(np.zeros((1, 32, 32, 3), np.float32))]))
    readers = [m for model in (pipe.sampler.models["unet"], pipe.sampler.models[model_name("controlnet", 0)])
               for _, m in model._reading_text()]
    assert projected.count(77) == len(readers) > 0
