"""Building blocks shared by the UNet, the VAE and the text encoders.

Attribute names follow diffusers' key paths (`to_q`, `to_out.0`, `ff.net.2`, `conv_shortcut`), so a
parameter path in sdx is the diffusers key with `weight` renamed to `kernel`/`scale`/`embedding`.
Tensors are NHWC. Norms and softmax run in float32 whatever the compute dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from sdx import conv as convlib
from sdx import interventions, outline, products
from sdx.attention import Backend
from sdx.errors import SdxError
from sdx.interventions import AttentionCall, Interventions, Processor


@dataclasses.dataclass(frozen=True)
class Compute:
    """How a model runs, as opposed to what it is (the architecture config).

    dtype: activations and matmuls; param_dtype: the stored weights; attention: the backend of
    `sdx.attention.dot_product_attention`; attention_chunk: query chunk for the `chunked` backend;
    batch_shards: the devices the batch is split over (a mesh's size: `sdx.mesh.batch_sharding`), whose
    shares the `chunked` backend keeps apart;
    conv: the backend of every convolution (`sdx.conv`; `auto` takes matrix products, or Winograd's, where
    they are faster on a CPU); remat: rematerialise (recompute in the backward pass) each UNet block, or each
    text encoder layer, for training (`rematerialised`).
    """

    dtype: jnp.dtype = jnp.float32
    param_dtype: jnp.dtype = jnp.float32
    attention: Backend = "xla"
    attention_chunk: int = 512
    batch_shards: int = 1
    conv: convlib.Backend = "auto"
    remat: bool = False


F32 = Compute()


def rematerialised(call, block: nnx.Module, *args):
    """call(block, *args), its activations recomputed in the backward pass instead of kept. The block goes
    through `jax.checkpoint` as its split state: `nnx.remat` refuses a block whose variables come from two
    traces (a LoRA run differentiates the adapters alone, the rest being constants). What the block
    records (`sdx.interventions.record`) comes out with its output."""
    graphdef, state = nnx.split(block)
    run = lambda s, *a: interventions.capture(call, nnx.merge(graphdef, s), *a)
    out, records = jax.checkpoint(run)(state, *args)
    interventions.forward(records)
    return out


class Linear(nnx.Linear):
    """nnx.Linear that adds the output of its LoRA adapter `lora` when it has one (`sdx.lora.attach`)."""

    lora = None

    def __call__(self, x):
        y = super().__call__(x)
        return y if self.lora is None else y + self.lora(x).astype(y.dtype)

    def without_bias(self, x):
        """The layer's linear map alone: its kernel (and LoRA adapter), no bias."""
        x, kernel = self.promote_dtype((x, self.kernel[...]), dtype=self.dtype)
        y = self.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=self.precision)
        return y if self.lora is None else y + self.lora(x).astype(y.dtype)


def linear(cp: Compute, din: int, dout: int, *, rngs: nnx.Rngs, bias: bool = True) -> Linear:
    return Linear(din, dout, use_bias=bias, dtype=cp.dtype, param_dtype=cp.param_dtype,
                      dot_general=products.dot_general, rngs=rngs)


