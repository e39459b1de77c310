"""Scaled dot-product attention: the one function every sdx model calls.

Query, key and value stay split by head, `(batch, tokens, heads, head_dim)`, the layout
`jax.nn.dot_product_attention` takes, so no backend needs a transpose. The backend is a config
field of the model (`attention=`), never a global:

- `xla`: the portable reference (every platform; `python -m sdx.sample`'s default on accelerators other
  than NVIDIA GPUs, and for float32 on those). Logits
  and softmax in float32 whatever the inputs' dtype, which is what diffusers' `upcast_attention`/
  `upcast_softmax` ask for.
- `cudnn`: cuDNN flash attention on NVIDIA GPUs. cuDNN takes only float16/bfloat16 inputs with a
  head_dim that is a multiple of 8 and at most 256 (128 before Hopper), so the choice is made per call
  at trace time (`cudnn_rejects`): a call cuDNN cannot take (the VAE's one 512-wide head) runs the `xla`
  path instead, logged once per reason. Odd sequence lengths (77 text tokens) are padded to even ones
  and masked (`_cudnn`): JAX refuses odd lengths in the cuDNN backward, which training needs.
  `python -m sdx.sample`'s default for float16 and bfloat16 on NVIDIA GPUs that have it (compute
  capability 8.0 or later): SDXL at 1024² in bfloat16 on an H100 samples 1.9× faster than with `xla`
  (benchmarks/LOG.md).
- `chunked`: one head, `chunk_size` queries and `shards` rows of the batch at a time under `lax.map`, so
  only a (shards, chunk, tokens_k) block of logits exists at once, in the forward or the backward pass.
  `shards` is the number of devices the batch is split over (1 on one device): a block takes one row
  from each device's share of the batch, so a batch split over devices stays split and each device
  works on one image's logits at a time. Attentions with fewer than `BLOCKED_LOGITS` logits per head and
  image run as `xla`. For very long sequences (the 128² latent of a 2048² image has 16,384 tokens: 1 GiB
  of float32 logits per head and image), and faster on a CPU from 1,024 tokens on, where the blocks stay
  in cache (benchmarks/LOG.md: SD 1.5's 1,024- and 4,096-token self-attentions 2.5-3× faster than
  `xla`; with the whole guidance batch in every block instead of one image, a 4,096-token one took 1.07×
  as long at one image and 1.9× at four), so `python -m sdx.sample` takes it there by default
  (`default_backend`).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp

Backend = Literal["xla", "cudnn", "chunked"]
BLOCKED_LOGITS = 1024 * 1024  # `chunked` works in blocks from this many logits per head and image on
BACKENDS: tuple[str, ...] = get_args(Backend)  # the one list of names: CLIs take their choices from here

_log = logging.getLogger(__name__)


# einsum specs of the two products: (B, Tq, H, D) inputs with (B, H, Tq, Tk) logits, or one head's (B, T, D)
_LAYOUTS = {4: ("bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd"), 3: ("bqd,bkd->bqk", "bqk,bkd->bqd")}


def _reference(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool,
               key_mask: jax.Array | None = None) -> jax.Array:
    """Attention with float32 logits and softmax. q: (B, Tq, H, D), k/v: (B, Tk, H, D); or one head,
    q: (B, Tq, D), k/v: (B, Tk, D). key_mask (B, Tk) bool: the keys each row may attend to (all if None).

    The softmax's division is applied to the (B, Tq, H, D) output instead of the (B, H, Tq, Tk)
    weights: one pass less over the largest tensor (about 30% faster at SD 1.5's 4096 tokens on a CPU,
    same result to float32 rounding).
    """
    qk, pv = _LAYOUTS[q.ndim]
    # the scale goes on the (B, Tq, H, D) queries, not on the (B, H, Tq, Tk) logits: XLA's CPU fusions
    # would otherwise materialise the scale broadcast to the logits' shape (a second buffer of their size)
    q = q * jnp.asarray(scale, q.dtype)
    logits = jnp.einsum(qk, q, k, preferred_element_type=jnp.float32)
    if causal:
        tq, tk = q.shape[1], k.shape[1]
        keep = jnp.tril(jnp.ones((tq, tk), dtype=bool), k=tk - tq)
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    if key_mask is not None:  # (B, Tk) -> the logits' (B, [1,] 1, Tk)
        seen = key_mask[:, None, None, :] if q.ndim == 4 else key_mask[:, None, :]
        logits = jnp.where(seen, logits, jnp.finfo(jnp.float32).min)
    top = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))  # any shift gives the same softmax
    weights = jnp.exp(logits - top)  # unnormalised, (B, H, Tq, Tk) or (B, Tq, Tk)
    out = jnp.einsum(pv, weights.astype(v.dtype), v, preferred_element_type=jnp.float32)
    total = weights.sum(axis=-1)  # (B, H, Tq) or (B, Tq)
    total = total.transpose(0, 2, 1)[..., None] if q.ndim == 4 else total[..., None]  # like out: (..., Tq, [H,] 1)
    return (out / total).astype(v.dtype)


def _chunked(q, k, v, scale: float, causal: bool, chunk_size: int, shards: int) -> jax.Array:
    """One head, `chunk_size` queries and gcd(B, shards) rows of the batch at a time under `lax.map`, each
    block checkpointed, when the (Tq, Tk) logits are large; `_reference` otherwise (see the module
    docstring)."""
    if causal:
        raise ValueError("attention='chunked' is for the image models; the causal text encoder uses 'xla'")
    b, tq, h, d = q.shape
    tk = k.shape[1]
    if tq * tk < BLOCKED_LOGITS:
        return _reference(q, k, v, scale, causal)
    g = math.gcd(b, shards)  # rows per block: row i*n + j of the batch is row i of group j
    n = b // g
    c = min(chunk_size, tq)
    m = math.ceil(tq / c)
    qp = jnp.pad(q, ((0, 0), (0, m * c - tq), (0, 0), (0, 0)))
    blocks = qp.reshape(g, n, m, c, h, d).transpose(1, 2, 4, 0, 3, 5).reshape(n * m * h, g, c, d)  # (n*m*H, g, c, D)
    index = jnp.arange(n * m * h)
    group, head = index // (m * h), index % h  # of each block
    k_groups, v_groups = (a.reshape(g, n, tk, h, d).transpose(1, 3, 0, 2, 4) for a in (k, v))  # (n, H, g, Tk, D)
    # Checkpointed per block: without it the backward pass would keep every block's softmax weights,
    # i.e. the whole (Tq, Tk) matrix the blocking exists to avoid.
    attend = jax.checkpoint(lambda a: _reference(a[0], k_groups[a[1], a[2]], v_groups[a[1], a[2]], scale, False))
    out = jax.lax.map(attend, (blocks, group, head))  # (n*m*H, g, c, D)
    out = out.reshape(n, m, h, g, c, d).transpose(3, 0, 1, 4, 2, 5).reshape(b, m * c, h, d)  # (B, Tq+pad, H, D)
    return out[:, :tq]


@functools.cache
def _cuda_capability() -> tuple[int, ...] | None:
    """The first GPU's CUDA compute capability, (9, 0) on an H100; None without an NVIDIA GPU."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    capability = getattr(gpus[0], "compute_capability", None) if gpus else None
    try:
        return tuple(int(x) for x in capability.split("."))
    except (AttributeError, ValueError):  # none, or another vendor's naming
        return None


