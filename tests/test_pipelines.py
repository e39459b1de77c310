"""End-to-end parity: `python -m sdx.sample` against diffusers' PyTorch pipelines on tiny random models.

Both sides start from the same initial noise (`--latents` / `latents=`). Each test compares the float32 latents
the VAE decodes (sdx's read from its decode program as the CLI runs, `sample`; diffusers' from its last step's
callback, `reference`) and the 8-bit images, at the bar of `tests.tiny_models.Bar`, and shows with
`assert_effect` that each flag it exercises moves the result by at least ten times that bar.

img2img draws two more random tensors in diffusers (the VAE posterior sample and the noise added to
the image latents): the test hands diffusers our noise, and gives the tiny VAE a posterior standard
deviation of exp(-15) so that the posterior sample equals its mean on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sdx.sample import main
from tests.tiny_models import Output, assert_effect, assert_parity, make_tiny_pipeline

STEPS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """kind -> (diffusers pipeline, its folder), with a near-deterministic VAE posterior; built once per kind."""
    made = {}

    def get(kind: str):
        if kind not in made:
            folder = tmp_path_factory.mktemp(kind)
            pipe = make_tiny_pipeline(kind, folder)
            with torch.no_grad():  # for img2img and inpainting: a near-deterministic VAE posterior
                c = pipe.vae.config.latent_channels
                pipe.vae.quant_conv.bias[c:] = -40.0  # log-variance channels -> clipped to -30
            pipe.save_pretrained(folder)
            made[kind] = (pipe, folder)
        return made[kind]

    return get


def run_cli(tmp_path: Path, model: Path, *args: str) -> np.ndarray:
    """Run the CLI, return its images (N, H, W, 3) uint8 in output order."""
    out = tmp_path / "out"
    argv = ["--model", str(model), "--output", str(out), "--cache", str(tmp_path / "cache"), "--quiet", *args]
    assert main(argv) == 0
    files = sorted(out.glob("*.png"))
    return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])


class _Recording:
    """A compiled decode program that keeps the latents it is called with in `seen`; anything else asked of it
    (its memory analysis) is the program's."""

    def __init__(self, program, seen: list):
        self.program, self.seen = program, seen

    def __call__(self, params, latents):
        self.seen.append(np.asarray(latents))
        return self.program(params, latents)

    def __getattr__(self, name):
        return getattr(self.program, name)


@contextlib.contextmanager
def decoded_latents():
    """A list that fills, while the block runs, with the latents (B, h, w, C) float32 each sampler call hands
    its decode program: the final latents, before the VAE (a spy on `Sampler.compiled`'s programs; nothing is
    compiled or run twice)."""
    from pipelines.sampler import Sampler

    seen, compiled = [], Sampler.compiled

    def spied(self, plan, inputs):
        programs = compiled(self, plan, inputs)
        if programs.decode is None:
            return programs
        return dataclasses.replace(programs, decode=_Recording(programs.decode, seen))

    Sampler.compiled = spied
    try:
        yield seen
    finally:
        Sampler.compiled = compiled


def sample(tmp_path: Path, model: Path, *args: str) -> Output:
    """`run_cli`'s images with the latents they were decoded from (batches in order, the last one's padding cut)."""
    with decoded_latents() as seen:
        images = run_cli(tmp_path, model, *args)
    assert seen, "no decode program ran"
    return Output(images, np.concatenate(seen)[: len(images)])


def reference(pipe, *args, output_type: str = "np", **kwargs) -> Output:
    """diffusers' `pipe(*args, **kwargs)`: its images to 8 bits and the latents its last step left (NHWC), read by
    the step callback the pipeline has."""
    steps = []
    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
        kwargs["callback_on_step_end"] = lambda _pipe, _i, _t, tensors: steps.append(tensors["latents"].clone()) or {}
    else:
        kwargs.update(callback=lambda _i, _t, latents: steps.append(latents.clone()), callback_steps=1)
    images = pipe(*args, output_type=output_type, **kwargs).images
    images = to_uint8(images) if output_type == "np" else np.stack([np.asarray(i) for i in images])
    return Output(images, steps[-1].numpy().transpose(0, 2, 3, 1))  # NCHW -> NHWC


