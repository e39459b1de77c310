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

`upsample_conv` is the 3×3 convolution of a nearest-neighbour 2× upsampled image computed on the image
before upsampling, with 2.25× fewer products; every `Upsample2D` takes it under `auto` on a CPU where
`folds_upsampling` says.
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


def _phase_kernel(kernel: jax.Array) -> jax.Array:
    """(3, 3, C, O) -> (2, 2, C, 4·O): for each output phase (a, b), channels (a, b, O), the 2×2 kernel
    over the input pixels that phase sees (below), the 3×3 taps falling on one input pixel summed."""
    def fold(k, axis):  # (.., 3, ..) -> (2 phases, .., 2 taps, ..): phase 0 sees [w0, w1 + w2], phase 1 [w0 + w1, w2]
        w0, w1, w2 = (jnp.take(k, i, axis=axis) for i in range(3))
        return jnp.stack([jnp.stack([w0, w1 + w2], axis=axis), jnp.stack([w0 + w1, w2], axis=axis)])
    k = fold(fold(kernel, 0), 2)  # (b, a, 2 row taps, 2 column taps, C, O)
    c, o = kernel.shape[2:]
    return k.transpose(2, 3, 4, 1, 0, 5).reshape(2, 2, c, 4 * o)


PHASE_PIXELS = 256
"""`upsample_conv` is taken (`folds_upsampling`) under `auto` on a CPU for an image of at least this many
pixels (B·H·W). Below it, forming the 2×2 kernels (16·C·O values each call) costs more than the products
saved: benchmarks/README.md measures both sides (2×4²×1280 slower, 2×16²×640 faster)."""


def folds_upsampling(shape: tuple[int, ...], backend: Backend) -> bool:
    """Whether an `Upsample2D` of a (B, H, W, C) image convolves it before upsampling (`upsample_conv`):
    under `auto` on a CPU, with B·H·W ≥ PHASE_PIXELS. Otherwise it upsamples, then convolves as any conv."""
    b, h, w, _ = shape
    return backend == "auto" and jax.default_backend() == "cpu" and b * h * w >= PHASE_PIXELS


def upsample_conv(x: jax.Array, kernel: jax.Array, backend: Backend) -> jax.Array:
    """The 3×3 convolution, padding 1 (no bias), of `x` (B, H, W, C) upsampled 2× by nearest neighbour,
    computed on `x` itself: (B, 2H, 2W, O) for the (3, 3, C, O) `kernel` (cast to x's dtype).

    Output pixel (2i + a, 2j + b) sees upsampled rows 2i + a - 1 .. 2i + a + 1, which are input rows i - 1, i
    (a = 0) or i, i + 1 (a = 1), and the same for columns: four 2×2 kernels (`_phase_kernel`). One 2×2
    convolution (`backend`'s) of `x` padded by one pixel computes all four as 4·O channels at
    (H + 1)·(W + 1) places; phase (a, b) is the window starting at (a, b). 16 products per input pixel and
    output channel, against the upsampled image's 36."""
    b, h, w, _ = x.shape
    o = kernel.shape[-1]
    k = _phase_kernel(kernel.astype(jnp.float32)).astype(x.dtype)
    nhwc = lax.conv_dimension_numbers(x.shape, k.shape, _NHWC)
    y = for_backend(backend)(x, k, (1, 1), ((1, 1), (1, 1)), dimension_numbers=nhwc).reshape(b, h + 1, w + 1, 2, 2, o)
    rows = [jnp.stack([y[:, a:a + h, c:c + w, a, c] for c in (0, 1)], axis=3) for a in (0, 1)]  # (B, H, W, 2, O)
    return jnp.stack(rows, axis=2).reshape(b, 2 * h, 2 * w, o)  # (B, H, 2, W, 2, O) -> (B, 2H, 2W, O)


# module-level functions, so two models built alike have equal graph definitions (jit's cache key)
_FUNCTIONS = {"auto": _auto, "xla": lax.conv_general_dilated, "matmul": _always}


def for_backend(backend: Backend):
    """The `conv_general_dilated` of `backend`, for `nnx.Conv(conv_general_dilated=...)`."""
    if backend not in _FUNCTIONS:
        raise ValueError(f"conv backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return _FUNCTIONS[backend]
