"""train.ema against diffusers' EMAModel: decay values and shadow weights after a sequence of steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.training_utils import EMAModel

from train import ema

CONFIGS = {
    "defaults": ema.EMAConfig(),
    "fast": ema.EMAConfig(decay=0.9),
    "warmup": ema.EMAConfig(use_warmup=True),
    "warmup_gamma": ema.EMAConfig(decay=0.995, use_warmup=True, inv_gamma=3.0, power=0.75),
    "after_step": ema.EMAConfig(decay=0.95, update_after_step=4),
    "min_decay": ema.EMAConfig(decay=0.999, min_decay=0.5),
    "min_over_max": ema.EMAConfig(decay=0.3, min_decay=0.6, update_after_step=2, use_warmup=True),
}


def reference(cfg: ema.EMAConfig, model: torch.nn.Module) -> EMAModel:
    return EMAModel(model.parameters(), decay=cfg.decay, min_decay=cfg.min_decay,
                    update_after_step=cfg.update_after_step, use_ema_warmup=cfg.use_warmup,
                    inv_gamma=cfg.inv_gamma, power=cfg.power)


@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_decay_and_shadow_match_ema_model(cfg):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    ref = reference(cfg, model)
    shadow = {name: jnp.asarray(p.detach().numpy()) for name, p in model.named_parameters()}
    update = jax.jit(ema.update, static_argnums=0)
    rng = np.random.default_rng(0)
    for step in range(1, 41):  # optimizer steps done, this one included
        with torch.no_grad():  # a new parameter value, as after an optimizer step
            for p in model.parameters():
                p.add_(torch.from_numpy(rng.standard_normal(tuple(p.shape)).astype(np.float32)) * 0.1)
        ref.step(model.parameters())
        params = {name: jnp.asarray(p.detach().numpy()) for name, p in model.named_parameters()}
        shadow = update(cfg, shadow, params, jnp.int32(step))
        d = float(ema.decay(cfg, jnp.int32(step)))
        assert np.isclose(d, ref.cur_decay_value, rtol=1e-6, atol=1e-7), (step, d, ref.cur_decay_value)
        for (name, _), s in zip(model.named_parameters(), ref.shadow_params):
            np.testing.assert_allclose(shadow[name], s.numpy(), rtol=1e-6, atol=1e-6, err_msg=f"{name} step {step}")


@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_decay_over_long_runs(cfg):
    ref = reference(cfg, torch.nn.Linear(1, 1))
    steps = np.array([0, 1, 2, 3, 5, 10, 100, 1000, 12345, 10**5, 10**6, 5 * 10**6])
    one_minus = jax.jit(jax.vmap(lambda s: ema.one_minus_decay(cfg, s)))(jnp.asarray(steps, jnp.int32))
    want = np.array([1 - ref.get_decay(int(s)) for s in steps])  # float64
    np.testing.assert_allclose(one_minus, want, rtol=2e-6)
    np.testing.assert_allclose(ema.decay(cfg, 10**6), ref.get_decay(10**6), rtol=1e-7)


def test_first_update_copies_and_bf16_params_keep_a_float32_shadow():
    cfg = ema.EMAConfig(min_decay=0.5)  # decay 0 at the first step even with a min_decay (as diffusers)
    assert float(ema.decay(cfg, 1)) == 0.0 and float(ema.decay(cfg, 0)) == 0.0
    params = {"w": jnp.asarray([1.5, -2.25], jnp.bfloat16)}
    shadow = ema.update(cfg, {"w": jnp.zeros(2, jnp.float32)}, params, 1)
    assert shadow["w"].dtype == jnp.float32
    np.testing.assert_array_equal(shadow["w"], [1.5, -2.25])
    shadow = ema.update(cfg, shadow, {"w": jnp.asarray([0.0, 0.0], jnp.bfloat16)}, 2)  # s = 1: d = max(2/11, .5)
    np.testing.assert_allclose(shadow["w"], [0.75, -1.125], rtol=1e-6)
