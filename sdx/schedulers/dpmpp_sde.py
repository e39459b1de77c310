"""DPM++ SDE sampler ("DPM++ SDE", "DPM++ SDE Karras"): k-diffusion's `sample_dpmpp_sde` (Crowson), a
stochastic second-order singlestep DPM-Solver++ (Lu et al. 2022, "DPM-Solver++", Algorithm 1 with r = 1/2)
made ancestral: each step takes an ancestral step (eta = 1) to the midpoint sigma_mid = sqrt(sigma_i *
sigma_{i+1}) (the midpoint in log sigma), calls the model there, and takes the ancestral step from sigma_i to
sigma_{i+1} onto that call's x0. The last step, to sigma = 0, is a plain Euler step.

The noise is a Brownian motion over sigma (`sdx.schedulers.brownian`), spanning the schedule's smallest
nonzero to its largest sigma as in k-diffusion: the first stage adds its increment over [sigma_mid, sigma_i],
the second over [sigma_{i+1}, sigma_i], each divided by the root of its length, so the two stages' noise is
correlated as the path makes it. Each image's path comes from its own key (`draw_noise`), not from a draw
per call.

Matches diffusers' DPMSolverSDEScheduler given the same noise (2n - 1 model calls for n steps); its
`noise_sampler_seed` seeds torchsde and has no meaning here: an image's key is its seed.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdx.schedulers.brownian import brownian_increment
from sdx.schedulers.common import sigma_ladder
from sdx.schedulers.two_stage import TwoStage, ancestral_split, first_calls, interleaved, midpoint_timesteps


@dataclasses.dataclass(frozen=True)
class DPMSolverSDE(TwoStage):
    beta_start: float = 0.00085
    beta_end: float = 0.012
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    diffusers_class = "DPMSolverSDEScheduler"
    inert = frozenset({"noise_sampler_seed"})

    @property
    def stochastic(self):
        return True

    def _schedule(self, n):
        ts, sigmas = sigma_ladder(self, n)
        s = sigmas.astype(np.float64)
        mids = np.sqrt(s[:-1] * s[1:])  # exp(-(t + (t_next - t) / 2)) with t = -log sigma
        return {"timesteps": midpoint_timesteps(self, ts, mids[:-1]), "sigmas": sigmas, "mids": mids}

    def _table(self, schedule, begin, end):
        S = interleaved(schedule["sigmas"].astype(np.float64))
        M = interleaved(np.append(schedule["mids"], 0.0))  # index k: the midpoint of step k // 2
        k = np.arange(begin, end)
        first = first_calls(begin, end)
        j = np.maximum(k - 1, 0)  # a second call finishes the step its first call (k - 1) began
        start = np.where(first, S[k], S[j])  # the step's sigma_i
        target = np.where(first, M[k], S[k])  # where this call's update ends: sigma_mid, then sigma_{i+1}
        down, up = ancestral_split(start, target)
        last = first & (S[np.minimum(k + 1, len(S) - 1)] == 0)  # a step to 0: Euler, no noise
        down, up = np.where(last, 0.0, down), np.where(last, 0.0, up)
        rows = self.rows(np.where(first, S[k], M[j]), first, to=(start, down), std=up)
        # the Brownian path's time: sigma over [smallest nonzero sigma, largest sigma] of the whole schedule
        lo, hi = schedule["sigmas"][schedule["sigmas"] > 0].min(), schedule["sigmas"].max()
        span = lambda sigma: (sigma - lo) / (hi - lo) if hi > lo else np.zeros_like(sigma)
        return {**rows, "u_from": span(start), "u_to": np.where(last, span(start), span(target))}

    def draw_noise(self, state, key, call, shape):
        """The Brownian increment of this call's stage on the image's path (`key` alone fixes the path)."""
        return brownian_increment(key, state.table["u_from"][state.index], state.table["u_to"][state.index], shape)
