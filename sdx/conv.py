"""2-D convolution for every sdx model: XLA's convolution, or the same sum as matrix products.

Every `sdx.layers.conv` (NHWC inputs, HWIO kernels) calls `for_backend(Compute.conv)`, a drop-in for
`lax.conv_general_dilated`. The backends give the same result to float32 rounding:

- `xla`: `lax.conv_general_dilated` (cuDNN on a GPU).
- `matmul`: every convolution without dilation or groups as one matrix product: a 1×1 kernel
  multiplies the pixels by the kernel directly; a k×k kernel first gathers each output pixel's k·k
  input pixels side by side (its patch, (B·Ho·Wo, k·k·C)) and multiplies that by the (k·k·C, O) kernel.
- `winograd`: every float32 3×3 convolution with stride 1 and one pixel of padding (every 3×3 one of
  the models but the downsamplers') as Winograd F(2×2, 3×3) (`winograd`): 16 matrix products with 4
  products per output pixel and channel pair instead of 9; `xla` for the rest.
- `auto` (the default): on a CPU, 3×3 kernels as `winograd` where `WINOGRAD_PIXELS` and
  `WINOGRAD_CHANNELS` say; then 1×1 kernels as `matmul` always, and larger kernels as `matmul` when
  the patch matrix has no more rows than the input has channels (B·Ho·Wo ≤ C); `xla` otherwise and on
  every other platform. XLA's CPU convolution splits its work over output pixels, so at the UNet's
  low-resolution levels (8×8 latents, 1,280 channels) it reaches a third of the matmul rate; there
  the patches cost little to gather (benchmarks/LOG.md: SD 1.5's UNet call at 256², 2.99 s → 2.06 s).
  At high resolution gathering the patches costs more than it saves, and there Winograd's products
  take the work (SD 1.5's VAE decode at 256², 2.90 → 2.32 s).

`upsample_conv` is the 3×3 convolution of a nearest-neighbour 2× upsampled image computed on the image
before upsampling, with 2.25× fewer products; every `Upsample2D` takes it under `auto` on a CPU where
`folds_upsampling` says.
"""

from __future__ import annotations

import functools
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax import lax

from sdx import products

Backend = Literal["auto", "xla", "matmul", "winograd"]
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
          feature_group_count=1, precision=None, preferred_element_type=None, *, form: str, **kw):
    """The convolution in `form` (`auto`, `matmul` or `winograd`, module docstring) where that form can
    compute it, XLA's otherwise."""
    if _as_matmul(lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                  feature_group_count, **kw):
        kh, kw_, c, o = rhs.shape
        ho, wo = _out_size(lhs, rhs, window_strides, padding)
        cpu, pixels = jax.default_backend() == "cpu", lhs.shape[0] * ho * wo
        if form != "matmul" and _winograd_computes(lhs, rhs, window_strides, padding) and (
                form == "winograd" or (cpu and pixels >= WINOGRAD_PIXELS and min(c, o) >= WINOGRAD_CHANNELS)):
            return winograd(lhs, rhs, precision, preferred_element_type)
        if form == "matmul" or (form == "auto" and cpu and (kh * kw_ == 1 or pixels <= c)):
            return _matmul(lhs, rhs, window_strides, padding, (ho, wo), precision, preferred_element_type)
    return lax.conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers, feature_group_count=feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type, **kw,
    )


# plain module-level functions: a model's graph definition holds one, and must compare equal to itself read
# back (`pipelines.executables` keeps abstract models), which a `functools.partial` does not
def _auto(*args, **kw):
    return _call(*args, form="auto", **kw)


def _always_matmul(*args, **kw):
    return _call(*args, form="matmul", **kw)


def _always_winograd(*args, **kw):
    return _call(*args, form="winograd", **kw)


WINOGRAD_PIXELS = 512
WINOGRAD_CHANNELS = 256
"""`auto` on a CPU computes a 3×3 convolution by `winograd` when it has at least WINOGRAD_PIXELS output
pixels (B·H·W) and WINOGRAD_CHANNELS input and output channels: below either, the transforms (memory
traffic, and the kernel's 16·C·O values formed at every call) cost more than the products saved
(benchmarks/LOG.md measures both sides)."""

