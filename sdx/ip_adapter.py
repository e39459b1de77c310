"""IP-Adapter: an image as a prompt for an SD 1.x/2.x or SDXL UNet (Ye et al. 2023, "IP-Adapter: Text
Compatible Image Prompt Adapter for Text-to-Image Diffusion Models", arXiv:2308.06721).

A CLIP image encoder (`sdx.clip_vision`) embeds the image; the adapter's image projection turns the
embedding into a few tokens of the text context's width; every cross-attention of the UNet attends to those
tokens with keys and values of its own (`to_k_ip`, `to_v_ip`), from the same queries as the text's, and adds
that attention times a scale to the text's before its output projection (the paper's decoupled
cross-attention, eq. 5; diffusers' IPAdapterAttnProcessor2_0, `sdx.layers.ImagePrompt`). The tokens do not change
during sampling, so their keys and values are projected once per image (`IPAdapter.keys_values`).

Two image projections, as the released files have them:

- plain (`ip-adapter_sd15`, `ip-adapter_sdxl(_vit-h)`): the encoder's `image_embeds` (B, E) -> a Linear to
  4 tokens of width D -> LayerNorm; diffusers' ImageProjection.
- plus (`ip-adapter-plus_sd15`, `ip-adapter-plus_sdxl_vit-h`, ...): the encoder's next-to-last hidden state
  (B, T, C) -> a perceiver resampler: learned latent queries attend, in `depth` blocks, to the projected
  image tokens and themselves; diffusers' IPAdapterPlusImageProjection (sdx.ip_adapter.Resampler).

Files are the original release's layout, which diffusers' `load_ip_adapter` reads: `image_proj.*` and
`ip_adapter.<n>.to_k_ip.weight` / `.to_v_ip.weight`, n = 1, 3, 5, ... numbering the UNet's cross-attentions
in diffusers' order of its attention processors (down blocks, up blocks, mid block; `cross_attentions`).

The scale is one number, or one per cross-attention from site patterns (`attention_scales`); diffusers' per-block
spec (InstantStyle, Wang et al. 2024: `{"up": {"block_0": [0.0, 1.0, 0.0]}}` lets only the style block read the
image) is translated into them as diffusers' `set_ip_adapter_scale` expands it (`diffusers_scales`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdx import io, weights
from sdx.attention import dot_product_attention
from sdx.errors import SdxError
from sdx.interventions import Interventions, select
from sdx.layers import F32, Attention, Compute, ImagePrompt, LayerNorm, linear

PLAIN, PLUS = "plain", "plus"
Scale = Union[float, Mapping]  # one number, or site patterns to scales (`attention_scales`)
PLAIN_TOKENS = 4  # the plain projection's token count (diffusers' load_ip_adapter fixes it too)
RESAMPLER_HEAD_DIM = 64  # the resampler's head size, which its files do not record


@dataclasses.dataclass(frozen=True)
class IPAdapterConfig:
    """What an IP-Adapter is, read from its file's shapes (`config_of`).

    kind: PLAIN or PLUS; image_embed_dim: the width of what it reads from the image encoder (plain: the
    projected `image_embeds`; plus: a hidden state); cross_attention_dim: its tokens' width (the UNet's text
    width); tokens: how many; attention_dims: each UNet cross-attention's inner width (heads x head_dim) in
    the file's order; plus only: hidden_dims, depth and heads of the resampler."""

    kind: str
    image_embed_dim: int
    cross_attention_dim: int
    tokens: int
    attention_dims: tuple[int, ...]
    hidden_dims: int = 0
    depth: int = 0
    heads: int = 0

    @property
    def reads_hidden_states(self) -> bool:
        """Whether it reads the image encoder's next-to-last hidden state (plus) or its `image_embeds`."""
        return self.kind == PLUS


class ImageProjection(nnx.Module):
    """(B, E) image embeddings -> (B, tokens, D): Linear, split into tokens, LayerNorm."""

    def __init__(self, cp: Compute, c: IPAdapterConfig, *, rngs: nnx.Rngs):
        self.tokens = c.tokens
        self.proj = linear(cp, c.image_embed_dim, c.tokens * c.cross_attention_dim, rngs=rngs)
        self.norm = LayerNorm(cp, c.cross_attention_dim, 1e-5, rngs=rngs)

    def __call__(self, embeds: jax.Array) -> jax.Array:
        x = self.proj(embeds)
        return self.norm(x.reshape(x.shape[0], self.tokens, -1))  # (B, tokens * D) -> (B, tokens, D)


