"""DPM-Solver++ multistep sampler: Lu, Zhou, Bao, Chen, Li & Zhu 2022, "DPM-Solver++: Fast Solver for
Guided Sampling of Diffusion Probabilistic Models", Algorithm 2 (2M) and its 3rd-order variant: exponential
integrator steps in lambda = log(alpha / sigma) on the data prediction, with the history of x0 predictions
giving the higher-order terms. Order 1 is DDIM.

algorithm_type "sde-dpmsolver++" ("DPM++ 2M SDE") solves the reverse diffusion SDE instead of the ODE with
the same multistep expansion (Lu et al., the SDE variant of the paper's data-prediction solver; diffusers
PR #3344): the x0 terms integrate e^{-2(lambda_t - lambda)}, so the ODE's weights with h -> 2h, the sample
keeps e^{-h} more of itself, and fresh noise of std sigma_t * sqrt(1 - e^{-2h}) is added.

Matches diffusers' DPMSolverMultistepScheduler with algorithm_type "dpmsolver++" or "sde-dpmsolver++",
solver_type "midpoint" or "heun", solver_order 1-3, lower_order_final, euler_at_final, final_sigmas_type,
lambda_min_clipped and Karras, exponential or beta sigmas ("DPM++ 2M Karras").

The third-order SDE step exists in two forms. diffusers' (PR #9104) weighs the second divided difference D2
by alpha_t * ((1 - e^{-2h} - 2h) / (2h)^2 - 1/2); the ODE's weight with h -> 2h, which k-diffusion's
`sample_dpmpp_3m_sde` (the "DPM++ 3M SDE" of A1111 and ComfyUI) uses, is alpha_t * ((1 - e^{-2h} - 2h) /
(2h)^2 + 1/2): the 1/2 has the other sign, so diffusers' weight tends to -alpha_t instead of 0 as h -> 0.
`sde_third_order` (not a diffusers config field) picks one; a scheduler_config.json gets diffusers'.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.schedulers.common import (
    Scheduler,
    check_field,
    multistep_ladder,
    train_sigmas,
    vp_from_sigma,
    x0_coefficients,
)


def log_snr(sigmas: np.ndarray, scales=vp_from_sigma) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(alpha, sigma_t, lambda = log(alpha / sigma_t)) of each noise level, +inf at sigma = 0; `scales(sigma)`
    -> (alpha, sigma_t) of the sample's parametrisation x = alpha * x0 + sigma_t * noise (variance preserving
    by default; (1, sigma) for EDM's variance exploding samples)."""
    alpha, sigma = scales(np.asarray(sigmas, np.float64))
    with np.errstate(divide="ignore"):
        return alpha, sigma, np.log(alpha) - np.log(sigma)


def exponential_step(alpha_t, sigma_t, sigma_s, h, *, sde: bool, third_order_sde: str = "diffusers"):
    """The exponential-integrator step of DPM-Solver++ over h = lambda_t - lambda_s from a sample at
    sigma_s: (c_x, std, phi_1, phi_2, phi_3) with x_t = c_x * x_s + phi_1 * D0 + phi_2 * D1 + phi_3 * D2 + std
    * noise, D0 the x0 prediction and D1, D2 its scaled divided differences (ODE; or the SDE, whose x0 terms
    integrate e^{-2(lambda_t - lambda)}: the ODE's weights with h -> 2h)."""
    hh = 2 * h if sde else h
    c_x = sigma_t / sigma_s * (np.exp(-h) if sde else 1.0)
    std = sigma_t * np.sqrt(-np.expm1(-2 * h)) if sde else 0.0
    half = -0.5 if sde and third_order_sde == "diffusers" else 0.5
    phi_1 = -alpha_t * np.expm1(-hh)
    with np.errstate(invalid="ignore"):  # h = inf (a step to sigma = 0) only ever takes phi_1
        phi_2 = alpha_t * (np.expm1(-hh) / hh + 1)
        phi_3 = -alpha_t * ((np.expm1(-hh) + hh) / hh**2 - half)
    return c_x, std, phi_1, phi_2, phi_3


def dpmpp_coefficients(order: int, sigmas: np.ndarray, i: int, solver_type: str, *, sde: bool = False,
                       third_order_sde: str = "diffusers", scales=vp_from_sigma) -> tuple[float, np.ndarray, float]:
    """(c_x, c[order], std) with x_{i+1} = c_x * x_i + sum_j c[j] * x0_{i-j} + std * noise for the multistep
    step sigmas[i] -> sigmas[i+1] (`scales`: see `log_snr`).

    The paper's D0 = m0, D1 = (m0 - m1) / r0 (2nd order) and D1, D2 from divided differences (3rd order)
    are expanded into weights on the x0 predictions m0 (newest), m1, m2."""
    alpha, sigma, lam = log_snr(sigmas[[i + 1, i, i - 1, i - 2][:order + 1]], scales)
    h = lam[0] - lam[1]
    c_x, std, phi_1, phi_2, phi_3 = exponential_step(alpha[0], sigma[0], sigma[1], h, sde=sde,
                                                     third_order_sde=third_order_sde)
    if order == 1:
        return c_x, np.array([phi_1]), std
    r0 = (lam[1] - lam[2]) / h
    d1_0 = np.array([1, -1, 0]) / r0  # D1_0 = (m0 - m1) / r0
    if order == 2:
        return c_x, np.array([phi_1, 0]) + (0.5 * phi_1 if solver_type == "midpoint" else phi_2) * d1_0[:2], std
    r1 = (lam[2] - lam[3]) / h
    d1_1 = np.array([0, 1, -1]) / r1
    d1 = d1_0 + r0 / (r0 + r1) * (d1_0 - d1_1)
    d2 = (d1_0 - d1_1) / (r0 + r1)
    return c_x, np.array([phi_1, 0, 0]) + phi_2 * d1 + phi_3 * d2, std


