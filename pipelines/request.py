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
import jax.numpy as jnp
import numpy as np

from pipelines import control, guidance, sampler, t2i_adapter, text
from pipelines.control import Control
from pipelines.image_prompt import ImagePrompt
from pipelines.t2i_adapter import AdapterImage
from pipelines.family import Family
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
    `controls`: one `Control` per ControlNet of the pipeline, in order; `guess_mode`: diffusers' (see
    `pipelines.control`); `image_prompt`: the IP-Adapter's image and scale (`pipelines.image_prompt`);
    `adapters`: one `AdapterImage` per T2I-Adapter of the pipeline, in order, acting in the first
    `adapter_factor` of the steps (`pipelines.t2i_adapter`); `prompt_syntax`: how prompts give words weights,
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
    guidance_scale: float | None = None  # None: 5.0 for SDXL, else 7.5
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
    controls: Sequence[Control] = ()
    guess_mode: bool = False
    image_prompt: ImagePrompt | None = None
    adapters: Sequence[AdapterImage] = ()
    adapter_factor: float = 1.0
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


def validate(r: Request, family: Family, factor: int, multiple: int, controlnets: int = 0, vae=None,
             ip_adapter: bool = False, adapters: Sequence = ()) -> None:
    """Fail early, in the user's terms, on what the models cannot take (`controlnets`: the pipeline's; `vae`:
    its VAE's config, whose tiles `vae_tiling` needs to line up; `ip_adapter`: whether it has one; `adapters`:
    its T2I-Adapters' configs)."""
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
    _validate_controls(r, family, controlnets)
    _validate_image_prompt(r, ip_adapter)
    _validate_adapters(r, family, adapters)


def _validate_adapters(r: Request, family: Family, adapters: Sequence) -> None:
    t2i_adapter.check_request(r.adapters, adapters, len(r.prompts), r.height, r.width)
    if not r.adapters:
        return
    if family.pix2pix:
        raise SdxError("--t2i-adapter: T2I-Adapters guide text-to-image, img2img and inpainting models, not InstructPix2Pix")
    if r.init_latents is not None or r.denoising_start is not None:
        raise SdxError("--t2i-adapter does not continue given latents (no --refiner)")
    if not 0.0 <= r.adapter_factor <= 1.0:
        raise SdxError(f"--t2i-adapter-factor {r.adapter_factor}: the share of the steps the adapters act in, from 0 to 1")


def _validate_image_prompt(r: Request, ip_adapter: bool) -> None:
    if ip_adapter and r.image_prompt is None:
        raise SdxError("--ip-adapter: give the image it reads, --ip-adapter-image")
    if r.image_prompt is not None and not ip_adapter:
        raise SdxError("--ip-adapter-image: this pipeline has no IP-Adapter (pass --ip-adapter)")
    if r.image_prompt is not None and r.image_prompt.pixels.shape[0] not in (1, len(r.prompts)):
        raise SdxError(f"give one --ip-adapter-image or one per prompt ({len(r.prompts)}), not "
                       f"{r.image_prompt.pixels.shape[0]}")


def _validate_controls(r: Request, family: Family, controlnets: int) -> None:
    if len(r.controls) != controlnets:
        raise SdxError(f"give one --control-image per --controlnet ({controlnets}), not {len(r.controls)}")
    if not r.controls:
        return
    if family.pix2pix:
        raise SdxError("--controlnet: ControlNets guide text-to-image, img2img and inpainting models, not InstructPix2Pix")
    if r.init_latents is not None or r.denoising_start is not None:
        raise SdxError("--controlnet does not continue given latents (no --refiner)")
    for c in r.controls:
        control.check_window(c.start, c.end)
        if c.image.ndim != 4 or c.image.shape[0] not in (1, len(r.prompts)) or c.image.shape[1:3] != (r.height, r.width):
            raise SdxError(f"the control image's shape {c.image.shape} does not fit {len(r.prompts)} prompt(s) at "
                           f"{r.height}x{r.width}")