class ResamplerAttention(nnx.Module):
    """The resampler's attention: the latents' queries over [image tokens, latents] (both layer-normed),
    no biases; file keys norm1/norm2, to_q, to_kv (keys and values stacked), to_out."""

    def __init__(self, cp: Compute, dim: int, heads: int, *, rngs: nnx.Rngs):
        inner = heads * RESAMPLER_HEAD_DIM
        self.heads = heads
        self.norm1 = LayerNorm(cp, dim, 1e-5, rngs=rngs)
        self.norm2 = LayerNorm(cp, dim, 1e-5, rngs=rngs)
        self.to_q = linear(cp, dim, inner, bias=False, rngs=rngs)
        self.to_kv = linear(cp, dim, 2 * inner, bias=False, rngs=rngs)
        self.to_out = linear(cp, inner, dim, bias=False, rngs=rngs)

    def __call__(self, x: jax.Array, latents: jax.Array) -> jax.Array:
        """x (B, T, C) image tokens, latents (B, Q, C) -> (B, Q, C)."""
        x, latents = self.norm1(x), self.norm2(latents)
        split = lambda a: a.reshape(a.shape[0], a.shape[1], self.heads, RESAMPLER_HEAD_DIM)  # (B, S, H, 64)
        k, v = jnp.split(self.to_kv(jnp.concatenate([x, latents], axis=1)), 2, axis=-1)  # each (B, T + Q, inner)
        o = dot_product_attention(split(self.to_q(latents)), split(k), split(v))  # (B, Q, H, 64)
        return self.to_out(o.reshape(o.shape[0], o.shape[1], -1))


class ResamplerFeedForward(nnx.Module):
    """LayerNorm, Linear to 4x, exact gelu, Linear back, no biases (the file's Sequential indices 0, 1 and 3,
    named `FEED_FORWARD`)."""

    def __init__(self, cp: Compute, dim: int, *, rngs: nnx.Rngs):
        self.norm = LayerNorm(cp, dim, 1e-5, rngs=rngs)
        self.up = linear(cp, dim, 4 * dim, bias=False, rngs=rngs)
        self.down = linear(cp, 4 * dim, dim, bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(self.norm(x)), approximate=False))


class Resampler(nnx.Module):
    """(B, T, E) hidden states -> (B, tokens, D): proj_in, `depth` blocks of latents + attention and latents
    + feed-forward, proj_out, norm_out (the file's `layers.<i>.0` attention and `layers.<i>.1` feed-forward)."""

    def __init__(self, cp: Compute, c: IPAdapterConfig, *, rngs: nnx.Rngs):
        self.latents = nnx.Param(jnp.zeros((1, c.tokens, c.hidden_dims), cp.param_dtype))
        self.proj_in = linear(cp, c.image_embed_dim, c.hidden_dims, rngs=rngs)
        self.layers = nnx.List([
            nnx.List([ResamplerAttention(cp, c.hidden_dims, c.heads, rngs=rngs), ResamplerFeedForward(cp, c.hidden_dims, rngs=rngs)])
            for _ in range(c.depth)
        ])
        self.proj_out = linear(cp, c.hidden_dims, c.cross_attention_dim, rngs=rngs)
        self.norm_out = LayerNorm(cp, c.cross_attention_dim, 1e-5, rngs=rngs)
        self.dtype = cp.dtype

    def __call__(self, hidden: jax.Array) -> jax.Array:
        x = self.proj_in(hidden)
        latents = jnp.broadcast_to(self.latents[...].astype(self.dtype), (x.shape[0], *self.latents.shape[1:]))
        for attention, feed_forward in self.layers:
            latents = latents + attention(x, latents)
            latents = latents + feed_forward(latents)
        return self.norm_out(self.proj_out(latents))


class ImageKeysValues(nnx.Module):
    """One cross-attention's projections of the image tokens (no biases, as the text's)."""

    def __init__(self, cp: Compute, cross_dim: int, inner: int, *, rngs: nnx.Rngs):
        self.to_k_ip = linear(cp, cross_dim, inner, bias=False, rngs=rngs)
        self.to_v_ip = linear(cp, cross_dim, inner, bias=False, rngs=rngs)