# Winograd F(2×2, 3×3) (Lavin & Gray, "Fast Algorithms for Convolutional Neural Networks", 2015): a 2×2 block
# of outputs of a 3×3 kernel is A^T [(G g G^T) ⊙ (B^T d B)] A for the block's 4×4 input tile d
_BT = ((1, 0, -1, 0), (0, 1, 1, 0), (0, -1, 1, 0), (0, 1, 0, -1))  # (4, 4) input transform
_G = ((1, 0, 0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0, 0, 1))  # (4, 3) kernel transform
_AT = ((1, 1, 1, 0), (0, 1, -1, -1))  # (2, 4) output transform


def _mix(xs: list, matrix) -> list:
    """[Σ_j matrix[i][j]·xs[j] for each row i] over arrays, as additions (no product by 0 or ±1)."""
    out = []
    for row in matrix:
        terms = [x if m == 1 else -x if m == -1 else x * m for m, x in zip(row, xs) if m != 0]
        out.append(functools.reduce(jnp.add, terms))
    return out


def _transform(grid: list[list], matrix) -> list[list]:
    """M X M^T for the grid of arrays X[i][j] and the constant matrix M: a grid [a][b] of len(M)²."""
    cols = [_mix([row[j] for row in grid], matrix) for j in range(len(grid[0]))]  # cols[j][a] = (M X)[a][j]
    return [_mix([col[a] for col in cols], matrix) for a in range(len(matrix))]


def _winograd_computes(lhs, rhs, window_strides, padding) -> bool:
    """Whether `winograd` computes this call (already one `_as_matmul` takes): a float32 3×3 kernel, stride 1,
    one pixel of padding on every side."""
    return (rhs.shape[:2] == (3, 3) and tuple(window_strides) == (1, 1)
            and tuple(map(tuple, padding)) == ((1, 1), (1, 1)) and lhs.dtype == rhs.dtype == jnp.float32)