def _cudnn_max_head_dim() -> int:
    """The largest head_dim cuDNN flash attention takes here: 256 on Hopper or later (compute capability
    9.0), 128 before, as jax's `check_is_flash_attention` decides. Without a CUDA device, 256."""
    capability = _cuda_capability()
    return 256 if capability is None or capability >= (9, 0) else 128


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
    _log.info("attention: cuDNN flash attention cannot take %s; these calls use the xla backend", reason)


def default_backend(dtype="float32") -> Backend:
    """The sampler's backend when none is asked for, computing in `dtype`: `chunked` on a CPU (faster
    and smaller there from 1,024 tokens on; below `BLOCKED_LOGITS` it is `xla`); `cudnn` in float16 or
    bfloat16 on an NVIDIA GPU with cuDNN flash attention (compute capability 8.0 or later); `xla`
    elsewhere."""
    if jax.default_backend() == "cpu":
        return "chunked"
    capability = _cuda_capability()
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
    return "cudnn" if half and capability is not None and capability >= (8, 0) else "xla"


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool) -> jax.Array:
    """cuDNN flash attention. Differentiating it, JAX refuses odd query or key lengths (its check in
    jax/_src/cudnn/fused_attention_stablehlo.py sees a bias where none was given), so an odd length is
    padded by one token, cuDNN's padding mask (`query_seq_lengths`/`key_value_seq_lengths`) leaves the
    padding out of the softmax, and the padded query row is dropped."""
    tq, tk = q.shape[1], k.shape[1]
    if tq % 2 == 0 and tk % 2 == 0:
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal, implementation="cudnn")
    even = lambda x: jnp.pad(x, ((0, 0), (0, x.shape[1] % 2), (0, 0), (0, 0)))  # (B, T, H, D) -> (B, T + T % 2, H, D)
    lengths = lambda t: jnp.full((q.shape[0],), t, jnp.int32)
    out = jax.nn.dot_product_attention(even(q), even(k), even(v), scale=scale, is_causal=causal,
                                       query_seq_lengths=lengths(tq), key_value_seq_lengths=lengths(tk),
                                       implementation="cudnn")
    return out[:, :tq]


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    backend: Backend = "xla",
    causal: bool = False,
    scale: float | None = None,
    chunk_size: int = 512,
    shards: int = 1,
    key_mask: jax.Array | None = None,
) -> jax.Array:
    """Attention over split heads. q: (B, Tq, H, D); k, v: (B, Tk, H, D) -> (B, Tq, H, D). chunk_size,
    shards: the `chunked` backend's queries per block and the devices the batch is split over. key_mask
    (B, Tk) bool: the keys each row may attend to (a text encoder's attention mask); it runs `xla`."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if key_mask is not None:
        return _reference(q, k, v, scale, causal, key_mask)
    if backend == "xla":
        return _reference(q, k, v, scale, causal)
    if backend == "cudnn":
        reason = cudnn_rejects(q.dtype, q.shape[-1])
        if reason is None:
            return _cudnn(q, k, v, scale, causal)
        _log_fallback(reason)
        return _reference(q, k, v, scale, causal)
    if backend == "chunked":
        return _chunked(q, k, v, scale, causal, chunk_size, shards)
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")