def to_uint8(images: np.ndarray) -> np.ndarray:
    return (images * 255).round().astype(np.uint8)


def noise_file(tmp_path: Path, shape, seed=0) -> tuple[Path, torch.Tensor]:
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)
    path = tmp_path / "latents.npy"
    np.save(path, noise.numpy())
    return path, noise


def latent_shape(pipe, n: int, height: int, width: int) -> tuple[int, ...]:
    f = pipe.vae_scale_factor
    return (n, pipe.vae.config.latent_channels, height // f, width // f)


def test_sd15_text_to_image(tiny, tmp_path):
    pipe, folder = tiny("sd15")
    prompts, negative = ["a red fox in the snow", "a blue boat"], ["blurry", "dark"]
    path, noise = noise_file(tmp_path, latent_shape(pipe, 2, 64, 64))
    run = dict(negative_prompt=negative, num_inference_steps=STEPS, guidance_scale=7.5, latents=noise, height=64,
               width=64)
    ref = reference(pipe, prompts, **run)
    ours = sample(tmp_path, folder, "--prompt", *prompts, "--negative-prompt", *negative, "--steps", str(STEPS),
                  "--guidance-scale", "7.5", "--latents", str(path), "--height", "64", "--width", "64")
    assert_parity(ours, ref)
    assert_effect("--negative-prompt", ref, reference(pipe, prompts, **{**run, "negative_prompt": None}))
    assert_effect("--guidance-scale 7.5 (against 5)", ref, reference(pipe, prompts, **{**run, "guidance_scale": 5.0}))


def test_sd21_v_prediction_with_guidance_rescale_and_scheduler_override(tiny, tmp_path):
    import diffusers

    pipe, folder = tiny("sd21_v")
    scheduler = diffusers.DPMSolverMultistepScheduler.from_config(pipe.scheduler.config, use_karras_sigmas=True)
    karras = diffusers.StableDiffusionPipeline(**{**pipe.components, "scheduler": scheduler})
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(num_inference_steps=STEPS, guidance_scale=6.0, guidance_rescale=0.7, latents=noise, height=64, width=64)
    ref = reference(karras, ["a castle on a hill"], **run)
    ours = sample(tmp_path, folder, "--prompt", "a castle on a hill", "--steps", str(STEPS), "--guidance-scale", "6",
                  "--guidance-rescale", "0.7", "--scheduler", "dpmpp_2m_karras", "--latents", str(path),
                  "--height", "64", "--width", "64")
    assert_parity(ours, ref)
    assert_effect("--guidance-rescale 0.7", ref,
                  reference(karras, ["a castle on a hill"], **{**run, "guidance_rescale": 0.0}))
    assert_effect("--scheduler dpmpp_2m_karras (against the model's own)", ref,
                  reference(pipe, ["a castle on a hill"], **run))


def test_sdxl_text_to_image_two_prompts_zero_negative_clip_skip(tiny, tmp_path):
    pipe, folder = tiny("sdxl")
    assert pipe.config.force_zeros_for_empty_prompt
    path, noise = noise_file(tmp_path, latent_shape(pipe, 2, 64, 64))
    run = dict(prompt_2="oil painting", num_images_per_prompt=2, num_inference_steps=STEPS, guidance_scale=5.0,
               latents=noise, height=64, width=64, original_size=(96, 80), target_size=(56, 72), clip_skip=1)
    ref = reference(pipe, "a lighthouse at dawn", **run)
    ours = sample(tmp_path, folder, "--prompt", "a lighthouse at dawn", "--prompt-2", "oil painting", "--num-images", "2",
                  "--steps", str(STEPS), "--guidance-scale", "5", "--latents", str(path), "--height", "64", "--width", "64",
                  "--original-size", "96x80", "--target-size", "56x72", "--clip-skip", "1")
    assert_parity(ours, ref)
    for flag in ("prompt_2", "original_size", "target_size", "clip_skip"):
        without = reference(pipe, "a lighthouse at dawn", **{**run, flag: None})
        assert_effect(f"--{flag.replace('_', '-')}", ref, without)


def test_sdxl_base_then_refiner_with_clip_skip(tiny, tmp_path):
    import diffusers

    # diffusers applies clip skip to the prompts, never to the negative prompts
    base, base_folder = tiny("sdxl")
    refiner, refiner_folder = tiny("sdxl_refiner")
    assert isinstance(refiner, diffusers.StableDiffusionXLImg2ImgPipeline)
    path, noise = noise_file(tmp_path, latent_shape(base, 1, 64, 64))
    steps = 6

    def both(frac=0.6, clip_skip=1) -> Output:
        latents = base("a red barn", negative_prompt="fog", num_inference_steps=steps, denoising_end=frac, latents=noise,
                       output_type="latent", height=64, width=64, clip_skip=clip_skip).images
        return reference(refiner, "a red barn", negative_prompt="fog", image=latents, num_inference_steps=steps,
                         denoising_start=frac, clip_skip=clip_skip)

    ref = both()
    ours = sample(tmp_path, base_folder, "--refiner", str(refiner_folder), "--high-noise-frac", "0.6",
                  "--prompt", "a red barn", "--negative-prompt", "fog", "--steps", str(steps), "--latents", str(path),
                  "--height", "64", "--width", "64", "--clip-skip", "1")
    assert_parity(ours, ref)
    assert_effect("--high-noise-frac 0.6 (against 0.8)", ref, both(frac=0.8))
    assert_effect("--clip-skip 1", ref, both(clip_skip=None))


@contextlib.contextmanager
def diffusers_noise(module, noise: torch.Tensor):
    """Make a diffusers img2img pipeline module draw `noise` for its image latents, and the VAE's
    posterior sample draw zeros (its standard deviation is exp(-15) in these tests anyway)."""
    import diffusers.models.autoencoders.vae as vae_module

    saved = module.randn_tensor, vae_module.randn_tensor
    module.randn_tensor = lambda shape, **kw: noise.reshape(shape).clone()
    vae_module.randn_tensor = lambda shape, **kw: torch.zeros(shape)
    try:
        yield
    finally:
        module.randn_tensor, vae_module.randn_tensor = saved


def input_image(tmp_path: Path | None, size=64, seed=1) -> tuple[Path | None, Image.Image]:
    """A smooth picture with noise, saved as tmp_path/input.png (not saved when tmp_path is None)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    arr = np.stack([yy, xx, 0.5 + 0.3 * np.sin(6 * xx * yy)], -1) * 200 + rng.uniform(0, 55, (size, size, 3))
    image = Image.fromarray(arr.clip(0, 255).astype(np.uint8))
    if tmp_path is None:
        return None, image
    path = tmp_path / "input.png"
    image.save(path)
    return path, image


def test_sd15_img2img(tiny, tmp_path):
    import diffusers
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as module

    pipe, folder = tiny("sd15")
    img2img = diffusers.StableDiffusionImg2ImgPipeline(**pipe.components)
    image_path, image = input_image(tmp_path)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = lambda strength: reference(img2img, "a harbour", image=image, strength=strength, num_inference_steps=5,
                                     guidance_scale=7.5)
    with diffusers_noise(module, noise):
        ref, other = run(0.6), run(0.8)
    ours = sample(tmp_path, folder, "--prompt", "a harbour", "--image", str(image_path), "--strength", "0.6",
                  "--steps", "5", "--guidance-scale", "7.5", "--latents", str(path))
    assert_parity(ours, ref)
    assert_effect("--strength 0.6 (against 0.8)", ref, other)


def test_sd15_img2img_with_vae_tiling(tiny, tmp_path):
    """--vae-tiling against diffusers' `vae.enable_tiling()`: the VAE's sample_size set to 32 px, so a 64 px
    image is encoded in tiles of 32 px and its latents decoded in tiles of 32 / f."""
    import diffusers
    import diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img as module

    pipe, folder = tiny("sd15")
    tiled = tmp_path / "tiled-vae"
    shutil.copytree(folder, tiled)
    config = json.loads((tiled / "vae" / "config.json").read_text())
    (tiled / "vae" / "config.json").write_text(json.dumps({**config, "sample_size": 32}))
    vae = diffusers.AutoencoderKL.from_pretrained(tiled / "vae")
    img2img = diffusers.StableDiffusionImg2ImgPipeline(**{**pipe.components, "vae": vae})
    image_path, image = input_image(tmp_path)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = lambda: reference(img2img, "a harbour", image=image, strength=0.6, num_inference_steps=5, guidance_scale=7.5)
    with diffusers_noise(module, noise):
        plain = run()
        img2img.vae.enable_tiling()
        ref = run()
    ours = sample(tmp_path, tiled, "--prompt", "a harbour", "--image", str(image_path), "--strength", "0.6",
                  "--steps", "5", "--guidance-scale", "7.5", "--latents", str(path), "--vae-tiling")
    assert_parity(ours, ref)
    assert_effect("--vae-tiling", ref, plain)  # the tiles are there: a sampler that ignored the flag would fail


def test_sdxl_refiner_img2img_with_aesthetic_scores(tiny, tmp_path):
    import diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl_img2img as module

    pipe, folder = tiny("sdxl_refiner")
    image_path, image = input_image(tmp_path)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = lambda **scores: reference(pipe, "a quiet street", image=image, strength=0.5, num_inference_steps=6,
                                     guidance_scale=5.0, **scores)
    with diffusers_noise(module, noise):
        ref, defaults = run(aesthetic_score=7.0, negative_aesthetic_score=2.0), run()
    ours = sample(tmp_path, folder, "--prompt", "a quiet street", "--image", str(image_path), "--strength", "0.5",
                  "--steps", "6", "--guidance-scale", "5", "--aesthetic-score", "7", "--negative-aesthetic-score", "2",
                  "--latents", str(path))
    assert_parity(ours, ref)
    assert_effect("--aesthetic-score 7 --negative-aesthetic-score 2 (against 6 and 2.5)", ref, defaults)


@pytest.mark.parametrize("kind", ["pix2pix", "sdxl_pix2pix", "cosxl_edit"])
def test_instruct_pix2pix(tiny, tmp_path, kind):
    import diffusers

    pipe, folder = tiny("sdxl_pix2pix" if kind == "cosxl_edit" else kind)
    # timbrooks/instruct-pix2pix samples with Euler ancestral, whose per-step noise cannot be shared with
    # torch; both sides use plain Euler here (ancestral noise parity is tested in test_schedulers).
    scheduler = diffusers.EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    euler = type(pipe)(**{**pipe.components, "scheduler": scheduler})
    edit = euler
    if kind == "cosxl_edit":  # image latents scaled by the VAE's factor, as model_index.json asks
        edit = type(pipe)(**euler.components, is_cosxl_edit=True)
        edit.register_to_config(is_cosxl_edit=True)
        folder = tmp_path / "cosxl"
        edit.save_pretrained(folder)
    image_path, image = input_image(tmp_path)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(image=image, num_inference_steps=STEPS, guidance_scale=7.0, image_guidance_scale=1.7, latents=noise)
    ref = reference(edit, "make it snowy", **run)
    ours = sample(tmp_path, folder, "--prompt", "make it snowy", "--image", str(image_path), "--steps", str(STEPS),
                  "--guidance-scale", "7", "--image-guidance-scale", "1.7", "--latents", str(path),
                  "--scheduler", "euler")
    assert_parity(ours, ref)
    if kind == "cosxl_edit":
        assert_effect("is_cosxl_edit", ref, reference(euler, "make it snowy", **run))
    else:
        assert_effect("--image-guidance-scale 1.7 (against 1.5)", ref,
                      reference(edit, "make it snowy", **{**run, "image_guidance_scale": 1.5}))


def test_png_metadata_and_no_overwrite(tiny, tmp_path):
    _, folder = tiny("sd15")
    args = ["--prompt", "a kite", "--steps", "2", "--seed", "7", "--height", "64", "--width", "64"]
    run_cli(tmp_path, folder, *args)
    png = next((tmp_path / "out").glob("*.png"))
    meta = json.loads(Image.open(png).text["sdx"])
    assert meta["prompt"] == "a kite" and meta["seed"] == 7 and meta["steps"] == 2 and meta["size"] == "64x64"
    assert "Steps: 2" in Image.open(png).text["parameters"]
    before = png.read_bytes()
    argv = ["--model", str(folder), "--output", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--quiet", *args]
    assert main(argv) == 2  # exists, no --overwrite
    assert png.read_bytes() == before
