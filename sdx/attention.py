"""Scaled dot-product attention: the one function every sdx model calls.

Query, key and value stay split by head, `(batch, tokens, heads, head_dim)`, the layout
`jax.nn.dot_product_attention` takes, so no backend needs a transpose. The backend is a config
field of the model (`attention=`), never a global:

- `xla`: the portable reference (every platform). Logits and softmax in float32 whatever the inputs'
  dtype, which is what diffusers' `upcast_attention`/`upcast_softmax` ask for.
- `cudnn`: cuDNN flash attention on NVIDIA GPUs (float16/bfloat16 inputs).
- `chunked`: queries processed `chunk_size` at a time under `lax.map`, so the `(tokens_q, tokens_k)`
  logits never exist for all queries at once, in the forward or the backward pass. For very long
  sequences (the 128² latent of a 2048² image has 16,384 tokens: 1 GiB of float32 logits per head
  and image).
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

Backend = Literal["xla", "cudnn", "chunked"]
BACKENDS: tuple[str, ...] = ("xla", "cudnn", "chunked")


def _reference(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool) -> jax.Array:
    """Attention with float32 logits and softmax. q: (B, Tq, H, D), k/v: (B, Tk, H, D).

    The softmax's division is applied to the (B, Tq, H, D) output instead of the (B, H, Tq, Tk)
    weights: one pass less over the largest tensor (about 30% faster at SD 1.5's 4096 tokens on a CPU,
    same result to float32 rounding).
    """
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    if causal:
        tq, tk = q.shape[1], k.shape[1]
        keep = jnp.tril(jnp.ones((tq, tk), dtype=bool), k=tk - tq)
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    top = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))  # any shift gives the same softmax
    weights = jnp.exp((logits - top) * scale)  # unnormalised, (B, H, Tq, Tk)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    total = weights.sum(axis=-1).transpose(0, 2, 1)[..., None]  # (B, H, Tq) -> (B, Tq, H, 1)
    return (out / total).astype(v.dtype)


def _chunked(q, k, v, scale: float, causal: bool, chunk_size: int) -> jax.Array:
    if causal:
        raise ValueError("attention='chunked' is for the image models; the causal text encoder uses 'xla'")
    b, tq, h, d = q.shape
    if tq <= chunk_size:
        return _reference(q, k, v, scale, causal)
    n = math.ceil(tq / chunk_size)
    pad = n * chunk_size - tq
    qp = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    chunks = qp.reshape(b, n, chunk_size, h, d).transpose(1, 0, 2, 3, 4)  # (n, B, chunk, H, D)
    # Checkpointed per chunk: without it the backward pass would keep every chunk's softmax weights,
    # i.e. the whole (Tq, Tk) matrix the chunking exists to avoid.
    attend = jax.checkpoint(lambda qc: _reference(qc, k, v, scale, False))
    out = jax.lax.map(attend, chunks)  # (n, B, chunk, H, D)
    out = out.transpose(1, 0, 2, 3, 4).reshape(b, n * chunk_size, h, d)  # (B, Tq+pad, H, D)
    return out[:, :tq]


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    backend: Backend = "xla",
    causal: bool = False,
    scale: float | None = None,
    chunk_size: int = 1024,
) -> jax.Array:
    """Attention over split heads. q: (B, Tq, H, D); k, v: (B, Tk, H, D) -> (B, Tq, H, D)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if backend == "xla":
        return _reference(q, k, v, scale, causal)
    if backend == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")
    if backend == "chunked":
        return _chunked(q, k, v, scale, causal, chunk_size)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