def cross_attentions(unet: nnx.Module) -> list[tuple[str, Attention]]:
    """(key, attention) of each cross-attention (`attn2`) of `unet`, in the order diffusers numbers its
    attention processors: the down blocks, then the up blocks, then the mid block, each in module order."""
    group = {"down_blocks": 0, "up_blocks": 1, "mid_block": 2}
    found = [(path, m) for path, m in nnx.iter_graph(unet)
             if isinstance(m, Attention) and path and path[-1] == "attn2" and path[0] in group]
    found.sort(key=lambda item: (group[item[0][0]], [(0, p, "") if isinstance(p, int) else (1, 0, p) for p in item[0]]))
    return [(".".join(map(str, path)), m) for path, m in found]


class IPAdapter(nnx.Module):
    """An IP-Adapter for one UNet: `image_proj` (ImageProjection or Resampler) and `layers`, one
    ImageKeysValues per cross-attention, in `cross_attentions`' order."""

    def __init__(self, config: IPAdapterConfig, cp: Compute = F32, *, rngs: nnx.Rngs):
        self.config, self.compute = config, cp
        c = config
        self.image_proj = (Resampler if c.kind == PLUS else ImageProjection)(cp, c, rngs=rngs)
        self.layers = nnx.List([ImageKeysValues(cp, c.cross_attention_dim, d, rngs=rngs) for d in c.attention_dims])

    def tokens(self, features: jax.Array) -> jax.Array:
        """The image tokens (B, tokens, D) of what the image encoder gave: image_embeds (B, E) for a plain
        adapter, the next-to-last hidden state (B, T, E) for a plus one."""
        return self.image_proj(features.astype(self.compute.dtype))

    def keys_values(self, unet: nnx.Module, tokens: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """Each cross-attention's keys and values of the image tokens (B, tokens, D), each (B, tokens, heads,
        head_dim), for every cross-attention of `unet`, in `cross_attentions`' order."""
        attentions = cross_attentions(unet)
        check_fits(self.config, attentions, "ip-adapter")
        kv = []
        for (_, attention), layer in zip(attentions, self.layers):
            split = lambda a: a.reshape(a.shape[0], a.shape[1], attention.heads, attention.head_dim)  # (B, N, H, D)
            kv.append((split(layer.to_k_ip(tokens)), split(layer.to_v_ip(tokens))))
        return kv

    def interventions(self, unet: nnx.Module, tokens: jax.Array, scale) -> Interventions:
        """What makes `unet`'s cross-attentions attend to the image tokens (B, tokens, D) at `scale` (a number, or
        (cross-attentions,) one each): its `__call__`'s `interventions`."""
        scales = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (tokens.shape[0], len(self.layers)))
        return image_attention(unet, self.keys_values(unet, tokens), scales)


def image_attention(unet: nnx.Module, kv, scales: jax.Array) -> Interventions:
    """An `sdx.layers.ImagePrompt` processor at each of `unet`'s cross-attentions: kv, their keys and values of an
    adapter's image tokens (`IPAdapter.keys_values`); scales (B, cross-attentions), each row's scale of each."""
    keys = [key for key, _ in cross_attentions(unet)]
    return Interventions(attention={key: (ImagePrompt(k, v, scales[:, i]),) for i, (key, (k, v)) in enumerate(zip(keys, kv))})


def attention_scales(scale: Scale, unet: nnx.Module) -> np.ndarray:
    """(cross-attentions,) float32: the scale of each of `unet`'s `cross_attentions`, from one number, or a mapping
    of site patterns (`sdx.interventions.select`, e.g. "up_blocks.0.attentions.1") to scales: each pattern sets the
    cross-attentions it selects, a later one over an earlier one; those none selects get 0 (diffusers' per-block
    dicts: `diffusers_scales`)."""
    keys = [key for key, _ in cross_attentions(unet)]
    if not isinstance(scale, Mapping):
        return np.full(len(keys), scale, np.float32)
    out = np.zeros(len(keys), np.float32)
    for pattern, value in scale.items():
        chosen = set(select(keys, pattern, f"--ip-adapter-scale {pattern!r}", kind="cross-attention"))
        try:
            out[[i for i, key in enumerate(keys) if key in chosen]] = value
        except (TypeError, ValueError):
            raise SdxError(f"--ip-adapter-scale {pattern!r}: {value!r} is not a number") from None
    return out