def batches(
    r: Request, family: Family, tokenizers, scheduler: Scheduler, *, factor: int, channels: int, devices: int = 1,
    ip_scales: np.ndarray | None = None,
) -> list[tuple[Plan, Inputs, int]]:
    """[(plan, inputs, real)]: the request cut into compiled-call batches; `real` is how many of the
    batch's images are wanted (the last batch is padded to the batch size). ip_scales: with an image prompt,
    its scale for each cross-attention of the UNet (`ImagePrompt.per_attention`)."""
    n, h, w = r.num_images, r.height // factor, r.width // factor
    batch = r.batch_size or n
    batch = -(-batch // devices) * devices  # every device gets the same share
    per_image = lambda values: [v for v in values for _ in range(r.num_images_per_prompt)]

    prompts = [per_image(list(r.prompts))]
    negatives = [per_image(per_prompt(r.negative_prompts, len(r.prompts), "--negative-prompt") or [""] * len(r.prompts))]
    if family.xl and family.encoders == ("text_encoder", "text_encoder_2"):
        prompts.append(per_image(per_prompt(r.prompts_2, len(r.prompts), "--prompt-2") or list(r.prompts)))
        neg2 = per_prompt(r.negative_prompts_2, len(r.prompts), "--negative-prompt-2")
        negatives.append(per_image(neg2) if neg2 else negatives[0])
    zero_negative = family.force_zeros and r.negative_prompts is None and r.negative_prompts_2 is None
    ((ids, weights), (neg_ids, neg_weights)), weighting = text.tokenize_weighted(
        family, tokenizers, [prompts, negatives], syntax=r.prompt_syntax, chunk=r.long_prompt == "chunk")

    start = START_NOISE
    if r.init_latents is not None:
        start = START_LATENTS
    elif r.image is not None and not family.pix2pix and (r.mask is None or r.strength < 1.0):
        start = START_IMAGE  # inpainting at strength 1 starts from pure noise, as diffusers' is_strength_max
    strength = r.strength if start == START_IMAGE and r.denoising_start is None else 1.0
    begin, end = denoising_range(
        scheduler, r.steps, strength=strength, denoising_start=r.denoising_start, denoising_end=r.denoising_end
    )
    guider, guider_values = interventions_lib.split(
        guidance.of_request(family, r.guidance_scale, r.image_guidance_scale, r.guidance))
    asked = [interventions_lib.split(one) for one in r.interventions]
    plan = Plan(
        family=family, scheduler=scheduler, guidance=guider,
        batch=batch, height=r.height, width=r.width, steps=r.steps, begin=begin, end=end, start=start,
        decode=not r.output_latents, chunks=ids[family.encoders[0]].shape[1], clip_skip=r.clip_skip,
        inpaint=r.mask is not None, controlnets=len(r.controls), guess_mode=r.guess_mode and bool(r.controls),
        image_prompt=r.image_prompt is not None, t2i_adapters=len(r.adapters),
        blank_rows=jax.default_backend() in sampler.BLANK_ROWS_PLATFORMS, vae_tiling=r.vae_tiling,
        interventions=tuple(static for static, _ in asked), weighting=weighting,
    )
    state = scheduler.set_timesteps(r.steps, (batch, h, w, channels), begin=begin, end=end)

    base_key = jax.random.PRNGKey(r.seed)
    keys = jax.vmap(lambda j: jax.random.fold_in(base_key, j))(jnp.arange(n))  # (n, 2): image j's key
    if r.latents is not None:
        noise_all = np.broadcast_to(r.latents.transpose(0, 2, 3, 1), (n, h, w, r.latents.shape[1]))  # NCHW -> NHWC
    else:
        noise_all = np.asarray(jax.vmap(lambda k: jax.random.normal(k, (h, w, channels)))(keys))
    per_image_array = lambda a: np.repeat(a if a.shape[0] == len(r.prompts) else np.repeat(a, len(r.prompts), 0),
                                          r.num_images_per_prompt, axis=0)  # (1 or prompts, ...) -> (n, ...)
    image_all = mask_all = None
    if start == START_LATENTS:
        image_all = np.broadcast_to(r.init_latents.transpose(0, 2, 3, 1), (n, h, w, r.init_latents.shape[1]))
    elif r.image is not None:
        image_all = per_image_array(r.image)
    if r.mask is not None:
        mask_all = per_image_array(r.mask)
    control_all = [per_image_array(c.image) for c in r.controls]
    ip_all = None if r.image_prompt is None else per_image_array(r.image_prompt.pixels)
    ip_scale = np.zeros((0,), np.float32) if ip_scales is None else np.asarray(ip_scales, np.float32)
    total_calls = len(scheduler.timesteps(r.steps))
    control_scales = control.scales_per_call(r.controls, total_calls, begin, end)
    adapter_all = [per_image_array(a.image) for a in r.adapters]
    adapter_scales = np.asarray([a.scale for a in r.adapters], np.float32)
    # N of `t2i_adapter.gates`: SDXL's pipeline counts the steps, SD's acts at every model call (PNDM makes one more)
    adapter_gates = t2i_adapter.gates(r.adapter_factor, r.steps if family.xl else total_calls, begin, end,
                                      cut=r.denoising_end is not None)

    time_ids = np.asarray([_time_ids(family, r, False)] * n, np.float32) if family.xl else np.zeros((n, 0), np.float32)
    neg_time_ids = np.asarray([_time_ids(family, r, True)] * n, np.float32) if family.xl else time_ids
    scales = guidance.Scales(*(np.float32(v) for v in (r.guidance_scale, r.image_guidance_scale, r.guidance_rescale)))

    out = []
    for b0 in range(0, n, batch):
        idx = np.arange(b0, b0 + batch) % n  # the last batch repeats images to fill its slots
        take = lambda a: np.ascontiguousarray(np.asarray(a)[idx])
        inputs = Inputs(
            ids={k: take(v) for k, v in ids.items()},
            negative_ids={k: take(v) for k, v in neg_ids.items()},
            zero_negative=np.full((batch,), zero_negative),
            noise=take(noise_all).astype(np.float32),
            keys=take(keys),
            scales=scales,
            time_ids=take(time_ids),
            negative_time_ids=take(neg_time_ids),
            image=take(image_all).astype(np.float32) if image_all is not None else np.zeros((0, 0, 0, 0), np.float32),
            mask=take(mask_all).astype(np.float32) if mask_all is not None else np.zeros((0, 0, 0, 0), np.float32),
            control=tuple(take(a).astype(np.float32) for a in control_all),
            control_scales=control_scales,
            ip_image=take(ip_all).astype(np.float32) if ip_all is not None else np.zeros((0, 0, 0, 0), np.float32),
            ip_scale=ip_scale,
            adapter=tuple(take(a).astype(np.float32) for a in adapter_all),
            adapter_scales=adapter_scales,
            adapter_gates=adapter_gates,
            state=state,
            guider=guider_values,
            interventions=tuple(values for _, values in asked),
            prompt_weights=None if weighting.syntax == "none" else jax.tree.map(
                take, {"positive": weights, "negative": neg_weights}),
        )
        out.append((plan, inputs, min(batch, n - b0)))
    return out
