"""k-diffusion (Crowson) as the second reference, for the samplers A1111 and ComfyUI run from it: sdx's
sampler and k-diffusion's `sample_*` function, given the same sigmas, the same noise and the same stand-in
model, must visit the same samples.

k-diffusion's package cannot be imported without torchvision, scikit-image, kornia, clean-fid, wandb...
(its `__init__` imports its training code, and `k_diffusion.utils` imports torchvision), which the test
extras do not install: `make test` installs it with --no-deps, and this module loads its `sampling.py` alone,
with the one helper that file takes from `k_diffusion.utils` (`append_dims`) given here.

k-diffusion works on x = x0 + sigma * noise with a denoiser D(x, sigma); sdx's DPM-Solver multistep sampler on
the variance-preserving x / sqrt(sigma^2 + 1), so its samples are compared after that scaling.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import types
from pathlib import Path
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sdx import schedulers
from sdx.schedulers.two_stage import TwoStage

SD = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "timestep_spacing": "leading",
      "steps_offset": 1}
SHAPE = (2, 4, 4, 3)
PHASE = np.linspace(0, 3, int(np.prod(SHAPE))).reshape(SHAPE)
RTOL = 1e-5


def load_sampling() -> types.ModuleType:
    """k_diffusion/sampling.py without the package's __init__ (see the module docstring)."""
    path = Path(importlib.util.find_spec("k_diffusion").origin).parent / "sampling.py"
    package = types.ModuleType("k_diffusion")
    package.__path__ = [str(path.parent)]
    utils = types.ModuleType("k_diffusion.utils")
    utils.append_dims = lambda x, n: x[(...,) + (None,) * (n - x.ndim)]  # k_diffusion.utils.append_dims
    spec = importlib.util.spec_from_file_location("k_diffusion.sampling", path)
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, {"k_diffusion": package, "k_diffusion.utils": utils}):
        package.utils = utils
        spec.loader.exec_module(module)
    return module


SAMPLING = load_sampling()


def eps_model(x_in, sigma):
    """The stand-in noise prediction of the scaled sample x / sqrt(sigma^2 + 1) at noise level sigma."""
    return 0.5 * np.tanh(x_in) + 0.3 * np.cos(0.5 * np.log(sigma) + PHASE)


def kdiffusion(fn, sigmas, x, noises, noise_calls, **kwargs):
    """k-diffusion's sampler `fn` from x at sigmas[0]: its sample after every step. noise_calls(j): which of
    `noises` (indexed by sdx's model calls) the j-th noise_sampler call returns."""
    drawn = []

    def noise_sampler(sigma, sigma_next):
        drawn.append(None)
        return torch.from_numpy(noises[noise_calls(len(drawn) - 1)]).double()

    def denoiser(x, sigma):
        s = sigma[0].item()
        return x - s * torch.from_numpy(eps_model(x.numpy() / np.sqrt(s**2 + 1), s))

    seen = []
    kwargs = kwargs | ({"noise_sampler": noise_sampler} if "noise_sampler" in inspect.signature(fn).parameters else {})
    out = fn(denoiser, torch.from_numpy(x).double(), torch.from_numpy(sigmas).double(), disable=True,
             callback=lambda info: seen.append(info["x"].numpy().copy()), **kwargs)
    return np.stack([*seen[1:], out.numpy()])


def ours(sched, n, x_ve, noises):
    """sdx's samples at the end of every step, in k-diffusion's scaling."""
    state = sched.set_timesteps(n, SHAPE)
    sigmas = sched.schedule(n)["sigmas"].astype(np.float64)
    ve = isinstance(sched, TwoStage)
    sample = jnp.asarray(x_ve if ve else x_ve / np.sqrt(sigmas[0] ** 2 + 1), jnp.float32)
    samples = []
    for call in range(state.num_calls):
        sigma = float(state.table["sigma"][call]) if ve else sigmas[call]
        out = eps_model(np.asarray(sched.scale_model_input(state, sample)), sigma)
        state, sample = sched.step(state, jnp.asarray(out, jnp.float32), sample, jnp.asarray(noises[call]))
        if not ve:  # a step per call
            samples.append(np.asarray(sample) * np.sqrt(sigmas[call + 1] ** 2 + 1))
        elif call % 2 == 1 or call == state.num_calls - 1:  # a step's second call, or the last step's only one
            samples.append(np.asarray(sample))
    return np.stack(samples), sigmas


