"""DPM-Solver++ multistep sampler: Lu, Zhou, Bao, Chen, Li & Zhu 2022, "DPM-Solver++: Fast Solver for
Guided Sampling of Diffusion Probabilistic Models", Algorithm 2 (2M) and its 3rd-order variant: exponential
integrator steps in lambda = log(alpha / sigma) on the data prediction, with the history of x0 predictions
giving the higher-order terms. Order 1 is DDIM.

Matches diffusers' DPMSolverMultistepScheduler with algorithm_type "dpmsolver++" (the only one sdx
implements), solver_type "midpoint" or "heun", solver_order 1-3, lower_order_final, euler_at_final,
final_sigmas_type, lambda_min_clipped and Karras sigmas ("DPM++ 2M Karras").
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
    vp_lambda,
    x0_coefficients,
)


def dpmpp_coefficients(order: int, sigmas: np.ndarray, i: int, solver_type: str) -> tuple[float, np.ndarray]:
    """(c_x, c[order]) with x_{i+1} = c_x * x_i + sum_j c[j] * x0_{i-j} for the step sigmas[i] -> sigmas[i+1].

    The paper's D0 = m0, D1 = (m0 - m1) / r0 (2nd order) and D1, D2 from divided differences (3rd order)
    are expanded into weights on the x0 predictions m0 (newest), m1, m2."""
    lam = vp_lambda(sigmas[[i + 1, i, i - 1, i - 2][:order + 1]])  # lambda_t, lambda_s0, lambda_s1, ...
    alpha_t, sigma_t = vp_from_sigma(sigmas[i + 1])
    h = lam[0] - lam[1]
    c_x = sigma_t / vp_from_sigma(sigmas[i])[1]
    phi_1 = -alpha_t * np.expm1(-h)  # weight of D0
    if order == 1:
        return c_x, np.array([phi_1])
    r0 = (lam[1] - lam[2]) / h
    d1_0 = np.array([1, -1, 0]) / r0  # D1_0 = (m0 - m1) / r0
    if order == 2:
        phi_2 = 0.5 * phi_1 if solver_type == "midpoint" else alpha_t * (np.expm1(-h) / h + 1)
        return c_x, np.array([phi_1, 0]) + phi_2 * d1_0[:2]
    r1 = (lam[2] - lam[3]) / h
    d1_1 = np.array([0, 1, -1]) / r1
    d1 = d1_0 + r0 / (r0 + r1) * (d1_0 - d1_1)
    d2 = (d1_0 - d1_1) / (r0 + r1)
    phi_2 = alpha_t * (np.expm1(-h) / h + 1)
    phi_3 = -alpha_t * ((np.expm1(-h) + h) / h**2 - 0.5)
    return c_x, np.array([phi_1, 0, 0]) + phi_2 * d1 + phi_3 * d2


@dataclasses.dataclass(frozen=True)
class DPMSolverMultistep(Scheduler):
    solver_order: int = 2
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False
    use_karras_sigmas: bool = False
    sigma_min: float | None = None  # read by diffusers' Karras ladder when the config carries them
    sigma_max: float | None = None
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -float("inf")
    rescale_betas_zero_snr: bool = False

    diffusers_class = "DPMSolverMultistepScheduler"
    zero_snr_floor = True
    fixed = {"thresholding": (False, None), "variance_type": (None,), "use_exponential_sigmas": (False, None),
             "use_beta_sigmas": (False, None), "use_lu_lambdas": (False, None), "use_flow_sigmas": (False, None),
             "use_dynamic_shifting": (False, None)}
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
        check_field(cls, "algorithm_type", self.algorithm_type, ("dpmsolver++",))
        check_field(cls, "solver_type", self.solver_type, ("midpoint", "heun"))
        check_field(cls, "solver_order", self.solver_order, (1, 2, 3))
        check_field(cls, "final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))

    def _schedule(self, n):
        acp = self.alphas_cumprod
        lambdas = np.log(np.sqrt(acp)) - np.log(np.sqrt(1 - acp))  # float32, decreasing in t
        last = self.num_train_timesteps - np.searchsorted(lambdas[::-1], self.lambda_min_clipped)
        ts, sigmas = multistep_ladder(self, n, karras=bool(self.use_karras_sigmas), sigma_min=self.sigma_min,
                                      sigma_max=self.sigma_max, last=last,
                                      round_karras=self.beta_schedule != "squaredcos_cap_v2")
        final = train_sigmas(acp)[0] if self.final_sigmas_type == "sigma_min" else 0.0
        return {"timesteps": ts, "sigmas": np.append(sigmas, final).astype(np.float32)}

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        calls = len(schedule["timesteps"])
        short = self.lower_order_final and calls < 15
        c_x, c_m = np.zeros(end - begin), np.zeros((end - begin, self.solver_order))
        for k, i in enumerate(range(begin, end)):
            order = min(self.solver_order, k + 1)  # warm up from the first call of this run
            if i == calls - 1 and (self.euler_at_final or short or self.final_sigmas_type == "zero"):
                order = 1
            elif i == calls - 2 and short:
                order = min(order, 2)
            c_x[k], c_m[k, :order] = dpmpp_coefficients(order, sigmas, i, self.solver_type)
        alpha, sigma_vp = vp_from_sigma(sigmas[begin:end])
        a, b = x0_coefficients(self.prediction_type, alpha, sigma_vp)
        return {"a": a, "b": b, "c_x": c_x, "c_m": c_m}

    def _history(self):
        return {"x0": (self.solver_order - 1,)}  # earlier x0 predictions, newest first

    def _update(self, row, history, model_output, sample, noise):
        x0 = jnp.concatenate([(row["a"] * sample + row["b"] * model_output)[None], history["x0"]])
        prev = row["c_x"] * sample + jnp.tensordot(row["c_m"], x0, 1)
        return {"x0": x0[:-1]}, prev
