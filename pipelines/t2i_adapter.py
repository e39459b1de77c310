"""T2I-Adapters in the sampler, as diffusers' StableDiffusion(XL)AdapterPipeline use them.

    python -m sdx.sample --model M --t2i-adapter A --t2i-adapter-image sketch.png --prompt "..."

Each adapter (`sdx.t2i_adapter.T2IAdapter`) reads its control image once per image, in the prepare program;
its feature maps times its scale are summed over the adapters (diffusers' MultiAdapter with
`adapter_weights`) and added inside the UNet's down blocks at every model call the adapters act in
(`UNet2DConditionModel.__call__`'s `down_intrablock_additional_residuals`), to every guidance branch alike.

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
from typing import TYPE_CHECKING

import jax
import numpy as np

from sdx.errors import SdxError
from sdx.t2i_adapter import T2IAdapter, T2IAdapterConfig
from sdx.unet import CROSS_DOWN, UNetConfig

if TYPE_CHECKING:
    import PIL.Image


def adapter_name(k: int) -> str:
    """The `Sampler.models` key of the k-th T2I-Adapter."""
    return f"t2i_adapter_{k}"


@dataclasses.dataclass(frozen=True)
class AdapterImage:
    """One T2I-Adapter's part of a request: image (N, H, W, C) float32 in [0, 1] at the generation size, N = 1
    or one per prompt, C its in_channels; scale: the weight of its feature maps (diffusers'
    adapter_conditioning_scale, one entry of it with several adapters)."""

    image: np.ndarray
    scale: float = 1.0


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


def check_request(adapters: Sequence[AdapterImage], configs: Sequence[T2IAdapterConfig], prompts: int,
                  height: int, width: int) -> None:
    """Refuse a request's adapter images and sizes that the pipeline's adapters cannot take, in the flags' words."""
    if len(adapters) != len(configs):
        raise SdxError(f"give one --t2i-adapter-image per --t2i-adapter ({len(configs)}), not {len(adapters)}")
    for a, c in zip(adapters, configs):
        if height % c.downscale_factor or width % c.downscale_factor:
            raise SdxError(f"--t2i-adapter: this adapter reads images whose sides are multiples of {c.downscale_factor} "
                           f"pixels; --height {height} --width {width} are not")
        if a.image.ndim != 4 or a.image.shape[0] not in (1, prompts) or a.image.shape[1:] != (height, width, c.in_channels):
            raise SdxError(f"the T2I-Adapter image's shape {a.image.shape} does not fit {prompts} prompt(s) at "
                           f"{height}x{width} with {c.in_channels} channel(s)")
        if not np.isfinite(a.scale):
            raise SdxError(f"--t2i-adapter-scale {a.scale} must be a finite number")


def features(adapters: Sequence[T2IAdapter], images: Sequence[jax.Array], scales: jax.Array) -> tuple[jax.Array, ...]:
    """Sum over the adapters of scale_k x adapter_k(image_k), per feature map (B, h_i, w_i, C_i); scales: (adapters,)."""
    total = None
    for k, (adapter, image) in enumerate(zip(adapters, images)):
        maps = [scales[k].astype(f.dtype) * f for f in adapter(image)]
        total = maps if total is None else [t + f for t, f in zip(total, maps)]
    return tuple(total)