def rel_err(a, b):
    axes = tuple(range(1, a.ndim))
    return float((np.abs(a - b).max(axis=axes) / np.abs(b).max(axis=axes)).max())


# sdx name, k-diffusion function and arguments, which sdx call's noise the j-th noise draw is
CASES = {
    "dpmpp_2s_a_karras": (SAMPLING.sample_dpmpp_2s_ancestral, {}, lambda j: 2 * j + 1),
    "dpmpp_sde_karras": (SAMPLING.sample_dpmpp_sde, {}, lambda j: j),
    "dpmpp_sde": (SAMPLING.sample_dpmpp_sde, {}, lambda j: j),
    "dpmpp_3m_sde_karras": (SAMPLING.sample_dpmpp_3m_sde, {}, lambda j: j),
    "dpmpp_3m_sde_exponential": (SAMPLING.sample_dpmpp_3m_sde, {}, lambda j: j),
    "dpmpp_2m_sde_karras": (SAMPLING.sample_dpmpp_2m_sde, {}, lambda j: j),
    "dpmpp_2m_sde_heun": (SAMPLING.sample_dpmpp_2m_sde, {"solver_type": "heun"}, lambda j: j),
    "dpmpp_2m_karras": (SAMPLING.sample_dpmpp_2m, {}, None),
    "dpm2_karras": (SAMPLING.sample_dpm_2, {}, None),
    "dpm2": (SAMPLING.sample_dpm_2, {}, None),
    "dpm2_a_karras": (SAMPLING.sample_dpm_2_ancestral, {}, lambda j: 2 * j + 1),
}


@pytest.mark.parametrize("name", CASES)
def test_sampler_matches_kdiffusion(name):
    fn, kwargs, noise_calls = CASES[name]
    sched, n = schedulers.from_name(name, SD), 9
    rng = np.random.default_rng(0)
    noises = rng.standard_normal((len(sched.timesteps(n)), *SHAPE), dtype=np.float32)
    sigmas = sched.schedule(n)["sigmas"].astype(np.float64)
    x = rng.standard_normal(SHAPE).astype(np.float32) * np.float32(sigmas[0])
    got, _ = ours(sched, n, x, noises)
    ref = kdiffusion(fn, sigmas, x.astype(np.float64), noises, noise_calls, **kwargs)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < RTOL


def test_diffusers_third_order_sde_step_is_not_kdiffusions():
    """diffusers' sde-dpmsolver++ third-order step (a scheduler_config.json's, `sde_third_order="diffusers"`)
    weighs D2 with the other sign of its 1/2 (see sdx.schedulers.dpmpp_2m): it leaves k-diffusion's path from
    the first third-order step on, by far more than the float32 error."""
    fn, kwargs, noise_calls = CASES["dpmpp_3m_sde_karras"]
    sched, n = schedulers.from_name("dpmpp_3m_sde_karras", SD), 9
    as_diffusers = type(sched).from_config({**SD, **{f: getattr(sched, f) for f in (
        "algorithm_type", "solver_order", "solver_type", "lower_order_final", "use_karras_sigmas")}})
    rng = np.random.default_rng(0)
    noises = rng.standard_normal((n, *SHAPE), dtype=np.float32)
    sigmas = sched.schedule(n)["sigmas"].astype(np.float64)
    x = rng.standard_normal(SHAPE).astype(np.float32) * np.float32(sigmas[0])
    ref = kdiffusion(fn, sigmas, x.astype(np.float64), noises, noise_calls)
    got, _ = ours(as_diffusers, n, x, noises)
    assert rel_err(got[:2], ref[:2]) < RTOL  # first and second order: the same
    assert rel_err(got[2:3], ref[2:3]) > 100 * RTOL
