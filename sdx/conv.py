"""2-D convolution for every sdx model: XLA's convolution, or the same sum as one matrix product.

Every `sdx.layers.conv` (NHWC inputs, HWIO kernels) calls `for_backend(Compute.conv)`, a drop-in for
`lax.conv_general_dilated`. The backends give the same result to float32 rounding:

- `xla`: `lax.conv_general_dilated` (cuDNN on a GPU).
- `matmul`: every convolution without dilation or groups as one matrix product: a 1×1 kernel
  multiplies the pixels by the kernel directly; a k×k kernel first gathers each output pixel's k·k
  input pixels side by side (its patch, (B·Ho·Wo, k·k·C)) and multiplies that by the (k·k·C, O) kernel.
- `auto` (the default): on a CPU, 1×1 kernels as `matmul` always, and larger kernels as `matmul` when
  the patch matrix has no more rows than the input has channels (B·Ho·Wo ≤ C); `xla` otherwise and on
  every other platform. XLA's CPU convolution splits its work over output pixels, so at the UNet's
  low-resolution levels (8×8 latents, 1,280 channels) it reaches a third of the matmul rate; there
  the patches cost little to gather (benchmarks/README.md: SD 1.5's UNet call at 256², 2.99 s → 2.06 s).
  At high resolution gathering the patches costs more than it saves, so those stay `xla`.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax

from sdx import products

Backend = Literal["auto", "xla", "matmul"]
BACKENDS: tuple[str, ...] = get_args(Backend)

_NHWC = ("NHWC", "HWIO", "NHWC")


def _as_matmul(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
               feature_group_count, **kw) -> bool:
    """Whether this call is one the matmul form computes: NHWC/HWIO, explicit padding, no dilation,
    no groups, no output sharding asked for."""
    if lhs.ndim != 4 or dimension_numbers != lax.conv_dimension_numbers(lhs.shape, rhs.shape, _NHWC):
        return False
    plain = lambda d: d is None or all(x == 1 for x in d)
    return (not isinstance(padding, str) and plain(lhs_dilation) and plain(rhs_dilation)
            and feature_group_count == 1 and kw.get("batch_group_count", 1) == 1 and kw.get("out_sharding") is None)


def _out_size(lhs, rhs, window_strides, padding) -> tuple[int, int]:
    """(Ho, Wo) of a convolution without dilation."""
    return tuple((n + lo + hi - k) // s + 1
                 for n, (lo, hi), k, s in zip(lhs.shape[1:3], padding, rhs.shape[:2], window_strides))


def _matmul(lhs, rhs, window_strides, padding, out_size, precision, preferred_element_type):
    """The convolution of NHWC `lhs` by the HWIO kernel `rhs` (output (Ho, Wo) = `out_size`) as one
    matrix product over patches."""
    b, _, _, c = lhs.shape
    kh, kw, _, o = rhs.shape
    (sh, sw), (ho, wo) = window_strides, out_size
    x = jnp.pad(lhs, ((0, 0), *padding, (0, 0)))
    taps = [x[:, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw, :] for i in range(kh) for j in range(kw)]
    patches = taps[0] if len(taps) == 1 else jnp.concatenate(taps, axis=-1)  # (B, Ho, Wo, kh*kw*C), HWI order
    out = products.dot_general(patches.reshape(b * ho * wo, kh * kw * c), rhs.reshape(kh * kw * c, o),  # (B*Ho*Wo, O)
                               (((1,), (0,)), ((), ())), precision, preferred_element_type)
    return out.reshape(b, ho, wo, o)


def _call(lhs, rhs, window_strides, padding, lhs_dilation=None, rhs_dilation=None, dimension_numbers=None,
          feature_group_count=1, precision=None, preferred_element_type=None, *, auto: bool, **kw):
    if _as_matmul(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                  feature_group_count, **kw):
        kh, kw_, c, _ = rhs.shape
        ho, wo = _out_size(lhs, rhs, window_strides, padding)
        if not auto or (jax.default_backend() == "cpu" and (kh * kw_ == 1 or lhs.shape[0] * ho * wo <= c)):
            return _matmul(lhs, rhs, window_strides, padding, (ho, wo), precision, preferred_element_type)
    return lax.conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers, feature_group_count=feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type, **kw,
    )


def _auto(*args, **kw):
    return _call(*args, auto=True, **kw)


def _always(*args, **kw):
    return _call(*args, auto=False, **kw)


# module-level functions, so two models built alike have equal graph definitions (jit's cache key)
_FUNCTIONS = {"auto": _auto, "xla": lax.conv_general_dilated, "matmul": _always}


def for_backend(backend: Backend):
    """The `conv_general_dilated` of `backend`, for `nnx.Conv(conv_general_dilated=...)`."""
    if backend not in _FUNCTIONS:
        raise ValueError(f"conv backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return _FUNCTIONS[backend]
