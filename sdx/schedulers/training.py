"""Training targets from the forward process x_t = sqrt(a_t) * x0 + sqrt(1 - a_t) * noise (Ho et al. 2020),
with a_t = alphas_cumprod[t], matching diffusers' DDPMScheduler.add_noise / get_velocity and
diffusers.training_utils.compute_snr. Use the model's config parsed as diffusers' training scripts do:
`sdx.schedulers.from_name("ddpm", scheduler_config)`.

x0, noise: f32[batch, ...] (any layout, batch first); timesteps: int[batch].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sdx.schedulers.common import Scheduler


def _scales(sched: Scheduler, timesteps: jax.Array, ndim: int) -> tuple[jax.Array, jax.Array]:
    """sqrt(a_t), sqrt(1 - a_t), shaped [batch, 1, ...] to broadcast over a rank-`ndim` sample."""
    a = jnp.asarray(sched.alphas_cumprod)[timesteps].reshape(-1, *(1,) * (ndim - 1))
    return jnp.sqrt(a), jnp.sqrt(1 - a)


def add_noise(sched: Scheduler, x0: jax.Array, noise: jax.Array, timesteps: jax.Array) -> jax.Array:
    """The noisy sample x_t the model is trained on."""
    signal, sigma = _scales(sched, timesteps, x0.ndim)
    return signal * x0 + sigma * noise


def get_velocity(sched: Scheduler, x0: jax.Array, noise: jax.Array, timesteps: jax.Array) -> jax.Array:
    """The v-prediction target v = sqrt(a_t) * noise - sqrt(1 - a_t) * x0 (Salimans & Ho 2022)."""
    signal, sigma = _scales(sched, timesteps, x0.ndim)
    return signal * noise - sigma * x0


def original_sample(sched: Scheduler, x_t: jax.Array, output: jax.Array, timesteps: jax.Array,
                    v_prediction: bool = False) -> jax.Array:
    """The clean sample x0 that an epsilon model's `output` (or, with v_prediction, a v model's) at x_t implies:
    (x_t - sqrt(1 - a_t) * eps) / sqrt(a_t), or sqrt(a_t) * x_t - sqrt(1 - a_t) * v (DDPMScheduler.step's
    pred_original_sample)."""
    signal, sigma = _scales(sched, timesteps, x_t.ndim)
    return signal * x_t - sigma * output if v_prediction else (x_t - sigma * output) / signal


def snr(sched: Scheduler, timesteps: jax.Array) -> jax.Array:
    """f32[batch]: signal-to-noise ratio a_t / (1 - a_t), for min-SNR loss weighting (Hang et al. 2023)."""
    signal, sigma = _scales(sched, timesteps, 1)
    return (signal / sigma) ** 2
