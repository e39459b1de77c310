"""Every sdx sampler against diffusers' PyTorch scheduler: same config, same closed-loop "model", same
injected noise; timesteps, sigmas, init_noise_sigma and every intermediate sample must agree.

The reference is diffusers' scheduler with its float32 tables (sigmas, alphas_cumprod) promoted to float64
(same values) and driven with float64 samples and model outputs: diffusers' algorithm without diffusers'
own float32 rounding, which reaches ~3e-5 where Euler starts from sigma = 4096 (zero-SNR; e.g. the float32
dt = sigma_next - 4096). Ours runs in float32 and must stay within RTOL of it.

The big grid runs eagerly (no compilation per cell); `test_jit_loop_no_recompile` runs a few cells inside
one jitted `lax.fori_loop` and checks that new input values do not recompile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import itertools
from types import SimpleNamespace
from unittest import mock

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import StableDiffusionXLImg2ImgPipeline

from sdx import schedulers
from sdx.schedulers import (
    DDIM,
    DDPM,
    KDPM2,
    LCM,
    LMS,
    PNDM,
    TCD,
    DEISMultistep,
    DPMSolverMultistep,
    DPMSolverSDE,
    DPMSolverSinglestep,
    EDMDPMSolverMultistep,
    EDMEuler,
    Euler,
    EulerAncestral,
    Heun,
    KDPM2Ancestral,
    UniPC,
)
from sdx.schedulers.edm import EDMScheduler
from sdx.schedulers.two_stage import TwoStage, interleaved

RTOL = 1e-5  # max |ours - diffusers| / max |diffusers|, per intermediate sample
RTOL_ODE = 2e-6  # the same for the deterministic samplers of the `MORE` grid and the new ladders (measured: <= 7e-7)
SHAPE = (2, 4, 4, 3)
PHASE = np.linspace(0, 3, int(np.prod(SHAPE)), dtype=np.float32).reshape(SHAPE)
SD = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012}


def model(x, t, dtype=np.float32):
    """A deterministic stand-in for the UNet: depends on the (scaled) sample and the timestep."""
    x, t = np.asarray(x, dtype), dtype(t)
    return (0.5 * np.tanh(x) + 0.3 * np.cos(dtype(0.01) * t + PHASE.astype(dtype))).astype(dtype)


def model_jax(x, t):
    return 0.5 * jnp.tanh(x) + 0.3 * jnp.cos(0.01 * t + PHASE)


NOT_CONFIG = {"eta", "sde_third_order"}  # our fields that are step arguments or sdx's own choices


def diffusers_config(sched) -> dict:
    """The diffusers config dict that describes `sched` (our fields are diffusers' names)."""
    skip = NOT_CONFIG | (sched.inert if isinstance(sched, EDMScheduler) else set())
    cfg = {f.name: getattr(sched, f.name) for f in dataclasses.fields(sched) if f.name not in skip}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


def step_kwargs(d, sched, noise) -> dict:
    """The step arguments diffusers' pipelines pass: DDIM's and TCD's eta (DDIM's noise as variance_noise)."""
    params = inspect.signature(d.step).parameters
    eta = getattr(sched, "eta", 0.0)
    kwargs = {"eta": eta} if "eta" in params else {}
    if eta and "variance_noise" in params:
        kwargs["variance_noise"] = noise
    return kwargs


def reference(sched, n, x, noises, *, strength=None, denoising_start=None, denoising_end=None, x0=None):
    """diffusers' scheduler driven the way its (SDXL) pipelines drive it. Returns (scheduler, timesteps run,
    samples after every call)."""
    d = getattr(diffusers, sched.diffusers_class).from_config(diffusers_config(sched))
    d.set_timesteps(n)
    timesteps = d.timesteps
    if strength is not None or denoising_start is not None:
        pipe = SimpleNamespace(scheduler=d)
        timesteps, _ = StableDiffusionXLImg2ImgPipeline.get_timesteps(pipe, n, strength, "cpu", denoising_start)
    if denoising_end is not None:  # StableDiffusionXL(Img2Img)Pipeline.__call__, "Apply denoising_end"
        cutoff = int(round(d.config.num_train_timesteps - denoising_end * d.config.num_train_timesteps))
        timesteps = timesteps[: len(list(filter(lambda ts: ts >= cutoff, timesteps)))]
    for name, value in vars(d).items():  # the float32 tables, as float64
        if isinstance(value, torch.Tensor) and value.dtype == torch.float32 and name != "timesteps":
            setattr(d, name, value.double())
    x, noises = torch.from_numpy(x).double(), torch.from_numpy(noises).double()
    if x0 is not None and denoising_start is None:
        sample = d.add_noise(torch.from_numpy(x0).double(), x, timesteps[:1])
    else:
        sample = x * (1.0 if denoising_start is not None else d.init_noise_sigma)
    module = importlib.import_module(type(d).__module__)
    call = [0]
    patch = (mock.patch.object(module, "randn_tensor", lambda *a, **k: noises[call[0]])
             if hasattr(module, "randn_tensor") else contextlib.nullcontext())
    if isinstance(d, diffusers.DPMSolverSDEScheduler):  # its Brownian noise sampler, given the same noise
        d.noise_sampler = lambda sigma, sigma_next: noises[call[0]]
    samples = []
    with patch:
        for i, t in enumerate(timesteps):
            call[0] = i
            out = torch.from_numpy(model(d.scale_model_input(sample, t).numpy(), t.item(), np.float64))
            sample = d.step(out, t, sample, **step_kwargs(d, sched, noises[i])).prev_sample
            samples.append(sample.numpy().copy())
    return d, timesteps.numpy(), np.stack(samples)


def ours(sched, n, x, noises, *, begin=0, end=None, x0=None, from_latents=False):
    state = sched.set_timesteps(n, SHAPE, begin=begin, end=end)
    if x0 is not None and not from_latents:
        sample = sched.add_noise(state, jnp.asarray(x0), jnp.asarray(x))
    else:
        sample = jnp.asarray(x) * (1.0 if from_latents else state.init_noise_sigma)
    samples = []
    for i in range(state.num_calls):
        out = model(sched.scale_model_input(state, sample), state.timestep)
        state, sample = sched.step(state, jnp.asarray(out), sample, jnp.asarray(noises[i]))
        samples.append(np.asarray(sample))
    return state, np.stack(samples)


def rel_err(a, b):
    axes = tuple(range(1, a.ndim))
    return float((np.abs(a - b).max(axis=axes) / np.abs(b).max(axis=axes)).max())


def inputs(sched, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    noises = rng.standard_normal((len(sched.timesteps(n)), *SHAPE), dtype=np.float32)
    return x, noises


def check_schedule(sched, d, n):
    """Host arrays: diffusers' are float32 from torch, whose CPU sqrt is not always correctly rounded, so
    allow a few float32 ulps."""
    np.testing.assert_allclose(sched.timesteps(n), d.timesteps.numpy().astype(np.float32), rtol=1e-5, atol=1e-5)
    if hasattr(d, "sigmas") and "sigmas" in sched.schedule(n):
        sigmas = sched.schedule(n)["sigmas"]
        if isinstance(sched, TwoStage):  # ours: one per step; diffusers': per call
            sigmas = interleaved(sigmas)[:len(d.sigmas)]
        np.testing.assert_allclose(sigmas, d.sigmas.numpy(), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(sched.set_timesteps(n, SHAPE).init_noise_sigma),
                               np.float32(d.init_noise_sigma), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------
# The grid: spacing x prediction type x Karras x zero-SNR x steps, where diffusers' class has the field.

def grid_cells():
    for cls in (Euler, EulerAncestral, Heun, DDIM, DDPM, PNDM, LMS, DPMSolverMultistep, UniPC):
        fields = {f.name for f in dataclasses.fields(cls)}
        karras = (False, True) if "use_karras_sigmas" in fields else (False,)
        zero_snr = (False, True) if "rescale_betas_zero_snr" in fields else (False,)
        for spacing, pred, k, z, n in itertools.product(("leading", "trailing", "linspace"), cls.prediction_types,
                                                        karras, zero_snr, (7, 20)):
            if z and pred == "epsilon" and cls in (DDIM, DDPM) and spacing != "leading":
                continue  # no signal at t=999: x0 from epsilon is undefined (an SdxError, tested elsewhere)
            cfg = {**SD, "timestep_spacing": spacing, "steps_offset": int(spacing == "leading"),
                   "prediction_type": pred}
            if "use_karras_sigmas" in fields:
                cfg["use_karras_sigmas"] = k
            if "rescale_betas_zero_snr" in fields:
                cfg["rescale_betas_zero_snr"] = z
            if "clip_sample" in fields:
                cfg["clip_sample"] = False
            yield pytest.param(cls, cfg, n, id=f"{cls.__name__}-{spacing}-{pred}-k{int(k)}-z{int(z)}-{n}")


# Fields beyond the grid, per sampler (each cell also runs at 7 and 20 steps).
EXTRA = {
    Euler: [{"interpolation_type": "log_linear"}, {"final_sigmas_type": "sigma_min"},
            {"use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0},
            {"timestep_type": "continuous", "prediction_type": "v_prediction"},
            {"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02},
            {"beta_schedule": "squaredcos_cap_v2", "use_karras_sigmas": True}],
    EulerAncestral: [{"beta_schedule": "squaredcos_cap_v2"}],
    Heun: [{"clip_sample": True, "prediction_type": "sample"}, {"beta_schedule": "linear"},
           {"use_karras_sigmas": True, "sigma_min": 0.05, "sigma_max": 12.0}],
    DDIM: [{"clip_sample": True, "clip_sample_range": 1.5}, {"set_alpha_to_one": False}, {"eta": 1.0},
           {"eta": 0.3, "timestep_spacing": "trailing"}, {"beta_schedule": "squaredcos_cap_v2"}],
    DDPM: [{"variance_type": "fixed_large"}, {"variance_type": "fixed_small_log"},
           {"clip_sample": True, "prediction_type": "sample"}, {"beta_schedule": "linear"}],
    PNDM: [{"skip_prk_steps": True}, {"skip_prk_steps": True, "set_alpha_to_one": True},
           {"skip_prk_steps": False, "prediction_type": "v_prediction", "timestep_spacing": "trailing"},
           {"skip_prk_steps": True, "timestep_spacing": "linspace", "beta_schedule": "squaredcos_cap_v2"}],
    LMS: [{"beta_schedule": "linear"}, {"use_karras_sigmas": True, "timestep_spacing": "trailing"}],
    DPMSolverMultistep: [{"solver_order": 1}, {"solver_order": 3}, {"solver_order": 3, "use_karras_sigmas": True},
                         {"solver_type": "heun"}, {"lower_order_final": False}, {"euler_at_final": True},
                         {"final_sigmas_type": "sigma_min"}, {"lambda_min_clipped": -5.1},
                         {"use_karras_sigmas": True, "sigma_min": 0.1, "sigma_max": 10.0},
                         {"beta_schedule": "squaredcos_cap_v2", "timestep_spacing": "trailing"},
                         {"solver_order": 3, "final_sigmas_type": "sigma_min", "lower_order_final": False}],
    UniPC: [{"solver_order": 1}, {"solver_order": 3}, {"solver_type": "bh1", "final_sigmas_type": "sigma_min"},
            {"predict_x0": False, "final_sigmas_type": "sigma_min"},
            {"predict_x0": False, "solver_type": "bh1", "prediction_type": "v_prediction", "solver_order": 3,
             "final_sigmas_type": "sigma_min"},
            {"disable_corrector": [0, 2]}, {"lower_order_final": False, "final_sigmas_type": "sigma_min"},
            {"use_karras_sigmas": True, "final_sigmas_type": "sigma_min"},
            {"use_karras_sigmas": True, "sigma_min": 0.1, "solver_order": 3}],
}


def extra_cells():
    for cls, cfgs in EXTRA.items():
        for j, extra in enumerate(cfgs):
            for n in (7, 20):
                cfg = {**SD, "timestep_spacing": "leading", "steps_offset": 1, "clip_sample": False, **extra}
                yield pytest.param(cls, cfg, n, id=f"{cls.__name__}-extra{j}-{n}")


# The samplers added for few-step models, A1111's and ComfyUI's samplers and EDM models: a lighter grid (one
# step count per cell, alternating 7 and 20), their options beyond it, and every sigma ladder once.
EDM = {"sigma_min": 0.002, "sigma_max": 80.0, "sigma_data": 0.5}
MORE = {
    LCM: [{"original_inference_steps": 30, "timestep_scaling": 5.0}, {"clip_sample": True},
          {"beta_schedule": "linear", "beta_start": 0.0001, "beta_end": 0.02}],
    TCD: [{"eta": 0.0}, {"eta": 1.0}, {"eta": 0.5, "original_inference_steps": 100}],
    DPMSolverMultistep: [{"algorithm_type": "sde-dpmsolver++", **extra} for extra in (
        {}, {"solver_order": 1}, {"solver_order": 3}, {"solver_type": "heun"}, {"use_karras_sigmas": True},
        {"final_sigmas_type": "sigma_min"}, {"solver_order": 3, "lower_order_final": False},
        {"rescale_betas_zero_snr": True, "prediction_type": "v_prediction", "timestep_spacing": "trailing"})],
    DPMSolverSinglestep: [{"solver_order": order, "solver_type": solver, "algorithm_type": algorithm}
                          for order, solver, algorithm in itertools.product(
                              (1, 2, 3), ("midpoint", "heun"), ("dpmsolver++", "sde-dpmsolver++"))]
    + [{"final_sigmas_type": "sigma_min", "lower_order_final": False, "solver_order": 3},
       {"lambda_min_clipped": -5.1}, {"use_karras_sigmas": True, "solver_order": 3}],
    KDPM2: [{"beta_schedule": "linear"}, {"use_karras_sigmas": True, "timestep_spacing": "trailing"}],
    KDPM2Ancestral: [{"use_karras_sigmas": True, "prediction_type": "v_prediction"}],
    DEISMultistep: [{"solver_order": 1}, {"solver_order": 3}, {"solver_order": 3, "lower_order_final": False},
                    {"use_karras_sigmas": True, "solver_order": 3}],
    DPMSolverSDE: [{"use_karras_sigmas": True}, {"beta_schedule": "linear"}],
    EDMEuler: [{"sigma_schedule": schedule, "prediction_type": pred, "final_sigmas_type": final}
               for schedule, pred, final in itertools.product(("karras", "exponential"), ("epsilon", "v_prediction"),
                                                              ("zero", "sigma_min"))]
    + [{"sigma_data": 1.0, "sigma_max": 120.0, "rho": 5.0}],
    EDMDPMSolverMultistep: [{"solver_order": order, "solver_type": solver, "algorithm_type": algorithm}
                            for order, solver, algorithm in ((1, "midpoint", "dpmsolver++"), (2, "midpoint", "dpmsolver++"),
                                                             (3, "midpoint", "dpmsolver++"), (2, "heun", "dpmsolver++"),
                                                             (2, "midpoint", "sde-dpmsolver++"),
                                                             (2, "heun", "sde-dpmsolver++"))]
    + [{"sigma_schedule": "exponential", "prediction_type": "v_prediction"}, {"final_sigmas_type": "sigma_min"},
       {"euler_at_final": True, "lower_order_final": False}],
}


def more_cells():
    j = 0
    for cls, extras in MORE.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        base = [] if issubclass(cls, EDMScheduler) or cls is DPMSolverMultistep else [
            {"timestep_spacing": spacing, "steps_offset": int(spacing == "leading"), "prediction_type": pred,
             "rescale_betas_zero_snr": z} if "rescale_betas_zero_snr" in fields else
            {"timestep_spacing": spacing, "steps_offset": int(spacing == "leading"), "prediction_type": pred}
            for spacing, pred, z in itertools.product(("leading",) if not cls.spaced else ("leading", "trailing", "linspace"),
                                                      cls.prediction_types, (False, True))
            if not (z and (pred == "epsilon" or "rescale_betas_zero_snr" not in fields))]
        ladders = [{f"use_{kind}_sigmas": True} for kind in ("karras", "exponential", "beta")
                   if f"use_{kind}_sigmas" in fields]
        for k, extra in enumerate([*base, *ladders, *extras]):
            j += 1
            n = (7, 20)[j % 2]
            root = EDM if issubclass(cls, EDMScheduler) else {**SD, "timestep_spacing": "leading", "steps_offset": 1}
            yield pytest.param(cls, {**root, **extra}, n, id=f"{cls.__name__}-more{k}-{n}")


# the ladders the older samplers gained (exponential, beta)
LADDER_CELLS = [pytest.param(cls, {**SD, "timestep_spacing": "leading", "steps_offset": 1, "clip_sample": False,
                                   f"use_{kind}_sigmas": True, **extra}, n, id=f"{cls.__name__}-{kind}-{n}")
                for j, ((cls, extra), kind) in enumerate(itertools.product(
                    [(Euler, {}), (Heun, {}), (LMS, {}), (DPMSolverMultistep, {}),
                     (UniPC, {"final_sigmas_type": "sigma_min"})], ("exponential", "beta")))
                for n in [(7, 20)[j % 2]]]


def check_trajectory(cls, cfg, n, rtol):
    sched = cls.from_config(cfg)
    x, noises = inputs(sched, n, seed=n)
    d, timesteps, ref = reference(sched, n, x, noises)
    check_schedule(sched, d, n)
    _, got = ours(sched, n, x, noises)
    assert got.shape == ref.shape
    assert rel_err(got, ref) < rtol(sched)


@pytest.mark.parametrize("cls,cfg,n", [*grid_cells(), *extra_cells()])
def test_trajectory_matches_diffusers(cls, cfg, n):
    check_trajectory(cls, cfg, n, lambda sched: RTOL)


@pytest.mark.parametrize("cls,cfg,n", [*more_cells(), *LADDER_CELLS])
def test_more_trajectories_match_diffusers(cls, cfg, n):
    check_trajectory(cls, cfg, n, lambda sched: RTOL if sched.stochastic else RTOL_ODE)


# ----------------------------------------------------------------------------------------------------------
# img2img / refiner cuts: strength, denoising_start (with the 2nd-order rule), denoising_end.

CUTS = [dict(strength=0.6), dict(strength=0.35), dict(denoising_start=0.7), dict(denoising_start=0.55),
        dict(denoising_end=0.8), dict(strength=1.0, denoising_start=0.3, denoising_end=0.8)]


cut_id = lambda c: "-".join(f"{k}{v}" for k, v in c.items())
FIRST = ["euler", "euler_a", "heun", "ddim", "ddpm", "pndm", "lms", "dpmpp_2m", "dpmpp_2m_karras", "unipc"]
# the later samplers with a diffusers class, on a strength cut and a refiner hand-over (the 2nd-order rule);
# EDM samplers have no hand-over (their timesteps are noise levels), dpmpp_3m_sde and dpmpp_2s_a no diffusers
# reference (tests/test_schedulers_kdiffusion.py)
LATER = ["lcm", "tcd", "deis", "dpmpp_2m_sde", "dpmpp_2s", "dpmpp_3s", "dpmpp_sde", "dpm2", "dpm2_a"]
IMG2IMG = [*itertools.product(FIRST, CUTS), *itertools.product(LATER, [CUTS[0], CUTS[3]]),
           *itertools.product(["edm_euler", "edm_dpmpp_2m_sde"], [CUTS[0]])]


@pytest.mark.parametrize("name,cut", IMG2IMG, ids=[f"{n}-{cut_id(c)}" for n, c in IMG2IMG])
def test_img2img_matches_diffusers(name, cut):
    root = {"_class_name": "EDMEulerScheduler", **EDM} if name.startswith("edm") else SD
    sched = schedulers.from_name(name, {**root, "timestep_spacing": "leading", "steps_offset": 1,
                                        "clip_sample": False, "skip_prk_steps": True})
    n = 10
    x, noises = inputs(sched, n, seed=1)
    # strength: img2img from noised image latents; denoising_start: the refiner continues latents as they are;
    # denoising_end alone: the SDXL base stops early
    x0 = np.random.default_rng(2).standard_normal(SHAPE, dtype=np.float32) if "strength" in cut else None
    refiner = "denoising_start" in cut
    d, timesteps, ref = reference(sched, n, x, noises, strength=cut.get("strength", 1.0 if refiner else None),
                                  x0=x0, denoising_start=cut.get("denoising_start"),
                                  denoising_end=cut.get("denoising_end"))
    begin, end = schedulers.denoising_range(sched, n, **cut)
    state, got = ours(sched, n, x, noises, begin=begin, end=end, x0=x0, from_latents=refiner)
    # fractional timesteps (midpoints, EDM's log sigma) within a float32 ulp
    np.testing.assert_allclose(np.asarray(state.timesteps), timesteps.astype(np.float32), rtol=2e-7, atol=1e-7)
    assert rel_err(got, ref) < RTOL


# ----------------------------------------------------------------------------------------------------------
# Inside jit: one compilation, reused when only values change.

@functools.partial(jax.jit, static_argnums=0)
def run_loop(sched, state, sample, noises):
    def body(k, carry):
        state, sample = carry
        out = model_jax(sched.scale_model_input(state, sample), state.timestep)
        return sched.step(state, out, sample, noises[k])

    return jax.lax.fori_loop(0, state.num_calls, body, (state, sample))[1]


JIT_CELLS = {
    "euler": {"use_karras_sigmas": True}, "euler_a": {}, "heun": {}, "ddim": {"timestep_spacing": "trailing"},
    "ddpm": {}, "pndm": {"skip_prk_steps": False}, "lms": {}, "dpmpp_2m_karras": {"solver_order": 3},
    "unipc": {"prediction_type": "v_prediction"},
    "lcm": {}, "dpmpp_2m_sde_karras": {}, "dpmpp_sde": {}, "dpm2_a": {}, "edm_euler": {},
}


@pytest.mark.parametrize("name", list(JIT_CELLS))
def test_jit_loop_no_recompile(name):
    root = {"_class_name": "EDMEulerScheduler", **EDM} if name.startswith("edm") else SD
    cfg = {**root, "timestep_spacing": "leading", "steps_offset": 1, "clip_sample": False, **JIT_CELLS[name]}
    sched, n = schedulers.from_name(name, cfg), 8
    x, noises = inputs(sched, n, seed=3)
    _, _, ref = reference(sched, n, x, noises)
    state = sched.set_timesteps(n, SHAPE)
    got = run_loop(sched, state, jnp.asarray(x) * state.init_noise_sigma, jnp.asarray(noises))
    assert rel_err(np.asarray(got)[None], ref[-1:]) < RTOL
    compiled = run_loop._cache_size()

    # new sample, new noise, and a state built from another noise schedule of the same shape: no recompile
    other = schedulers.from_name(name, {**cfg, "beta_end": 0.02}).set_timesteps(n, SHAPE)
    x2, noises2 = inputs(sched, n, seed=4)
    again = run_loop(sched, other, jnp.asarray(x2), jnp.asarray(noises2))
    assert run_loop._cache_size() == compiled
    assert not np.allclose(np.asarray(again), np.asarray(got))


def test_bfloat16_sample_keeps_dtype_and_float32_math():
    sched = schedulers.from_name("dpmpp_2m", SD)
    state = sched.set_timesteps(5, SHAPE)
    sample = jnp.ones(SHAPE, jnp.bfloat16)
    state, prev = sched.step(state, jnp.ones(SHAPE, jnp.bfloat16), sample)
    assert prev.dtype == jnp.bfloat16
    assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(state.history))
