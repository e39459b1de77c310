"""The CLIP text transformer: one module for every text encoder Stable Diffusion uses.

- CLIP ViT-L/14 text (OpenAI): SD 1.x and SDXL's first encoder. quick_gelu.
- OpenCLIP ViT-bigG/14 text with its projection: SDXL's second encoder. gelu; `text_embeds` is the
  projected EOS token (SDXL's pooled conditioning).
- OpenCLIP ViT-H/14 text: SD 2.x. gelu. The diffusers repos store 23 of its 24 layers (SD 2.x
  conditions on the penultimate layer, with the final layer norm applied), so `last_hidden_state`
  of that 23-layer model is the SD 2.x conditioning.

The math is transformers' `CLIPTextModel`/`CLIPTextModelWithProjection` (models/clip/modeling_clip.py):
token + learned position embeddings, pre-norm causal self-attention and MLP blocks, a final layer
norm, the pooled output taken at the EOS token. Attribute names are transformers' key paths
(`text_model.encoder.layers.0.self_attn.q_proj`, `text_projection`), so a checkpoint maps onto the
model mechanically through `sdx.weights.load_torch_state` after `transformers_state` (below) has
removed the one non-parameter tensor (`position_ids`) and normalised the key prefix.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdx.attention import dot_product_attention
from sdx import diffusers_config, outline, presets
from sdx.config import FLAG, JsonConfig, Kind
from sdx.errors import SdxError
from sdx.layers import F32, Compute, LayerNorm, linear, rematerialised

# transformers' ACT2FN names we implement. quick_gelu is x*sigmoid(1.702x) (OpenAI CLIP); gelu is the
# exact erf form (torch's nn.GELU(), which OpenCLIP used).
ACTIVATIONS = ("quick_gelu", "gelu")


@dataclasses.dataclass(frozen=True)
class TextEncoderConfig(JsonConfig):
    """Architecture of a CLIP text encoder; field names are transformers' `CLIPTextConfig` names.

    `with_projection`: a `text_projection` (Linear, no bias, hidden_size -> projection_dim) follows the
    pooled output (transformers' CLIPTextModelWithProjection). `eos_token_id` picks the pooling rule:
    2 is the legacy value most SD checkpoints carry and means "the position of the largest token id"
    (the EOS id 49407 is the largest in CLIP's vocabulary); anything else means "the first position
    holding eos_token_id". `bos_token_id`/`pad_token_id` are kept for the round trip only.
    """

    label: ClassVar[str] = "text encoder config"
    kinds: ClassVar[Mapping[str, Kind]] = {**diffusers_config.TEXT_ENCODER_KINDS, "with_projection": FLAG}
    causal: ClassVar[bool] = True  # `CLIPAttention`: each token attends to itself and the tokens before it

    vocab_size: int = 49408
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    max_position_embeddings: int = 77
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    projection_dim: int = 768
    with_projection: bool = False
    eos_token_id: int = 2
    bos_token_id: int = 0
    pad_token_id: int = 1

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise SdxError(
                f"text encoder config: hidden_act={self.hidden_act!r} is not implemented; sdx has {', '.join(ACTIVATIONS)}"
            )
        if self.num_attention_heads <= 0 or self.hidden_size % self.num_attention_heads:
            raise SdxError(
                f"text encoder config: hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> TextEncoderConfig:
        """From a transformers `config.json` of CLIPTextModel / CLIPTextModelWithProjection (missing
        fields take transformers' defaults; the rules for every field are `sdx.diffusers_config`'s)."""
        return cls(**diffusers_config.text_encoder_fields(d))

    @classmethod
    def preset(cls, name: str, component: str = "text_encoder") -> TextEncoderConfig:
        """Text encoder `component` ("text_encoder" or "text_encoder_2") of pipeline preset `name` of
        `sdx.presets`: ("sd15", "text_encoder") is CLIP ViT-L/14, ("sdxl_base", "text_encoder_2")
        OpenCLIP bigG/14, ("sd21", "text_encoder") OpenCLIP ViT-H/14 (23 of its 24 layers, as SD 2.x uses)."""
        configs = presets.get(name).configs
        if component not in configs:
            raise SdxError(f"preset {name!r} has no {component}")
        return cls.from_diffusers_config(configs[component])

    def to_diffusers_config(self) -> dict[str, Any]:
        """A transformers `config.json` for this architecture (for writing the diffusers layout)."""
        return diffusers_config.text_encoder_to_transformers(self.to_dict())


class CLIPTextOutput(NamedTuple):
    """What the encoder returns (a pytree, so it leaves `jax.jit` as is).

    last_hidden_state: (B, T, C) after the final layer norm.
    hidden_states: embeddings output then each layer's output, all before the final layer norm
        (transformers' `output_hidden_states`): num_hidden_layers + 1 arrays of (B, T, C).
    pooler_output: (B, C) the EOS token of `last_hidden_state`.
    text_embeds: (B, projection_dim) `text_projection(pooler_output)`, or None without a projection.
    """

    last_hidden_state: jax.Array
    hidden_states: tuple[jax.Array, ...]
    pooler_output: jax.Array
    text_embeds: jax.Array | None


def _activation(name: str, x: jax.Array) -> jax.Array:
    if name == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    raise SdxError(f"text encoder config: hidden_act={name!r} is not implemented")


class CLIPTextEmbeddings(nnx.Module):
    """Token and position embeddings. `words`: the vectors of words being learned (textual inversion,
    `sdx.textual_inversion`), (n, C), the ids after the token embedding's; None otherwise."""

    words = None

    def __init__(self, cfg: TextEncoderConfig, cp: Compute, *, rngs: nnx.Rngs):
        embed = lambda n: nnx.Embed(  # noqa: E731
            n, cfg.hidden_size, dtype=cp.dtype, param_dtype=cp.param_dtype, rngs=rngs
        )
        self.token_embedding = embed(cfg.vocab_size)
        self.position_embedding = embed(cfg.max_position_embeddings)

    def __call__(self, input_ids):
        t = input_ids.shape[1]
        if self.words is None:
            tokens = self.token_embedding(input_ids)
        else:
            table = self.token_embedding.embedding[...]
            table = jnp.concatenate([table, self.words[...].astype(table.dtype)])  # (vocab + n, C)
            tokens = jnp.take(table, input_ids, axis=0).astype(self.token_embedding.dtype)
        return tokens + self.position_embedding(jnp.arange(t))[None]  # (B, T, C)


class CLIPAttention(nnx.Module):
    """Self-attention, causal or not as `cfg.causal` says: the text encoder's config (causal) or the
    vision encoder's (`sdx.clip_vision.VisionEncoderConfig`, every patch sees every other); the layers
    built on it serve both."""

    def __init__(self, cfg: TextEncoderConfig, cp: Compute, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.heads, self.head_dim, self.causal = cfg.num_attention_heads, cfg.head_dim, cfg.causal
        # 77 text tokens (or ViT-H/14's 257 image tokens) need no query chunking, so `chunked` (an
        # image-model backend) means `xla` here, and cuDNN flash attention is only used where it exists,
        # for 16-bit activations.
        half = jnp.dtype(cp.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        self.backend = "cudnn" if cp.attention == "cudnn" and half else "xla"
        self.q_proj = linear(cp, d, d, rngs=rngs)
        self.k_proj = linear(cp, d, d, rngs=rngs)
        self.v_proj = linear(cp, d, d, rngs=rngs)
        self.out_proj = linear(cp, d, d, rngs=rngs)

    def __call__(self, x, key_mask=None):
        b, t, _ = x.shape
        split = lambda a: a.reshape(b, t, self.heads, self.head_dim)  # (B, T, H, D)  # noqa: E731
        o = dot_product_attention(
            split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x)),
            backend=self.backend, causal=self.causal, key_mask=key_mask,
        )
        return self.out_proj(o.reshape(b, t, self.heads * self.head_dim))  # (B, T, C)


class CLIPMLP(nnx.Module):
    def __init__(self, cfg: TextEncoderConfig, cp: Compute, *, rngs: nnx.Rngs):
        self.act = cfg.hidden_act
        self.fc1 = linear(cp, cfg.hidden_size, cfg.intermediate_size, rngs=rngs)
        self.fc2 = linear(cp, cfg.intermediate_size, cfg.hidden_size, rngs=rngs)

    def __call__(self, x):
        return self.fc2(_activation(self.act, self.fc1(x)))


class CLIPEncoderLayer(nnx.Module):
    """Pre-norm: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, cfg: TextEncoderConfig, cp: Compute, *, rngs: nnx.Rngs):
        self.self_attn = CLIPAttention(cfg, cp, rngs=rngs)
        self.layer_norm1 = LayerNorm(cp, cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)
        self.mlp = CLIPMLP(cfg, cp, rngs=rngs)
        self.layer_norm2 = LayerNorm(cp, cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)

    def __call__(self, x, key_mask=None):
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nnx.Module):
    def __init__(self, cfg: TextEncoderConfig, cp: Compute, *, rngs: nnx.Rngs):
        self.layers = nnx.List([CLIPEncoderLayer(cfg, cp, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.remat = cp.remat  # each layer rematerialised in the backward pass (a trained encoder's LoRA)

    def __call__(self, x, key_mask=None) -> tuple[jax.Array, ...]:
        """Returns (x, layer 1 output, ..., layer N output). key_mask (B, T) bool: the tokens attention may
        read (transformers' attention_mask), or None."""
        states = [x]
        for layer in self.layers:
            x = states[-1]
            args = (x,) if key_mask is None else (x, key_mask)
            states.append(rematerialised(outline.call, layer, *args) if self.remat else outline.call(layer, *args))
        return tuple(states)


class CLIPTextTransformer(nnx.Module):
    """transformers' `text_model`: embeddings, encoder, final_layer_norm."""

    def __init__(self, cfg: TextEncoderConfig, cp: Compute, *, rngs: nnx.Rngs):
        self.embeddings = CLIPTextEmbeddings(cfg, cp, rngs=rngs)
        self.encoder = CLIPEncoder(cfg, cp, rngs=rngs)
        self.final_layer_norm = LayerNorm(cp, cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)


def eos_positions(input_ids: jax.Array, eos_token_id: int) -> jax.Array:
    """(B,) index of the token the pooled output is taken from, as transformers picks it.

    eos_token_id == 2 (the legacy config value of every SD 1.x/2.x/XL text encoder): the first position
    of the largest id (the EOS 49407, whatever the pad token). Otherwise the first position equal
    to eos_token_id (0 when there is none, as torch's argmax of all-zeros gives).
    """
    ids = input_ids.astype(jnp.int32)
    if eos_token_id == 2:
        return jnp.argmax(ids, axis=-1)
    return jnp.argmax((ids == eos_token_id).astype(jnp.int32), axis=-1)


class CLIPTextModel(nnx.Module):
    """CLIP text encoder, with the optional `text_projection` of CLIPTextModelWithProjection.

    `model(input_ids)` with input_ids (B, T) int32, T <= max_position_embeddings (77), returns a
    `CLIPTextOutput`. Nothing here pads or masks: pass the tokenizer's padded ids, as diffusers does
    (the SD pipelines give no attention mask; the causal mask alone applies). `attention_mask` (B, T), 1
    where a token may be attended to, is transformers' (compel's down-weighting masks a prompt's words out).
    """

    def __init__(self, config: TextEncoderConfig, cp: Compute = F32, *, rngs: nnx.Rngs):
        self.config, self.compute = config, cp
        self.text_model = CLIPTextTransformer(config, cp, rngs=rngs)
        self.text_projection = (
            linear(cp, config.hidden_size, config.projection_dim, bias=False, rngs=rngs) if config.with_projection else None
        )

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> CLIPTextOutput:
        if input_ids.ndim != 2 or input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(
                f"input_ids must be (batch, tokens<= {self.config.max_position_embeddings}), got {input_ids.shape}"
            )
        tm = self.text_model
        key_mask = None if attention_mask is None else jnp.asarray(attention_mask) > 0
        hidden_states = tm.encoder(tm.embeddings(input_ids), key_mask)
        last = tm.final_layer_norm(hidden_states[-1])  # (B, T, C)
        pooled = last[jnp.arange(last.shape[0]), eos_positions(input_ids, self.config.eos_token_id)]  # (B, C)
        text_embeds = self.text_projection(pooled) if self.text_projection is not None else None
        return CLIPTextOutput(last, hidden_states, pooled, text_embeds)

    def hidden_state(self, out: CLIPTextOutput, *, skip: int = 0, final_layer_norm: bool) -> jax.Array:
        """The output of the layer `skip` layers before the last: out.hidden_states[-(skip + 1)].

        With `final_layer_norm` the model's final layer norm is applied to it (skip=0 then equals
        `last_hidden_state`). What the diffusers pipelines take, for their `clip_skip` argument c:

        - SD 1.x / SD 2.x: c=None -> skip=0, final_layer_norm=True (`last_hidden_state`);
          c>=1 -> skip=c, final_layer_norm=True.
        - SDXL, both encoders: c=None -> skip=1, final_layer_norm=False (the penultimate layer, raw);
          c>=1 -> skip=c+1, final_layer_norm=False. The pooled conditioning stays encoder 2's
          `text_embeds` whatever c is.
        skip = number of layers reaches the embeddings' output (hidden_states[0]), as diffusers' indexing does.
        """
        n = len(out.hidden_states) - 1
        if not 0 <= skip <= n:
            raise SdxError(f"clip skip {skip} is out of range for a {n}-layer text encoder (0..{n})")
        h = out.hidden_states[-(skip + 1)]
        return self.text_model.final_layer_norm(h) if final_layer_norm else h


# transformers' CLIPTextEmbeddings registers `position_ids` (an arange over max_position_embeddings)
# as a buffer; checkpoints written by transformers < 4.31 saved it. It is no parameter: transformers
# ignores it on load and recomputes arange(T) (so do we; some merged SD 1.x checkpoints carry a
# corrupted float copy that diffusers ignores too). These are the only keys `transformers_state` drops.
POSITION_IDS_KEYS = ("text_model.embeddings.position_ids", "embeddings.position_ids")
# transformers 5 saves CLIPTextModel without the `text_model.` prefix (its loader re-adds it); diffusers
# repos and CLIPTextModelWithProjection keep it. Keys under these roots get the prefix back.
_UNPREFIXED = re.compile(r"^(embeddings|encoder|final_layer_norm)\.")


def transformers_state(state: Mapping[str, Any], *, where: str) -> dict[str, np.ndarray]:
    """A transformers CLIPTextModel(WithProjection) state dict, keyed for `sdx.weights.load_torch_state`.

    Drops exactly the `position_ids` buffer (see POSITION_IDS_KEYS) and adds the `text_model.`
    prefix that transformers 5 leaves out; every other key passes unchanged, so the strict loader
    still rejects anything unexpected. `where` names the file in errors.
    """
    out: dict[str, np.ndarray] = {}
    for key, value in state.items():
        if key in POSITION_IDS_KEYS:
            continue
        new = "text_model." + key if _UNPREFIXED.match(key) else key
        if new in out:
            raise SdxError(f"{where}: tensor {key!r} appears both with and without the 'text_model.' prefix")
        out[new] = value
    return out
