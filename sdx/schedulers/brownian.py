"""A Brownian tree in JAX: one Brownian motion per image, queried at any time, from the image's key alone.

The stochastic DPM++ samplers of k-diffusion (and diffusers' DPMSolverSDEScheduler) take their noise from a
Brownian motion W over the noise levels, as the increments (W(b) - W(a)) / sqrt(|b - a|) between the sigmas
of each stage: the two stages of a step see correlated noise, and the same seed gives nearly the same image at
another step count (the path, not the draws, is the randomness). torchsde's BrownianInterval (Li et al.
2020, "Scalable Gradients for Stochastic Differential Equations", the "Brownian tree") builds such a path
lazily by bisection.

This tree is the same construction, stateless: time is normalised to [0, 1] over the sampler's sigma range;
W(1) is a normal draw from the key, and each of `DEPTH` levels of bisection draws the midpoint of the current
interval from the Brownian bridge between its ends (mean their average, variance a quarter of the width), the
node's key being its parent's folded with 1 (left) or 2 (right); the query point is interpolated linearly in
the last interval (width 2^-24, the float32 resolution of the normalised time). It has the law of torchsde's
paths at the same queries (both are Brownian motion to within their tolerance: torchsde's tol is 1e-6 in
sigma), but not its numbers: those come from torch's generator seeded through torchsde's own seed tree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEPTH = 24


def brownian_point(key: jax.Array, u: jax.Array, shape: tuple[int, ...], depth: int = DEPTH) -> jax.Array:
    """W(u) (float32, `shape`) of the standard Brownian motion on [0, 1] (W(0) = 0) that `key` fixes."""
    w_hi = jax.random.normal(jax.random.fold_in(key, 0), shape, jnp.float32)  # W(1)
    node = jax.random.fold_in(key, 1)  # the root interval [0, 1]

    def level(d, carry):
        lo, w_lo, w_hi, node = carry
        width = jnp.float32(2.0) ** -d.astype(jnp.float32)
        mid = lo + width / 2
        bridge = jax.random.normal(jax.random.fold_in(node, 0), shape, jnp.float32)
        w_mid = (w_lo + w_hi) / 2 + jnp.sqrt(width / 4) * bridge
        left = u < mid
        return (jnp.where(left, lo, mid), jnp.where(left, w_lo, w_mid), jnp.where(left, w_mid, w_hi),
                jax.random.fold_in(node, jnp.where(left, 1, 2)))

    init = (jnp.float32(0.0), jnp.zeros(shape, jnp.float32), w_hi, node)
    lo, w_lo, w_hi, _ = jax.lax.fori_loop(0, depth, level, init)
    width = jnp.float32(2.0) ** -depth
    return w_lo + (u - lo) / width * (w_hi - w_lo)


def brownian_increment(key: jax.Array, u_from: jax.Array, u_to: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """(W(u_to) - W(u_from)) / sqrt(|u_to - u_from|): a standard normal draw (zeros when u_to == u_from)."""
    dt = jnp.abs(u_to - u_from)
    dw = brownian_point(key, u_to, shape) - brownian_point(key, u_from, shape)
    return jnp.where(dt > 0, dw / jnp.sqrt(jnp.where(dt > 0, dt, 1.0)), 0.0)
