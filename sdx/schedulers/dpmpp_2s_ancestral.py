"""DPM++ 2S ancestral sampler ("DPM++ 2S a"): k-diffusion's `sample_dpmpp_2s_ancestral` (Crowson): each step
is a DPM-Solver++(2S) step (Lu et al. 2022, "DPM-Solver++", Algorithm 1 with r = 1/2) from sigma_i down to
the ancestral sigma_down: a first-order step to the midpoint sqrt(sigma_i * sigma_down), a model call there,
and the step from sigma_i to sigma_down onto that call's x0; then fresh noise of std sigma_up up to
sigma_{i+1} (eta = 1). The last step, to sigma = 0, is a plain Euler step.

diffusers has no such scheduler (its DPMSolverSinglestepScheduler is not ancestral), so there is no
scheduler_config.json class for it: `--scheduler dpmpp_2s_a` runs it on the model's noise schedule, with the
timesteps and sigma ladders of EulerDiscreteScheduler (spacing, Karras, exponential or beta sigmas) and the
midpoint calls at their fractional training timestep (2n - 1 model calls for n steps).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdx.schedulers.common import sigma_ladder
from sdx.schedulers.two_stage import TwoStage, ancestral_split, first_calls, interleaved, midpoint_timesteps


@dataclasses.dataclass(frozen=True)
class DPMSolverSinglestepAncestral(TwoStage):
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    diffusers_class = ""

    @property
    def stochastic(self):
        return True

    def _schedule(self, n):
        ts, sigmas = sigma_ladder(self, n)
        s = sigmas.astype(np.float64)
        down, up = ancestral_split(s[:-1], s[1:])
        mids = np.sqrt(s[:-1] * down)  # exp(-(t + h / 2)), t = -log sigma_i, h = log(sigma_i / sigma_down)
        return {"timesteps": midpoint_timesteps(self, ts, mids[:-1]), "sigmas": sigmas, "mids": mids,
                "down": down, "up": up}

    def _table(self, schedule, begin, end):
        per_call = lambda base: interleaved(np.append(base, 0.0))  # index k: step k // 2
        S, M = interleaved(schedule["sigmas"].astype(np.float64)), per_call(schedule["mids"])
        down, up = per_call(schedule["down"]), per_call(schedule["up"])
        k = np.arange(begin, end)
        first = first_calls(begin, end)
        j = np.maximum(k - 1, 0)  # a second call finishes the step its first call (k - 1) began
        start = np.where(first, S[k], S[j])
        # first call: to the midpoint (0 on the last step, an Euler step onto this call's x0); second: from
        # the step's start to sigma_down onto the midpoint's x0, plus the ancestral noise
        target = np.where(first, M[k], down[j])
        std = np.where(first, 0.0, up[j])
        return self.rows(np.where(first, S[k], M[j]), first, to=(start, target), std=std)
