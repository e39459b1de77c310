"""T2I-Adapters in the sampler, as diffusers' StableDiffusion(XL)AdapterPipeline use them.

    python -m sdx.sample --model M --t2i-adapter A --t2i-adapter-image sketch.png --prompt "..."

Each adapter (`sdx.t2i_adapter.T2IAdapter`) reads its control image once per image, in the prepare program;
its feature maps times its scale are added inside the UNet's down blocks (`sdx.residuals`, where diffusers adds
`down_intrablock_additional_residuals`) at every model call it acts in, to every guidance branch alike; several
adapters' maps add up (diffusers' MultiAdapter with `adapter_weights`). `AdapterImage` is its request part,
`AdapterPlugin` its program part (`pipelines.plugin`).

- The control image is the user's map (sketch, depth, pose, ...): resized to the generation size with Lanczos
  when it differs, in [0, 1] with no normalisation, RGB, or grayscale (PIL's "L") for a one-channel adapter
  (diffusers' `_preprocess_adapter_image`).
- The adapters act in the first int(N x factor) model calls that run (diffusers' adapter_conditioning_factor),
  N being, for SDXL, the steps, or, when --denoising-end cuts the schedule, the calls that run (diffusers' rule: it
  counts the steps after the cut); for SD, the model calls of the schedule (diffusers' SD adapter pipeline has no
  factor and acts at every call: PNDM, SD's scheduler, makes one call more than the steps). sdx also lets them
  guide img2img and inpainting, where the calls count from the first that runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.control import refuse_edits
from pipelines.plugin import PREPARE, Batch, Input, ModelCall, Plugin, Ready
from sdx import residuals
from sdx.errors import SdxError
from sdx.interventions import Interventions
from sdx.t2i_adapter import T2IAdapter, T2IAdapterConfig
from sdx.unet import CROSS_DOWN, UNetConfig

if TYPE_CHECKING:
    import PIL.Image


@dataclasses.dataclass(frozen=True)
class AdapterImage(Input):
    """One T2I-Adapter's part of a request: image (N, H, W, C) float32 in [0, 1] at the generation size, N = 1
    or one per prompt, C its in_channels; scale: the weight of its feature maps (diffusers'
    adapter_conditioning_scale, one entry of it with several adapters); factor: the share of the steps, from the
    first, it acts in (diffusers' adapter_conditioning_factor)."""

    image: np.ndarray
    scale: float = 1.0
    factor: float = 1.0
    kind: ClassVar[str] = "t2i_adapter"
    flag: ClassVar[str] = "--t2i-adapter"
    image_flag: ClassVar[str] = "--t2i-adapter-image"

    def size(self) -> tuple[int, int]:
        return tuple(self.image.shape[1:3])

    def check(self, r, pipe, model: str) -> None:
        refuse_edits(r, pipe.family, "--t2i-adapter: T2I-Adapters", "an adapter")
        if not 0.0 <= self.factor <= 1.0:
            raise SdxError(f"--t2i-adapter-factor {self.factor}: the share of the steps the adapters act in, from 0 to 1")
        c = pipe.sampler.models[model].config
        if r.height % c.downscale_factor or r.width % c.downscale_factor:
            raise SdxError(f"--t2i-adapter: this adapter reads images whose sides are multiples of {c.downscale_factor} "
                           f"pixels; --height {r.height} --width {r.width} are not")
        if (self.image.ndim != 4 or self.image.shape[0] not in (1, len(r.prompts))
                or self.image.shape[1:] != (r.height, r.width, c.in_channels)):
            raise SdxError(f"the T2I-Adapter image's shape {self.image.shape} does not fit {len(r.prompts)} prompt(s) at "
                           f"{r.height}x{r.width} with {c.in_channels} channel(s)")
        if not np.isfinite(self.scale):
            raise SdxError(f"--t2i-adapter-scale {self.scale} must be a finite number")

    def plugin(self, batch: Batch, model: str, pipe) -> AdapterPlugin:
        # N of `gates`: SDXL's pipeline counts the steps, SD's acts at every model call (PNDM makes one more)
        gated = gates(self.factor, batch.steps if batch.family.xl else batch.calls, batch.begin, batch.end, batch.cut)
        return AdapterPlugin(model, batch.take(self.image).astype(np.float32), batch.per_row(self.scale),
                             np.repeat(gated[None], batch.rows, axis=0))


@dataclasses.dataclass(frozen=True)
class AdapterPlugin(Plugin):
    """A T2I-Adapter in the sampler: model, its name in the sampler; image (B, H, W, C) in [0, 1], scale (B,) and
    gates (B, calls), 1 at the model calls it acts in (traced). Prepare reads the image once; each model call adds
    the feature maps, gated, inside the UNet's down blocks, to every guidance branch alike."""

    model: str
    image: jax.Array
    scale: jax.Array
    gates: jax.Array
    traced: ClassVar[tuple[str, ...]] = ("image", "scale", "gates")
    reads: ClassVar[tuple[str, ...]] = (PREPARE,)

    def prepare(self, models, ready: Ready) -> tuple[jax.Array, ...]:
        """Its feature maps times its scale, each (B, h_i, w_i, C_i)."""
        return tuple(_per_row(self.scale, f) * f for f in models[self.model](self.image))

    def contribute(self, models, features: tuple[jax.Array, ...], call: ModelCall) -> Interventions:
        gate = self.gates[:, call.index]  # (B,)
        return residuals.adapter(call.unet, [jnp.repeat(f * _per_row(gate, f), call.branches, axis=0) for f in features])


def _per_row(values: jax.Array, like: jax.Array) -> jax.Array:
    """(B,) -> (B, 1, 1, 1) in `like`'s dtype, to scale each row of a (B, h, w, C) map."""
    return values.astype(like.dtype).reshape(-1, 1, 1, 1)


def fit_image(picture: PIL.Image.Image, size: tuple[int, int], channels: int) -> np.ndarray:
    """(1, H, W, channels) float32 in [0, 1] from `picture`, resized with Lanczos to `size` = (H, W) when it
    differs; grayscale for a one-channel adapter."""
    from PIL import Image

    if channels not in (1, 3):
        raise SdxError(f"--t2i-adapter-image: this adapter reads {channels}-channel images; sdx feeds it RGB or gray")
    if (picture.height, picture.width) != size:
        picture = picture.resize((size[1], size[0]), Image.LANCZOS)
    pixels = np.asarray(picture.convert("L" if channels == 1 else "RGB"), np.float32) / 255.0
    return pixels.reshape(1, *size, channels)


def gates(factor: float, steps: int, begin: int, end: int, cut: bool) -> np.ndarray:
    """(end - begin,) float32: 1 at the model calls of [begin, end) the adapters act in, 0 after (see the
    module doc; `steps`: N when the schedule is not cut; `cut`: --denoising-end cut the schedule)."""
    n = end - begin if cut else steps
    return (np.arange(end - begin) < int(n * factor)).astype(np.float32)


def _unet_sites(c: UNetConfig, h: int, w: int) -> list[tuple[int, int, int]]:
    """(h, w, channels) of the UNet activation each adapter feature map meets, for latents of h x w: one per
    down block (a block with attentions before its downsampler, one without after it), then the mid block."""
    sites = []
    for level, ch in enumerate(c.block_out_channels):
        halved = (-(-h // 2), -(-w // 2)) if level < c.levels - 1 else (h, w)
        sites.append((h, w, ch) if c.down_block_types[level] == CROSS_DOWN else (*halved, ch))
        h, w = halved
    if c.mid_block_type is not None:
        sites.append((h, w, c.block_out_channels[-1]))
    return sites


def check_compatible(adapter: T2IAdapter, unet: UNetConfig, factor: int, where: str) -> None:
    """Refuse an adapter whose feature maps do not meet the UNet's activations (`factor`: the VAE's), before
    compiling."""
    size = 2 ** (unet.levels + 1)  # latents that halve evenly at every level
    features = adapter.config.feature_shapes(size * factor, size * factor)
    sites = _unet_sites(unet, size, size)
    if len(features) > len(sites) or any(f != s for f, s in zip(features, sites)):
        describe = lambda shapes: ", ".join(f"{c}@{h}x{w}" for h, w, c in shapes)  # noqa: E731
        raise SdxError(
            f"--t2i-adapter {where}: made for another UNet: for {size}x{size} latents its feature maps are "
            f"{describe(features)} (channels@size), the UNet's blocks take {describe(sites)} (an SD 1.x adapter goes "
            "with SD 1.x models, an SDXL one with SDXL)"
        )


def check_together(configs: Sequence[T2IAdapterConfig], sources: Sequence[str]) -> None:
    """Refuse adapters that cannot be summed (diffusers' MultiAdapter: the same feature maps)."""
    counts = {len(c.halvings) for c in configs}
    factors = {c.downscale_factor for c in configs}
    if len(counts) > 1 or len(factors) > 1:
        raise SdxError(f"--t2i-adapter {', '.join(sources)}: adapters given together must give the same feature maps; "
                       "these differ in their number or size")
