"""Exponential moving average of the weights: diffusers' EMAModel (training_utils.py) as pure functions.

Step convention: `optimization_step` is the number of optimizer steps done *including* the one whose
parameters are being averaged in, so the first update after the first optimizer step passes 1. This is
diffusers' counter: the scripts call `ema_unet.step(unet.parameters())` once per optimizer step
(`if accelerator.sync_gradients`), and `EMAModel.step` increments `optimization_step` before it computes
the decay. In `train.step`, that is the state's step count after the increment.

Decay (EMAModel.get_decay): s = max(0, optimization_step − update_after_step − 1); s = 0 gives decay 0
(the shadow becomes a copy of the weights, min_decay notwithstanding); otherwise
d = 1 − (1 + s/inv_gamma)^(−power) with warm-up, (1 + s)/(10 + s) without, then
d = max(min(d, decay), min_decay), and shadow ← shadow − (1 − d)(shadow − param).

Precision: the shadow is float32 whatever the parameters' dtype. `1 − d` is computed directly (not as
1 minus a float32 d near 1, which would keep only a few bits of it), so the update is as exact in
float32 as diffusers' float64 decay is.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class EMAConfig:
    """diffusers' EMAModel arguments, with its defaults (the scripts' --use_ema takes them all)."""

    decay: float = 0.9999
    min_decay: float = 0.0
    update_after_step: int = 0
    use_warmup: bool = False
    inv_gamma: float = 1.0
    power: float = 2 / 3


def one_minus_decay(cfg: EMAConfig, optimization_step) -> jax.Array:
    """f32 scalar 1 − d for this optimization step (traced or Python int)."""
    s = jnp.maximum(jnp.asarray(optimization_step, jnp.int32) - cfg.update_after_step - 1, 0).astype(jnp.float32)
    if cfg.use_warmup:
        rest = (1.0 + s / cfg.inv_gamma) ** -cfg.power
    else:
        rest = 9.0 / (10.0 + s)  # 1 − (1 + s)/(10 + s)
    rest = jnp.clip(rest, 1.0 - cfg.decay, 1.0 - cfg.min_decay)  # d = max(min(d, decay), min_decay)
    return jnp.where(s <= 0, 1.0, rest).astype(jnp.float32)


def decay(cfg: EMAConfig, optimization_step) -> jax.Array:
    """f32 scalar: the EMA decay d of this optimization step (EMAModel.get_decay)."""
    return 1.0 - one_minus_decay(cfg, optimization_step)


def update(cfg: EMAConfig, ema_params, params, optimization_step):
    """The shadow after this optimization step: shadow − (1 − d)(shadow − param), leaf by leaf, float32."""
    rate = one_minus_decay(cfg, optimization_step)

    def one(shadow, param):
        shadow = shadow.astype(jnp.float32)
        return shadow - rate * (shadow - param.astype(jnp.float32))

    return jax.tree.map(one, ema_params, params)
