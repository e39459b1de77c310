"""Euler ancestral sampler: an Euler step down to sigma_down, then fresh noise back up to sigma_next, so
sigma_down^2 + sigma_up^2 = sigma_next^2. Karras et al. 2022 ("Elucidating the Design Space of
Diffusion-Based Generative Models") ODE step combined with the ancestral noise split of Ho et al. 2020;
k-diffusion's `sample_euler_ancestral` with eta = 1.

Matches diffusers' EulerAncestralDiscreteScheduler.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdx.schedulers.common import SigmaScheduler, sigma_ladder


@dataclasses.dataclass(frozen=True)
class EulerAncestral(SigmaScheduler):
    rescale_betas_zero_snr: bool = False

    diffusers_class = "EulerAncestralDiscreteScheduler"
    prediction_types = ("epsilon", "v_prediction")
    zero_snr_floor = True

    @property
    def stochastic(self):
        return True

    def _schedule(self, n):
        ts, sigmas = sigma_ladder(self, n)
        return {"timesteps": ts, "sigmas": sigmas}

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        sigma, sigma_next = sigmas[begin:end], sigmas[begin + 1:end + 1]
        sigma_up = np.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2)
        sigma_down = np.sqrt(sigma_next**2 - sigma_up**2)
        return {**self._euler_step(sigma, sigma_down), "sigma_up": sigma_up}

    def _update(self, row, history, model_output, sample, noise):
        return history, row["c_x"] * sample + row["c_m"] * model_output + row["sigma_up"] * noise
