"""A generation request as a user states it, and its translation into sampler batches.

Image order follows diffusers: every prompt's images together, [p0, p0, p1, p1] for two images per
prompt. Image j's key is `fold_in(PRNGKey(seed), j)` and everything random about image j comes from it
(its initial noise is `normal(key)`; see `pipelines.sampler` for the rest), so an image does not change
with the batch size; `latents` replaces the initial noise with given noise (diffusers' `latents=`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from collections.abc import Callable

from pipelines import guidance, sampler, text
from pipelines.family import Family
from pipelines.plugin import Batch, Input
from pipelines.sampler import START_IMAGE, START_LATENTS, START_NOISE, Inputs, Plan
from sdx import interventions as interventions_lib
from sdx.errors import SdxError
from sdx.interventions import Intervention
from sdx.schedulers import Scheduler, denoising_range


@dataclasses.dataclass
class Request:
    """What to generate. Sizes in pixels; `image` (N, H, W, 3) float32 in [-1, 1] with N = 1 or one per
    prompt; `mask` (N, H, W, 1) float32, 1.0 where the image is repainted (`pipelines.masks.fit_mask`),
    for inpainting; `latents` (images, h, w, C) float32 initial noise in sdx layout (NHWC), before the
    scheduler's init_noise_sigma; `init_latents` (images, h, w, C) to continue (refiner hand-over);
    `conditioning`: the conditioning plug-ins' inputs (`pipelines.plugin.Input`), each matched in order to the
    pipeline's models of its kind: a `pipelines.control.Control` per ControlNet, a
    `pipelines.t2i_adapter.AdapterImage` per T2I-Adapter, a `pipelines.image_prompt.ImagePrompt` per
    IP-Adapter; `prompt_syntax`: how prompts give words weights,
    "a1111" (`(word:1.3)`, `[word]`, `BREAK`), "compel" (`word++`, `(words)0.8`, `.and()`) or "none"
    (`pipelines.text`, `sdx.prompt_syntax`)."""

    prompts: Sequence[str]
    height: int | None = None  # None: `Pipeline.complete` chooses, as the command does
    width: int | None = None
    steps: int = 30
    prompts_2: Sequence[str] | None = None
    negative_prompts: Sequence[str] | None = None
    negative_prompts_2: Sequence[str] | None = None
    num_images_per_prompt: int = 1
    batch_size: int | None = None
    seed: int = 0
    guidance_scale: float | None = None  # None: the model's own (`Family.guidance_scale`)
    image_guidance_scale: float = 1.5
    guidance_rescale: float = 0.0
    strength: float | None = None  # None: diffusers' default for the pipeline (`Pipeline.complete`)
    denoising_start: float | None = None
    denoising_end: float | None = None
    image: np.ndarray | None = None
    mask: np.ndarray | None = None
    latents: np.ndarray | None = None
    init_latents: np.ndarray | None = None
    original_size: tuple[int, int] | None = None
    crops_coords_top_left: tuple[int, int] = (0, 0)
    target_size: tuple[int, int] | None = None
    negative_original_size: tuple[int, int] | None = None
    negative_crops_coords_top_left: tuple[int, int] | None = None
    negative_target_size: tuple[int, int] | None = None
    aesthetic_score: float = 6.0
    negative_aesthetic_score: float = 2.5
    clip_skip: int | None = None
    long_prompt: str = "truncate"
    prompt_syntax: str = "a1111"
    output_latents: bool = False
    vae_tiling: bool = False
    conditioning: Sequence[Input] = ()
    # research: a guider around the one the scales choose (`pipelines.pag.PerturbedAttention`,
    # `pipelines.sag.SelfAttention`, or one's own `pipelines.guidance.Guidance`), and what to change in the UNet
    # (`sdx.interventions.Intervention`s: `sdx.freeu.FreeU`, `sdx.interventions.At(pattern, processor)`, ...)
    guidance: guidance.Guidance | None = None
    interventions: Sequence[Intervention] = ()

    @property
    def num_images(self) -> int:
        return len(self.prompts) * self.num_images_per_prompt


def per_prompt(values: Sequence[str] | None, n: int, name: str) -> list[str] | None:
    """`values` given once or once per prompt, as one per prompt (None stays None)."""
    if values is None:
        return None
    values = list(values)
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise SdxError(f"{name}: give one value or one per prompt ({n}), not {len(values)}")
    return values


def _time_ids(family: Family, r: Request, negative: bool) -> list[float]:
    size = (r.height, r.width)
    original = r.original_size or size
    crops = r.crops_coords_top_left
    if negative:
        original = r.negative_original_size or original
        crops = r.negative_crops_coords_top_left or crops
    if family.aesthetic:
        return [*original, *crops, r.negative_aesthetic_score if negative else r.aesthetic_score]
    target = r.target_size or size
    if negative:
        target = r.negative_target_size or target
    return [*original, *crops, *target]


def validate(r: Request, family: Family, factor: int, multiple: int, vae=None) -> None:
    """Fail early, in the user's terms, on what the models cannot take (`vae`: the VAE's config, whose tiles
    `vae_tiling` needs to line up; the conditioning inputs are checked by `Pipeline.validate`)."""
    if not r.prompts:
        raise SdxError("give at least one prompt")
    if r.steps < 1:
        raise SdxError(f"--steps {r.steps}: the number of steps must be a positive integer")
    if r.num_images_per_prompt < 1:
        raise SdxError(f"--num-images {r.num_images_per_prompt} must be at least 1")
    if r.batch_size is not None and r.batch_size < 1:
        raise SdxError(f"--batch-size {r.batch_size} must be at least 1")
    for name, v in (("--height", r.height), ("--width", r.width)):
        if v < multiple or v % multiple:
            raise SdxError(f"{name} {v}: this model takes sizes that are positive multiples of {multiple} pixels")
    if family.pix2pix and r.image is None:
        raise SdxError("an InstructPix2Pix model edits an image: pass --image")
    if family.inpaint and (r.image is None or r.mask is None):
        raise SdxError("an inpainting model repaints the masked part of an image: pass --image and --mask")
    if r.mask is not None:
        if r.image is None:
            raise SdxError("--mask marks what to repaint in --image: pass --image too")
        if family.pix2pix:
            raise SdxError("--mask: an InstructPix2Pix model edits the whole image; inpaint with a text-to-image "
                           "or an inpainting model")
        if r.init_latents is not None or r.denoising_start is not None:
            raise SdxError("--mask: inpainting does not continue given latents (no --refiner)")
        if r.mask.shape[0] not in (1, len(r.prompts)) or r.mask.shape[1:] != (*r.image.shape[1:3], 1):
            raise SdxError(f"the mask's shape {r.mask.shape} does not fit the image's {r.image.shape}")
    if r.long_prompt not in ("truncate", "chunk"):
        raise SdxError(f"--long-prompt {r.long_prompt!r}: choose truncate or chunk")
    if r.prompt_syntax not in text.SYNTAXES:
        raise SdxError(f"--prompt-syntax {r.prompt_syntax!r}: choose {', '.join(text.SYNTAXES)}")
    text.check_syntax(r.prompt_syntax, [*r.prompts, *(r.prompts_2 or ()), *(r.negative_prompts or ()),
                                        *(r.negative_prompts_2 or ())])
    if r.clip_skip is not None and r.clip_skip < 0:
        raise SdxError(f"--clip-skip {r.clip_skip} must be >= 0")
    for name, arr, shape in (
        ("--latents", r.latents, (r.height // factor, r.width // factor)),
        ("initial latents", r.init_latents, (r.height // factor, r.width // factor)),
    ):
        if arr is not None and (arr.ndim != 4 or arr.shape[0] not in (1, r.num_images) or arr.shape[2:4] != shape):
            raise SdxError(
                f"{name}: shape {arr.shape} does not fit {r.num_images} image(s) of {r.height}x{r.width} "
                f"(expected (1 or {r.num_images}, channels, {shape[0]}, {shape[1]}) in the diffusers layout)"
            )
    if r.image is not None and r.image.shape[0] not in (1, len(r.prompts)):
        raise SdxError(f"give one input image or one per prompt ({len(r.prompts)}), not {r.image.shape[0]}")
    if r.vae_tiling and vae is not None:
        for decoding in (True, False):
            vae.tiles(decoding)  # an SdxError unless the tiles line up


def batches(
    r: Request, family: Family, tokenizers, scheduler: Scheduler, *, factor: int, channels: int, devices: int = 1,
    plugins: Callable[[Batch], tuple] = lambda batch: (),
) -> list[tuple[Plan, Inputs, int]]:
    """[(plan, inputs, real)]: the request cut into compiled-call batches; `real` is how many of the
    batch's images are wanted (the last batch is padded to the batch size). plugins: the conditioning plug-ins of
    one batch (`Pipeline`'s, from the request's `conditioning`)."""
    n, h, w = r.num_images, r.height // factor, r.width // factor
    batch = -(-(r.batch_size or n) // devices) * devices  # every device gets the same share
    (ids, weights), (neg_ids, neg_weights), weighting = _texts(r, family, tokenizers)
    start = _start(r, family)
    strength = r.strength if start == START_IMAGE and r.denoising_start is None else 1.0
    begin, end = denoising_range(
        scheduler, r.steps, strength=strength, denoising_start=r.denoising_start, denoising_end=r.denoising_end
    )
    guider, guider_values = interventions_lib.split(
        guidance.of_request(family, r.guidance_scale, r.image_guidance_scale, r.guidance))
    asked = [interventions_lib.split(one) for one in r.interventions]
    rows = lambda idx: Batch(lambda a: np.ascontiguousarray(_per_image(r, a)[idx]), batch, r.steps,  # noqa: E731
                             len(scheduler.timesteps(r.steps)), begin, end, r.denoising_end is not None, family)
    plan = Plan(
        family=family, scheduler=scheduler, guidance=guider,
        batch=batch, height=r.height, width=r.width, steps=r.steps, begin=begin, end=end, start=start,
        decode=not r.output_latents, chunks=ids[family.encoders[0]].shape[1], clip_skip=r.clip_skip,
        inpaint=r.mask is not None, blank_rows=jax.default_backend() in sampler.BLANK_ROWS_PLATFORMS,
        vae_tiling=r.vae_tiling, interventions=tuple(static for static, _ in asked), weighting=weighting,
        plugins=tuple(interventions_lib.split(p)[0] for p in plugins(rows(np.arange(batch) % n))),
    )
    state = scheduler.set_timesteps(r.steps, (batch, h, w, channels), begin=begin, end=end)
    arrays = _arrays(r, family, start, (h, w, channels))
    zero_negative = family.force_zeros and r.negative_prompts is None and r.negative_prompts_2 is None
    out = []
    for b0 in range(0, n, batch):
        idx = np.arange(b0, b0 + batch) % n  # the last batch repeats images to fill its slots
        take = lambda a: a if np.shape(a)[0] == 0 else np.ascontiguousarray(np.asarray(a)[idx])  # noqa: E731
        inputs = Inputs(
            ids={k: take(v) for k, v in ids.items()}, negative_ids={k: take(v) for k, v in neg_ids.items()},
            zero_negative=np.full((batch,), zero_negative), state=state, guider=guider_values,
            interventions=tuple(values for _, values in asked),
            prompt_weights=None if weighting.syntax == "none" else jax.tree.map(
                take, {"positive": weights, "negative": neg_weights}),
            plugins=tuple(interventions_lib.split(p)[1] for p in plugins(rows(idx))),
            **{k: jax.tree.map(take, v) for k, v in arrays.items()},
        )
        out.append((plan, inputs, min(batch, n - b0)))
    return out


def _per_image(r: Request, a: np.ndarray) -> np.ndarray:
    """(1 or one per prompt, ...) -> (images, ...): a prompt's value for each of its images."""
    a = np.asarray(a)
    return np.repeat(a if a.shape[0] == len(r.prompts) else np.repeat(a, len(r.prompts), 0), r.num_images_per_prompt,
                     axis=0)


