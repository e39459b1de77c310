"""Inpainting through `python -m sdx.sample --image --mask` against diffusers' StableDiffusionInpaintPipeline
and StableDiffusionXLInpaintPipeline on tiny random models: 9-channel inpainting UNets, and ordinary
4-channel models (the known region blended back after every step), from the same initial noise.

diffusers draws the VAE posterior samples of the image and of the masked image too: as in
test_pipelines.py, the tiny VAE gets a posterior standard deviation of exp(-15) and diffusers' posterior
draws are zeros, so both sides encode to the posterior mean; the noise diffusers draws is ours. Latents and
images are compared as there (`tests.tiny_models.assert_parity`), and each test shows that its mask and flags
move the result (`assert_effect`; a mirrored mask stands for another one).
"""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image, ImageDraw

from sdx.sample import main
from tests.test_pipelines import (  # noqa: F401 (tiny: the fixture)
    diffusers_noise,
    input_image,
    latent_shape,
    noise_file,
    reference,
    run_cli,
    sample,
    tiny,
)
from tests.tiny_models import Output, assert_effect, assert_parity

STEPS = 5


def mask_file(tmp_path, size=(64, 64)) -> tuple[str, Image.Image]:
    """A greyscale mask of `size` (W, H): a white ellipse, a grey ramp across the binarising threshold."""
    w, h = size
    mask = Image.new("L", size, 0)
    draw = ImageDraw.Draw(mask)
    draw.ellipse((w // 5, h // 4, w * 3 // 5, h * 4 // 5), fill=255)
    for x in range(w * 3 // 5, w):  # values from 0 to ~255: the 0.5 cut decides, after the resize
        draw.line((x, 0, x, h // 3), fill=int(255 * (x - w * 3 // 5) / (w * 2 // 5)))
    path = tmp_path / "mask.png"
    mask.save(path)
    return str(path), mask


def _inpaint(kind, pipe, image, mask, noise, *, blur=0, **kwargs) -> Output:
    """diffusers' inpainting pipeline for `pipe`'s components, drawing `noise` (`reference`'s output)."""
    import diffusers
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint as sd_module
    import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_inpaint as xl_module

    xl = kind.startswith("sdxl")
    cls = diffusers.StableDiffusionXLInpaintPipeline if xl else diffusers.StableDiffusionInpaintPipeline
    inpaint = pipe if isinstance(pipe, cls) else cls(**pipe.components)
    if blur:
        mask = inpaint.mask_processor.blur(mask, blur_factor=blur)
    with diffusers_noise(xl_module if xl else sd_module, noise):
        return reference(inpaint, image=image, mask_image=mask, height=64, width=64, num_inference_steps=STEPS, **kwargs)


def mirrored(mask: Image.Image) -> Image.Image:
    """Another mask of the same area: `mask` mirrored left to right."""
    return mask.transpose(Image.FLIP_LEFT_RIGHT)


@pytest.mark.parametrize("strength", [1.0, 0.6])
def test_sd_inpainting_model(tiny, tmp_path, strength):
    pipe, folder = tiny("sd15_inpaint")
    image_path, image = input_image(tmp_path)
    image_path = str(image_path)
    mask_path, mask = mask_file(tmp_path)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = lambda mask=mask, strength=strength: _inpaint("sd15_inpaint", pipe, image, mask, noise, prompt="a harbour",
                                                        strength=strength, guidance_scale=7.5)
    ref = run()
    ours = sample(tmp_path, folder, "--prompt", "a harbour", "--image", image_path, "--mask", mask_path,
                  "--strength", str(strength), "--steps", str(STEPS), "--guidance-scale", "7.5", "--latents", str(path))
    assert_parity(ours, ref)
    assert_effect("--mask (against it mirrored)", ref, run(mask=mirrored(mask)))
    assert_effect(f"--strength {strength} (against 0.8)", ref, run(strength=0.8))


@pytest.mark.parametrize("strength, blur", [(1.0, 0), (0.7, 3)])
def test_sd_ordinary_model_blends_the_known_region(tiny, tmp_path, strength, blur):
    pipe, folder = tiny("sd15")
    image_path, image = input_image(tmp_path)
    image_path = str(image_path)
    mask_path, mask = mask_file(tmp_path, size=(96, 80))  # resized to the image, as diffusers does
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = lambda mask=mask, blur=blur: _inpaint("sd15", pipe, image, mask, noise, blur=blur, prompt="a garden",
                                                strength=strength, guidance_scale=6.0)
    ref = run()
    ours = sample(tmp_path, folder, "--prompt", "a garden", "--image", image_path, "--mask", mask_path,
                  "--mask-blur", str(blur), "--strength", str(strength), "--steps", str(STEPS),
                  "--guidance-scale", "6", "--latents", str(path))
    assert_parity(ours, ref)
    assert_effect("--mask (against it mirrored)", ref, run(mask=mirrored(mask)))
    if blur:
        assert_effect(f"--mask-blur {blur}", ref, run(blur=0))
    # outside the mask the picture is the input's, through the VAE: far closer to it than inside
    keep = np.asarray(mask.resize((64, 64), Image.LANCZOS)) < 128
    err = np.abs(ours.images[0].astype(np.int32) - np.asarray(image, np.int32)).mean(-1)
    assert err[keep].mean() < err[~keep].mean()


def test_sdxl_inpainting_model_at_diffusers_default_strength(tiny, tmp_path):
    pipe, folder = tiny("sdxl_inpaint")
    image_path, image = input_image(tmp_path)
    image_path = str(image_path)
    mask_path, mask = mask_file(tmp_path)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = lambda mask: _inpaint("sdxl_inpaint", pipe, image, mask, noise, prompt="a lighthouse", guidance_scale=5.0)  # 0.9999
    ref = run(mask)
    ours = sample(tmp_path, folder, "--prompt", "a lighthouse", "--image", image_path, "--mask", mask_path,
                  "--steps", str(STEPS), "--latents", str(path))
    assert_parity(ours, ref)
    assert_effect("--mask (against it mirrored)", ref, run(mirrored(mask)))


def test_sdxl_ordinary_model_with_guidance_rescale(tiny, tmp_path):
    pipe, folder = tiny("sdxl")
    image_path, image = input_image(tmp_path)
    image_path = str(image_path)
    mask_path, mask = mask_file(tmp_path)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    # a strong guidance, for the rescale to move the masked region by far more than the bar
    run = lambda mask=mask, rescale=0.7: _inpaint("sdxl", pipe, image, mask, noise, prompt="a boat", negative_prompt="fog",
                                                  strength=0.8, guidance_scale=12.0, guidance_rescale=rescale)
    ref = run()
    ours = sample(tmp_path, folder, "--prompt", "a boat", "--negative-prompt", "fog", "--image", image_path,
                  "--mask", mask_path, "--strength", "0.8", "--steps", str(STEPS), "--guidance-scale", "12",
                  "--guidance-rescale", "0.7", "--latents", str(path))
    assert_parity(ours, ref)
    assert_effect("--mask (against it mirrored)", ref, run(mask=mirrored(mask)))
    assert_effect("--guidance-rescale 0.7", ref, run(rescale=0.0))


def test_an_image_does_not_change_with_the_batch_size(tiny, tmp_path):
    """The posterior samples of the image and the masked image, and the step noise, are each image's own
    draws."""
    _, folder = tiny("sd15_inpaint")
    image_path = str(input_image(tmp_path)[0])
    mask_path, _ = mask_file(tmp_path)
    args = ["--prompt", "a harbour", "a field", "--image", image_path, "--mask", mask_path, "--strength", "0.7",
            "--steps", "3", "--num-images", "2", "--scheduler", "euler_a"]
    one = run_cli(tmp_path / "one", folder, *args, "--batch-size", "1")
    four = run_cli(tmp_path / "four", folder, *args, "--batch-size", "4")
    # equal up to float rounding of a batched XLA call (an 8-bit level on a few pixels); another draw per
    # batch would repaint the masked region differently
    assert np.abs(one.astype(np.int32) - four.astype(np.int32)).max() <= 1


@pytest.mark.parametrize("model, args, words", [
    ("sd15", ["--mask", "MASK"], "--mask marks what to repaint in --image: pass --image too"),
    ("sd15", ["--image", "IMAGE", "--mask", "IMAGE.missing"], "--mask IMAGE.missing: cannot read the image"),
    ("sd15", ["--image", "IMAGE", "--mask", "MASK", "--mask-blur", "-1"], "--mask-blur -1.0 must be >= 0"),
    ("sd15", ["--image", "IMAGE", "--mask", "MASK", "--refiner", "x"], "--mask and --refiner do not go together"),
    ("sd15_inpaint", ["--image", "IMAGE"], "an inpainting model repaints the masked part of an image: pass --image and "
                                           "--mask"),
    ("pix2pix", ["--image", "IMAGE", "--mask", "MASK"], "an InstructPix2Pix model edits the whole image"),
    ("sd15", ["--image", "IMAGE", "--padding-mask-crop", "4"], "--padding-mask-crop 4: a number of pixels >= 0, with --mask"),
    ("sd15", ["--image", "IMAGE", "--mask", "MASK", "--padding-mask-crop", "-1"], "--padding-mask-crop -1: a number of"),
    ("sd15", ["--image", "IMAGE", "--mask", "BLACK", "--padding-mask-crop", "4"], "is black everywhere"),
])
def test_bad_inpainting_requests_are_one_error_line(tiny, tmp_path, capsys, model, args, words):
    _, folder = tiny(model)
    image_path = str(input_image(tmp_path)[0])
    mask_path, _ = mask_file(tmp_path)
    black = tmp_path / "black.png"
    Image.new("L", (64, 64), 0).save(black)
    args = [a.replace("MASK", mask_path).replace("IMAGE", image_path).replace("BLACK", str(black)) for a in args]
    words = words.replace("IMAGE", image_path)
    out = tmp_path / "out"
    code = main(["--model", str(folder), "--prompt", "x", "--output", str(out), "--cache", str(tmp_path / "cache"),
                 "--quiet", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and words in err[-1], err
    assert not out.exists()



def _masks_for_crops():
    """Masks of 100x70 with a box or a blob in a corner, in the middle, along an edge; and generation sizes of
    every aspect, so each branch of the crop region (grow in height or width, shift back, clip) runs."""
    out = []
    for box in ((5, 5, 20, 12), (40, 30, 60, 40), (80, 2, 99, 69), (0, 50, 100, 70), (47, 33, 48, 34)):
        mask = Image.new("L", (100, 70), 0)
        ImageDraw.Draw(mask).rectangle(box, fill=255)
        out.append(mask)
    return out


@pytest.mark.parametrize("size", [(64, 64), (48, 96), (96, 40)])
@pytest.mark.parametrize("pad", [0, 7, 40])
def test_crop_region_fill_and_overlay_equal_diffusers(size, pad):
    from diffusers.image_processor import VaeImageProcessor

    from pipelines import masks

    processor = VaeImageProcessor()
    _, picture = input_image(None, size=100)
    picture = picture.crop((0, 0, 100, 70))
    for mask in _masks_for_crops():
        box = masks.crop_region(mask, size, pad)
        assert box == processor.get_crop_region(mask, size[1], size[0], pad=pad)
        cut = picture.crop(box)
        assert np.array_equal(np.asarray(masks.resize_fill(cut, size)),
                              np.asarray(processor.resize(cut, size[0], size[1], resize_mode="fill")))
        generated = np.asarray(picture.resize((size[1], size[0])))[::-1].copy()
        want = processor.apply_overlay(mask, picture, Image.fromarray(generated), box)
        assert np.array_equal(masks.overlay(mask, picture, generated, box), np.asarray(want))


def test_padding_mask_crop_repaints_a_crop_and_pastes_it_back(tiny, tmp_path):
    import diffusers
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint as module

    pipe, folder = tiny("sd15_inpaint")
    image_path, image = input_image(tmp_path, size=96)
    mask_path, mask = mask_file(tmp_path, size=(96, 96))
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 48))
    inpaint = diffusers.StableDiffusionInpaintPipeline(**pipe.components)
    run = lambda pad: reference(inpaint, prompt="a harbour", image=image, mask_image=mask, height=64, width=48,
                                padding_mask_crop=pad, num_inference_steps=STEPS, strength=0.8, guidance_scale=7.5,
                                output_type="pil")
    with diffusers_noise(module, noise):
        ref, wider = run(6), run(20)
    ours = sample(tmp_path, folder, "--prompt", "a harbour", "--image", str(image_path), "--mask", mask_path,
                  "--padding-mask-crop", "6", "--height", "64", "--width", "48", "--strength", "0.8",
                  "--steps", str(STEPS), "--latents", str(path))
    assert ours.images.shape == (1, 96, 96, 3)
    assert_parity(ours, ref)
    assert_effect("--padding-mask-crop 6 (against 20)", ref, wider)
