"""Euler sampler: the first-order (Euler) discretisation of the probability-flow ODE
dx/dsigma = (x - D(x; sigma)) / sigma, Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based
Generative Models", Algorithm 1 without the second-order correction and without churn.

Matches diffusers' EulerDiscreteScheduler (s_churn = 0, as every diffusers pipeline calls it).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdx.schedulers.common import SigmaScheduler, check_field, sigma_ladder


@dataclasses.dataclass(frozen=True)
class Euler(SigmaScheduler):
    interpolation_type: str = "linear"
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    sigma_min: float | None = None  # Karras ladder ends; default: the spaced schedule's ends
    sigma_max: float | None = None
    timestep_type: str = "discrete"
    rescale_betas_zero_snr: bool = False
    final_sigmas_type: str = "zero"

    diffusers_class = "EulerDiscreteScheduler"
    zero_snr_floor = True

    def __post_init__(self):
        super().__post_init__()
        check_field(type(self), "interpolation_type", self.interpolation_type, ("linear", "log_linear"))
        check_field(type(self), "timestep_type", self.timestep_type, ("discrete", "continuous"))
        check_field(type(self), "final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))

    def _schedule(self, n):
        ts, sigmas = sigma_ladder(self, n, interpolation=self.interpolation_type, sigma_min=self.sigma_min,
                                  sigma_max=self.sigma_max, final=self.final_sigmas_type)
        if self.timestep_type == "continuous" and self.prediction_type == "v_prediction":
            ts = 0.25 * np.log(sigmas[:-1])  # EDM's c_noise
        return {"timesteps": ts, "sigmas": sigmas}

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        return self._euler_step(sigmas[begin:end], sigmas[begin + 1:end + 1])

    def _update(self, row, history, model_output, sample, noise):
        return history, row["c_x"] * sample + row["c_m"] * model_output
