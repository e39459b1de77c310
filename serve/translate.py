"""An A1111 request body -> the `pipelines.request.Request` the sampling command would make of the same settings.

The body becomes the command's flags (a namespace of `python -m sdx.sample`'s own defaults with the body's
values set) and its decoded pictures, and `pipelines.cli`'s own request-building turns them into the request, so
the server's image is the command's for the same settings and a bad value gets the command's words. On the way:

- a field sdx cannot honour is refused naming it (`NEUTRAL`), except at its neutral value, which clients send on
  every call (webuiapi: enable_hr false, restore_faces false, tiling false, subseed_strength 0, s_churn 0, eta 1);
- seed -1 is a random seed; image j of a request seeded s is seeded s + j (`info`'s all_seeds);
- prompts are read as A1111 reads them: its weighting syntax, long prompts in 75-token chunks; an empty negative
  prompt is no negative prompt (for SDXL, zeros, as the command without --negative-prompt);
- A1111's clip skip N (CLIP_stop_at_last_layers) is sdx's --clip-skip N - 1;
- img2img: resize_mode 0 (Lanczos to the size), 1 (crop) or 2 (fill); a mask is repainted with the command's
  --mask-blur and, as A1111 always does, the kept pixels pasted back (--apply-overlay), or with inpaint_full_res a
  crop around the mask generated at the size and pasted back (--padding-mask-crop); inpainting_fill 1
  ("original") is sdx's way;
- LoRAs are merged at start (--lora): a prompt's `<lora:NAME:W>` is taken off when NAME is merged at W, refused
  otherwise;
- the limits (`Limits`) of the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import re
from collections.abc import Callable

import numpy as np

from serve import controlnet, images, samplers
from serve.bodies import Generation, Img2Img
from serve.infotext import Shown
from sdx.errors import SdxError


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask for (`python -m sdx.serve`'s --max-* flags)."""

    max_pixels: int = 8 * 1024 * 1024  # width x height x images
    max_steps: int = 150
    max_prompt_length: int = 20_000  # characters
    max_image_pixels: int = 4096 * 4096  # of a picture sent in (decompression bombs)
    max_body_bytes: int = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Planned:
    """A body made ready to run: the completed request, the pipeline that runs it (the model with the request's
    sampler), what the infotext shows, every image's seed, and `finish`, (N, H, W, 3) uint8 generated -> the
    pictures answered (a crop pasted back, or the kept pixels put back over an inpainting)."""

    request: object
    pipeline: object
    shown: Shown
    seeds: list[int]
    sampler_name: str
    finish: Callable[[np.ndarray], np.ndarray]


# field: (its neutral values, what sdx does instead)
NEUTRAL = {
    "enable_hr": ((False,), "sdx has no hires fix; ask for the size you want"),
    "restore_faces": ((None, False), "sdx has no face restoration"),
    "tiling": ((None, False), "sdx does not tile"),
    "subseed_strength": ((0,), "sdx has no variation seeds"),
    "s_churn": ((None, 0), "sdx's samplers have no churn"),
    "s_tmin": ((None, 0), "sdx's samplers have no churn"),
    "s_tmax": ((None, 0, math.inf), "sdx's samplers have no churn"),
    "s_noise": ((None, 1), "sdx's samplers add their noise at scale 1"),
    "s_min_uncond": ((None, 0), "sdx always runs the negative prompt"),
    "refiner_checkpoint": ((None, "", "None"), "this server runs one model"),
    "firstpass_image": ((None, ""), "sdx has no hires fix"),
    "script_name": ((None, ""), "this server has no scripts"),
    "infotext": ((None, ""), "send the settings as fields"),
    "initial_noise_multiplier": ((None, 1), "sdx's noise is not scaled"),
    "mask_round": ((True,), "sdx binarises the mask at 0.5"),
    "latent_mask": ((None, ""), "sdx repaints where the mask says"),
}
_EXTRA_NETWORK = re.compile(r"<(\w+):([^:>]+)(?::([^:>]*))?(?::[^>]*)?>")