def _texts(r: Request, family: Family, tokenizers) -> tuple:
    """((ids, token weights) of the prompts, of the negative prompts, the weighting), one row per image."""
    per_image = lambda values: [v for v in values for _ in range(r.num_images_per_prompt)]  # noqa: E731
    prompts = [per_image(list(r.prompts))]
    negatives = [per_image(per_prompt(r.negative_prompts, len(r.prompts), "--negative-prompt") or [""] * len(r.prompts))]
    if family.xl and family.encoders == ("text_encoder", "text_encoder_2"):
        prompts.append(per_image(per_prompt(r.prompts_2, len(r.prompts), "--prompt-2") or list(r.prompts)))
        neg2 = per_prompt(r.negative_prompts_2, len(r.prompts), "--negative-prompt-2")
        negatives.append(per_image(neg2) if neg2 else negatives[0])
    (positive, negative), weighting = text.tokenize_weighted(
        family, tokenizers, [prompts, negatives], syntax=r.prompt_syntax, chunk=r.long_prompt == "chunk")
    return positive, negative, weighting


def _arrays(r: Request, family: Family, start: str, latent: tuple[int, int, int]) -> dict:
    """`Inputs`' per-image arrays but the texts, for every image: keys, noise, the input image (or the latents to
    continue), the mask, SDXL's time ids, the guidance scales ((0, 0, 0, 0) for an image or a mask not given)."""
    n, (h, w, channels) = r.num_images, latent
    keys = image_keys(r.seed, n)
    if r.latents is not None:
        noise = np.broadcast_to(r.latents.transpose(0, 2, 3, 1), (n, h, w, r.latents.shape[1]))  # NCHW -> NHWC
    else:
        noise = np.asarray(jax.vmap(lambda k: jax.random.normal(k, (h, w, channels)))(keys))
    none = np.zeros((0, 0, 0, 0), np.float32)
    image = none if r.image is None else _per_image(r, r.image)
    if start == START_LATENTS:
        image = np.broadcast_to(r.init_latents.transpose(0, 2, 3, 1), (n, h, w, r.init_latents.shape[1]))
    time_ids = np.asarray([_time_ids(family, r, False)] * n, np.float32) if family.xl else np.zeros((n, 0), np.float32)
    scales = guidance.Scales(*(np.full((n,), v, np.float32)
                               for v in (r.guidance_scale, r.image_guidance_scale, r.guidance_rescale)))
    return {"keys": keys, "noise": noise.astype(np.float32), "image": image.astype(np.float32),
            "mask": none if r.mask is None else _per_image(r, r.mask).astype(np.float32), "time_ids": time_ids,
            "negative_time_ids": np.asarray([_time_ids(family, r, True)] * n, np.float32) if family.xl else time_ids,
            "scales": scales}


def _start(r: Request, family: Family) -> str:
    """Where the request's latents start: given latents (the refiner), an image (img2img; inpainting below
    strength 1, as diffusers' is_strength_max), or noise."""
    if r.init_latents is not None:
        return START_LATENTS
    if r.image is not None and not family.pix2pix and (r.mask is None or r.strength < 1.0):
        return START_IMAGE
    return START_NOISE


def image_keys(seed: int, n: int) -> np.ndarray:
    """(n, 2) uint32: image j's PRNG key, `fold_in(PRNGKey(seed + j), 0)`: the key of the first image of a request
    seeded seed + j, so that each image of a request is the one its own seed gives alone (A1111's all_seeds).
    Seeds count modulo 2**32, as `jax.random.PRNGKey` reads them."""
    seeds = (np.int64(seed) + np.arange(n)) % 2**32
    return np.asarray(jax.vmap(lambda s: jax.random.fold_in(jax.random.PRNGKey(s), 0))(seeds.astype(np.uint32)))