def conv(cp: Compute, cin: int, cout: int, kernel: int, *, rngs: nnx.Rngs, stride: int = 1, padding=None,
         bias: bool = True) -> nnx.Conv:
    """A torch-style Conv2d: symmetric padding kernel//2 unless given explicitly."""
    if padding is None:
        padding = ((kernel // 2, kernel // 2),) * 2
    return nnx.Conv(
        cin, cout, (kernel, kernel), strides=stride, padding=padding, use_bias=bias,
        dtype=cp.dtype, param_dtype=cp.param_dtype, conv_general_dilated=convlib.for_backend(cp.conv), rngs=rngs,
    )


class GroupNorm(nnx.GroupNorm):
    """torch.nn.GroupNorm over NHWC (or (B, T, C)): exact two-pass variance in float32."""

    def __init__(self, cp: Compute, channels: int, groups: int, eps: float, *, rngs: nnx.Rngs):
        super().__init__(
            channels, num_groups=groups, epsilon=eps, dtype=jnp.float32,
            param_dtype=cp.param_dtype, use_fast_variance=False, rngs=rngs,
        )

    def __call__(self, x):
        return super().__call__(x.astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.LayerNorm):
    """torch.nn.LayerNorm over the last axis, computed in float32."""

    def __init__(self, cp: Compute, dim: int, eps: float, *, rngs: nnx.Rngs):
        super().__init__(
            dim, epsilon=eps, dtype=jnp.float32, param_dtype=cp.param_dtype,
            use_fast_variance=False, rngs=rngs,
        )

    def __call__(self, x):
        return super().__call__(x.astype(jnp.float32)).astype(x.dtype)


def timestep_embedding(
    t: jax.Array, dim: int, *, flip_sin_to_cos: bool, freq_shift: float, max_period: float = 10000.0
) -> jax.Array:
    """Sinusoidal embedding (DDPM/transformer style) of t: (B,) -> (B, dim), in float32.

    Frequencies exp(-ln(max_period) * i / (dim/2 - freq_shift)); `flip_sin_to_cos` puts cos first.
    """
    half = dim // 2
    exponent = -math.log(max_period) * jnp.arange(half, dtype=jnp.float32) / (half - freq_shift)
    args = t.astype(jnp.float32)[:, None] * jnp.exp(exponent)[None, :]  # (B, half)
    sin, cos = jnp.sin(args), jnp.cos(args)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    if dim % 2:
        emb = jnp.pad(emb, ((0, 0), (0, 1)))
    return emb


def widen(x: jax.Array, rows: int) -> jax.Array:
    """x (b, ...) -> (rows, ...), each row repeated rows // b times in place: an activation computed once for
    consecutive rows of a batch that share it (a sampler's guidance branches of one image,
    `UNet2DConditionModel.__call__`) meeting a batch of `rows`. x itself when it has `rows` rows."""
    return x if x.shape[0] == rows else jnp.repeat(x, rows // x.shape[0], axis=0)


class TimestepEmbedding(nnx.Module):
    """linear_1 -> SiLU -> linear_2 (diffusers TimestepEmbedding); with `cond_dim`, a condition (B, cond_dim)
    projected by `cond_proj` (no bias) is added to the input first (an LCM UNet's guidance embedding)."""

    def __init__(self, cp: Compute, din: int, dim: int, *, cond_dim: int | None = None, rngs: nnx.Rngs):
        self.cond_proj = linear(cp, cond_dim, din, bias=False, rngs=rngs) if cond_dim else None
        self.linear_1 = linear(cp, din, dim, rngs=rngs)
        self.linear_2 = linear(cp, dim, dim, rngs=rngs)

    def __call__(self, x, condition=None):
        if condition is not None:
            x = x + self.cond_proj(condition.astype(x.dtype))
        return self.linear_2(jax.nn.silu(self.linear_1(x)))


class ResnetBlock2D(nnx.Module):
    """GroupNorm-SiLU-conv twice, timestep added between, 1x1 `conv_shortcut` when channels change.

    temb_channels=None for the VAE (no time embedding). out = (x + h) / output_scale_factor.
    """

    def __init__(
        self, cp: Compute, cin: int, cout: int, *, temb_channels: int | None, groups: int, eps: float,
        output_scale_factor: float = 1.0, rngs: nnx.Rngs,
    ):
        self.output_scale_factor = output_scale_factor
        self.norm1 = GroupNorm(cp, cin, groups, eps, rngs=rngs)
        self.conv1 = conv(cp, cin, cout, 3, rngs=rngs)
        self.time_emb_proj = linear(cp, temb_channels, cout, rngs=rngs) if temb_channels else None
        self.norm2 = GroupNorm(cp, cout, groups, eps, rngs=rngs)
        self.conv2 = conv(cp, cout, cout, 3, rngs=rngs)
        self.conv_shortcut = conv(cp, cin, cout, 1, rngs=rngs) if cin != cout else None

    def __call__(self, x, temb=None):
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        if self.time_emb_proj is not None:
            h = h + widen(self.time_emb_proj(jax.nn.silu(temb)), h.shape[0])[:, None, None, :]
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(x)
        out = x + h
        return out / self.output_scale_factor if self.output_scale_factor != 1.0 else out


class Downsample2D(nnx.Module):
    """3x3 stride-2 conv. padding=1 in the UNet; the VAE encoder pads (0,1,0,1) and uses padding=0."""

    def __init__(self, cp: Compute, channels: int, *, padding: int = 1, rngs: nnx.Rngs):
        pad = ((1, 1), (1, 1)) if padding == 1 else ((0, 1), (0, 1))
        self.conv = conv(cp, channels, channels, 3, stride=2, padding=pad, rngs=rngs)

    def __call__(self, x):
        return self.conv(x)


class Upsample2D(nnx.Module):
    """Nearest-neighbour 2x then a 3x3 conv; on a CPU, for large enough images, the conv computed before
    upsampling (`sdx.conv.upsample_conv`, `folds_upsampling`)."""

    def __init__(self, cp: Compute, channels: int, *, rngs: nnx.Rngs):
        self.conv = conv(cp, channels, channels, 3, rngs=rngs)
        self.backend = cp.conv

    def __call__(self, x):
        if not convlib.folds_upsampling(x.shape, self.backend):
            return self.conv(jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2))  # (B, 2H, 2W, C)
        y = convlib.upsample_conv(x.astype(self.conv.dtype), self.conv.kernel[...], self.backend)
        return y + self.conv.bias[...].astype(y.dtype)


@dataclasses.dataclass(frozen=True)
class Rows:
    """Some rows of each period of a batch: row j * period + r for each r in `rows`. A sampler's guidance
    batch is image-major (branch k of image j is row j * branches + k), so one branch of every image is
    `Rows(branches, (k,))`."""

    period: int
    rows: tuple[int, ...]

    def group(self, a: jax.Array) -> jax.Array:
        """(B * period, ...) -> (B, period, ...)."""
        if a.shape[0] % self.period:
            raise SdxError(f"rows of period {self.period} in a batch of {a.shape[0]} rows")
        return a.reshape(a.shape[0] // self.period, self.period, *a.shape[1:])

    def pick(self, a: jax.Array, rows: tuple[int, ...]) -> jax.Array:
        """(B * period, ...) -> (B * len(rows), ...): rows j * period + r of `a`, r in `rows`, image-major."""
        picked = jnp.stack([self.group(a)[:, r] for r in rows], axis=1)  # (B, len(rows), ...)
        return picked.reshape(picked.shape[0] * len(rows), *a.shape[1:])

    def others(self) -> tuple[int, ...]:
        """The positions in a period that are not `rows`."""
        return tuple(r for r in range(self.period) if r not in self.rows)

    def join(self, others: jax.Array, these: jax.Array) -> jax.Array:
        """The inverse of picking `others()` and `rows` apart: (B * len(others), ...) and (B * len(rows), ...)
        -> (B * period, ...). `these` may be one row's shape, broadcast to every row of `rows`."""
        kept = self.others()
        grouped = others.reshape(-1, len(kept), *others.shape[1:])  # (B, len(others), ...)
        row_shape = grouped[:, 0].shape
        mine = (these.reshape(-1, len(self.rows), *others.shape[1:]) if these.ndim == others.ndim
                else jnp.broadcast_to(these, (row_shape[0], len(self.rows), *row_shape[1:])))  # (B, len(rows), ...)
        rows = [grouped[:, kept.index(r)] if r in kept else mine[:, self.rows.index(r)] for r in range(self.period)]
        return jnp.stack(rows, axis=1).reshape(-1, *others.shape[1:])  # (B, period, ...) -> (B * period, ...)


@dataclasses.dataclass(frozen=True)
class BlankRows(Rows):
    """Rows of a batch whose text may be blank (all zeros). SDXL's negative branch without a negative prompt
    (force_zeros_for_empty_prompt) is `BlankRows(2, (0,))` in classifier-free guidance's batch."""

    def merge(self, others: jax.Array, fill: jax.Array) -> jax.Array:
        """The inverse of `pick(a, self.others())`, each blank row being `fill` broadcast to a row's shape:
        (B * len(others), ...) -> (B * period, ...)."""
        return self.join(others, fill)

    def all_zero(self, states: jax.Array) -> jax.Array:
        """() bool: whether the text `states` (B * period, S, D) is zeros in every blank row."""
        if states.shape[0] % self.period:
            raise SdxError(f"blank rows of period {self.period} in a batch of {states.shape[0]} rows")
        return jnp.all(self.pick(states, self.rows) == 0)


@dataclasses.dataclass(frozen=True)
class SkipBlankRows(Processor):
    """The built-in processor of a cross-attention whose `TextContext` says which rows may be blank: when they
    are (`is_blank`, at run time), only the other rows attend. In a blank row every key and value is the
    projection of the zero vector, so the softmax is uniform and the attention is to_v's bias (zeros without
    one) for every query, and the output to_out of that: to_out's bias when to_v has none, as in every UNet
    (SDXL's negative branch: cross-attentions 4 % of the UNet's arithmetic)."""

    blank: BlankRows
    is_blank: jax.Array
    traced: ClassVar[tuple[str, ...]] = ("is_blank",)
    per_row: ClassVar[bool] = False

    def __call__(self, call: AttentionCall) -> jax.Array:
        return jax.lax.cond(self.is_blank, lambda: self._skip(call), call.proceed)

    def _skip(self, call: AttentionCall) -> jax.Array:
        attended = call.rows(self.blank, self.blank.others()).proceed()  # (B * len(others), T, C)
        m = call.module
        out = m.to_out[0]
        if m.to_v.bias is None:  # every UNet's: no product at all
            constant = out.bias[...].astype(attended.dtype)  # (C,)
        else:
            constant = out(m.to_v.bias[...].astype(attended.dtype))  # (C,)
        return self.blank.merge(attended, constant)  # (B * period, T, C)

    def restrict(self, pick):
        return None  # its rows are the whole batch's


@dataclasses.dataclass(frozen=True)
class ImagePrompt(Processor):
    """An IP-Adapter's decoupled cross-attention (`sdx.ip_adapter`): the attention of the same queries over the
    image tokens' keys and values (B, N, heads, head_dim), times `scale` (B,), one per row, added to the text's.
    diffusers adds it before to_out; to_out being linear, it is added here to the output of the rest of the chain
    through to_out's kernel alone (`AttentionCall.added_output`), so that several adapters, the blank rows'
    shortcut and other processors compose."""

    keys: jax.Array
    values: jax.Array
    scale: jax.Array
    traced: ClassVar[tuple[str, ...]] = ("keys", "values", "scale")
    per_row: ClassVar[bool] = False

    def __call__(self, call: AttentionCall) -> jax.Array:
        q = call.query()
        image = call.attend(q, self.keys, self.values)  # (B, T, heads, head_dim)
        scale = self.scale.astype(image.dtype).reshape(-1, 1, 1, 1)  # (B,) -> (B, 1, 1, 1)
        return call.proceed(q=q) + call.added_output(scale * image)

    def restrict(self, pick):
        return dataclasses.replace(self, keys=pick(self.keys), values=pick(self.values), scale=pick(self.scale))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TextContext:
    """A UNet's text context with the keys and values of every attention that reads it already projected
    (`UNet2DConditionModel.text_context`), for calls that read the same text: a sampler's steps; and what
    the call's attentions and blocks run besides (`sdx.interventions`).

    states: (B, S, D); kv: {attention key: (keys, values), each (B, S, heads, head_dim)}; blank: the rows
    whose text may be blank (static), and is_blank () bool, whether it is: then those rows' cross-attentions
    are not computed (`SkipBlankRows`). interventions: the call's processors and hooks (an IP-Adapter's
    `ImagePrompt`s among them), None without any."""

    states: jax.Array
    kv: dict[str, tuple[jax.Array, jax.Array]]
    blank: BlankRows | None = dataclasses.field(default=None, metadata={"static": True})
    is_blank: jax.Array | None = None
    interventions: Interventions | None = None

    def only(self, keys, paths=()) -> TextContext:
        """This context with the projections of `keys` alone and the processors of `paths` alone (what one
        block passes on)."""
        own = None if self.interventions is None else self.interventions.only(paths)
        return dataclasses.replace(self, kv={k: self.kv[k] for k in keys}, interventions=own)

    def rows(self, layout: Rows, which: tuple[int, ...]) -> TextContext:
        """This context for rows `which` of each period of `layout` alone (a call on some guidance branches):
        every per-row array picked, the blank rows' shortcut left out."""
        pick = lambda a: layout.pick(a, which)
        own = None if self.interventions is None else self.interventions.restrict(pick)
        return TextContext(pick(self.states), jax.tree.map(pick, self.kv), None, None, own)

    def processors(self, key: str | None, reads: bool) -> tuple[Processor, ...]:
        """The processors of the attention `key` (`reads`: whether it reads this context), outermost first:
        the interventions', then, where rows may be blank, `SkipBlankRows`."""
        chain = () if self.interventions is None else self.interventions.attention.get(key, ())
        return (*chain, SkipBlankRows(self.blank, self.is_blank)) if reads and self.blank is not None else chain


class Attention(nnx.Module):
    """diffusers' Attention: to_q/to_k/to_v, split heads, attention, to_out.0.

    `groups` adds the VAE's `group_norm` on the input; `residual` adds the input back and divides by
    `rescale_output_factor`. x: (B, T, C) or (B, H, W, C); context: (B, S, Cc) for cross-attention, or a
    `TextContext` holding this attention's projections under its `key` (given by its model: an attention
    built with a `context_dim` reads a context, whose projections can then be made once), and for any
    attention its processors (`sdx.interventions`): `q, k, v -> out` is theirs, the projections stay here.
    """

    def __init__(
        self, cp: Compute, query_dim: int, *, heads: int, head_dim: int, context_dim: int | None = None,
        qkv_bias: bool = False, groups: int | None = None, eps: float = 1e-6, residual: bool = False,
        rescale_output_factor: float = 1.0, rngs: nnx.Rngs,
    ):
        inner = heads * head_dim
        kv_dim = context_dim or query_dim
        self.backend, self.chunk, self.shards = cp.attention, cp.attention_chunk, cp.batch_shards
        self.heads, self.head_dim = heads, head_dim
        self.residual, self.rescale_output_factor = residual, rescale_output_factor
        self.reads_context = context_dim is not None
        self.key: str | None = None  # its module path in its model (`UNetEncoder._name_attentions`)
        self.group_norm = GroupNorm(cp, query_dim, groups, eps, rngs=rngs) if groups else None
        self.to_q = linear(cp, query_dim, inner, bias=qkv_bias, rngs=rngs)
        self.to_k = linear(cp, kv_dim, inner, bias=qkv_bias, rngs=rngs)
        self.to_v = linear(cp, kv_dim, inner, bias=qkv_bias, rngs=rngs)
        self.to_out = nnx.List([linear(cp, inner, query_dim, rngs=rngs)])

    def keys_values(self, ctx) -> tuple[jax.Array, jax.Array]:
        """(B, S, C) -> keys and values, each (B, S, heads, head_dim)."""
        split = lambda a: a.reshape(a.shape[0], a.shape[1], self.heads, self.head_dim)  # (B, S, H, D)
        return split(self.to_k(ctx)), split(self.to_v(ctx))

    def __call__(self, x, context=None):
        shape = x.shape
        h = x.reshape(shape[0], -1, shape[-1])  # (B, T, C)
        if self.group_norm is not None:
            h = self.group_norm(h)
        text = context if isinstance(context, TextContext) else None
        if text is not None and self.reads_context:
            k, v = text.kv[self.key]
        else:
            k, v = self.keys_values(h if context is None or text is not None else context)
        chain = () if text is None else text.processors(self.key, self.reads_context)
        placed = None if text is None else text.interventions
        step, calls = (None, None) if placed is None else (placed.step, placed.calls)
        o = AttentionCall(self, h, k, v, self.key, step, chain, calls).proceed().reshape(shape)
        if self.residual:
            o = (o + x) / self.rescale_output_factor
        return o


class GEGLU(nnx.Module):
    """proj to 2x width, split, value * gelu(gate) (exact erf gelu, as torch's F.gelu)."""

    def __init__(self, cp: Compute, din: int, dout: int, *, rngs: nnx.Rngs):
        self.proj = linear(cp, din, 2 * dout, rngs=rngs)

    def __call__(self, x):
        value, gate = jnp.split(self.proj(x), 2, axis=-1)
        return value * jax.nn.gelu(gate, approximate=False)


class FeedForward(nnx.Module):
    """net.0 = GEGLU, net.1 = dropout, net.2 = output Linear (diffusers' indices kept)."""

    def __init__(self, cp: Compute, dim: int, *, mult: int = 4, dropout: float = 0.0, rngs: nnx.Rngs):
        inner = dim * mult
        self.net = nnx.List([GEGLU(cp, dim, inner, rngs=rngs), nnx.Dropout(dropout), linear(cp, inner, dim, rngs=rngs)])

    def __call__(self, x):
        for layer in self.net:
            x = layer(x)
        return x


class BasicTransformerBlock(nnx.Module):
    """Pre-norm self-attention, cross-attention and GEGLU feed-forward, each residual."""

    def __init__(
        self, cp: Compute, dim: int, *, heads: int, head_dim: int, context_dim: int, only_cross_attention: bool = False,
        rngs: nnx.Rngs,
    ):
        self.only_cross_attention = only_cross_attention
        self.norm1 = LayerNorm(cp, dim, 1e-5, rngs=rngs)
        self.attn1 = Attention(
            cp, dim, heads=heads, head_dim=head_dim, context_dim=context_dim if only_cross_attention else None, rngs=rngs
        )
        self.norm2 = LayerNorm(cp, dim, 1e-5, rngs=rngs)
        self.attn2 = Attention(cp, dim, heads=heads, head_dim=head_dim, context_dim=context_dim, rngs=rngs)
        self.norm3 = LayerNorm(cp, dim, 1e-5, rngs=rngs)
        self.ff = FeedForward(cp, dim, rngs=rngs)

    def __call__(self, x, context):
        """x (b, T, C) -> (B, T, C), B the context's rows: x may have fewer, B / n, each shared by n
        consecutive rows of the batch (`widen`), until the first attention that reads the text."""
        text = isinstance(context, TextContext)
        rows = (context.states if text else context).shape[0]
        if self.only_cross_attention:
            x = widen(x, rows)
            x = x + self.attn1(self.norm1(x), context)
        else:  # a self-attention reads only its processors from a TextContext
            x = widen(x + self.attn1(self.norm1(x), context if text else None), rows)
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))

    def own(self, context):
        """`context`, narrowed to this block's projections and processors when it is a `TextContext`."""
        if not isinstance(context, TextContext):
            return context
        attentions = (self.attn1, self.attn2)
        return context.only((a.key for a in attentions if a.reads_context), (a.key for a in attentions))


class Transformer2DModel(nnx.Module):
    """GroupNorm, proj_in (1x1 conv, or Linear when use_linear_projection), N transformer blocks, proj_out, residual."""

    def __init__(
        self, cp: Compute, channels: int, *, heads: int, head_dim: int, context_dim: int, layers: int,
        groups: int, use_linear_projection: bool, only_cross_attention: bool = False, rngs: nnx.Rngs,
    ):
        inner = heads * head_dim
        self.use_linear_projection = use_linear_projection
        self.norm = GroupNorm(cp, channels, groups, 1e-6, rngs=rngs)
        make = (lambda a, b: linear(cp, a, b, rngs=rngs)) if use_linear_projection else (lambda a, b: conv(cp, a, b, 1, rngs=rngs))
        self.proj_in = make(channels, inner)
        self.transformer_blocks = nnx.List([
            BasicTransformerBlock(
                cp, inner, heads=heads, head_dim=head_dim, context_dim=context_dim,
                only_cross_attention=only_cross_attention, rngs=rngs,
            )
            for _ in range(layers)
        ])
        self.proj_out = make(inner, channels)

    def __call__(self, x, context):
        """x (b, H, W, C) -> (B, H, W, C): B the context's rows, which x's may share (`BasicTransformerBlock`)."""
        b, hh, ww, c = x.shape
        h = self.norm(x)
        if self.use_linear_projection:
            h = self.proj_in(h.reshape(b, hh * ww, c))  # (b, HW, inner)
        else:
            h = self.proj_in(h)
            h = h.reshape(b, hh * ww, h.shape[-1])  # (b, HW, inner)
        for block in self.transformer_blocks:
            h = outline.call(block, h, block.own(context))  # (B, HW, inner)
        if self.use_linear_projection:
            h = self.proj_out(h).reshape(h.shape[0], hh, ww, c)  # (B, H, W, C)
        else:
            h = self.proj_out(h.reshape(h.shape[0], hh, ww, h.shape[-1]))  # (B, H, W, inner) -> (B, H, W, C)
        return h + widen(x, h.shape[0])