def plan(body: Generation, served, limits: Limits, template: argparse.Namespace) -> Planned:
    """What `body` asks of `served` (`serve.model.Served`), or an SdxError naming the field. template: the
    sampling command's flags at their defaults."""
    from pipelines import sampling_cli
    from pipelines.cli import Job, read_flags
    from pipelines.conditioning_cli import ControlNetFlags
    from pipelines.cli import job_request
    from sdx.schedulers import from_name

    img2img = isinstance(body, Img2Img)
    _check_neutral(body)
    _check_limits(body, limits)
    choice = samplers.choose(body.sampler_name or body.sampler_index, body.scheduler)
    clip_stop = served.check_settings(body.override_settings or {}, "override_settings").get(
        "CLIP_stop_at_last_layers", served.clip_stop)
    seed = random.randrange(2**32 - 1) if body.seed == -1 else body.seed
    n = body.batch_size * body.n_iter
    size = (body.height, body.width)
    args = argparse.Namespace(**vars(template))
    args.prompt = [_without_loras(body.prompt, "prompt", served.loras)]
    negative = _without_loras(body.negative_prompt or "", "negative_prompt", served.loras)
    args.negative_prompt = [negative] if negative else None
    vars(args).update(steps=body.steps, guidance_scale=body.cfg_scale, height=body.height, width=body.width,
                      num_images=n, batch_size=body.batch_size, seed=seed, scheduler=choice.sdx,
                      clip_skip=clip_stop - 1 or None, long_prompt="chunk", prompt_syntax="a1111",
                      model=served.title)
    scheduler = from_name(choice.sdx, served.scheduler_config)
    args.eta = _eta(body.eta, scheduler)
    units = controlnet.units(body.alwayson_scripts, served.controlnets, size, limits.max_image_pixels)
    pipe = served.pipeline if units else served.plain
    job = Job(args, [])
    given = {}
    if units:
        given[ControlNetFlags.title] = _set_controls(args, units, served, size)
    finish = lambda pixels: pixels
    if img2img:
        finish = _set_image(body, args, job, pipe.family.pix2pix, size, limits)
    sampling_cli.check(args)
    job.read = read_flags(args, given)
    pipe = sampling_cli.configured(args, dataclasses.replace(pipe, scheduler=scheduler))
    request, crop = job_request(job, pipe)
    if crop is not None:
        finish = lambda pixels: np.stack([crop.paste(p) for p in pixels])
    shown = Shown(
        prompt=args.prompt[0], negative_prompt=negative, steps=body.steps, sampler=choice.label,
        schedule=choice.schedule, cfg_scale=body.cfg_scale,
        image_cfg_scale=request.image_guidance_scale if img2img and pipe.family.pix2pix else None,
        width=body.width, height=body.height, model=served.title, vae=served.vae,
        denoising_strength=body.denoising_strength if img2img and not pipe.family.pix2pix else None,
        clip_skip=clip_stop if clip_stop > 1 else None, mask_blur=int(args.mask_blur) if args.mask else None,
        extra=tuple(u.infotext(served.controlnets[u.net]) for u in units))
    return Planned(request, pipe, shown, [seed + j for j in range(n)], choice.label, finish)


def _check_neutral(body: Generation) -> None:
    for field, (neutral, instead) in NEUTRAL.items():
        value = getattr(body, field, None)
        if field in type(body).model_fields and value not in neutral:
            raise SdxError(f"{field} {value!r}: {instead}")
    if body.styles:
        raise SdxError(f"styles {body.styles!r}: this server has no prompt styles")
    for field in ("seed_resize_from_h", "seed_resize_from_w"):
        if getattr(body, field) > 0:
            raise SdxError(f"{field} {getattr(body, field)}: sdx has no seed resize")


def _check_limits(body: Generation, limits: Limits) -> None:
    for field in ("steps", "batch_size", "n_iter", "width", "height"):
        value = getattr(body, field)
        if value < 1:
            raise SdxError(f"{field} {value} must be a positive integer")
    if body.steps > limits.max_steps:
        raise SdxError(f"steps {body.steps}: more than this server's --max-steps {limits.max_steps}")
    pixels = body.width * body.height * body.batch_size * body.n_iter
    if pixels > limits.max_pixels:
        raise SdxError(f"width x height x batch_size x n_iter = {body.width}x{body.height}x{body.batch_size}x"
                       f"{body.n_iter} = {pixels} pixels: more than this server's --max-pixels {limits.max_pixels}")
    for field in ("prompt", "negative_prompt"):
        text = getattr(body, field) or ""
        if len(text) > limits.max_prompt_length:
            raise SdxError(f"{field}: {len(text)} characters, more than this server's --max-prompt-length "
                           f"{limits.max_prompt_length}")
    if body.seed < -1 or body.seed + body.batch_size * body.n_iter >= 2**63:
        raise SdxError(f"seed {body.seed}: -1 (a random seed) or a number from 0 to 2**63 - 1")


def _without_loras(text: str, field: str, loras: tuple[tuple[str, float], ...]) -> str:
    """`text` without its extra-network tags, each of which must be a LoRA merged at start at its scale."""
    merged = dict(loras)
    for tag in _EXTRA_NETWORK.finditer(text):
        kind, name, weight = tag.groups()
        try:
            scale = float(weight) if weight else 1.0
        except ValueError:
            scale = None
        if kind not in ("lora", "lyco") or name not in merged or scale != merged[name]:
            have = ", ".join(f"<lora:{n}:{s}>" for n, s in loras) or "none"
            raise SdxError(f"{field}: {tag.group(0)}: this server merged its LoRAs at start (--lora): {have}")
    return _EXTRA_NETWORK.sub("", text).strip()