def diffusers_scales(spec: Mapping, unet: nnx.Module) -> dict[str, float]:
    """diffusers' per-block `set_ip_adapter_scale` dict as `attention_scales`' site patterns, expanded as diffusers
    expands it (`_maybe_expand_lora_scales`): {"down": S, "mid": S, "up": S}, each part optional (default 0); a
    part S is one number for all its blocks with attentions or {"block_<i>": V}, blocks left out 0; V is one number
    for all the block's Transformer2DModels or a list with one per Transformer2DModel (a one-item list counts for
    all). One pattern per Transformer2DModel (its cross-attentions)."""
    unknown = sorted(set(spec) - {"down", "mid", "up"})
    if unknown:
        raise SdxError(f"--ip-adapter-scale: unknown part {unknown[0]!r}; the parts are down, mid and up")
    out = {}
    for part, group in (("down", "down_blocks"), ("up", "up_blocks")):
        blocks = {i: len(b.attentions) for i, b in enumerate(getattr(unet, group)) if b.attentions is not None}
        given = spec.get(part, 0.0)
        given = given if isinstance(given, Mapping) else {f"block_{i}": given for i in blocks}
        wrong = sorted(set(given) - {f"block_{i}" for i in blocks})
        if wrong:
            raise SdxError(f"--ip-adapter-scale: {part} has no {wrong[0]} with attentions; it has "
                           f"{', '.join(f'block_{i}' for i in blocks)}")
        for i, count in blocks.items():
            values = given.get(f"block_{i}", 0.0)
            values = list(values) if isinstance(values, (list, tuple)) else [values]
            if len(values) not in (1, count):
                raise SdxError(f"--ip-adapter-scale: {part}.block_{i} has {count} transformer(s); give 1 or {count} "
                               f"scales, not {len(values)}")
            out |= {f"{group}.{i}.attentions.{j}": v for j, v in enumerate(values * count if len(values) == 1 else values)}
    mid = spec.get("mid", 0.0)
    mid = list(mid) if isinstance(mid, (list, tuple)) else [mid]
    if len(mid) != 1:
        raise SdxError(f"--ip-adapter-scale: mid takes one scale, not {len(mid)}")
    return out | ({"mid_block.attentions.0": mid[0]} if unet.mid_block is not None and unet.mid_block.attentions else {})


def check_fits(c: IPAdapterConfig, attentions: list[tuple[str, Attention]], where: str) -> None:
    """Refuse an adapter made for another UNet, whose `cross_attentions` are `attentions`, naming what differs."""
    dims = tuple(m.heads * m.head_dim for _, m in attentions)
    widths = {m.to_k.in_features for _, m in attentions}
    if c.attention_dims != dims or widths != {c.cross_attention_dim}:
        raise SdxError(
            f"{where}: made for another UNet: it has {len(c.attention_dims)} cross-attentions of widths "
            f"{sorted(set(c.attention_dims))} reading {c.cross_attention_dim}-wide tokens; this UNet has {len(dims)} of "
            f"widths {sorted(set(dims))} reading {'/'.join(map(str, sorted(widths)))} (an SD 1.5 adapter goes with SD "
            "1.x models, an SDXL one with SDXL)"
        )


# --------------------------------------------------------------------------------------------------
# Files


FEED_FORWARD = {"0": "norm", "1": "up", "3": "down"}  # a plus file's feed-forward indices -> ResamplerFeedForward's


def _plus_key(key: str) -> str:
    """A plus file's resampler key -> the sdx module's torch-style key: `layers.<i>.1.<j>.weight` (the
    feed-forward's Sequential) -> `layers.<i>.1.<FEED_FORWARD[j]>.weight`; everything else is named alike."""
    parts = key.split(".")
    if len(parts) == 5 and parts[0] == "layers" and parts[2] == "1" and parts[3] in FEED_FORWARD:
        parts[3] = FEED_FORWARD[parts[3]]
    return ".".join(parts)


