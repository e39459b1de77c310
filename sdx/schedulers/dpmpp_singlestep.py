"""DPM-Solver++ singlestep sampler ("DPM++ 2S", "DPM++ 3S"): Lu, Zhou, Bao, Chen, Li & Zhu 2022,
"DPM-Solver++: Fast Solver for Guided Sampling of Diffusion Probabilistic Models", Algorithm 1 (2S) and the
singlestep 3rd-order solver of DPM-Solver (Lu et al. 2022, Algorithm 2 in data-prediction form).

Each large step of order k spans k consecutive timesteps: it starts from the sample at its first timestep,
calls the model at each intermediate one (the model outputs of the step itself, not of earlier steps), and the
last call's update goes from the starting sample straight to the end of the step. The orders come in cycles
(1, 2), or (1, 2, 3), ending in lower orders as diffusers' `get_order_list` lays them out.
algorithm_type "sde-dpmsolver++" solves the reverse SDE instead (the ODE's weights with h -> 2h, fresh noise).

Matches diffusers' DPMSolverSinglestepScheduler with algorithm_type "dpmsolver++" or "sde-dpmsolver++",
solver_type, solver_order 1-3, lower_order_final (forced on as diffusers forces it), final_sigmas_type,
lambda_min_clipped and Karras, exponential or beta sigmas. Its timesteps are always linspace-spaced.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.schedulers.common import Scheduler, check_field, multistep_ladder, train_sigmas, vp_from_sigma, x0_coefficients
from sdx.schedulers.dpmpp_2m import DPMSolverMultistep, check_dpm_fields, exponential_step, log_snr


def order_list(steps: int, order: int, lower_order_final: bool, final_zero: bool) -> list[int]:
    """The order of each step, as diffusers' DPMSolverSinglestepScheduler.get_order_list."""
    cycle = list(range(1, order + 1))
    if not lower_order_final:
        orders = cycle * (steps // order)
    elif order == 3:
        tail = {0: [1, 2, 1], 1: [1], 2: [1, 2]}[steps % 3]
        orders = cycle * (steps // 3 - (steps % 3 == 0)) + tail
    elif order == 2:
        orders = cycle * (steps // 2 - (steps % 2 == 0)) + ([1, 1] if steps % 2 == 0 else [1])
    else:
        orders = [1] * steps
    if final_zero:
        orders[-1] = 1
    return orders


def singlestep_coefficients(order: int, sigmas: np.ndarray, i: int, solver_type: str,
                            sde: bool) -> tuple[float, np.ndarray, float]:
    """(c_x, c[order], std) with x_{i+1} = c_x * x_{i-order+1} + sum_j c[j] * m_j + std * noise: the update at
    call i of a step of `order` from the sample at its start, m0 the x0 prediction at sigmas[i] (newest),
    m1 at sigmas[i-1], m2 at sigmas[i-2]."""
    alpha, sigma, lam = log_snr(sigmas[[i + 1, i, i - 1, i - 2][:order + 1]])
    h = lam[0] - lam[order]  # from the step's start
    c_x, std, phi_1, phi_2, phi_3 = exponential_step(alpha[0], sigma[0], sigma[order], h, sde=sde)
    if order == 1:
        return c_x, np.array([phi_1]), std
    if order == 2:  # D0 = m1, D1 = (m0 - m1) / r0
        r0 = (lam[1] - lam[2]) / h
        d1 = np.array([1, -1]) / r0
        return c_x, np.array([0, phi_1]) + (0.5 * phi_1 if solver_type == "midpoint" else phi_2) * d1, std
    # D0 = m2, D1_0 = (m1 - m2) / r1, D1_1 = (m0 - m2) / r0
    r0, r1 = (lam[1] - lam[3]) / h, (lam[2] - lam[3]) / h
    d1_0, d1_1 = np.array([0, 1, -1]) / r1, np.array([1, 0, -1]) / r0
    base = np.array([0, 0, phi_1])
    if solver_type == "midpoint":
        return c_x, base + phi_2 * d1_1, std
    d1 = (r0 * d1_0 - r1 * d1_1) / (r0 - r1)
    d2 = 2 * (d1_1 - d1_0) / (r0 - r1)
    return c_x, base + phi_2 * d1 + phi_3 * d2, std


@dataclasses.dataclass(frozen=True)
class DPMSolverSinglestep(Scheduler):
    solver_order: int = 2
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = False
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    final_sigmas_type: str = "zero"
    lambda_min_clipped: float = -float("inf")

    diffusers_class = "DPMSolverSinglestepScheduler"
    spaced = False
    fixed = {"thresholding": (False, None), "variance_type": (None,), "use_flow_sigmas": (False, None),
             "use_dynamic_shifting": (False, None)}
    # thresholding's and flow matching's; timestep_spacing and steps_offset are not fields of this class
    # (its timesteps are always linspace-spaced), so another class's values must not reach the base fields
    inert = frozenset({"dynamic_thresholding_ratio", "sample_max_value", "flow_shift", "time_shift_type",
                       "timestep_spacing", "steps_offset"})
    _compat = DPMSolverMultistep._compat

    def __post_init__(self):
        super().__post_init__()
        cls = type(self)
        check_dpm_fields(self)
        check_field(cls, "final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))
        check_field(cls, "timestep_spacing", self.timestep_spacing, ("linspace",))
        check_field(cls, "steps_offset", self.steps_offset, (0,))

    @property
    def stochastic(self):
        return self.algorithm_type == "sde-dpmsolver++"

    def _schedule(self, n):
        acp = self.alphas_cumprod
        lambdas = np.log(np.sqrt(acp)) - np.log(np.sqrt(1 - acp))  # float32, decreasing in t
        last = self.num_train_timesteps - np.searchsorted(lambdas[::-1], self.lambda_min_clipped)
        ts, sigmas = multistep_ladder(self, n, sigma_min=None, sigma_max=None, last=last)
        final = train_sigmas(acp)[0] if self.final_sigmas_type == "sigma_min" else 0.0
        return {"timesteps": ts, "sigmas": np.append(sigmas, final).astype(np.float32)}

    def _orders(self, calls: int) -> list[int]:
        # diffusers turns lower_order_final on when the steps do not fill whole cycles or the last sigma is 0
        lower = self.lower_order_final or calls % self.solver_order != 0 or self.final_sigmas_type == "zero"
        return order_list(calls, self.solver_order, lower, self.final_sigmas_type == "zero")

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        orders = self._orders(len(schedule["timesteps"]))
        p = self.solver_order
        rows = {"c_x": np.zeros(end - begin), "c_m": np.zeros((end - begin, p)), "std": np.zeros(end - begin),
                "restart": np.zeros(end - begin)}
        for k, i in enumerate(range(begin, end)):
            order = min(orders[i], k + 1)  # only the model outputs seen since `begin`
            rows["restart"][k] = order == 1  # a step starts here: its starting sample is this call's
            rows["c_x"][k], rows["c_m"][k, :order], rows["std"][k] = singlestep_coefficients(
                order, sigmas, i, self.solver_type, self.stochastic)
        alpha, sigma_vp = vp_from_sigma(sigmas[begin:end])
        rows["a"], rows["b"] = x0_coefficients(self.prediction_type, alpha, sigma_vp)
        return rows

    def _history(self):
        return {"x0": (self.solver_order - 1,), "start": ()}  # the step's x0 predictions, newest first

    def _update(self, row, history, model_output, sample, noise):
        x0 = jnp.concatenate([(row["a"] * sample + row["b"] * model_output)[None], history["x0"]])
        start = jnp.where(row["restart"] > 0, sample, history["start"])
        prev = row["c_x"] * start + jnp.tensordot(row["c_m"], x0, 1)
        if self.stochastic:
            prev = prev + row["std"] * noise
        return {"x0": x0[:-1], "start": start}, prev