def _eta(eta: float | None, scheduler) -> float | None:
    """The --eta for A1111's `eta`: the sampler's own (DDIM's eta, TCD's gamma), else only A1111's neutral 1."""
    if eta is None or "eta" in {f.name for f in dataclasses.fields(scheduler)}:
        return eta
    if eta != samplers.ETA_NEUTRAL:
        raise SdxError(f"eta {eta}: {type(scheduler).__name__} has no eta (DDIM's eta and TCD's gamma have one)")
    return None


def _set_controls(args: argparse.Namespace, units: list, served, size: tuple[int, int]) -> list:
    """The units as --controlnet flags; returns their pictures. A ControlNet no unit uses acts at weight 0 (a black
    map)."""
    from PIL import Image

    by_net = {u.net: u for u in units}
    blank = controlnet.Unit(-1, Image.new("RGB", (size[1], size[0])), 0.0, 0.0, 1.0)
    chosen = [by_net.get(k, blank) for k in range(len(served.controlnets))]
    args.controlnet = list(served.controlnets)
    args.control_image = [f"alwayson_scripts.controlnet unit {k}" for k in range(len(chosen))]
    args.controlnet_conditioning_scale = [u.weight for u in chosen]
    args.control_guidance_start = [u.start for u in chosen]
    args.control_guidance_end = [u.end for u in chosen]
    return [u.picture for u in chosen]


def _set_image(body: Img2Img, args: argparse.Namespace, job, pix2pix: bool, size: tuple[int, int],
               limits: Limits) -> Callable[[np.ndarray], np.ndarray]:
    """The init image and mask as --image, --mask and their flags; returns what puts the kept pixels back."""
    from PIL import ImageOps

    from pipelines.masks import overlaid

    if not body.init_images:
        raise SdxError("init_images: give the image to start from, as base64 or a data URI")
    if len(body.init_images) > 1:
        raise SdxError(f"init_images: {len(body.init_images)} images; sdx starts a request's images from one")
    picture = _resized(images.decode(body.init_images[0], "init_images[0]", limits.max_image_pixels),
                       body.resize_mode, size)
    args.image, job.picture = "init_images[0]", picture
    if pix2pix:
        if body.denoising_strength != 1.0:
            raise SdxError(f"denoising_strength {body.denoising_strength}: an InstructPix2Pix model edits from "
                           "noise, as diffusers' pipeline does; send 1.0")
        args.image_guidance_scale = 1.5 if body.image_cfg_scale is None else body.image_cfg_scale
    else:
        if not 0.0 <= body.denoising_strength <= 1.0:
            raise SdxError(f"denoising_strength {body.denoising_strength} must be in [0, 1] (the share of the "
                           "steps that run)")
        args.strength = body.denoising_strength
    if not body.mask:
        return lambda pixels: pixels
    if body.mask_blur is None and body.mask_blur_x != body.mask_blur_y:
        raise SdxError(f"mask_blur_x {body.mask_blur_x}, mask_blur_y {body.mask_blur_y}: sdx blurs a mask alike "
                       "in both directions; send mask_blur")
    blur = body.mask_blur if body.mask_blur is not None else body.mask_blur_x
    if blur < 0:
        raise SdxError(f"mask_blur {blur} must be >= 0 (a blur radius in pixels)")
    if body.inpainting_fill != 1:
        raise SdxError(f"inpainting_fill {body.inpainting_fill}: sdx starts from the image under the mask "
                       "(inpainting_fill 1, original)")
    mask = images.decode(body.mask, "mask", limits.max_image_pixels)
    if body.inpainting_mask_invert:
        mask = ImageOps.invert(mask)
    args.mask, args.mask_blur = "mask", float(blur)
    if body.inpaint_full_res:
        if body.inpaint_full_res_padding < 0:
            raise SdxError(f"inpaint_full_res_padding {body.inpaint_full_res_padding}: a number of pixels >= 0")
        args.padding_mask_crop = body.inpaint_full_res_padding
        job.mask = mask
        return lambda pixels: pixels  # the crop is pasted back (`plan`)
    job.mask = _resized(mask, body.resize_mode, size)
    return lambda pixels: np.stack([overlaid(p, picture, job.mask, float(blur)) for p in pixels])


def _resized(picture, mode: int, size: tuple[int, int]):
    """`picture` as A1111's resize_mode fits it to `size` = (H, W): 0 as it is (the command resizes it to the
    size, Lanczos), 1 cropped to cover the size, 2 fitted inside with its edges stretched over the margins."""
    from PIL import Image, ImageOps

    from pipelines.masks import resize_fill

    if mode == 0 or (picture.height, picture.width) == size:
        return picture
    if mode == 1:
        return ImageOps.fit(picture, (size[1], size[0]), Image.LANCZOS)
    if mode == 2:
        return resize_fill(picture, size)
    raise SdxError(f"resize_mode {mode}: 0 (just resize), 1 (crop and resize) or 2 (resize and fill); sdx resizes "
                   "pictures, not latents")
