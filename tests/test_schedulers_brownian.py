"""The Brownian tree behind DPM++ SDE (sdx.schedulers.brownian): it is Brownian motion (Var W(u) = u,
Cov(W(u), W(v)) = min(u, v)), each image's path comes from its key alone, and the sampler's two stages of a
step see the correlation the path gives them. Statistics over 4096 keys: a standard error of about 0.02."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sdx import schedulers
from sdx.schedulers.brownian import brownian_point

KEYS = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(jnp.arange(4096))
SDXL = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "timestep_spacing": "leading",
        "steps_offset": 1}


@pytest.fixture(scope="module")
def paths() -> np.ndarray:
    """W at U for every key: (4096, len(U))."""
    return np.asarray(jax.jit(jax.vmap(lambda k: jax.vmap(lambda u: brownian_point(k, u, ()))(jnp.asarray(U))))(KEYS))


U = np.array([0.0, 0.1, 0.35, 0.3501, 0.8, 1.0], np.float32)


def test_the_tree_is_brownian_motion(paths):
    cov = paths.T @ paths / len(paths)
    np.testing.assert_allclose(cov, np.minimum(U[:, None], U[None, :]), atol=0.06)
    assert np.all(paths[:, 0] == 0)
    # a small increment is normal with its own variance, not the interpolation's
    du = float(U[3]) - float(U[2])
    assert abs(np.var((paths[:, 3] - paths[:, 2]) / np.sqrt(du)) - 1) < 0.1


def test_a_path_is_its_keys_alone():
    point = jax.jit(jax.vmap(lambda k: brownian_point(k, jnp.float32(0.42), (3, 2))))
    alone, batched = point(KEYS[5:6])[0], point(KEYS[3:7])
    np.testing.assert_array_equal(np.asarray(batched[2]), np.asarray(alone))
    assert not np.allclose(np.asarray(batched[1]), np.asarray(alone))


def test_dpmpp_sde_noise_correlations():
    """Stage 1 of step i draws the increment over [sigma_mid, sigma_i], stage 2 over [sigma_{i+1}, sigma_i]:
    correlated by sqrt((sigma_i - sigma_mid) / (sigma_i - sigma_{i+1})); steps are independent."""
    sched = schedulers.from_name("dpmpp_sde_karras", SDXL)
    state = sched.set_timesteps(6, ())
    at = lambda k, c: sched.draw_noise(dataclasses.replace(state, index=c), k, c, ())
    calls = jnp.arange(state.num_calls)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: jax.vmap(lambda c: at(k, c))(calls)))(KEYS))  # (keys, calls)
    schedule = sched.schedule(6)
    sigmas, mids = schedule["sigmas"].astype(np.float64), schedule["mids"]
    np.testing.assert_allclose(draws[:, :-1].var(axis=0), 1.0, atol=0.1)  # the last call (to 0) draws nothing
    assert np.all(draws[:, -1] == 0)
    corr = np.corrcoef(draws[:, :-1].T)
    for i in range(5):
        expected = np.sqrt((sigmas[i] - mids[i]) / (sigmas[i] - sigmas[i + 1]))
        assert abs(corr[2 * i, 2 * i + 1] - expected) < 0.05, i
        if i < 4:
            assert abs(corr[2 * i + 1, 2 * i + 2]) < 0.06, i

