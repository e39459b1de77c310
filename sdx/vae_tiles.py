"""A VAE pass over overlapping tiles, blended where they overlap: diffusers' `AutoencoderKL` tiling
(`vae.enable_tiling()`), so a large image's decode (or encode) works on one tile at a time and its working
memory is one tile's, whatever the image's size.

Tiles start every `stride` pixels along each side and reach `tile` pixels (less at the right and bottom
edges). Each output tile is blended into the tile above it and then the tile to its left over `blend`
rows and columns (linearly, from the neighbour to itself), and keeps its first `keep` rows and columns,
in diffusers' order: a neighbour is blended already when it is read. GroupNorm sees one tile at a time,
so the result is not the untiled pass's (the blending hides the seams); it is diffusers' tiled result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from sdx.errors import SdxError

OVERLAP = 0.25  # of a tile's side that neighbours share (diffusers' tile_overlap_factor)


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Where the tiles of one pass are: input tiles of `tile` pixels every `stride`; output tiles blended
    over `blend` pixels, each keeping its first `keep`."""

    tile: int
    stride: int
    blend: int
    keep: int

    @classmethod
    def for_pass(cls, tile_in: int, tile_out: int, overlap: float = OVERLAP) -> Tiles:
        """diffusers' numbers for a pass from tiles of `tile_in` pixels to tiles of `tile_out` (decoding:
        latent pixels to image pixels; encoding: the reverse)."""
        stride, blend = int(tile_in * (1 - overlap)), int(tile_out * overlap)
        keep = tile_out - blend
        if stride * tile_out != keep * tile_in:  # (a stride of 0 included: keep is at least 1)
            # diffusers' numbers are int()s of fractions: unless they line up, its tiled output is misplaced
            # and of another size than the untiled one
            raise SdxError(f"VAE tiling: tiles of {tile_in} pixels ({tile_out} out) overlapping by {overlap} do not "
                           "line up with their outputs; the VAE config's sample_size (the tile size) must be a "
                           "multiple of 4 x its downsample factor")
        return cls(tile_in, stride, blend, keep)

    def cuts(self, height: int, width: int) -> bool:
        """Whether an input of this size is larger than one tile (else a tiled pass is the untiled one)."""
        return max(height, width) > self.tile

    def corners(self, height: int, width: int) -> list[list[tuple[int, int]]]:
        """Each row's tiles' top-left corners, in input pixels."""
        return [[(i, j) for j in range(0, width, self.stride)] for i in range(0, height, self.stride)]


def apply(fn: Callable[[jax.Array], jax.Array], x: jax.Array, tiles: Tiles) -> jax.Array:
    """fn over `x` (B, H, W, C) tile by tile, blended (module docstring); fn(x) when x fits in one tile. Tiles
    of one shape run under one
    `lax.map` (whole tiles, and those the right or bottom edge cuts: at most three sizes along a side, as a
    stride is 3/4 of a tile), so one tile's working memory is alive at a time and the program holds fn once
    per shape."""
    height, width = x.shape[1:3]
    if not tiles.cuts(height, width):
        return fn(x)
    corners = tiles.corners(height, width)
    by_shape: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for i, j in (c for row in corners for c in row):
        by_shape.setdefault((min(tiles.tile, height - i), min(tiles.tile, width - j)), []).append((i, j))
    done = {}
    for (h, w), group in by_shape.items():
        stack = jnp.stack([x[:, i:i + h, j:j + w] for i, j in group])  # (tiles, B, h, w, C)
        outs = jax.lax.map(fn, stack)  # (tiles, B, h', w', C')
        done.update({corner: outs[k] for k, corner in enumerate(group)})
    blended, rows = {}, []
    for r, row in enumerate(corners):
        kept = []
        for c, corner in enumerate(row):
            out = done[corner]
            if r:
                out = _blend(blended[corners[r - 1][c]], out, tiles.blend, axis=1)
            if c:
                out = _blend(blended[row[c - 1]], out, tiles.blend, axis=2)
            blended[corner] = out
            kept.append(out[:, :tiles.keep, :tiles.keep])
        rows.append(jnp.concatenate(kept, axis=2))
    return jnp.concatenate(rows, axis=1)  # (B, H', W', C')


def _blend(before: jax.Array, out: jax.Array, extent: int, axis: int) -> jax.Array:
    """`out`'s first n rows (axis 1) or columns (axis 2) faded in over the last n of `before`, the neighbour
    above or to the left: out's line k < n becomes before's line (its size - n + k) * (1 - k/n) + its own
    * k/n; n is `extent` cut to both tiles' sizes (diffusers' blend_v / blend_h)."""
    n = min(before.shape[axis], out.shape[axis], extent)
    if n == 0:
        return out
    shape = [1] * out.ndim
    shape[axis] = n
    ramp = np.arange(n) / n  # float64, then each weight rounded to the tiles' dtype, as torch's scalar factors
    mine, theirs = (jnp.asarray(w.reshape(shape), out.dtype) for w in (ramp, 1 - ramp))
    head = jax.lax.slice_in_dim(before, before.shape[axis] - n, before.shape[axis], axis=axis) * theirs + \
        jax.lax.slice_in_dim(out, 0, n, axis=axis) * mine
    return jnp.concatenate([head, jax.lax.slice_in_dim(out, n, out.shape[axis], axis=axis)], axis=axis)
