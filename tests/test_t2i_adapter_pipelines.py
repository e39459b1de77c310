"""T2I-Adapters through `python -m sdx.sample --t2i-adapter --t2i-adapter-image` (and `Pipeline`) against
diffusers' StableDiffusion(XL)AdapterPipeline and MultiAdapter on tiny random models, from the same initial noise.

Each adapter is a diffusers T2IAdapter shaped for the tiny UNets (whose VAE shrinks images 2x: SD's full
adapter unshuffles by 2, SDXL's full_xl by 4), every parameter moved off its value, saved as a diffusers
folder. The pictures are edge-like maps; the first is of another size than the generation, so the resize and
the size rule (text-to-image takes the adapter image's size, rounded down to the adapter's factor) are covered
(odd latent sizes are tests/test_t2i_adapter.py's: diffusers' adapter pipelines take multiples of 8 only).
Latents and images are compared as in test_pipelines.py (`tests.tiny_models.assert_parity`), and each test shows
that its adapters and their flags move the result (`assert_effect`, against diffusers' output without them).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
import torch
from PIL import Image

from convert.library import ensure_sdx_folder
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from pipelines.t2i_adapter import AdapterImage, fit_image
from sdx import mesh as meshlib
from sdx.sample import main
from tests.test_controlnet_pipelines import control_image
from tests.test_pipelines import (  # noqa: F401 (tiny: the fixture)
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
# kind -> diffusers T2IAdapter config fitting its tiny UNet
SHAPES = {
    "sd15": dict(channels=[32, 64], num_res_blocks=2, downscale_factor=2, adapter_type="full_adapter"),
    "sdxl": dict(channels=[32, 64], num_res_blocks=1, downscale_factor=4, adapter_type="full_adapter_xl"),
}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """(kind, in_channels, seed) -> (diffusers T2IAdapter, its folder)."""
    made = {}

    def get(kind: str, in_channels: int = 3, seed: int = 0):
        key = (kind, in_channels, seed)
        if key not in made:
            torch.manual_seed(seed)
            model = diffusers.T2IAdapter(in_channels=in_channels, **SHAPES[kind])
            perturb(model, torch.Generator().manual_seed(seed + 10))
            folder = tmp_path_factory.mktemp(f"adapter-{kind}-{in_channels}-{seed}")
            model.eval().save_pretrained(folder)
            made[key] = (model, folder)
        return made[key]

    return get


def _gray(tmp_path, size, seed) -> tuple[str, Image.Image]:
    path, picture = control_image(tmp_path, size, seed=seed, name=f"gray-{seed}.png")
    picture = picture.convert("L")
    picture.save(path)
    return path, picture


def test_sd_text_to_image_takes_the_adapter_image_size(tiny, adapter, tmp_path):
    pipe, folder = tiny("sd15")
    model, adapter_folder = adapter("sd15")
    path, picture = control_image(tmp_path, (88, 73))  # the generation's size, rounded down to the adapter's factor 2
    h, w = 72, 88  # diffusers' adapter pipelines take multiples of 8 only: its size is given
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, h, w))
    components = {k: v for k, v in pipe.components.items() if k != "image_encoder"}
    adapted = diffusers.StableDiffusionAdapterPipeline(**components, adapter=model)
    run = dict(prompt="a castle", height=h, width=w, latents=noise, num_inference_steps=STEPS, guidance_scale=7.5)
    ref = reference(adapted, image=picture, adapter_conditioning_scale=2.5, **run)
    ours = sample(tmp_path, folder, "--prompt", "a castle", "--t2i-adapter", str(adapter_folder),
                  "--t2i-adapter-image", path, "--t2i-adapter-scale", "2.5", "--steps", str(STEPS),
                  "--latents", str(latents))
    assert ours.images.shape == (1, h, w, 3)
    assert_parity(ours, ref)
    assert_effect("--t2i-adapter", ref, reference(pipe, **run))
    assert_effect("--t2i-adapter-scale 2.5 (against 1)", ref, reference(adapted, image=picture, **run))


def test_sd_two_adapters_one_gray_with_weights(tiny, adapter, tmp_path):
    """diffusers' MultiAdapter: each adapter's maps times its weight, summed; the second reads a one-channel
    picture (resized from 48x80)."""
    pipe, folder = tiny("sd15")
    (rgb, rgb_folder), (gray, gray_folder) = adapter("sd15"), adapter("sd15", in_channels=1, seed=1)
    path_a, picture_a = control_image(tmp_path, (64, 64))
    path_b, picture_b = _gray(tmp_path, (48, 80), seed=1)
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 2, 64, 64))
    components = {k: v for k, v in pipe.components.items() if k != "image_encoder"}
    multi = diffusers.StableDiffusionAdapterPipeline(**components, adapter=[rgb, gray])
    run = lambda weights: reference(multi, prompt="a bridge", negative_prompt="rain", image=[picture_a, picture_b],
                                    height=64, width=64, latents=noise, num_inference_steps=STEPS, guidance_scale=6.0,
                                    num_images_per_prompt=2, adapter_conditioning_scale=weights)
    ref = run([1.2, 0.6])
    ours = sample(tmp_path, folder, "--prompt", "a bridge", "--negative-prompt", "rain",
                  "--t2i-adapter", str(rgb_folder), "--t2i-adapter-image", path_a,
                  "--t2i-adapter", str(gray_folder), "--t2i-adapter-image", path_b,
                  "--t2i-adapter-scale", "1.2", "0.6", "--height", "64", "--width", "64", "--num-images", "2",
                  "--guidance-scale", "6", "--steps", str(STEPS), "--latents", str(latents))
    assert_parity(ours, ref)
    assert_effect("the gray adapter (against its weight 0)", ref, run([1.2, 0.0]))


def test_sdxl_conditioning_factor_over_a_cut_schedule(tiny, adapter, tmp_path):
    """SDXL's adapter pipeline: the adapter acts in the first int(N x factor) calls, N counting the calls left
    once denoising_end has cut the schedule (8 steps cut at 0.7 keep 5 calls: the adapter acts in 3). The base's
    latents, as a refiner would continue them."""
    pipe, folder = tiny("sdxl")
    model, adapter_folder = adapter("sdxl")
    _, picture = control_image(tmp_path, (64, 48))
    noise = torch.randn(latent_shape(pipe, 1, 48, 64), generator=torch.Generator().manual_seed(0))
    adapted = diffusers.StableDiffusionXLAdapterPipeline(**pipe.components, adapter=model)
    run = lambda factor: Output(None, adapted(
        prompt="a lighthouse", image=picture, height=48, width=64, latents=noise, num_inference_steps=8,
        denoising_end=0.7, adapter_conditioning_factor=factor, guidance_scale=5.0, output_type="latent",
    ).images.numpy().transpose(0, 2, 3, 1))  # NCHW -> NHWC
    ref = run(0.6)
    ours_pipe = Pipeline.load(ensure_sdx_folder(folder, cache_dir=tmp_path), t2i_adapters=(str(adapter_folder),),
                              mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    request = Request(prompts=["a lighthouse"], height=48, width=64, steps=8, guidance_scale=5.0,
                      latents=noise.numpy(), denoising_end=0.7, output_latents=True,
                      conditioning=[AdapterImage(fit_image(picture, (48, 64), 3), factor=0.6)])
    assert_parity(Output(None, ours_pipe(request)), ref)
    assert_effect("--t2i-adapter-factor 0.6 (against 0.5: the adapter acts in one call fewer)", ref, run(0.5))


def test_img2img_with_an_adapter(tiny, adapter, tmp_path):
    """Beyond diffusers (no adapter img2img pipeline): the adapter guides img2img, its maps at the scale the
    request gives (an input of the compiled programs: a second scale compiles nothing); at scale 0 the result
    is plain img2img's (to float32 rounding in another program)."""
    _, folder = tiny("sd15")
    _, adapter_folder = adapter("sd15")
    _, image = input_image(None)
    _, picture = control_image(tmp_path, (64, 64))
    pipe = Pipeline.load(ensure_sdx_folder(folder, cache_dir=tmp_path), t2i_adapters=(str(adapter_folder),),
                         mesh=meshlib.make_mesh(devices=jax.devices()[:1]))
    plain_pipe = dataclasses.replace(pipe, conditioners={})  # the same models, the adapter not asked for
    request = Request(prompts=["a meadow"], height=64, width=64, steps=STEPS, strength=0.6,
                      image=np.asarray(image, np.float32)[None] / 127.5 - 1)
    plain = plain_pipe(request)
    adapted = lambda scale: pipe(dataclasses.replace(  # noqa: E731
        request, conditioning=[AdapterImage(fit_image(picture, (64, 64), 3), scale)]))
    zero, guided = adapted(0.0), adapted(3.0)
    assert pipe.sampler.compilations == 2  # plain img2img's programs, then the adapter's for both scales
    err, moved = np.abs(zero - plain).max(), np.abs(guided - plain).mean()
    print(f"scale 0 against no adapter: max abs diff {err:.1e} (bar 1e-5); scale 3 moves the images by {moved:.3f} "
          f"mean ({moved / 1e-5:.0f}x the bar)")
    assert err < 1e-5 and moved > 0.01


