"""ControlNet in the sampler, as diffusers' StableDiffusion(XL)ControlNet(Img2Img/Inpaint)Pipeline use it.

    python -m sdx.sample --model M --controlnet CN --control-image edges.png --prompt "..."

Each ControlNet (`sdx.controlnet.ControlNetModel`) reads the latents the UNet reads (scaled by the
scheduler, without an inpainting model's mask channels), the timestep, the text conditioning and its own
control image, and its residuals are added to the UNet's skip connections and mid block; several
ControlNets' residuals are summed (diffusers' MultiControlNetModel).

- The control image is the user's map (edges, depth, pose, ...): resized to the generation size with
  Lanczos when it differs, RGB, in [0, 1] (diffusers' control_image_processor: no normalisation).
- Per model call i of the L calls that run, a ControlNet's residuals are scaled by its conditioning scale
  while start <= i / L and (i + 1) / L <= end, and by 0 outside (diffusers' `controlnet_keep`; L counts
  the calls from the first that runs to the end of the schedule, before SDXL's denoising_end cuts it).
- Guess mode (or a ControlNet with global_pool_conditions, as diffusers decides from the first one): the
  residuals are also scaled from 0.1 to 1 across the blocks, and with classifier-free guidance the
  ControlNets run on the text branch only and the negative branch gets no residuals.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.guidance import Conditioning
from sdx.controlnet import ControlNetModel
from sdx.errors import SdxError
from sdx.layers import TextContext
from sdx.unet import UNetConfig

if TYPE_CHECKING:
    import PIL.Image


@dataclasses.dataclass(frozen=True)
class Control:
    """One ControlNet's part of a request: image (N, H, W, C) float32 in [0, 1] at the generation size,
    N = 1 or one per prompt; scale: diffusers' controlnet_conditioning_scale; start/end: its
    control_guidance_start/_end, the share of the calls it acts in."""

    image: np.ndarray
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0


def fit_control_image(picture: PIL.Image.Image, size: tuple[int, int], channels: int) -> np.ndarray:
    """(1, H, W, channels) float32 in [0, 1] from `picture`, resized with Lanczos to `size` = (H, W) when it differs."""
    from PIL import Image

    if channels != 3:
        raise SdxError(f"--control-image: this ControlNet reads {channels}-channel images; sdx feeds it RGB (3)")
    if (picture.height, picture.width) != size:
        picture = picture.resize((size[1], size[0]), Image.LANCZOS)
    return (np.asarray(picture.convert("RGB"), np.float32) / 255.0)[None]


def scales_per_call(controls: Sequence[Control], total: int, begin: int, end: int) -> np.ndarray:
    """(nets, end - begin) float32: each ControlNet's scale at each call of [begin, end) of a `total`-call
    schedule (diffusers' controlnet_keep times controlnet_conditioning_scale)."""
    n = total - begin  # diffusers' len(timesteps) once strength has cut the start
    i = np.arange(end - begin)
    out = np.zeros((len(controls), end - begin), np.float32)
    for k, c in enumerate(controls):
        off = (i / n < c.start) | ((i + 1) / n > c.end)
        out[k] = np.float32(c.scale) * np.where(off, np.float32(0.0), np.float32(1.0))
    return out


def check_window(start: float, end: float) -> None:
    """Refuse a guidance window diffusers refuses, in the flags' words."""
    if not 0.0 <= start < end <= 1.0:
        raise SdxError(f"--control-guidance-start {start} / --control-guidance-end {end}: need 0 <= start < end <= 1")


def check_compatible(net: ControlNetModel, unet: UNetConfig, factor: int, where: str) -> None:
    """Refuse a ControlNet whose residuals or conditioning do not fit the model's UNet, or whose image
    embedding does not shrink by the VAE's `factor`, before compiling."""
    c = net.config.unet
    fields = ("block_out_channels", "layers_per_block", "cross_attention_dim", "addition_embed_type",
              "projection_class_embeddings_input_dim")
    wrong = [f for f in fields if getattr(c, f) != getattr(unet, f)]
    if c.in_channels != unet.out_channels:
        wrong.insert(0, f"in_channels (the latents' {unet.out_channels})")
    if net.config.downscale_factor != factor:
        wrong.append(f"conditioning_embedding_out_channels (it reads images {net.config.downscale_factor}x the latents' "
                     f"size, the VAE's factor is {factor})")
    if wrong:
        raise SdxError(f"--controlnet {where}: made for another UNet; it differs in {', '.join(wrong)} (an SD 1.x "
                       "ControlNet goes with SD 1.x models, an SDXL one with SDXL)")


def residuals(
    nets: Sequence[ControlNetModel],
    images: Sequence[jax.Array],
    scales: jax.Array,
    latents: jax.Array,
    timestep: jax.Array,
    cond: Conditioning,
    texts: Sequence[TextContext],
    branches: int,
    shared: int,
    guess_mode: bool,
    xl: bool,
) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """The summed residuals of `nets` for the UNet batch.

    images: per ControlNet (B, H, W, C) in [0, 1]; scales: (nets,) this call's scales; latents (B, h, w, C)
    scaled for the model (no extra channels); timestep (); cond: the UNet batch's conditioning (B * branches
    rows, image-major, the text branch last, see `pipelines.guidance`); texts: per ControlNet, its
    `text_context` of `cond.context`; shared: how many consecutive rows share their input (`Guidance.shared`),
    which the ControlNets then read once. -> residuals for B * branches rows.
    """
    text_only = guess_mode and branches > 1
    if text_only:  # the text branch's rows; the others get zeros below
        pick = lambda a: a.reshape(a.shape[0] // branches, branches, *a.shape[1:])[:, -1]  # (B*n, ...) -> (B, ...)
        cond, texts = jax.tree.map(pick, (cond, tuple(texts)))
        x, rows = latents, lambda a: a
    else:
        rows = lambda a: jnp.repeat(a, branches // shared, axis=0)  # (B*n/shared, ...)
        x = rows(latents)
    added = {"text_embeds": cond.pooled, "time_ids": cond.time_ids} if xl else None
    t = jnp.broadcast_to(timestep, (x.shape[0],))
    total = None
    for k, net in enumerate(nets):
        out = net(x, t, texts[k], rows(images[k]), scales[k], added, guess_mode)
        total = out if total is None else jax.tree.map(jnp.add, total, out)
    if text_only:
        def pad(r):  # (B, ...) -> (B * n, ...), zeros in the other branches' rows
            stacked = jnp.stack([jnp.zeros_like(r)] * (branches - 1) + [r], axis=1)  # (B, n, ...)
            return stacked.reshape(r.shape[0] * branches, *r.shape[1:])
        total = jax.tree.map(pad, total)
    return total
