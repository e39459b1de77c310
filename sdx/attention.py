"""Scaled dot-product attention: the one function every sdx model calls.

Query, key and value stay split by head, `(batch, tokens, heads, head_dim)`, the layout
`jax.nn.dot_product_attention` takes, so no backend needs a transpose. The backend is a config
field of the model (`attention=`), never a global:

- `xla`: the portable reference (every platform). Logits and softmax in float32 whatever the inputs'
  dtype, which is what diffusers' `upcast_attention`/`upcast_softmax` ask for.
- `cudnn`: cuDNN flash attention on NVIDIA GPUs. cuDNN takes only float16/bfloat16 inputs with a
  head_dim that is a multiple of 8 and at most 256 (128 before Hopper), so the choice is made per call
  at trace time (`cudnn_rejects`): a call cuDNN cannot take (the VAE's one 512-wide float32 head) runs
  the `xla` path instead, logged once per reason.
- `chunked`: queries processed `chunk_size` at a time under `lax.map`, so the `(tokens_q, tokens_k)`
  logits never exist for all queries at once, in the forward or the backward pass. For very long
  sequences (the 128² latent of a 2048² image has 16,384 tokens: 1 GiB of float32 logits per head
  and image).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp

Backend = Literal["xla", "cudnn", "chunked"]
BACKENDS: tuple[str, ...] = get_args(Backend)  # the one list of names: CLIs take their choices from here

_log = logging.getLogger(__name__)


def _reference(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool) -> jax.Array:
    """Attention with float32 logits and softmax. q: (B, Tq, H, D), k/v: (B, Tk, H, D).

    The softmax's division is applied to the (B, Tq, H, D) output instead of the (B, H, Tq, Tk)
    weights: one pass less over the largest tensor (about 30% faster at SD 1.5's 4096 tokens on a CPU,
    same result to float32 rounding).
    """
    # the scale goes on the (B, Tq, H, D) queries, not on the (B, H, Tq, Tk) logits: XLA's CPU fusions
    # would otherwise materialise the scale broadcast to the logits' shape (a second buffer of their size)
    q = q * jnp.asarray(scale, q.dtype)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    if causal:
        tq, tk = q.shape[1], k.shape[1]
        keep = jnp.tril(jnp.ones((tq, tk), dtype=bool), k=tk - tq)
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    top = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))  # any shift gives the same softmax
    weights = jnp.exp(logits - top)  # unnormalised, (B, H, Tq, Tk)
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


@functools.cache
def _cudnn_max_head_dim() -> int:
    """The largest head_dim cuDNN flash attention takes here: 256 on Hopper or later (compute capability
    9.0), 128 before, as jax's `check_is_flash_attention` decides. Without a CUDA device, 256."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    capability = getattr(gpus[0], "compute_capability", None) if gpus else None
    if capability is None:
        return 256
    return 256 if tuple(int(x) for x in capability.split(".")) >= (9, 0) else 128


def cudnn_rejects(dtype, head_dim: int, max_head_dim: int | None = None) -> str | None:
    """Why cuDNN flash attention cannot take inputs of `dtype` and `head_dim` (None when it can).

    jax raises for these (jax/_src/cudnn/fused_attention_stablehlo.py: `check_layout`,
    `check_is_flash_attention`) instead of falling back, so sdx checks first. max_head_dim: None reads
    the device's limit.
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        return f"{jnp.dtype(dtype).name} inputs (cuDNN takes float16 or bfloat16)"
    limit = _cudnn_max_head_dim() if max_head_dim is None else max_head_dim
    if head_dim % 8 or head_dim > limit:
        return f"head_dim {head_dim} (cuDNN takes multiples of 8 up to {limit})"
    return None


@functools.cache
def _log_fallback(reason: str) -> None:
    """Once per distinct reason: a run traces the same shapes many times."""
    _log.warning("attention: cuDNN flash attention cannot take %s; these calls use the xla backend", reason)


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
        reason = cudnn_rejects(q.dtype, q.shape[-1])
        if reason is None:
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")
        _log_fallback(reason)
        return _reference(q, k, v, scale, causal)
    if backend == "chunked":
        return _chunked(q, k, v, scale, causal, chunk_size)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