@pytest.mark.parametrize("model, args, words", [
    ("sd15", ["--t2i-adapter-image", "PICTURE"], "give one --t2i-adapter-image per --t2i-adapter (0), not 1"),
    ("sd15", ["--t2i-adapter", "ADAPTER"], "give one --t2i-adapter-image per --t2i-adapter (1), not 0"),
    ("sd15", ["--t2i-adapter-factor", "0.5"], "--t2i-adapter-scale and --t2i-adapter-factor act on T2I-Adapters"),
    ("sd15", ["--t2i-adapter", "ADAPTER", "--t2i-adapter-image", "PICTURE", "--t2i-adapter-scale", "1", "2"],
     "--t2i-adapter-scale: give one value or one per --t2i-adapter (1), not 2"),
    ("sd15", ["--t2i-adapter", "ADAPTER", "--t2i-adapter-image", "PICTURE", "--t2i-adapter-factor", "1.5"],
     "--t2i-adapter-factor 1.5: the share of the steps the adapters act in, from 0 to 1"),
    ("sd15", ["--t2i-adapter", "ADAPTER", "--t2i-adapter-image", "PICTURE.missing"], "cannot read the image"),
    ("sd15", ["--t2i-adapter", "MODEL", "--t2i-adapter-image", "PICTURE"], "has no config.json"),
    ("sd15", ["--t2i-adapter", "ADAPTER", "--t2i-adapter-image", "PICTURE", "--refiner", "x"],
     "--t2i-adapter and --refiner do not go together"),
    ("sdxl", ["--t2i-adapter", "ADAPTER", "--t2i-adapter-image", "PICTURE"], "made for another UNet"),
    ("pix2pix", ["--image", "PICTURE", "--t2i-adapter", "ADAPTER", "--t2i-adapter-image", "PICTURE"],
     "T2I-Adapters guide text-to-image, img2img and inpainting models, not InstructPix2Pix"),
])
def test_bad_requests_are_one_error(tiny, adapter, tmp_path, capsys, model, args, words):
    _, folder = tiny(model)
    _, adapter_folder = adapter("sd15")
    path, _ = control_image(tmp_path, (64, 64))
    subst = {"ADAPTER": str(adapter_folder), "PICTURE": path, "PICTURE.missing": path + ".missing",
             "MODEL": str(folder)}
    argv = ["--model", str(folder), "--prompt", "x", "--steps", "1", "--output", str(tmp_path / "out"),
            "--cache", str(tmp_path / "cache"), "--quiet", *[subst.get(a, a) for a in args]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_an_sdxl_adapter_needs_sizes_of_its_factor(tiny, adapter, tmp_path, capsys):
    _, folder = tiny("sdxl")
    _, adapter_folder = adapter("sdxl")
    path, _ = control_image(tmp_path, (64, 64))
    argv = ["--model", str(folder), "--prompt", "x", "--steps", "1", "--output", str(tmp_path / "out"), "--height", "66",
            "--width", "64", "--cache", str(tmp_path / "cache"), "--quiet", "--t2i-adapter", str(adapter_folder),
            "--t2i-adapter-image", path]
    assert main(argv) == 2
    assert "reads images whose sides are multiples of 4 pixels; --height 66 --width 64 are not" in capsys.readouterr().err
