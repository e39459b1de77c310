"""ControlNet-Union (xinsir's ControlNet++, github.com/xinsir6/ControlNetPlus): one SDXL ControlNet for many
control types (pose, depth, edges, ...), given one image or several at once, each with its type.

`ControlNetUnionModel` mirrors diffusers' class of the same name (diffusers/models/controlnets/controlnet_union.py):
a `sdx.controlnet.ControlNetModel` (the UNet's encoder half, the image embedding, the zero convolutions) plus

- a control-type embedding added to the time embedding: the multi-hot `control_type` (1 at each type in use)
  through the sinusoidal embedding of SDXL's size conditioning, then `control_add_embedding`;
- a condition transformer: one token per control image (its embedding's spatial mean plus `task_embedding`'s
  row for its type) and one for conv_in's output, through `transformer_layes` (CLIP-style blocks, torch's
  `nn.MultiheadAttention`), and `spatial_ch_projs` of each image's token added to that image's embedding; the
  images' embeddings so shifted are summed into conv_in's output, where a ControlNet adds its one image's.

Attribute paths are diffusers' state-dict keys (`task_embedding`, `transformer_layes.<i>.attn.in_proj_weight`,
`spatial_ch_projs`, `control_add_embedding`, and the ControlNet's own), diffusers' spelling included; the
attention's `in_proj_weight` / `in_proj_bias` keep torch's (3C, C) layout. Tensors are NHWC.

Scaling, as diffusers': with one image its scale multiplies the residuals (as a ControlNet's); with several,
each image's scale multiplies its token and its shifted embedding, and the residuals are not scaled.

Which rows attend to each other. diffusers' blocks call `nn.MultiheadAttention` without `batch_first` on tokens
of shape (B, K + 1, C), so they attend across the batch: token k of one row attends to token k of every row, and
one image's residuals depend on the batch's other rows (the other images, and so the batch size). sdx gives an
image the same pixels at any batch size, so the attention runs across each image's own rows only
(`rows_per_image`: its guidance branches, which read the same latents and images and so hold the same tokens).
For a batch of one image that is exactly diffusers' result; `rows_per_image=None` is diffusers' whole-batch
attention, for comparing with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from sdx import diffusers_config, products
from sdx.attention import dot_product_attention
from sdx.controlnet import ControlNetConfig, ControlNetModel
from sdx.errors import SdxError
from sdx.layers import F32, Compute, LayerNorm, TimestepEmbedding, linear, timestep_embedding


@dataclasses.dataclass(frozen=True)
class ControlNetUnionConfig(ControlNetConfig):
    """A ControlNet's config (`ControlNetConfig`) and diffusers' five union fields:

    num_control_type: the control types it knows (`task_embedding`'s rows; xinsir's union 6, its ProMax 8).
    num_trans_channel, num_trans_head, num_trans_layer: the condition transformer's width (the UNet's first
        block's), heads and blocks.
    num_proj_channel: `spatial_ch_projs`' output (the UNet's first block's width).
    """

    label: ClassVar[str] = "controlnet-union config"
    diffusers_fields: ClassVar = staticmethod(diffusers_config.controlnet_union_fields)
    kinds: ClassVar[Mapping] = {**ControlNetConfig.kinds, **diffusers_config.CONTROLNET_UNION_KINDS}

    conditioning_embedding_out_channels: tuple[int, ...] = (48, 96, 192, 384)  # diffusers' union default
    num_control_type: int = 6
    num_trans_channel: int = 320
    num_trans_head: int = 8
    num_trans_layer: int = 1
    num_proj_channel: int = 320

    def __post_init__(self):
        super().__post_init__()
        u = self.unet
        if u.addition_embed_type != "text_time" or u.addition_time_embed_dim is None:
            raise SdxError(f"{self.label}: a ControlNet-Union is SDXL's (addition_embed_type 'text_time' with "
                           "addition_time_embed_dim, which also embeds its control types)")
        if self.controlnet_conditioning_channel_order != "rgb":
            raise SdxError(f"{self.label}: controlnet_conditioning_channel_order must be 'rgb' (diffusers' union "
                           "refuses any other)")
        for name in ("num_trans_channel", "num_proj_channel"):
            if getattr(self, name) != u.block_out_channels[0]:
                raise SdxError(f"{self.label}: {name}={getattr(self, name)} must be the first block's width "
                               f"{u.block_out_channels[0]} (its tokens and projections meet the image embedding)")
        if self.num_trans_channel % self.num_trans_head:
            raise SdxError(f"{self.label}: num_trans_channel={self.num_trans_channel} is not a multiple of "
                           f"num_trans_head={self.num_trans_head}")


class MultiheadAttention(nnx.Module):
    """torch's `nn.MultiheadAttention` (its parameters: in_proj_weight (3C, C) and in_proj_bias (3C,) in torch's
    layout, out_proj), attending across consecutive groups of rows (see the module docstring)."""

    def __init__(self, cp: Compute, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.heads, self.dtype = heads, cp.dtype
        init = nnx.initializers.xavier_uniform()
        self.in_proj_weight = nnx.Param(init(rngs.params(), (3 * dim, dim), cp.param_dtype))
        self.in_proj_bias = nnx.Param(jnp.zeros((3 * dim,), cp.param_dtype))
        self.out_proj = linear(cp, dim, dim, rngs=rngs)

    def __call__(self, x: jax.Array, group: int) -> jax.Array:
        """x (B, T, C) -> (B, T, C): token t of each row attends to token t of the `group` rows of its group."""
        b, t, c = x.shape
        x, w = x.astype(self.dtype), self.in_proj_weight[...].astype(self.dtype)
        qkv = products.dot_general(x, w, (((2,), (1,)), ((), ()))) + self.in_proj_bias[...].astype(self.dtype)
        qkv = qkv.reshape(b // group, group, t, 3, self.heads, c // self.heads)  # (G, g, T, 3, H, D)
        qkv = qkv.transpose(3, 0, 2, 1, 4, 5).reshape(3, b // group * t, group, self.heads, c // self.heads)
        out = dot_product_attention(qkv[0], qkv[1], qkv[2])  # (G*T, g, H, D): the group's rows are the sequence
        out = out.reshape(b // group, t, group, c).transpose(0, 2, 1, 3).reshape(b, t, c)  # (B, T, C)
        return self.out_proj(out)


class ResidualAttentionMlp(nnx.Module):
    """c_fc -> QuickGELU (x sigmoid(1.702 x)) -> c_proj, 4x wide."""

    def __init__(self, cp: Compute, dim: int, *, rngs: nnx.Rngs):
        self.c_fc = linear(cp, dim, 4 * dim, rngs=rngs)
        self.c_proj = linear(cp, 4 * dim, dim, rngs=rngs)

    def __call__(self, x):
        x = self.c_fc(x)
        return self.c_proj(x * jax.nn.sigmoid(1.702 * x))


class ResidualAttentionBlock(nnx.Module):
    """Pre-norm: x + attn(ln_1(x)), then x + mlp(ln_2(x)) (torch's LayerNorm eps 1e-5)."""

    def __init__(self, cp: Compute, dim: int, heads: int, *, rngs: nnx.Rngs):
        self.attn = MultiheadAttention(cp, dim, heads, rngs=rngs)
        self.ln_1 = LayerNorm(cp, dim, 1e-5, rngs=rngs)
        self.mlp = ResidualAttentionMlp(cp, dim, rngs=rngs)
        self.ln_2 = LayerNorm(cp, dim, 1e-5, rngs=rngs)

    def __call__(self, x, group: int):
        x = x + self.attn(self.ln_1(x), group)
        return x + self.mlp(self.ln_2(x))


class ControlNetUnionModel(ControlNetModel):
    """A ControlNet (`ControlNetModel`) with the union's control-type embedding and condition transformer (see
    the module docstring). `__call__` gives the residuals `UNet2DConditionModel` adds, in `cp.dtype`."""

    label: ClassVar[str] = "controlnet-union"

    def __init__(self, config: ControlNetUnionConfig, cp: Compute = F32, *, rngs: nnx.Rngs):
        super().__init__(config, cp, rngs=rngs)
        c, width = config, config.num_trans_channel
        self.task_embedding = nnx.Param(width ** 0.5 * jax.random.normal(rngs.params(), (c.num_control_type, width),
                                                                          cp.param_dtype))
        self.transformer_layes = nnx.List([ResidualAttentionBlock(cp, width, c.num_trans_head, rngs=rngs)
                                           for _ in range(c.num_trans_layer)])  # diffusers' key, as spelt there
        self.spatial_ch_projs = linear(cp, width, c.num_proj_channel, rngs=rngs)
        self.control_add_embedding = TimestepEmbedding(
            cp, c.unet.addition_time_embed_dim * c.num_control_type, c.unet.time_embed_dim, rngs=rngs)

    def _check_union_inputs(self, sample, images, control_type, index, scale) -> None:
        c, b = self.config, sample.shape[0]
        if images.ndim != 5 or images.shape[0] not in (1, b) or images.shape[1] < 1:
            raise SdxError(f"{self.label}: controlnet_cond must be (B={b} or 1, K images, H, W, C) NHWC, got "
                           f"{tuple(images.shape)}")
        k = images.shape[1]
        self._check_image(images[:, 0], sample)
        if control_type.ndim != 2 or control_type.shape[0] not in (1, b) or control_type.shape[1] != c.num_control_type:
            raise SdxError(f"{self.label}: control_type must be (B={b} or 1, num_control_type={c.num_control_type}), "
                           f"got {tuple(control_type.shape)}")
        for name, value in (("control_type_idx", index), ("conditioning_scale", scale)):
            if jnp.shape(value) not in ((), (k,), (1, k), (b, k)):
                raise SdxError(f"{self.label}: {name} must be one value, one per image ({k}) or (B={b}, {k}), "
                               f"not {jnp.shape(value)}")

    def __call__(
        self,
        sample: jax.Array,
        timesteps: jax.Array | float | int,
        encoder_hidden_states: jax.Array,
        controlnet_cond: jax.Array,
        control_type: jax.Array,
        control_type_idx: jax.Array,
        conditioning_scale: jax.Array | float = 1.0,
        added_cond: Mapping[str, jax.Array] | None = None,
        guess_mode: bool = False,
        rows_per_image: int | None = None,
    ) -> tuple[tuple[jax.Array, ...], jax.Array]:
        """diffusers' ControlNetUnionModel.forward. sample (B, h, w, C_in) latents; timesteps () or (B,);
        encoder_hidden_states (B, S, D), or this model's `text_context` of it; controlnet_cond (B or 1, K, f*h,
        f*w, C_img): K control images in [0, 1], RGB (f = `config.downscale_factor`); control_type (B or 1,
        num_control_type): 1 at every type in use, else 0; control_type_idx: each image's type (an integer
        array, traced is fine: (), (K,) or (B, K)); conditioning_scale: each image's scale, likewise (see the
        module docstring for where it acts); added_cond as the UNet's (SDXL); guess_mode (static): diffusers'
        (the residuals also scaled from 0.1 to 1); rows_per_image (static): the consecutive rows of the batch
        that are one image's, which the condition transformer attends across (None: the whole batch, as
        diffusers does). diffusers' `from_multi` (MultiControlNetUnionModel gives each net one image) is K = 1.

        -> (down residuals, one per UNet skip connection, each (B, H_i, W_i, C_i); the mid residual).
        """
        b, rows = self._check_inputs(sample, encoder_hidden_states)
        self._check_union_inputs(sample, controlnet_cond, control_type, control_type_idx, conditioning_scale)
        k, group = controlnet_cond.shape[1], rows_per_image or b
        if b % group:
            raise SdxError(f"{self.label}: rows_per_image={group} does not divide the batch's {b} rows")
        scale = jnp.broadcast_to(jnp.asarray(conditioning_scale, jnp.float32), (b, k))  # (B, K)
        index = jnp.broadcast_to(jnp.asarray(control_type_idx, jnp.int32), (b, k))  # (B, K)
        temb = self._embed(timesteps, b, added_cond) + self._control_types(control_type, b)
        x = self.conv_in(sample.astype(self.dtype))
        x = x + self._fused(x, controlnet_cond, index, scale if k > 1 else jnp.ones_like(scale), group)
        return self._residuals(x, temb, encoder_hidden_states, rows, scale[:, 0] if k == 1 else 1.0, guess_mode)

    def _control_types(self, control_type: jax.Array, b: int) -> jax.Array:
        """(B, time_embed_dim): the multi-hot control_type (B or 1, T) embedded as SDXL's time ids are
        (diffusers' `control_type_proj`), through `control_add_embedding`."""
        u = self.config.unet
        types = jnp.broadcast_to(control_type, (b, control_type.shape[1])).reshape(-1)  # (B * T,)
        embedded = timestep_embedding(types, u.addition_time_embed_dim, flip_sin_to_cos=u.flip_sin_to_cos,
                                      freq_shift=u.freq_shift).reshape(b, -1)  # (B, T * addition_time_embed_dim)
        return self.control_add_embedding(embedded.astype(self.dtype))

    def _fused(self, x: jax.Array, images: jax.Array, index: jax.Array, scale: jax.Array, group: int) -> jax.Array:
        """What the condition transformer adds to conv_in's output x (B, h, w, C0): the sum over the K images of
        (embedding + its token's projection), each times its scale."""
        n, k = images.shape[:2]
        flat = images.astype(self.dtype).reshape(n * k, *images.shape[2:])  # (n*K, f*h, f*w, C_img)
        cond = self.controlnet_cond_embedding(flat)
        cond = cond.reshape(n, k, *cond.shape[1:])  # (n, K, h, w, C0), n = B or 1
        s = scale.astype(cond.dtype)  # (B, K)
        feats = jnp.mean(cond, axis=(2, 3)) + self.task_embedding[...].astype(cond.dtype)[index]  # (B, K, C0)
        tokens = jnp.concatenate([feats * s[..., None], jnp.mean(x, axis=(1, 2))[:, None]], axis=1)  # (B, K+1, C0)
        for layer in self.transformer_layes:
            tokens = layer(tokens, group)
        alpha = self.spatial_ch_projs(tokens[:, :k])  # (B, K, C0)
        per_image = [cond[:, i] * s[:, i, None, None, None] + alpha[:, i, None, None, :] * s[:, i, None, None, None]
                     for i in range(k)]  # each (B, h, w, C0)
        return sum(per_image)