def check_dpm_fields(sched) -> None:
    """Refuse a DPM-Solver config field value diffusers' multistep, singlestep and EDM classes share but sdx does not
    implement (naming the class and the field)."""
    cls = type(sched)
    check_field(cls, "algorithm_type", sched.algorithm_type, ("dpmsolver++", "sde-dpmsolver++"))
    check_field(cls, "solver_type", sched.solver_type, ("midpoint", "heun"))
    check_field(cls, "solver_order", sched.solver_order, (1, 2, 3))


def multistep_rows(sched, sigmas: np.ndarray, calls: int, begin: int, end: int, scales=vp_from_sigma) -> dict:
    """Rows "c_x", "c_m", "std" of calls [begin, end) of a DPM-Solver++ multistep sampler `sched` (its fields
    solver_order, solver_type, lower_order_final, euler_at_final, final_sigmas_type, and sde_third_order where
    it has one): the order warms up from the run's first call and drops at the end as diffusers' `step` does."""
    short = sched.lower_order_final and calls < 15
    c_x, c_m, std = np.zeros(end - begin), np.zeros((end - begin, sched.solver_order)), np.zeros(end - begin)
    for k, i in enumerate(range(begin, end)):
        order = min(sched.solver_order, k + 1)
        if i == calls - 1 and (sched.euler_at_final or short or sched.final_sigmas_type == "zero"):
            order = 1
        elif i == calls - 2 and short:
            order = min(order, 2)
        c_x[k], c_m[k, :order], std[k] = dpmpp_coefficients(
            order, sigmas, i, sched.solver_type, sde=sched.stochastic,
            third_order_sde=getattr(sched, "sde_third_order", "diffusers"), scales=scales)
    return {"c_x": c_x, "c_m": c_m, "std": std}


@dataclasses.dataclass(frozen=True)
class DPMSolverMultistep(Scheduler):
    solver_order: int = 2
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    sigma_min: float | None = None  # read by diffusers' Karras ladder when the config carries them
    sigma_max: float | None = None
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -float("inf")
    rescale_betas_zero_snr: bool = False
    sde_third_order: str = "diffusers"  # not a config field: "diffusers" or "k-diffusion" (see above)

    diffusers_class = "DPMSolverMultistepScheduler"
    zero_snr_floor = True
    fixed = {"thresholding": (False, None), "variance_type": (None,), "use_lu_lambdas": (False, None),
             "use_flow_sigmas": (False, None), "use_dynamic_shifting": (False, None)}
    inert = frozenset({"dynamic_thresholding_ratio", "sample_max_value", "flow_shift", "time_shift_type"})

    @classmethod
    def _compat(cls, kwargs):
        if kwargs.get("solver_type") in ("logrho", "bh1", "bh2"):  # diffusers' rename for other classes' configs
            kwargs["solver_type"] = "midpoint"
        if kwargs.get("algorithm_type") == "deis":
            kwargs["algorithm_type"] = "dpmsolver++"
        return kwargs

    def __post_init__(self):
        super().__post_init__()
        cls = type(self)
        check_dpm_fields(self)
        check_field(cls, "sde_third_order", self.sde_third_order, ("diffusers", "k-diffusion"))
        check_field(cls, "final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))

    def _schedule(self, n):
        acp = self.alphas_cumprod
        lambdas = np.log(np.sqrt(acp)) - np.log(np.sqrt(1 - acp))  # float32, decreasing in t
        last = self.num_train_timesteps - np.searchsorted(lambdas[::-1], self.lambda_min_clipped)
        ts, sigmas = multistep_ladder(self, n, sigma_min=self.sigma_min, sigma_max=self.sigma_max, last=last,
                                      round_karras=self.beta_schedule != "squaredcos_cap_v2")
        final = train_sigmas(acp)[0] if self.final_sigmas_type == "sigma_min" else 0.0
        return {"timesteps": ts, "sigmas": np.append(sigmas, final).astype(np.float32)}

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        alpha, sigma_vp = vp_from_sigma(sigmas[begin:end])
        a, b = x0_coefficients(self.prediction_type, alpha, sigma_vp)
        return {"a": a, "b": b, **multistep_rows(self, sigmas, len(schedule["timesteps"]), begin, end)}

    @property
    def stochastic(self):
        return self.algorithm_type == "sde-dpmsolver++"

    def _history(self):
        return {"x0": (self.solver_order - 1,)}  # earlier x0 predictions, newest first

    def _update(self, row, history, model_output, sample, noise):
        x0 = jnp.concatenate([(row["a"] * sample + row["b"] * model_output)[None], history["x0"]])
        prev = row["c_x"] * sample + jnp.tensordot(row["c_m"], x0, 1)
        return {"x0": x0[:-1]}, (prev + row["std"] * noise) if self.stochastic else prev