def config_of(tensors: Mapping[str, np.ndarray], where: str) -> IPAdapterConfig:
    """The config a file's tensors (keyed as the file) describe, or an SdxError saying why they are no
    IP-Adapter sdx can run."""
    shape = lambda k: tuple(tensors[k].shape)
    proj = {k[len("image_proj."):] for k in tensors if k.startswith("image_proj.")}
    n = len({k.split(".")[1] for k in tensors if k.startswith("ip_adapter.")})
    attention_dims = []
    for i in range(n):
        key = f"ip_adapter.{2 * i + 1}.to_k_ip.weight"
        if key not in tensors:
            raise SdxError(f"{where}: no tensor {key}; the ip_adapter.* keys should number the cross-attentions 1, 3, 5, ...")
        attention_dims.append(shape(key)[0])
    if not proj or not n:
        raise SdxError(f"{where}: not an IP-Adapter file (it needs image_proj.* and ip_adapter.* tensors, as "
                       "h94/IP-Adapter's .safetensors files have)")
    cross = shape("ip_adapter.1.to_k_ip.weight")[1]
    if proj == {"proj.weight", "proj.bias", "norm.weight", "norm.bias"}:
        embed = shape("image_proj.proj.weight")[1]
        return IPAdapterConfig(PLAIN, embed, cross, shape("image_proj.proj.weight")[0] // cross, tuple(attention_dims))
    if "latents" in proj and "proj_in.weight" in proj:
        _, tokens, hidden = shape("image_proj.latents")
        depth = len({k.split(".")[1] for k in proj if k.startswith("layers.")})
        heads = shape("image_proj.layers.0.0.to_q.weight")[0] // RESAMPLER_HEAD_DIM
        return IPAdapterConfig(PLUS, shape("image_proj.proj_in.weight")[1], cross, tokens, tuple(attention_dims),
                               hidden, depth, heads)
    if "perceiver_resampler.proj_in.weight" in proj or "proj.3.weight" in proj or "norm.weight" in proj:
        raise SdxError(f"{where}: a FaceID or full-face IP-Adapter; sdx runs the plain and plus ones")
    raise SdxError(f"{where}: an image projection sdx does not know (keys {sorted(proj)[:4]}...)")


def _sdx_keys(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The file's tensors keyed as `IPAdapter`'s torch-style paths: `image_proj.*` as they are (plus files'
    feed-forwards re-indexed), `ip_adapter.<2i+1>.*` -> `layers.<i>.*`."""
    out = {}
    for key, value in tensors.items():
        group, _, rest = key.partition(".")
        if group == "image_proj":
            out[f"image_proj.{_plus_key(rest)}"] = value
        else:
            index, _, name = rest.partition(".")
            out[f"layers.{(int(index) - 1) // 2}.{name}"] = value
    return out


def read_file(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of an IP-Adapter .safetensors file (memory-mapped), or an SdxError saying what is wrong."""
    path = Path(path)
    if path.suffix == ".bin":
        raise SdxError(f"--ip-adapter {path}: a pickled .bin file; sdx reads .safetensors (h94/IP-Adapter has both; or "
                       "convert it: torch.load it and safetensors.torch.save_file each of its two dicts' tensors with "
                       "'image_proj.' / 'ip_adapter.' prefixes)")
    if not path.is_file():
        raise SdxError(f"--ip-adapter {path}: no such file")
    tensors = io.read_safetensors(path)
    unknown = sorted(k for k in tensors if not k.startswith(("image_proj.", "ip_adapter.")))
    if unknown:
        raise SdxError(f"--ip-adapter {path}: unexpected tensor {unknown[0]!r} (an IP-Adapter file holds image_proj.* and "
                       "ip_adapter.* tensors)")
    return tensors


def load_ip_adapter(path: str | os.PathLike, unet: nnx.Module, *, dtype: str = "float32", compute: Compute | None = None,
                    sharding: weights.Sharding = None) -> IPAdapter:
    """The IP-Adapter in `path` (a .safetensors file of the original layout) for `unet`, its parameters in
    `dtype`, checked against the UNet before anything is placed."""
    where = f"--ip-adapter {path}"
    tensors = read_file(path)
    config = config_of(tensors, where)
    check_fits(config, cross_attentions(unet), where)
    param_dtype = jnp.dtype(weights.dtype_of(dtype))
    cp = dataclasses.replace(compute or Compute(dtype=param_dtype), param_dtype=param_dtype)
    model = weights.abstract(lambda rngs: IPAdapter(config, cp, rngs=rngs))
    return weights.load_torch_state(model, _sdx_keys(tensors), where=where, dtype=param_dtype, sharding=sharding)
