"""DPM2 sampler ("DPM2"): Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative
Models", Algorithm 2 with the DPM-Solver-2 midpoint rule (Lu et al. 2022) in place of Heun's: an Euler step
to the geometric mean of the step's sigmas, a model call there, and the full step along that midpoint slope.
The last step, to sigma = 0, is a plain Euler step. k-diffusion's `sample_dpm_2` (Crowson), without churn.

Matches diffusers' KDPM2DiscreteScheduler: 2n - 1 model calls for n steps, the calls at the midpoints
evaluating the model at their interpolated training timestep.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdx.schedulers.common import sigma_ladder
from sdx.schedulers.two_stage import TwoStage, first_calls, interleaved, log_midpoints_f32, midpoint_timesteps


@dataclasses.dataclass(frozen=True)
class KDPM2(TwoStage):
    beta_start: float = 0.00085
    beta_end: float = 0.012
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    diffusers_class = "KDPM2DiscreteScheduler"

    def _schedule(self, n):
        ts, sigmas = sigma_ladder(self, n, round_karras=True)
        mids = log_midpoints_f32(sigmas[1:], sigmas[:-1])  # between sigma_i and sigma_{i+1}; 0 before 0
        return {"timesteps": midpoint_timesteps(self, ts, mids[:-1]), "sigmas": sigmas, "mids": mids}

    def _table(self, schedule, begin, end):
        # diffusers' per-call arrays: sigmas S and interpolated sigmas M (M_i between sigma_{i-1} and sigma_i)
        S = interleaved(schedule["sigmas"].astype(np.float64))
        M = interleaved(np.concatenate([[np.nan], schedule["mids"].astype(np.float64)]))
        k = np.arange(begin, end)
        first = first_calls(begin, end)
        # first call of a step: Euler from S[k] to the midpoint M[k+1]; second: from the step's start S[k-1]
        # along the midpoint's slope to S[k]
        sigma_in = np.where(first, S[k], M[k])
        dt = np.where(first, M[np.minimum(k + 1, len(M) - 1)] - S[k], S[k] - S[np.maximum(k - 1, 0)])
        return self.rows(sigma_in, first, euler_dt=dt)