def winograd(x: jax.Array, kernel: jax.Array, precision=None, preferred_element_type=None) -> jax.Array:
    """The 3×3 convolution, padding 1, of `x` (B, H, W, C) by `kernel` (3, 3, C, O), as Winograd F(2×2, 3×3):
    16 matrix products of (tiles, C) by (C, O), 4 products per output pixel and channel pair instead of 9.
    The transforms are additions (and halvings of the kernel), so the result is the convolution's to
    float32 rounding.

    A batch of more than WINOGRAD_BAND output pixels is computed in bands of about that many, whole rows of
    one image each, one band at a time (`lax.map`), so that a band's transformed tiles stay in the CPU's
    cache."""
    b, h, w, c = x.shape
    u = _transform([[kernel[i, j] for j in range(3)] for i in range(3)], _G)  # 4×4 of (C, O)
    tiles = lambda xp: _winograd_tiles(xp, u, precision, preferred_element_type)
    rows = max(2, WINOGRAD_BAND // w // 2 * 2)  # output rows of a band, even
    n = -(-h // rows)  # bands of an image
    if b * h * w <= WINOGRAD_BAND or n == 1:
        return tiles(jnp.pad(x, ((0, 0), (1, 1 + h % 2), (1, 1 + w % 2), (0, 0))))[:, :h, :w]
    xp = jnp.pad(x, ((0, 0), (1, 1 + n * rows - h), (1, 1 + w % 2), (0, 0)))  # (B, n·rows + 2, W + 2 (+1), C)
    band = lambda k: lax.dynamic_slice_in_dim(lax.dynamic_index_in_dim(xp, k // n), (k % n) * rows, rows + 2, axis=1)
    out = lax.map(lambda k: tiles(band(k)), jnp.arange(b * n))  # (B·n, 1, rows, W (+1), O), image-major
    return out.reshape(b, n * rows, *out.shape[3:])[:, :h, :w]


WINOGRAD_BAND = 2048
"""`winograd` computes a batch of more output pixels than this in bands of about as many (benchmarks/LOG.md:
the VAE decoder's 256²×256→256 403 ms whole, 288-310 ms in bands of 1,024-4,096 pixels)."""


def _winograd_tiles(xp: jax.Array, u: list[list], precision, preferred_element_type) -> jax.Array:
    """`winograd`'s output (B, H, W, O) for the input padded by one pixel, (B, H + 2, W + 2, C), H and W even,
    and the kernel's transform `u`. Output block (i, j) (pixels 2i, 2i + 1 by 2j, 2j + 1) reads the 4×4
    tile of `xp` at (2i, 2j)."""
    b, th, tw = xp.shape[0], xp.shape[1] // 2 - 1, xp.shape[2] // 2 - 1  # output blocks down and across
    p, c = b * th * tw, xp.shape[-1]
    # d[i][j]: pixel (i, j) of every 4×4 tile, (P, C)
    tiles = [[xp[:, i:i + 2 * th:2, j:j + 2 * tw:2].reshape(p, c) for j in range(4)] for i in range(4)]
    v = _transform(tiles, _BT)  # 4×4 of (P, C)
    m = [[products.dot_general(v[a][e], u[a][e], (((1,), (0,)), ((), ())), precision, preferred_element_type)
          for e in range(4)] for a in range(4)]  # (P, O) each
    y = _transform(m, _AT)  # y[r][s]: output pixel (2i + r, 2j + s) of every block, (P, O)
    o = y[0][0].shape[-1]
    rows = [jnp.stack([y[r][s].reshape(b, th, tw, o) for s in (0, 1)], axis=3) for r in (0, 1)]  # (B, th, tw, 2, O)
    return jnp.stack(rows, axis=2).reshape(b, 2 * th, 2 * tw, o)  # (B, th, 2, tw, 2, O) -> (B, 2th, 2tw, O)


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
saved: benchmarks/LOG.md measures both sides (2×4²×1280 slower, 2×16²×640 faster)."""


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
    output channel, against the upsampled image's 36.

    The padding is a `jnp.pad` before an unpadded convolution, not the convolution's own: XLA folds it back
    into the forward convolution (the same program), but the kernel's gradient of a 2×2 convolution padded
    by 1 on every side (padded by its full width) is a convolution XLA:CPU runs with a reversed kernel on a
    slow path, 25-80× slower than the gradient of the unpadded one (benchmarks/LOG.md: 42.6 s against
    0.56 s for 2×32²×640 channels); from the padded input it is an ordinary one."""
    b, h, w, _ = x.shape
    o = kernel.shape[-1]
    k = _phase_kernel(kernel.astype(jnp.float32)).astype(x.dtype)
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))  # (B, H + 2, W + 2, C)
    nhwc = lax.conv_dimension_numbers(xp.shape, k.shape, _NHWC)
    y = for_backend(backend)(xp, k, (1, 1), ((0, 0), (0, 0)), dimension_numbers=nhwc).reshape(b, h + 1, w + 1, 2, 2, o)
    rows = [jnp.stack([y[:, a:a + h, c:c + w, a, c] for c in (0, 1)], axis=3) for a in (0, 1)]  # (B, H, W, 2, O)
    return jnp.stack(rows, axis=2).reshape(b, 2 * h, 2 * w, o)  # (B, H, 2, W, 2, O) -> (B, 2H, 2W, O)


# module-level functions, so two models built alike have equal graph definitions (jit's cache key)
_FUNCTIONS = {"auto": _auto, "xla": lax.conv_general_dilated, "matmul": _always_matmul, "winograd": _always_winograd}


def for_backend(backend: Backend):
    """The `conv_general_dilated` of `backend`, for `nnx.Conv(conv_general_dilated=...)`."""
    if backend not in _FUNCTIONS:
        raise ValueError(f"conv backend {backend!r} is not one of {', '.join(BACKENDS)}")
    return _FUNCTIONS[backend]
