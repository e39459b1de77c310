"""DPM2 ancestral sampler ("DPM2 a"): the DPM2 step (`sdx.schedulers.kdpm2`) taken down to sigma_down,
then fresh noise of std sigma_up back up to the next sigma (the ancestral split of Ho et al. 2020 as
k-diffusion's `get_ancestral_step` writes it, eta = 1): k-diffusion's `sample_dpm_2_ancestral` (Crowson).
The midpoint lies between the step's sigma and its sigma_down; the last step is a plain Euler step to 0.

Matches diffusers' KDPM2AncestralDiscreteScheduler (2n - 1 model calls for n steps).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdx.schedulers.common import sigma_ladder
from sdx.schedulers.two_stage import TwoStage, first_calls, interleaved, log_midpoints_f32, midpoint_timesteps


@dataclasses.dataclass(frozen=True)
class KDPM2Ancestral(TwoStage):
    beta_start: float = 0.00085
    beta_end: float = 0.012
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    diffusers_class = "KDPM2AncestralDiscreteScheduler"

    @property
    def stochastic(self):
        return True

    def _schedule(self, n):
        ts, sigmas = sigma_ladder(self, n, round_karras=True)
        # step i: sigma_i -> sigma_{i+1}, in float32 as diffusers computes them (sigma_down^2 = sigma_{i+1}^2 -
        # sigma_up^2 cancels: the float32 rounding reaches 1e-5 at the last steps)
        s, s_next = sigmas[:-1], sigmas[1:]
        with np.errstate(divide="ignore", invalid="ignore"):
            up = np.sqrt(s_next**2 * (s**2 - s_next**2) / s**2)
        down = np.sqrt(s_next**2 - up**2)
        mids = log_midpoints_f32(s, down)  # between sigma_i and its sigma_down
        mids[-1] = 0.0  # the last step is an Euler step to 0
        return {"timesteps": midpoint_timesteps(self, ts, mids[:-1]), "sigmas": sigmas, "mids": mids,
                "down": down, "up": up}

    def _table(self, schedule, begin, end):
        per_call = lambda base: interleaved(np.append(base.astype(np.float64), 0.0))  # index k: step k // 2
        S, M = interleaved(schedule["sigmas"].astype(np.float64)), per_call(schedule["mids"])
        down, up = per_call(schedule["down"]), per_call(schedule["up"])
        k = np.arange(begin, end)
        first = first_calls(begin, end)
        j = np.maximum(k - 1, 0)  # a second call finishes the step its first call (k - 1) began
        sigma_in = np.where(first, S[k], M[j])
        dt = np.where(first, M[k] - S[k], down[j] - S[j])
        return self.rows(sigma_in, first, euler_dt=dt, std=np.where(first, 0.0, up[j]))
