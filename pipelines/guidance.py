"""Guidance: which branches one batched UNet call evaluates, and how their outputs become one prediction.

Three kinds, picked per request by `choose` (a kind is static: a new one compiles anew):

- `Unguided`: the text branch alone (guidance_scale <= 1, as diffusers);
- `ClassifierFree` (Ho & Salimans 2022): [negative, text];
- `InstructPix2Pix` (Brooks et al. 2023): [text + image, negative + image, negative + no image].

More are guiders of their own files that wrap the chosen one (`Guidance.around`): Perturbed-Attention
Guidance (`pipelines.pag`, a branch whose self-attentions are perturbed) and Self-Attention Guidance
(`pipelines.sag`, a second model call on blurred latents). A guider is an `sdx.interventions.Intervention`:
it may place attention processors on the UNet (`install`), its fields named in `traced` are inputs of the
compiled programs (a new PAG scale compiles nothing), and `predict` is its whole model call.

Each owns the UNet batch layout: branch k of image j is row j * branches + k (image-major), so when
the batch is split over a mesh an image's branches stay on the device that holds the image, and the
guidance combination needs no communication.

The negative branch without a negative prompt is the null conditioning (`null_conditioning`): zeros
for SDXL models with force_zeros_for_empty_prompt, else the encoding of "". Training's conditioning
dropout swaps in the same. Zeros let the UNet skip those rows' cross-attentions (`Guidance.blank_rows`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from pipelines import text
from pipelines.family import Family
from sdx import interventions
from sdx.errors import SdxError
from sdx.interventions import Intervention
from sdx.layers import BlankRows


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Conditioning:
    """What the UNet is conditioned on, batch first: context (B, S, D); pooled (B, P), SDXL's pooled text
    embedding, or None; time_ids (B, N), SDXL's micro-conditioning ((B, 0) otherwise); image (B, h, w, K):
    channels concatenated to the UNet's input (InstructPix2Pix's image latents, or an inpainting model's
    mask and masked-image latents), or None."""

    context: jax.Array
    pooled: jax.Array | None
    time_ids: jax.Array
    image: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Scales:
    """(B,) float32, one per image, traced: guidance_scale, image_guidance_scale (InstructPix2Pix), guidance_rescale
    phi; `of` shapes one to scale each image of a (B, ...) array."""

    text: jax.Array
    image: jax.Array
    rescale: jax.Array

    def of(self, name: str, like: jax.Array) -> jax.Array:
        """Scale `name` as (B, 1, ...) in float32, to broadcast over `like` (B, ...)."""
        return getattr(self, name).astype(jnp.float32).reshape(-1, *[1] * (like.ndim - 1))


def interleave(*branches):
    """n branches of B rows (Conditionings or arrays) -> one batch of B * n rows, row j * n + k being branch k
    of image j."""
    n = len(branches)
    return jax.tree.map(lambda *xs: jnp.stack(xs, axis=1).reshape(xs[0].shape[0] * n, *xs[0].shape[1:]), *branches)  # (B*n, ...)


def deinterleave(batch, n: int) -> list:
    """The inverse of `interleave`: a batch (an array or a Conditioning) of B * n rows -> its n branches of B."""
    group = lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:])  # (B, n, ...)
    return [jax.tree.map(lambda a, k=k: group(a)[:, k], batch) for k in range(n)]


def branch_rows(batch, n: int, branches: tuple[int, ...]):
    """The rows of `branches` of a batch of n branches (a Conditioning or an array of B * n rows) -> B *
    len(branches) rows, image-major."""
    def pick(a):
        rows = a.shape[0] // n * len(branches)
        return a.reshape(a.shape[0] // n, n, *a.shape[1:])[:, list(branches)].reshape(rows, *a.shape[1:])

    return jax.tree.map(pick, batch)


@dataclasses.dataclass(frozen=True)
class Step:
    """One model call of the sampler as a guider sees it (made while the denoise program is traced).

    model(x_in, branches=None): the UNet's output, float32, for x_in the guidance batch's input (`model_input`'s
    rows), or with `branches` for those branches' rows alone (x_in of B * len(branches) rows, none shared);
    latents (B, h, w, C) float32: the sample before the scheduler scales it; model_input: `model_input` of the
    scaled latents; timestep (); state, scheduler: the scheduler's; scales: the request's `Scales`."""

    model: Callable[..., jax.Array]
    latents: jax.Array
    model_input: jax.Array
    timestep: jax.Array
    state: Any
    scheduler: Any
    scales: Scales


@dataclasses.dataclass(frozen=True)
class Guidance(Intervention):
    """The base: `conditioning` stacks the branches into the UNet batch, `model_input` stacks the
    latents the same way, `combine` turns the UNet's output back into one prediction per image, and
    `predict` is the whole of one model call (the UNet on the batch, then `combine`)."""

    branches: ClassVar[int] = 1
    negative_branches: ClassVar[tuple[int, ...]] = ()  # the branches that read the negative prompt's text
    per_row: ClassVar[bool] = False

    @property
    def text_branch(self) -> int:
        """The branch that reads the prompt alone (no image channels taken away): the last by default."""
        return self.branches - 1

    def around(self, chosen: Guidance) -> Guidance:
        """The guider a request runs when it asks for this one and its scales pick `chosen` (`choose`): this
        one; a guider that wraps another (PAG, SAG) takes `chosen` as its inner one."""
        return self

    def predict(self, step: Step) -> jax.Array:
        """The prediction (B, h, w, C) float32 of one model call."""
        return self.combine(step.model(step.model_input), step.scales)

    def conditioning(self, text: Conditioning, negative: Conditioning | None) -> Conditioning:
        raise NotImplementedError

    def by_branch(self, positive, negative):
        """The UNet batch's rows of per-image values (arrays or pytrees of B rows): `negative`'s in the branches
        that read the negative prompt, `positive`'s in the others -> B * branches rows, image-major."""
        return interleave(*[negative if k in self.negative_branches else positive for k in range(self.branches)])

    def blank_rows(self, family: Family) -> BlankRows | None:
        """The UNet batch's rows whose text is zeros when no negative prompt is given (SDXL's
        force_zeros_for_empty_prompt), for `UNet2DConditionModel.text_context`; None where none can be."""
        if not (family.force_zeros and self.negative_branches):
            return None
        return BlankRows(self.branches, self.negative_branches)

    def shared(self, family: Family) -> int:
        """How many consecutive rows of the UNet batch take the same input (latents, image channels and
        timestep), so that the UNet runs what comes before its first text-reading attention once for them
        (`UNet2DConditionModel.__call__`): 1 unless a subclass says otherwise."""
        return 1

    def model_input(self, latents: jax.Array, cond: Conditioning, shared: int) -> jax.Array:
        """latents (B, h, w, C) -> (B * branches / shared, h, w, C + K), with `cond.image`'s K channels
        appended (the first of each `shared` rows: the same in all of them, see `shared`)."""
        x = jnp.repeat(latents, self.branches // shared, axis=0)  # (B*n/shared, h, w, C), image-major like `cond`
        return x if cond.image is None else jnp.concatenate([x, cond.image[::shared].astype(x.dtype)], axis=-1)

    def combine(self, out: jax.Array, scales: Scales) -> jax.Array:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Unguided(Guidance):
    branches: ClassVar[int] = 1

    def conditioning(self, text, negative):
        return text

    def combine(self, out, scales):
        return out


@dataclasses.dataclass(frozen=True)
class ClassifierFree(Guidance):
    """uncond + g * (text - uncond), then `rescale`."""

    branches: ClassVar[int] = 2
    negative_branches: ClassVar[tuple[int, ...]] = (0,)

    def conditioning(self, text, negative):
        return interleave(negative, text)

    def shared(self, family):
        """Both branches, unless the time embedding reads the pooled text (SDXL): an inpainting model's
        image channels are the same in both (`pipelines.sampler`), and InstructPix2Pix never guides this way."""
        return 1 if family.xl else self.branches

    def combine(self, out, scales):
        uncond, cond = deinterleave(out, 2)
        return rescale(uncond + scales.of("text", cond) * (cond - uncond), cond, scales.of("rescale", cond))


class Around(Guidance):
    """The base of a guider that adds to the one a request's scales choose, `Unguided` or `ClassifierFree`
    (PAG, SAG): a subclass has the field `inner`, None until `around` sets it, and the message `refused` for
    any other guider; its batch is the inner one's unless it says otherwise."""

    refused: ClassVar[str] = ""

    def around(self, chosen: Guidance) -> Guidance:
        if self.inner is not None:
            return self
        if not isinstance(chosen, (Unguided, ClassifierFree)):
            raise SdxError(self.refused)
        return dataclasses.replace(self, inner=chosen)

    @property
    def branches(self) -> int:
        return self.inner.branches

    @property
    def negative_branches(self) -> tuple[int, ...]:
        return self.inner.negative_branches

    @property
    def text_branch(self) -> int:
        return self.inner.text_branch

    def conditioning(self, text, negative):
        return self.inner.conditioning(text, negative)


@dataclasses.dataclass(frozen=True)
class InstructPix2Pix(Guidance):
    """uncond + g * (text - image) + g_image * (image - uncond) (the paper's eq. 3), then `rescale`. Every
    branch takes the text's time ids, as diffusers' SDXL InstructPix2Pix pipeline does."""

    branches: ClassVar[int] = 3
    negative_branches: ClassVar[tuple[int, ...]] = (1, 2)
    text_branch: ClassVar[int] = 0

    def conditioning(self, text, negative):
        with_image = dataclasses.replace(negative, time_ids=text.time_ids, image=text.image)
        no_image = dataclasses.replace(with_image, image=jnp.zeros_like(text.image))
        return interleave(text, with_image, no_image)

    def combine(self, out, scales):
        cond, image, uncond = deinterleave(out, 3)
        guided = uncond + scales.of("text", cond) * (cond - image) + scales.of("image", cond) * (image - uncond)
        return rescale(guided, cond, scales.of("rescale", cond))


def choose(family: Family, guidance_scale: float, image_guidance_scale: float) -> Guidance:
    """diffusers' rule: guidance runs when guidance_scale > 1 and, for InstructPix2Pix, image_guidance_scale >= 1,
    and never for a UNet that embeds the scale itself (an LCM UNet: `pipelines.sampler` hands it the scale)."""
    if family.guidance_embedded or guidance_scale <= 1.0 or (family.pix2pix and image_guidance_scale < 1.0):
        return Unguided()
    return InstructPix2Pix() if family.pix2pix else ClassifierFree()


def of_request(family: Family, guidance_scale: float, image_guidance_scale: float, asked: Guidance | None) -> Guidance:
    """The guider a request runs: the one `choose` picks, or the one it asks for around it (`Guidance.around`)."""
    chosen = choose(family, guidance_scale, image_guidance_scale)
    return chosen if asked is None else asked.around(chosen)


def check_request(guider: Guidance, request, pipe) -> None:
    """Check `guider` against the request and pipeline (`Guidance.check`) and place its and the request's
    interventions on the pipeline's UNet once, in Python, so that a pattern that selects nothing or a model
    they cannot act on fails in the user's terms before anything is compiled."""
    for one in (guider, *request.interventions):
        one.check(request, pipe)
    interventions.installed(pipe.sampler.models["unet"], (guider, *request.interventions))


def shared_rows(guider: Guidance, asked: tuple[Intervention, ...], family: Family) -> int:
    """`guider.shared(family)`, or 1 when an intervention reads the batch's rows by their place (`per_row`)."""
    return 1 if any(one.per_row for one in asked) else guider.shared(family)


def rescale(guided: jax.Array, text: jax.Array, phi: jax.Array) -> jax.Array:
    """Lin et al. 2023 ("Common Diffusion Noise Schedules and Sample Steps are Flawed"), section 3.4:
    rescale the guided prediction to the per-sample standard deviation of the text prediction, mixed
    by phi (a number, or (B, 1, ...) one per sample). Standard deviations are unbiased (as torch.std).

    phi = 0 returns `guided` bit for bit (selected, not multiplied by 0, so a non-finite rescaled
    value cannot leak in); a sample whose guided prediction has zero spread keeps it unscaled
    instead of dividing by zero.
    """
    axes = tuple(range(1, guided.ndim))
    std_text = jnp.std(text, axis=axes, keepdims=True, ddof=1)
    std_guided = jnp.std(guided, axis=axes, keepdims=True, ddof=1)
    flat = std_guided == 0
    factor = jnp.where(flat, 1.0, std_text / jnp.where(flat, 1.0, std_guided))
    return jnp.where(phi == 0, guided, phi * (guided * factor) + (1.0 - phi) * guided)


def negative_conditioning(
    family: Family, encoders: Mapping, ids: Mapping[str, jax.Array], zero: jax.Array, dtype,
    weighting: text.Weighting = text.PLAIN, weights: Mapping[str, text.TokenWeights] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """The negative branch's (context (B, S, D), pooled (B, P) or None) from the negative prompts' ids
    {encoder: (B, chunks, 77)} and token weights (`text.encode`); rows where `zero` (B,) bool is set are zeros (no negative prompt and
    SDXL's force_zeros_for_empty_prompt). When every row is, the text encoders do not run (a `lax.cond`:
    SDXL's prepare at 256² on a 2-core CPU, 2.09-2.18 → 1.28-1.30 s). No clip skip: diffusers encodes negatives
    without it."""

    def encoded():
        context, pooled = text.encode(family, encoders, ids, None, dtype, weighting, weights)
        context = jnp.where(zero[:, None, None], jnp.zeros_like(context), context)
        if pooled is not None:
            pooled = jnp.where(zero[:, None], jnp.zeros_like(pooled), pooled)
        return context, pooled

    zeros = lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(encoded))
    return jax.lax.cond(zero.all(), zeros, encoded)


def null_conditioning(family: Family, encoders: Mapping, tokenizers: Mapping, dtype) -> dict[str, jax.Array]:
    """The conditioning of no prompt, without a batch axis: {"context": (77, D)} plus "pooled" (P,) for
    SDXL. What the negative branch takes without a negative prompt, and what training's conditioning
    dropout swaps in (diffusers' SDXL training script encodes "" where its pipeline uses zeros,
    diffusers#7920; sdx follows the pipeline)."""
    ids = text.tokenize(family, tokenizers, [[""]] * len(family.encoders), chunks=None)

    def encode():
        context, pooled = text.encode(family, encoders, {k: jnp.asarray(v) for k, v in ids.items()}, None, dtype)
        return {"context": context} | ({} if pooled is None else {"pooled": pooled})  # (1, ...) each

    if family.force_zeros:  # zeros: only the shapes are needed, so the encoders are traced, not run
        return jax.tree.map(lambda a: jnp.zeros(a.shape[1:], a.dtype), jax.eval_shape(encode))
    return jax.tree.map(lambda a: a[0], encode())
