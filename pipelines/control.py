"""ControlNet in the sampler, as diffusers' StableDiffusion(XL)ControlNet(Img2Img/Inpaint)Pipeline use it.

    python -m sdx.sample --model M --controlnet CN --control-image edges.png --prompt "..."

Each ControlNet (`sdx.controlnet.ControlNetModel`) reads the latents the UNet reads (scaled by the
scheduler, without an inpainting model's mask channels), the timestep, the text conditioning and its own
control image, and its residuals are added to the UNet's skip connections and mid block (`sdx.residuals`);
several ControlNets' residuals add up (diffusers' MultiControlNetModel). `Control` is a ControlNet's request part,
`ControlNetPlugin` its program part (`pipelines.plugin`), `pipelines.conditioning_cli.ControlNetFlags` its command-line
part (`pipelines.method`).

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
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.plugin import DENOISE, PREPARE, Batch, Input, ModelCall, Plugin, Ready
from sdx import residuals
from sdx.controlnet import ControlNetModel
from sdx.controlnet_union import ControlNetUnionModel
from sdx.errors import SdxError
from sdx.interventions import Interventions
from sdx.layers import TextContext
from sdx.unet import UNetConfig

if TYPE_CHECKING:
    import PIL.Image


@dataclasses.dataclass(frozen=True)
class Control(Input):
    """One ControlNet's part of a request: image (N, H, W, C) float32 in [0, 1] at the generation size,
    N = 1 or one per prompt; scale: diffusers' controlnet_conditioning_scale; start/end: its
    control_guidance_start/_end, the share of the calls it acts in; guess_mode: diffusers' (see the module
    docstring; a pipeline whose first ControlNet pools its residuals turns it on for all, as diffusers)."""

    image: np.ndarray
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0
    guess_mode: bool = False
    kind: ClassVar[str] = "controlnet"
    flag: ClassVar[str] = "--controlnet"
    image_flag: ClassVar[str] = "--control-image"

    def size(self) -> tuple[int, int]:
        return tuple(self.image.shape[1:3])

    def check(self, r, pipe, model: str) -> None:
        if any(isinstance(net, ControlNetUnionModel) for net in pipe.conditioning_models(self.kind)):
            raise SdxError("a ControlNet-Union takes a UnionControl (on the command line, a --control-mode per "
                           "--control-image), and goes with no plain ControlNet (diffusers has no such pipeline)")
        self.check_image(r, pipe)

    def check_image(self, r, pipe) -> None:
        """Refuse what any ControlNet cannot take: the pipeline, the window, the image's shape, the scale."""
        refuse_edits(r, pipe.family, "--controlnet: ControlNets", "a ControlNet")
        check_window(self.start, self.end)
        if (self.image.ndim != 4 or self.image.shape[0] not in (1, len(r.prompts))
                or self.image.shape[1:3] != (r.height, r.width)):
            raise SdxError(f"the control image's shape {self.image.shape} does not fit {len(r.prompts)} prompt(s) at "
                           f"{r.height}x{r.width}")
        if not np.isfinite(self.scale):
            raise SdxError(f"--controlnet-conditioning-scale {self.scale} must be a finite number")

    def plugin(self, batch: Batch, model: str, pipe) -> ControlNetPlugin:
        guess = self.guess_mode or pipe.sampler.models[pipe.conditioners["controlnet"][0]].config.global_pool_conditions
        scales = scales_per_call([self], batch.calls, batch.begin, batch.end)  # (1, calls that run)
        return ControlNetPlugin(model, guess, batch.take(self.image).astype(np.float32),
                                np.repeat(scales, batch.rows, axis=0))


@dataclasses.dataclass(frozen=True)
class ControlNetPlugin(Plugin):
    """A ControlNet in the sampler: model, its name in the sampler; guess_mode (static); image (B, H, W, C) in
    [0, 1] and scales (B, calls), its scale at each model call that runs (traced). Prepare projects the UNet
    batch's text for its attentions once; each model call adds its residuals to the UNet's skip connections and
    mid block."""

    model: str
    guess_mode: bool
    image: jax.Array
    scales: jax.Array
    traced: ClassVar[tuple[str, ...]] = ("image", "scales")
    reads: ClassVar[tuple[str, ...]] = (PREPARE, DENOISE)

    def prepare(self, models, ready: Ready) -> TextContext:
        # guess mode runs the ControlNet on the text rows alone, which are never blank
        return models[self.model].text_context(ready.cond.context, None if self.guess_mode else ready.blank)

    def contribute(self, models, text: TextContext, call: ModelCall) -> Interventions:
        """The ControlNet's residuals for the UNet batch (B * branches rows, image-major, the text branch last,
        `pipelines.guidance`), read from the rows that share their input once (`ModelCall.shared`); in guess mode
        with guidance, from the text branch's rows alone, the other branches' residuals zeros."""
        n, cond, scale = call.branches, call.cond, self.scales[..., call.index]  # scale: (B, ...)
        text_only = self.guess_mode and n > 1
        if text_only:  # the text branch's rows; the others get zeros below
            pick = lambda a: a.reshape(a.shape[0] // n, n, *a.shape[1:])[:, -1]  # (B*n, ...) -> (B, ...)
            cond, text = jax.tree.map(pick, (cond, text))
            x, rows = call.latents, lambda a: a
        else:
            rows = lambda a: jnp.repeat(a, n // call.shared, axis=0)  # (B*n/shared, ...)
            x = rows(call.latents)
        t = jnp.broadcast_to(call.timestep, (x.shape[0],))
        scale = scale if text_only else jnp.repeat(scale, n, axis=0)  # one per context row
        down, mid = self.residuals(models[self.model], x, t, text, rows, scale, call.added(cond))
        if text_only:
            def pad(r):  # (B, ...) -> (B * n, ...), zeros in the other branches' rows
                stacked = jnp.stack([jnp.zeros_like(r)] * (n - 1) + [r], axis=1)  # (B, n, ...)
                return stacked.reshape(r.shape[0] * n, *r.shape[1:])
            down, mid = jax.tree.map(pad, (down, mid))
        return residuals.controlnet(call.unet, down, mid)

    def residuals(self, net, x, t, text, rows, scale, added) -> tuple:
        """The net's two outputs for the ControlNet's batch x; `rows` takes this plug-in's per-image inputs to
        x's rows."""
        return net(x, t, text, rows(self.image), scale, added, self.guess_mode)


def default_scale(at) -> float:
    """diffusers' controlnet_conditioning_scale for the pipeline (`pipelines.method.Context`): 1.0, img2img 0.8,
    inpainting 0.5 (SDXL 1.0)."""
    return (1.0 if at.pipe.family.xl else 0.5) if at.mask else 0.8 if at.image else 1.0


def refuse_edits(r, family, what: str, one: str) -> None:
    """Refuse a conditioning method (`what`: its flag and name, `one`: "a ControlNet") on an InstructPix2Pix model
    or on a run that continues given latents (the refiner)."""
    if family.pix2pix:
        raise SdxError(f"{what} guide text-to-image, img2img and inpainting models, not InstructPix2Pix")
    if r.init_latents is not None or r.denoising_start is not None:
        raise SdxError(f"{what.split(':')[0]} does not continue given latents (no --refiner): {one} guides one model")


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
