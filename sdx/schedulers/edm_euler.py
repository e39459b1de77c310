"""EDM Euler sampler: Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models",
Algorithm 1 without the second-order correction and without churn, on the EDM preconditioned denoiser
(`sdx.schedulers.edm`): x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * (x_i - D(x_i; sigma_i)) / sigma_i.

Matches diffusers' EDMEulerScheduler with step(s_churn=0), as its pipelines call it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdx.schedulers.edm import EDMScheduler


@dataclasses.dataclass(frozen=True)
class EDMEuler(EDMScheduler):
    diffusers_class = "EDMEulerScheduler"

    def _schedule(self, n):
        sigmas = self.edm_sigmas(np.linspace(0, 1, n)).astype(np.float32)  # a float64 ramp, as diffusers'
        return self.with_final(sigmas, sigmas[-1])

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        rows = self.preconditioning(sigmas[begin:end])
        keep = sigmas[begin + 1:end + 1] / sigmas[begin:end]  # x + (s' - s)(x - x0)/s = keep x + (1 - keep) x0
        return {"c_in": rows["c_in"], "c_x": keep + (1 - keep) * rows["a"], "c_m": (1 - keep) * rows["b"]}

    def _update(self, row, history, model_output, sample, noise):
        return history, row["c_x"] * sample + row["c_m"] * model_output
