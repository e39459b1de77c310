"""Heun sampler: Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models",
Algorithm 1 (deterministic, no churn): an Euler step to the next sigma, then a second model call there and
the average of the two slopes (the trapezoidal rule). The last step, to sigma = 0, is a plain Euler step.

As in diffusers' HeunDiscreteScheduler each step takes two model calls, so the call list repeats every
timestep but the first: t0, t1, t1, t2, t2, ... One loop iteration is one model call; even calls (counted
from the start of the run) are predictor calls, odd ones corrector calls.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.schedulers.common import SigmaScheduler, sigma_ladder


@dataclasses.dataclass(frozen=True)
class Heun(SigmaScheduler):
    beta_start: float = 0.00085
    beta_end: float = 0.012
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    sigma_min: float | None = None  # read by diffusers' Karras ladder when the config carries them
    sigma_max: float | None = None
    clip_sample: bool = False
    clip_sample_range: float = 1.0

    diffusers_class = "HeunDiscreteScheduler"
    order = 2

    def _schedule(self, n):
        ts, sigmas = sigma_ladder(self, n, sigma_min=self.sigma_min,
                                  sigma_max=self.sigma_max)
        # [s0, s1, s1, ..., s_{n-1}, s_{n-1}, 0]: the sigma each call evaluates at, plus the final one
        sigmas = np.concatenate([sigmas[:1], sigmas[1:-1].repeat(2), sigmas[-1:]])
        return {"timesteps": np.concatenate([ts[:1], ts[1:].repeat(2)]), "sigmas": sigmas}

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        calls = np.arange(begin, end)
        predictor = (calls - begin) % 2 == 0
        # predictor: from sigma[i] to sigma[i+1]; corrector: redo the step from sigma[i-1] to sigma[i]
        dt = np.where(predictor, sigmas[calls + 1] - sigmas[calls], sigmas[calls] - sigmas[np.maximum(calls - 1, 0)])
        return {**self._denoiser(sigmas[calls]), "dt": dt, "predictor": predictor}

    def _history(self):
        return {"derivative": (), "sample": ()}

    def _update(self, row, history, model_output, sample, noise):
        x0 = row["a"] * sample + row["b"] * model_output
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        derivative = (sample - x0) / row["sigma"]
        predictor = row["predictor"] > 0
        slope = jnp.where(predictor, derivative, (history["derivative"] + derivative) / 2)
        start = jnp.where(predictor, sample, history["sample"])
        return {"derivative": derivative, "sample": sample}, start + slope * row["dt"]
