"""The denoising UNet of SD 1.x, SD 2.x, SDXL (base and refiner) and InstructPix2Pix.

One module, `UNet2DConditionModel`, mirrors diffusers' class of the same name: its attribute paths are
diffusers' state-dict keys (`down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`), so loading a
checkpoint is `sdx.weights.load_torch_state` with no rename table. Tensors are NHWC. Its encoder half
(conv_in, embeddings, down and mid blocks) is `UNetEncoder`, which `sdx.controlnet.ControlNetModel`
shares; the ControlNet's residuals come back in as `down_block_additional_residuals` /
`mid_block_additional_residual`.

The architecture is a frozen `UNetConfig`. Its fields are diffusers' config fields with every per-level
value spelled out as a tuple, and one rename that undoes a diffusers naming accident:

- diffusers' `attention_head_dim` is, in every SD/SDXL config, the number of heads (diffusers issue
  2011: `num_attention_heads` defaults to `attention_head_dim`, and the head size is channels // heads).
  sdx stores it as `num_attention_heads`. SD1: 8 heads of 40/80/160; SD2/SDXL: 64-wide heads.

`UNetConfig.from_diffusers_config(config_json_dict)` honours every field that changes the math and
raises `SdxError` naming the field for any value sdx does not implement (never a silent default); the
rules for every field of diffusers' file are in `sdx.diffusers_config`.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdx import diffusers_config, presets, residuals
from sdx.config import (
    COUNT,
    COUNT_LIST,
    COUNTS,
    DEPTH,
    DEPTHS,
    FLAG,
    NAME,
    NAMES,
    NATURAL,
    NUMBER,
    POSITIVE,
    JsonConfig,
    Kind,
    list_of,
    optional,
)
from sdx.errors import SdxError
from sdx.interventions import Interventions, hooked
from sdx.layers import (
    F32,
    Attention,
    BlankRows,
    Compute,
    Downsample2D,
    GroupNorm,
    ResnetBlock2D,
    TimestepEmbedding,
    TextContext,
    Transformer2DModel,
    rematerialised,
    Upsample2D,
    conv,
    timestep_embedding,
    widen,
)

CROSS_DOWN, PLAIN_DOWN = "CrossAttnDownBlock2D", "DownBlock2D"
CROSS_UP, PLAIN_UP = "CrossAttnUpBlock2D", "UpBlock2D"
CROSS_MID, PLAIN_MID = "UNetMidBlock2DCrossAttn", "UNetMidBlock2D"

LayerCounts = int | tuple[int, ...]  # transformer layers of one level: one number, or one per resnet


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UNetConfig(JsonConfig):
    """What a UNet is. Per-level fields have one entry per entry of `block_out_channels`.

    num_attention_heads: heads per level (diffusers' `attention_head_dim`); head size = channels // heads.
    transformer_layers_per_block: per level, the BasicTransformerBlock count of each Transformer2DModel:
        one int for the whole level, or a tuple with one int per resnet of the down block.
    reverse_transformer_layers_per_block: the up blocks' counts (first entry = deepest level), needed
        only when a level of `transformer_layers_per_block` is a tuple (asymmetric UNets like SSD-1B).
    addition_embed_type: None, or "text_time" (SDXL: pooled text embedding + sinusoidal `time_ids`).
    upcast_attention: kept for round-tripping; sdx always computes attention logits and softmax in
        float32, which is what diffusers' flag asks for.
    sample_size: the latent resolution the model was trained at (default image size = 8 x this).
    """

    label: ClassVar[str] = "unet config"
    kinds: ClassVar[Mapping[str, Kind]] = {
        **{k: COUNT for k in ("in_channels", "out_channels", "norm_num_groups", "conv_in_kernel", "conv_out_kernel")},
        **{k: COUNT_LIST for k in ("block_out_channels", "num_attention_heads", "cross_attention_dim")},
        "down_block_types": NAMES, "up_block_types": NAMES, "mid_block_type": optional(NAME),
        "layers_per_block": list_of(DEPTH), "transformer_layers_per_block": list_of(DEPTHS),
        "reverse_transformer_layers_per_block": optional(list_of(DEPTHS)), "only_cross_attention": list_of(FLAG),
        **{k: FLAG for k in ("use_linear_projection", "upcast_attention", "center_input_sample", "flip_sin_to_cos")},
        "norm_eps": POSITIVE, "downsample_padding": NATURAL, "mid_block_scale_factor": NUMBER, "freq_shift": NUMBER,
        **{k: optional(COUNT) for k in ("time_embedding_dim", "addition_time_embed_dim",
                                        "projection_class_embeddings_input_dim", "time_cond_proj_dim")},
        "addition_embed_type": optional(NAME), "sample_size": optional(COUNTS),
    }

    in_channels: int = 4
    out_channels: int = 4
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    down_block_types: tuple[str, ...] = (CROSS_DOWN, CROSS_DOWN, CROSS_DOWN, PLAIN_DOWN)
    up_block_types: tuple[str, ...] = (PLAIN_UP, CROSS_UP, CROSS_UP, CROSS_UP)
    mid_block_type: str | None = CROSS_MID
    layers_per_block: tuple[int, ...] = (2, 2, 2, 2)
    transformer_layers_per_block: tuple[LayerCounts, ...] = (1, 1, 1, 1)
    reverse_transformer_layers_per_block: tuple[LayerCounts, ...] | None = None
    num_attention_heads: tuple[int, ...] = (8, 8, 8, 8)
    cross_attention_dim: tuple[int, ...] = (768, 768, 768, 768)
    only_cross_attention: tuple[bool, ...] = (False, False, False, False)
    use_linear_projection: bool = False
    upcast_attention: bool = False
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    center_input_sample: bool = False
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3
    flip_sin_to_cos: bool = True
    freq_shift: float = 0
    time_embedding_dim: int | None = None
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    projection_class_embeddings_input_dim: int | None = None
    time_cond_proj_dim: int | None = None  # an LCM UNet's guidance-scale embedding (`guidance_scale_embedding`)
    sample_size: int | tuple[int, int] | None = None

    def __post_init__(self):
        n = len(self.block_out_channels)
        for name in ("down_block_types", "up_block_types", "layers_per_block", "transformer_layers_per_block",
                     "num_attention_heads", "cross_attention_dim", "only_cross_attention"):
            if len(getattr(self, name)) != n:
                raise SdxError(
                    f"unet config: {name} has {len(getattr(self, name))} entries, block_out_channels has {n}"
                )
        kinds = (("down_block_types", (CROSS_DOWN, PLAIN_DOWN)), ("up_block_types", (CROSS_UP, PLAIN_UP)))
        for name, allowed in kinds:
            for t in getattr(self, name):
                if t not in allowed:
                    raise SdxError(
                        f"unet config: {name} entry {t!r} is not implemented in sdx (only {', '.join(allowed)})"
                    )
        if self.mid_block_type not in (CROSS_MID, PLAIN_MID, None):
            raise SdxError(
                f"unet config: mid_block_type {self.mid_block_type!r} is not implemented in sdx "
                f"(only {CROSS_MID}, {PLAIN_MID} or null)"
            )
        if self.addition_embed_type not in (None, "text_time"):
            raise SdxError(
                f"unet config: addition_embed_type {self.addition_embed_type!r} is not implemented in sdx "
                "(only null or 'text_time')"
            )
        if self.addition_embed_type == "text_time" and (
            not self.addition_time_embed_dim or not self.projection_class_embeddings_input_dim
        ):
            raise SdxError(
                "unet config: addition_embed_type 'text_time' needs addition_time_embed_dim and "
                "projection_class_embeddings_input_dim"
            )
        if self.downsample_padding not in (0, 1):
            raise SdxError(
                f"unet config: downsample_padding {self.downsample_padding} is not implemented (only 0 or 1)"
            )
        for name in ("conv_in_kernel", "conv_out_kernel"):
            k = getattr(self, name)
            if k < 1 or k % 2 == 0:
                raise SdxError(f"unet config: {name} {k} is not implemented (odd kernel sizes only)")
        for level, (c, heads) in enumerate(zip(self.block_out_channels, self.num_attention_heads)):
            if c % self.norm_num_groups:
                raise SdxError(
                    f"unet config: block_out_channels {c} is not divisible by norm_num_groups {self.norm_num_groups}"
                )
            if level in self.attention_levels and (heads < 1 or c % heads):
                raise SdxError(
                    f"unet config: {c} channels do not split into num_attention_heads (attention_head_dim) {heads}"
                )
        asymmetric = any(isinstance(x, tuple) for x in self.transformer_layers_per_block)
        if asymmetric and self.reverse_transformer_layers_per_block is None:
            raise SdxError(
                "unet config: transformer_layers_per_block has per-layer lists; "
                "reverse_transformer_layers_per_block must then be given (as diffusers requires)"
            )
        reverse = self.reverse_transformer_layers_per_block
        if reverse is not None and len(reverse) != n:
            raise SdxError(f"unet config: reverse_transformer_layers_per_block needs {n} entries")
        for i in range(n):  # every per-layer list matches its block's resnet count
            self.down_transformer_layers(i)
            self.up_transformer_layers(i)

    # ---- derived quantities --------------------------------------------------------------------

    @property
    def levels(self) -> int:
        return len(self.block_out_channels)

    @property
    def attention_levels(self) -> tuple[int, ...]:
        """The levels (0 = full resolution) with a Transformer2DModel in a down, mid or up block."""
        n = self.levels
        found = {i for i, t in enumerate(self.down_block_types) if t == CROSS_DOWN}
        found |= {n - 1 - i for i, t in enumerate(self.up_block_types) if t == CROSS_UP}
        found |= {n - 1} if self.mid_block_type == CROSS_MID else set()
        return tuple(sorted(found))

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding_dim or 4 * self.block_out_channels[0]

    @property
    def downscale_factor(self) -> int:
        """How much the UNet shrinks the latent at its deepest level (2 ** number of downsamplers)."""
        return 2 ** (self.levels - 1)

    def down_transformer_layers(self, level: int) -> tuple[int, ...]:
        """BasicTransformerBlock count of each Transformer2DModel of down block `level`."""
        return self._expand(
            "transformer_layers_per_block", self.transformer_layers_per_block[level], self.layers_per_block[level]
        )

    def up_transformer_layers(self, i: int) -> tuple[int, ...]:
        """Same for up block `i` (i = 0 is the deepest level)."""
        n = self.layers_per_block[::-1][i] + 1
        if self.reverse_transformer_layers_per_block is None:
            return self._expand("transformer_layers_per_block", self.transformer_layers_per_block[::-1][i], n)
        return self._expand("reverse_transformer_layers_per_block", self.reverse_transformer_layers_per_block[i], n)

    def mid_transformer_layers(self) -> int:
        last = self.transformer_layers_per_block[-1]
        return last[0] if isinstance(last, tuple) else last

    @staticmethod
    def _expand(name: str, value: LayerCounts, n: int) -> tuple[int, ...]:
        if isinstance(value, int):
            return (value,) * n
        if len(value) != n:
            raise SdxError(f"unet config: {name} entry {list(value)} needs one count per resnet ({n})")
        return value

    # ---- diffusers config.json ----------------------------------------------------------------

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> UNetConfig:
        """From a diffusers `unet/config.json` dict (missing fields take diffusers' defaults; the rules
        for every field are `sdx.diffusers_config`'s)."""
        return cls(**diffusers_config.unet_fields(d))

    def to_diffusers_config(self) -> dict[str, Any]:
        """A complete diffusers `unet/config.json` dict (`UNet2DConditionModel(**d)` accepts it without `_` keys)."""
        return diffusers_config.unet_to_diffusers(self.to_dict())

    # ---- sdx's own JSON -----------------------------------------------------------------------

    @classmethod
    def preset(cls, name: str) -> UNetConfig:
        """The UNet of pipeline preset `name` of `sdx.presets` (sd15, sdxl_base, sdxl_refiner, tiny, ...)."""
        return cls.from_diffusers_config(presets.get(name).configs["unet"])


# --------------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------------


def _transformers(cp, c: UNetConfig, channels: int, level: int, counts, *, only_cross: bool, rngs) -> nnx.List:
    heads = c.num_attention_heads[level]
    return nnx.List([
        Transformer2DModel(
            cp, channels, heads=heads, head_dim=channels // heads, context_dim=c.cross_attention_dim[level],
            layers=n, groups=c.norm_num_groups, use_linear_projection=c.use_linear_projection,
            only_cross_attention=only_cross, rngs=rngs,
        )
        for n in counts
    ])


class DownBlock2D(nnx.Module):
    """diffusers' DownBlock2D, or its CrossAttnDownBlock2D (a Transformer2DModel after each resnet) when
    `down_block_types` says so for this level.

    Returns the output and the skip connections it leaves for the up path (one per resnet, plus the
    downsampled output). Each transformer's output is a site (`down_blocks.<i>.attentions.<j>`) whose hooks, in
    the context, see it before the skip is taken (where a T2I-Adapter adds its feature map, `sdx.residuals`).
    """

    def __init__(self, cp: Compute, c: UNetConfig, level: int, cin: int, *, rngs: nnx.Rngs):
        cout, layers = c.block_out_channels[level], c.layers_per_block[level]
        self.resnets = nnx.List([
            ResnetBlock2D(cp, cin if i == 0 else cout, cout, temb_channels=c.time_embed_dim,
                          groups=c.norm_num_groups, eps=c.norm_eps, rngs=rngs)
            for i in range(layers)
        ])
        self.attentions = (
            _transformers(cp, c, cout, level, c.down_transformer_layers(level),
                          only_cross=c.only_cross_attention[level], rngs=rngs)
            if c.down_block_types[level] == CROSS_DOWN else None
        )
        last = level == c.levels - 1
        self.downsamplers = (
            None if last else nnx.List([Downsample2D(cp, cout, padding=c.downsample_padding, rngs=rngs)])
        )
        self.index = level

    def __call__(self, x, temb, context):
        hooks = _hooks(context)
        skips = []
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                (x,) = hooked(hooks, f"down_blocks.{self.index}.attentions.{i}", self.attentions[i](x, context))
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, tuple(skips)


def _hooks(context) -> Interventions | None:
    """The interventions a `TextContext` carries (None for a plain context array)."""
    return context.interventions if isinstance(context, TextContext) else None


class MidBlock2D(nnx.Module):
    """UNetMidBlock2DCrossAttn (resnet, transformer, resnet) or UNetMidBlock2D (one resnet)."""

    def __init__(self, cp: Compute, c: UNetConfig, *, rngs: nnx.Rngs):
        ch = c.block_out_channels[-1]
        cross = c.mid_block_type == CROSS_MID
        self.resnets = nnx.List([
            ResnetBlock2D(cp, ch, ch, temb_channels=c.time_embed_dim, groups=c.norm_num_groups, eps=c.norm_eps,
                          output_scale_factor=c.mid_block_scale_factor, rngs=rngs)
            for _ in range(2 if cross else 1)
        ])
        self.attentions = (
            _transformers(cp, c, ch, c.levels - 1, (c.mid_transformer_layers(),), only_cross=False, rngs=rngs)
            if cross else None
        )

    def __call__(self, x, temb, context):
        x = self.resnets[0](x, temb)
        if self.attentions is not None:
            (x,) = hooked(_hooks(context), "mid_block.attentions.0", self.attentions[0](x, context))
            x = self.resnets[1](x, temb)
        return x


def token_grid(tokens: int, height: int, width: int) -> tuple[int, int]:
    """The (h, w) of an attention's `tokens` positions in a UNet whose latents are (height, width): the size
    halved (rounding up, as its stride-2 downsamplers do) until it has that many positions."""
    h, w = height, width
    while h * w > tokens:
        h, w = -(-h // 2), -(-w // 2)
    if h * w != tokens:
        raise SdxError(f"unet: {tokens} attention positions are no halving of {height}x{width} latents")
    return h, w


def nearest_resize(x, size: tuple[int, int]):
    """torch F.interpolate(mode='nearest', size=size) on NHWC: source index floor(dst * in/out)."""
    def index(n_in, n_out):
        scale = np.float32(n_in / n_out)
        return np.minimum(np.floor(np.arange(n_out, dtype=np.float32) * scale).astype(np.int32), n_in - 1)
    return x[:, index(x.shape[1], size[0])][:, :, index(x.shape[2], size[1])]


class UpBlock2D(nnx.Module):
    """diffusers' UpBlock2D, or its CrossAttnUpBlock2D when `up_block_types` says so; each resnet eats
    one skip connection (the last one left by the down path), concatenated after its input's channels."""

    def __init__(self, cp: Compute, c: UNetConfig, i: int, *, rngs: nnx.Rngs):
        rev = c.block_out_channels[::-1]
        n = c.levels
        cout, cin, prev = rev[i], rev[min(i + 1, n - 1)], rev[max(i - 1, 0)]
        layers = c.layers_per_block[::-1][i] + 1
        self.resnets = nnx.List([
            ResnetBlock2D(
                cp, (prev if j == 0 else cout) + (cin if j == layers - 1 else cout), cout,
                temb_channels=c.time_embed_dim, groups=c.norm_num_groups, eps=c.norm_eps, rngs=rngs,
            )
            for j in range(layers)
        ])
        self.attentions = (
            _transformers(cp, c, cout, n - 1 - i, c.up_transformer_layers(i),
                          only_cross=c.only_cross_attention[::-1][i], rngs=rngs)
            if c.up_block_types[i] == CROSS_UP else None
        )
        self.upsamplers = None if i == n - 1 else nnx.List([Upsample2D(cp, cout, rngs=rngs)])
        self.index = i

    def __call__(self, x, skips, temb, context, upsample_size: tuple[int, int] | None = None):
        """The hooks of each resnet's site `up_blocks.<i>.resnets.<j>.skip` (`sdx.interventions`), in the
        context, see (hidden states, skip) before they are concatenated."""
        hooks = _hooks(context)
        for j, resnet in enumerate(self.resnets):
            x, skip = hooked(hooks, f"up_blocks.{self.index}.resnets.{j}.skip", x, widen(skips[-1 - j], x.shape[0]))
            x = jnp.concatenate([x, skip], axis=-1)  # (B, H, W, C + C_skip), diffusers' order
            x = resnet(x, temb)
            if self.attentions is not None:
                (x,) = hooked(hooks, f"up_blocks.{self.index}.attentions.{j}", self.attentions[j](x, context))
        if self.upsamplers is not None:
            up = self.upsamplers[0]
            if upsample_size is None:
                x = up(x)
            else:  # an odd size upstream: match the skip's size exactly, as diffusers does
                x = up.conv(nearest_resize(x, upsample_size))
        return x


# --------------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------------


class UNetEncoder(nnx.Module):
    """The half of a UNet that diffusers' ControlNetModel copies (`ControlNetModel.from_unet`): conv_in, the
    time embedding (plus SDXL's added embedding), the down blocks and the mid block, with their input
    checks and the remat switch. `UNet2DConditionModel` adds the up path; `sdx.controlnet.ControlNetModel`
    the conditioning image's embedding and the zero convolutions. Attribute names are diffusers' keys.
    """

    label: ClassVar[str] = "unet"  # the model's name in error messages

    def __init__(self, config: UNetConfig, cp: Compute, *, rngs: nnx.Rngs):
        c = config
        self.compute = cp  # what the model carries, so callers never infer the compute dtype from a kernel
        self.remat = cp.remat
        self.dtype = cp.dtype
        boc = c.block_out_channels
        self.conv_in = conv(cp, c.in_channels, boc[0], c.conv_in_kernel, rngs=rngs)
        self.time_embedding = TimestepEmbedding(cp, boc[0], c.time_embed_dim, cond_dim=c.time_cond_proj_dim, rngs=rngs)
        self.add_embedding = (
            TimestepEmbedding(cp, c.projection_class_embeddings_input_dim, c.time_embed_dim, rngs=rngs)
            if c.addition_embed_type == "text_time" else None
        )
        cins = (boc[0],) + boc[:-1]
        self.down_blocks = nnx.List([DownBlock2D(cp, c, i, cins[i], rngs=rngs) for i in range(c.levels)])
        self.mid_block = MidBlock2D(cp, c, rngs=rngs) if c.mid_block_type is not None else None

    @property
    def unet_config(self) -> UNetConfig:
        """The architecture of this half (a UNet's own config; a ControlNet's `config.unet`)."""
        return self.config

    def _reading_text(self) -> list[tuple[tuple, Attention]]:
        """(path, attention) of each attention that reads the text context: every cross-attention, and a
        self-attention of `only_cross_attention`."""
        return [(path, m) for path, m in nnx.iter_graph(self) if isinstance(m, Attention) and m.reads_context]

    def _name_attentions(self) -> None:
        """Key each attention by its path, diffusers' module name (a subclass calls it once all its modules
        exist)."""
        for path, m in nnx.iter_graph(self):
            if isinstance(m, Attention):
                m.key = ".".join(map(str, path))

    def sites(self) -> dict[str, str]:
        """{name: kind} of every place an intervention can act on (`sdx.interventions`), in module order:
        each attention by its path, of kind "self" or "cross" (diffusers' `is_cross_attention`: attn2, and
        attn1 with only_cross_attention), each transformer's output (`down_blocks.<i>.attentions.<j>`,
        `mid_block.attentions.0`, kind "transformer") and each block's output (`down_blocks.<i>`, `mid_block`,
        kind "block"); a UNet adds its up blocks' transformers, skip concatenations (kind "skip") and outputs."""
        attentions = [m for _, m in nnx.iter_graph(self) if isinstance(m, Attention)]
        found = {m.key: "cross" if m.reads_context else "self" for m in attentions}
        for i, block in enumerate(self.down_blocks):
            found |= _transformer_sites(f"down_blocks.{i}", block) | {f"down_blocks.{i}": "block"}
        if self.mid_block is not None:
            found |= _transformer_sites("mid_block", self.mid_block) | {"mid_block": "block"}
        return found

    def text_context(self, encoder_hidden_states: jax.Array, blank: BlankRows | None = None) -> TextContext:
        """encoder_hidden_states (B, S, D) with the keys and values of every attention that reads it
        projected, for calls that read the same text: a sampler makes them once per image instead of once
        per step (SDXL's 140 projections from 2,048 features; on a 2-core CPU at 256² a UNet call took
        5.16-5.18 s with them, 4.13-4.62 s without). `__call__` takes it in place of the array, with the
        same result; only this model's `__call__` does (a ControlNet has its own).

        blank: rows whose text may be zeros (SDXL's negative branch without a negative prompt); when
        every one of them is, at run time, their cross-attentions are not computed (`Attention`). Their
        projections here still are (once per image): skipping them too takes a second `lax.cond` per
        attention, a copy of every projection in a program a warm start reads back."""
        states = encoder_hidden_states
        kv = {m.key: m.keys_values(states) for _, m in self._reading_text()}
        return TextContext(states, kv, blank, None if blank is None else blank.all_zero(states))

    def _check_inputs(self, sample, encoder_hidden_states) -> tuple[int, int]:
        """The sample's rows and the batch's (the context's), after checking the sample's layout, the
        context's width (and that a `TextContext` holds this model's attentions) and that the sample's rows
        can be shared (`UNet2DConditionModel.__call__`)."""
        c = self.unet_config
        if sample.ndim != 4 or sample.shape[-1] != c.in_channels:
            raise SdxError(f"{self.label}: sample must be (B, H, W, {c.in_channels}) NHWC, got {tuple(sample.shape)}")
        b = sample.shape[0]
        ctx = encoder_hidden_states
        if isinstance(ctx, TextContext):
            if set(ctx.kv) != {m.key for _, m in self._reading_text()}:
                raise SdxError(f"{self.label}: this TextContext was not made by this model's text_context")
            ctx = ctx.states
        widths = sorted({c.cross_attention_dim[i] for i in c.attention_levels})  # what the context must be
        if ctx.ndim != 3 or ctx.shape[0] % b or any(w != ctx.shape[-1] for w in widths):
            raise SdxError(
                f"{self.label}: encoder_hidden_states must be (B, S, {'/'.join(map(str, widths)) or 'any'}) with B "
                f"the sample's {b} rows or a multiple of them, got {tuple(ctx.shape)}"
            )
        if ctx.shape[0] != b and self.add_embedding is not None:
            raise SdxError(
                f"{self.label}: this model's time embedding reads the pooled text (addition_embed_type "
                f"'text_time', SDXL), so rows of its sample cannot be shared: give one per context row "
                f"({ctx.shape[0]}), not {b}"
            )
        return b, ctx.shape[0]

    def _check_added_cond(self, batch: int, added_cond) -> None:
        c = self.unet_config
        if self.add_embedding is None:
            return
        if not added_cond or "text_embeds" not in added_cond or "time_ids" not in added_cond:
            raise SdxError(
                f"{self.label}: this model (addition_embed_type 'text_time', SDXL) needs added_cond="
                "{'text_embeds': (B, P), 'time_ids': (B, N)}"
            )
        text, time_ids = added_cond["text_embeds"], added_cond["time_ids"]
        got = text.shape[-1] + time_ids.shape[-1] * c.addition_time_embed_dim
        if got != c.projection_class_embeddings_input_dim or text.shape[0] != batch or time_ids.shape[0] != batch:
            raise SdxError(
                f"{self.label}: text_embeds {tuple(text.shape)} and time_ids {tuple(time_ids.shape)} give "
                f"{got} conditioning features; this model takes {c.projection_class_embeddings_input_dim} "
                f"for a batch of {batch} (base SDXL: 6 time ids, refiner: 5)"
            )

    def _embed(self, timesteps, batch: int, added_cond, timestep_cond: jax.Array | None = None) -> jax.Array:
        """The time embedding (B, time_embed_dim) (with an LCM UNet's guidance embedding `timestep_cond` (B,
        time_cond_proj_dim), `guidance_scale_embedding`), plus SDXL's pooled-text-and-size embedding."""
        c = self.unet_config
        if timestep_cond is not None and (c.time_cond_proj_dim is None
                                          or tuple(timestep_cond.shape) != (batch, c.time_cond_proj_dim)):
            raise SdxError(f"{self.label}: timestep_cond {tuple(timestep_cond.shape)} for a batch of {batch}; this "
                           f"model takes (B, time_cond_proj_dim={c.time_cond_proj_dim})")
        t = jnp.asarray(timesteps).reshape(-1)
        if t.shape[0] not in (1, batch):
            raise SdxError(
                f"{self.label}: {t.shape[0]} timesteps for a batch of {batch} (give one, or one per sample)"
            )
        self._check_added_cond(batch, added_cond)
        t = jnp.broadcast_to(t, (batch,))
        emb = self.time_embedding(
            timestep_embedding(t, c.block_out_channels[0], flip_sin_to_cos=c.flip_sin_to_cos, freq_shift=c.freq_shift),
            timestep_cond,
        )
        if self.add_embedding is None:
            return emb
        text, time_ids = added_cond["text_embeds"], added_cond["time_ids"]
        time_emb = timestep_embedding(
            time_ids.reshape(-1), c.addition_time_embed_dim, flip_sin_to_cos=c.flip_sin_to_cos, freq_shift=c.freq_shift
        ).reshape(batch, -1)  # (B, N * addition_time_embed_dim)
        add = jnp.concatenate([text.astype(jnp.float32), time_emb], axis=-1)  # (B, projection dim)
        return emb + self.add_embedding(add)

    def _run(self, block, *args, **static):
        """Call a block, rematerialised in the backward pass when `cp.remat` (static args by closure)."""
        if self.remat:
            return rematerialised(lambda b, *a: b(*a, **static), block, *args)
        return block(*args, **static)

    def _down(self, x, temb, context) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The down blocks on conv_in's output x: (their output, the skip connections: x, then each block's)."""
        skips: tuple = (x,)
        for i, block in enumerate(self.down_blocks):
            x, res = hooked(_hooks(context), f"down_blocks.{i}", *self._run(block, x, temb, context))
            skips += res
        return x, skips


def _transformer_sites(prefix: str, block) -> dict[str, str]:
    """The "transformer" sites of a block: its transformers' outputs, none without attentions."""
    return {f"{prefix}.attentions.{j}": "transformer" for j in range(len(block.attentions or ()))}


def guidance_scale_embedding(w: jax.Array, dim: int) -> jax.Array:
    """(B,) -> (B, dim) float32: the sinusoidal embedding of w * 1000 an LCM UNet's `timestep_cond` takes (VDM's,
    Kingma et al. 2021, as diffusers' `get_guidance_scale_embedding`); its pipelines embed w = guidance_scale - 1
    and run no classifier-free guidance branch."""
    half = dim // 2
    freqs = jnp.exp(jnp.arange(half, dtype=jnp.float32) * -(jnp.log(jnp.float32(10000.0)) / (half - 1)))
    angles = (jnp.asarray(w, jnp.float32) * 1000.0)[:, None] * freqs[None, :]  # (B, half)
    return jnp.pad(jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=1), ((0, 0), (0, dim % 2)))


class UNet2DConditionModel(UNetEncoder):
    """eps/v prediction network. sample (B, H, W, C_in) NHWC -> (B, H, W, C_out) in `cp.dtype`.

    H and W need not be multiples of `config.downscale_factor` (odd sizes are upsampled back to the
    skip connection's size, as in diffusers).
    """

    def __init__(self, config: UNetConfig, cp: Compute = F32, *, rngs: nnx.Rngs):
        self.config = config
        super().__init__(config, cp, rngs=rngs)
        c, boc = config, config.block_out_channels
        self.up_blocks = nnx.List([UpBlock2D(cp, c, i, rngs=rngs) for i in range(c.levels)])
        self.conv_norm_out = GroupNorm(cp, boc[0], c.norm_num_groups, c.norm_eps, rngs=rngs)
        self.conv_out = conv(cp, boc[0], c.out_channels, c.conv_out_kernel, rngs=rngs)
        self._name_attentions()

    def sites(self) -> dict[str, str]:
        found = super().sites()
        for i, block in enumerate(self.up_blocks):
            found |= {f"up_blocks.{i}.resnets.{j}.skip": "skip" for j in range(len(block.resnets))}
            found |= _transformer_sites(f"up_blocks.{i}", block) | {f"up_blocks.{i}": "block"}
        return found

    def __call__(
        self,
        sample: jax.Array,
        timesteps: jax.Array | float | int,
        encoder_hidden_states: jax.Array,
        added_cond: Mapping[str, jax.Array] | None = None,
        down_block_additional_residuals: Sequence[jax.Array] | None = None,
        mid_block_additional_residual: jax.Array | None = None,
        down_intrablock_additional_residuals: Sequence[jax.Array] = (),
        interventions: Interventions | None = None,
        timestep_cond: jax.Array | None = None,
    ) -> jax.Array:
        """sample (B, H, W, C_in); timesteps () or (B,); encoder_hidden_states (B, S, D), or this model's
        `text_context` of it; added_cond {"text_embeds": (B, P), "time_ids": (B, N)} for SDXL. -> (B, H, W, C_out).

        interventions: processors and hooks for this call (`sdx.interventions`, on the names of `sites()`),
        added outermost to the context's own; what they record comes out of `sdx.interventions.capture`.

        The sample may have B / n rows, each the input of n consecutive rows of the batch (a sampler's
        classifier-free guidance branches of one image, which share their latents and timestep; timesteps
        then () or (B / n,)): what comes before the first attention that reads the text runs once for them
        (SD 1.x: conv_in, the first resnet and the first self-attention; SD 1.5's call with guidance on a
        2-core CPU 1.5 % faster at 512², 5 % at 256²), the same result as the sample repeated n times to
        float32 rounding. Not for a model whose time embedding reads the pooled text (SDXL), where nothing
        comes before the text.

        diffusers' residual arguments, translated into hooks on the sites where diffusers adds them
        (`sdx.residuals`): down_block_additional_residuals and mid_block_additional_residual, a ControlNet's
        outputs (`sdx.controlnet.ControlNetModel`, in the order it returns them), both or neither;
        down_intrablock_additional_residuals, a T2I-Adapter's feature maps (`sdx.t2i_adapter`), each (B, H_i,
        W_i, C_i) with B the context's rows: one per down block from the first, and one more for the mid
        block's output (SDXL's adapters).

        timestep_cond: (B, time_cond_proj_dim), an LCM UNet's guidance embedding (`guidance_scale_embedding` of
        w - 1, as diffusers' pipelines build it), B the sample's rows; None: none added (as diffusers).
        """
        added = residuals.from_diffusers(self, down_block_additional_residuals, mid_block_additional_residual,
                                         down_intrablock_additional_residuals)
        context = self.with_interventions(encoder_hidden_states, interventions, added)
        return self.forward(sample, timesteps, context, added_cond, timestep_cond)

    def with_interventions(self, context, outer: Interventions | None, inner: Interventions | None = None):
        """`context` (an array, or this model's `text_context`) carrying `outer` outside its own interventions
        and `inner` inside them (a `TextContext`, made when there are any)."""
        if outer is None and inner is None:
            return context
        context = context if isinstance(context, TextContext) else self.text_context(context)
        layers = [one for one in (outer, context.interventions, inner) if one is not None]
        return dataclasses.replace(context, interventions=functools.reduce(operator.or_, layers))

    def forward(self, sample: jax.Array, timesteps, context, added_cond=None, timestep_cond=None) -> jax.Array:
        """`__call__` with everything that changes the model in the context's interventions."""
        c = self.config
        b, rows = self._check_inputs(sample, context)
        x = sample.astype(self.dtype)
        if c.center_input_sample:
            x = 2 * x - 1.0
        temb = self._embed(timesteps, b, added_cond, timestep_cond)
        x, skips = self._down(self.conv_in(x), temb, context)
        if self.mid_block is not None:
            (x,) = hooked(_hooks(context), "mid_block", self._run(self.mid_block, x, temb, context))
        odd = sample.shape[1] % c.downscale_factor or sample.shape[2] % c.downscale_factor
        for i, block in enumerate(self.up_blocks):
            n = len(block.resnets)
            res, skips = skips[-n:], skips[:-n]
            size = tuple(skips[-1].shape[1:3]) if odd and i < len(self.up_blocks) - 1 else None
            (x,) = hooked(_hooks(context), f"up_blocks.{i}", self._run(block, x, res, temb, context, upsample_size=size))
        x = jax.nn.silu(self.conv_norm_out(x))
        return widen(self.conv_out(x), rows)
