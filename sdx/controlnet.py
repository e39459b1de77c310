"""ControlNet (Zhang et al. 2023, "Adding Conditional Control to Text-to-Image Diffusion Models",
arXiv:2302.05543): a copy of the UNet's encoder half that reads an extra image (edges, depth, pose, ...)
and returns one residual per skip connection of the UNet, plus one for its mid block.

`ControlNetModel` mirrors diffusers' class of the same name (diffusers/models/controlnets/controlnet.py):
its attribute paths are diffusers' state-dict keys (`controlnet_cond_embedding.blocks.0`,
`controlnet_down_blocks.3`, `controlnet_mid_block`, and the UNet's own `conv_in`, `time_embedding`,
`add_embedding`, `down_blocks...`, `mid_block...`), so a checkpoint loads with no rename table
(`convert.controlnet.load_controlnet`). Tensors are NHWC.

The UNet half is `sdx.unet.UNetEncoder`, the same code the UNet runs; its architecture is the `UNetConfig`
the `ControlNetConfig` holds. The residuals go to `UNet2DConditionModel.__call__` as
`down_block_additional_residuals` / `mid_block_additional_residual`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdx import diffusers_config
from sdx.config import COUNT, COUNT_LIST, FLAG, NAME, JsonConfig, Kind
from sdx.errors import SdxError
from sdx.layers import F32, Compute, conv, widen
from sdx.unet import UNetConfig, UNetEncoder

CHANNEL_ORDERS = ("rgb", "bgr")


@dataclasses.dataclass(frozen=True)
class ControlNetConfig(JsonConfig):
    """What a ControlNet is.

    unet: the UNet whose encoder half it copies (diffusers' `ControlNetModel.from_unet`): its conv_in, time
        and added embeddings, down blocks and mid block are built from it; its up half is not used (a
        config read from diffusers mirrors the down half there).
    conditioning_channels: channels of the conditioning image.
    conditioning_embedding_out_channels: widths of the image embedding's stages; each stage after the
        first halves the image, so the image is `downscale_factor` times the latent's size.
    global_pool_conditions: every residual is its spatial mean, (B, 1, 1, C) (e.g. the shuffle ControlNet).
    controlnet_conditioning_channel_order: "rgb", or "bgr" for a ControlNet trained on BGR images
        (the image's channels are flipped before use).
    """

    label: ClassVar[str] = "controlnet config"
    diffusers_fields: ClassVar = staticmethod(diffusers_config.controlnet_fields)  # config.json -> the fields
    kinds: ClassVar[Mapping[str, Kind]] = {
        "unet": ("a UNet config (an object)", lambda v: isinstance(v, UNetConfig)),
        "conditioning_channels": COUNT, "conditioning_embedding_out_channels": COUNT_LIST,
        "global_pool_conditions": FLAG, "controlnet_conditioning_channel_order": NAME,
    }

    unet: UNetConfig = UNetConfig()
    conditioning_channels: int = 3
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)
    global_pool_conditions: bool = False
    controlnet_conditioning_channel_order: str = "rgb"

    def __post_init__(self):
        if self.unet.mid_block_type is None:
            raise SdxError(f"{self.label}: a ControlNet needs a mid block (its UNet has mid_block_type null)")
        if self.unet.center_input_sample:
            raise SdxError(f"{self.label}: diffusers' ControlNetModel has no center_input_sample; its UNet sets it")
        if self.controlnet_conditioning_channel_order not in CHANNEL_ORDERS:
            raise SdxError(
                f"{self.label}: controlnet_conditioning_channel_order "
                f"{self.controlnet_conditioning_channel_order!r} is not one of {', '.join(CHANNEL_ORDERS)}"
            )
        if not self.conditioning_embedding_out_channels:
            raise SdxError(f"{self.label}: conditioning_embedding_out_channels needs at least one width")

    @property
    def downscale_factor(self) -> int:
        """Conditioning-image pixels per latent pixel, each way (8 for every released ControlNet)."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)

    @property
    def residual_channels(self) -> tuple[int, ...]:
        """Channels of each down residual, in order: conv_in's, then per level one per resnet and one
        for the downsampler (none at the deepest level); the same as the UNet's skip connections."""
        c = self.unet
        out = [c.block_out_channels[0]]
        for level, ch in enumerate(c.block_out_channels):
            downsampler = 1 if level < c.levels - 1 else 0
            out += [ch] * (c.layers_per_block[level] + downsampler)
        return tuple(out)

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> ControlNetConfig:
        """From a diffusers ControlNetModel `config.json` dict (missing fields take diffusers' defaults;
        the rules for every field are `sdx.diffusers_config`'s)."""
        fields = cls.diffusers_fields(d)
        try:
            unet = UNetConfig(**fields.pop("unet"))
        except SdxError as e:
            raise SdxError(f"{cls.label}: {e}") from None
        return cls(unet=unet, **fields)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "unet": self.unet.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ControlNetConfig:
        if isinstance(d, Mapping) and isinstance(d.get("unet"), Mapping):
            d = {**d, "unet": UNetConfig.from_dict(d["unet"])}
        return super().from_dict(d)


class ControlNetConditioningEmbedding(nnx.Module):
    """diffusers' ControlNetConditioningEmbedding (the paper's E(.)): a 3x3 conv_in, then per further
    width a 3x3 conv and a 3x3 stride-2 conv, SiLU after each, and a 3x3 conv_out (zero-initialised in
    training) to the UNet's first width. (B, f*H, f*W, C_img) -> (B, H, W, C0), f = 2 ** (widths - 1)."""

    def __init__(self, cp: Compute, cin: int, widths: tuple[int, ...], cout: int, *, rngs: nnx.Rngs):
        self.conv_in = conv(cp, cin, widths[0], 3, rngs=rngs)
        blocks = []
        for a, b in zip(widths[:-1], widths[1:]):
            blocks += [conv(cp, a, a, 3, rngs=rngs), conv(cp, a, b, 3, stride=2, rngs=rngs)]
        self.blocks = nnx.List(blocks)
        self.conv_out = conv(cp, widths[-1], cout, 3, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.silu(self.conv_in(x))
        for block in self.blocks:
            x = jax.nn.silu(block(x))
        return self.conv_out(x)


class ControlNetModel(UNetEncoder):
    """The UNet's encoder half plus the conditioning image's embedding and one 1x1 conv (zero-initialised
    in training) per residual. `__call__` gives the residuals `UNet2DConditionModel` adds, in `cp.dtype`."""

    label: ClassVar[str] = "controlnet"

    def __init__(self, config: ControlNetConfig, cp: Compute = F32, *, rngs: nnx.Rngs):
        self.config = config
        super().__init__(config.unet, cp, rngs=rngs)
        c = config.unet
        self.controlnet_cond_embedding = ControlNetConditioningEmbedding(
            cp, config.conditioning_channels, config.conditioning_embedding_out_channels, c.block_out_channels[0],
            rngs=rngs,
        )
        self.controlnet_down_blocks = nnx.List([conv(cp, ch, ch, 1, rngs=rngs) for ch in config.residual_channels])
        self.controlnet_mid_block = conv(cp, c.block_out_channels[-1], c.block_out_channels[-1], 1, rngs=rngs)
        self._name_attentions()

    @property
    def unet_config(self) -> UNetConfig:
        return self.config.unet

    def _check_image(self, image, sample) -> None:
        c, f = self.config, self.config.downscale_factor
        b, h, w = sample.shape[:3]
        want = (f * h, f * w, c.conditioning_channels)
        if image.ndim != 4 or image.shape[0] not in (1, b) or tuple(image.shape[1:]) != want:
            raise SdxError(
                f"controlnet: controlnet_cond must be (B={b} or 1, {want[0]}, {want[1]}, {want[2]}) NHWC, "
                f"{f}x the latent's size, got {tuple(image.shape)}"
            )

    def __call__(
        self,
        sample: jax.Array,
        timesteps: jax.Array | float | int,
        encoder_hidden_states: jax.Array,
        controlnet_cond: jax.Array,
        conditioning_scale: jax.Array | float = 1.0,
        added_cond: Mapping[str, jax.Array] | None = None,
        guess_mode: bool = False,
    ) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """diffusers' ControlNetModel.forward. sample (B, h, w, C_in) latents; timesteps () or (B,);
        encoder_hidden_states (B, S, D), or this model's `text_context` of it; controlnet_cond (B or 1, f*h,
        f*w, C_img) the conditioning image in [0, 1] (f = `config.downscale_factor`, 8), RGB (a "bgr"
        ControlNet flips it itself);
        conditioning_scale a number, a () array (traced is fine) or one per row (B,), multiplying every residual
        (of its row); added_cond
        as the UNet's for SDXL; guess_mode (static): the residuals are also scaled from 0.1 (first) to 1
        (mid) on a log scale, diffusers' `torch.logspace(-1, 0, n + 1)` (not with global_pool_conditions,
        as in diffusers).

        -> (down residuals, one per UNet skip connection, each like its skip (B, H_i, W_i, C_i); the mid
        residual (B, H_mid, W_mid, C_mid)); with global_pool_conditions each is (B, 1, 1, C). B is the
        context's rows; the sample's and the image's may be shared by n of them, as the UNet's.
        """
        c = self.config
        b, rows = self._check_inputs(sample, encoder_hidden_states)
        self._check_image(controlnet_cond, sample)
        if jnp.ndim(conditioning_scale) != 0 and jnp.shape(conditioning_scale) != (rows,):
            raise SdxError(f"controlnet: conditioning_scale must be one number or one per row ({rows}), not "
                           f"{jnp.shape(conditioning_scale)}")
        image = controlnet_cond.astype(self.dtype)
        if c.controlnet_conditioning_channel_order == "bgr":
            image = image[..., ::-1]  # diffusers flips the channel axis
        temb = self._embed(timesteps, b, added_cond)
        x = self.conv_in(sample.astype(self.dtype)) + self.controlnet_cond_embedding(image)
        return self._residuals(x, temb, encoder_hidden_states, rows, conditioning_scale, guess_mode)

    def _residuals(self, x, temb, context, rows: int, scale, guess_mode: bool) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """`__call__`'s residuals from x, conv_in's output with the image's embedding added (B, h, w, C0): the
        down and mid blocks, a zero convolution each, widened to the context's `rows`, times `scale` (a number or
        one per row) and guess mode's steps, pooled with global_pool_conditions."""
        c = self.config
        x, skips = self._down(x, temb, context)
        x = self._run(self.mid_block, x, temb, context)
        residuals = [widen(zero_conv(s), rows) for zero_conv, s in zip(self.controlnet_down_blocks, skips)]
        residuals.append(widen(self.controlnet_mid_block(x), rows))

        n = len(residuals)
        steps = np.logspace(-1, 0, n) if guess_mode and not c.global_pool_conditions else np.ones(n)
        scales = jnp.asarray(scale, jnp.float32)[..., None] * jnp.asarray(steps, jnp.float32)  # ([B,] n)
        per_row = lambda s: s.reshape(-1, 1, 1, 1)  # () or (B,) -> (1 or B, 1, 1, 1)
        residuals = [r * per_row(scales[..., i]).astype(r.dtype) for i, r in enumerate(residuals)]
        if c.global_pool_conditions:
            residuals = [jnp.mean(r, axis=(1, 2), keepdims=True) for r in residuals]  # (B, 1, 1, C)
        return tuple(residuals[:-1]), residuals[-1]
