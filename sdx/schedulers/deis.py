"""DEIS multistep sampler: Zhang & Chen 2023, "Fast Sampling of Diffusion Models with Exponential Integrator",
the log-rho variant of the multistep exponential integrator (tAB-DEIS in rho = sigma / alpha): the noise
prediction is extrapolated by the Lagrange polynomial through the last 1-3 of them in log rho, and that
polynomial's integral in rho is the step.

Matches diffusers' DEISMultistepScheduler (algorithm_type "deis", solver_type "logrho", solver_order 1-3,
lower_order_final, Karras, exponential or beta sigmas). As in diffusers, the last step ends at the smallest
training sigma, or at the last sigma of a Karras/exponential/beta ladder (a step of length 0).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.schedulers.common import (
    Scheduler,
    check_field,
    eps_coefficients,
    multistep_ladder,
    sigma_kind,
    train_sigmas,
    vp_from_sigma,
)


def _integral(order: int, rho_t: float, rho_s0: float, knots: np.ndarray) -> float:
    """The integral in rho from rho_s0 to rho_t of the Lagrange basis polynomial (in log rho) that is 1 at
    knots[0] and 0 at the other knots, as diffusers' closed-form `ind_fn` differences."""
    b, *others = np.log(knots)

    def ind(t):
        lt = np.log(t)
        if order == 2:
            (c,) = others
            return t * (-c + lt - 1) / (b - c)
        c, d = others
        return t * (c * (d - lt + 1) - d * lt + d + lt**2 - 2 * lt + 2) / ((b - c) * (b - d))

    return ind(rho_t) - ind(rho_s0)


def deis_coefficients(order: int, sigmas: np.ndarray, i: int) -> tuple[float, np.ndarray]:
    """(c_x, c[order]) with x_{i+1} = c_x * x_i + sum_j c[j] * eps_{i-j} (eps_i the newest noise prediction)."""
    alpha, sigma = vp_from_sigma(sigmas[[i + 1, i, i - 1, i - 2][:order + 1]])
    rho = sigma / alpha  # the variance-exploding sigma
    c_x = alpha[0] / alpha[1]
    if order == 1:
        with np.errstate(over="ignore"):
            h = np.log(alpha[0] / sigma[0]) - np.log(alpha[1] / sigma[1])
        return c_x, np.array([-sigma[0] * np.expm1(h)])
    knots = rho[1:]
    c = [alpha[0] * _integral(order, rho[0], rho[1], np.roll(knots, -j)) for j in range(order)]
    return c_x, np.array(c)


@dataclasses.dataclass(frozen=True)
class DEISMultistep(Scheduler):
    solver_order: int = 2
    algorithm_type: str = "deis"
    solver_type: str = "logrho"
    lower_order_final: bool = True
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    diffusers_class = "DEISMultistepScheduler"
    fixed = {"thresholding": (False, None), "use_flow_sigmas": (False, None), "use_dynamic_shifting": (False, None)}
    inert = frozenset({"dynamic_thresholding_ratio", "sample_max_value", "flow_shift", "time_shift_type"})

    @classmethod
    def _compat(cls, kwargs):  # diffusers' renames when loading a DPM-Solver or UniPC config
        if kwargs.get("algorithm_type") in ("dpmsolver", "dpmsolver++"):
            kwargs["algorithm_type"] = "deis"
        if kwargs.get("solver_type") in ("midpoint", "heun", "bh1", "bh2"):
            kwargs["solver_type"] = "logrho"
        return kwargs

    def __post_init__(self):
        super().__post_init__()
        cls = type(self)
        check_field(cls, "algorithm_type", self.algorithm_type, ("deis",))
        check_field(cls, "solver_type", self.solver_type, ("logrho",))
        check_field(cls, "solver_order", self.solver_order, (1, 2, 3))

    def _schedule(self, n):
        ts, sigmas = multistep_ladder(self, n, sigma_min=None, sigma_max=None, last=self.num_train_timesteps)
        final = sigmas[-1] if sigma_kind(self) else train_sigmas(self.alphas_cumprod)[0]
        return {"timesteps": ts, "sigmas": np.append(sigmas, final).astype(np.float32)}

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        calls = len(schedule["timesteps"])
        short = self.lower_order_final and calls < 15
        c_x, c_m = np.zeros(end - begin), np.zeros((end - begin, self.solver_order))
        for k, i in enumerate(range(begin, end)):
            order = min(self.solver_order, k + 1)  # warm up from the first call of this run
            if short and i == calls - 1:
                order = 1
            elif short and i == calls - 2:
                order = min(order, 2)
            c_x[k], c_m[k, :order] = deis_coefficients(order, sigmas, i)
        alpha, sigma_vp = vp_from_sigma(sigmas[begin:end])
        c, d = eps_coefficients(self.prediction_type, alpha, sigma_vp)
        return {"c": c, "d": d, "c_x": c_x, "c_m": c_m}

    def _history(self):
        return {"eps": (self.solver_order - 1,)}  # earlier noise predictions, newest first

    def _update(self, row, history, model_output, sample, noise):
        eps = jnp.concatenate([(row["c"] * sample + row["d"] * model_output)[None], history["eps"]])
        prev = row["c_x"] * sample + jnp.tensordot(row["c_m"], eps, 1)
        return {"eps": eps[:-1]}, prev
