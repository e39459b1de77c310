"""Trajectory Consistency Distillation sampler: Zheng, He, Gao, Wang, Liu, Xu, Ma & Wang 2024, "Trajectory
Consistency Distillation", Algorithm 4 (strategic stochastic sampling): from timestep t the model's x0 and
noise estimates jump along the probability-flow trajectory to s = floor((1 - gamma) * t_prev), and from there
fresh noise takes the sample forward to t_prev. gamma = 0 is deterministic (DDIM-like jumps to t_prev);
gamma = 1 is LCM-like (back to x0, then noised). No noise after the last step.

Matches diffusers' TCDScheduler with step(eta=gamma); `eta` is not a config field but the step argument the
TCD pipeline passes (0.3 by default, the paper's recommendation). The schedule is LCM's
(`sdx.schedulers.lcm.distilled_timesteps`); clip_sample, thresholding, set_alpha_to_one and timestep_scaling
are TCDScheduler fields its step never reads.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdx.errors import SdxError
from sdx.schedulers.common import Scheduler, eps_coefficients, x0_coefficients
from sdx.schedulers.lcm import distilled_timesteps, no_signal_check


@dataclasses.dataclass(frozen=True)
class TCD(Scheduler):
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    original_inference_steps: int = 50
    timestep_spacing: str = "leading"
    rescale_betas_zero_snr: bool = False
    eta: float = 0.3  # gamma: not a config field, the `eta` step argument of diffusers' TCD pipeline

    diffusers_class = "TCDScheduler"
    spaced = False
    inert = frozenset({"clip_sample", "clip_sample_range", "set_alpha_to_one", "thresholding",
                       "dynamic_thresholding_ratio", "sample_max_value", "timestep_scaling"})

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.eta <= 1.0:
            raise SdxError(f"TCD eta (gamma)={self.eta} must be in [0, 1]")

    @property
    def stochastic(self):
        return self.eta > 0

    def _schedule(self, n):
        return {"timesteps": distilled_timesteps(self.num_train_timesteps, self.original_inference_steps, n)}

    def _table(self, schedule, begin, end):
        acp = self.alphas_cumprod.astype(np.float64)
        ts = schedule["timesteps"]
        calls = np.arange(begin, end)
        t = ts[calls]
        last = calls == len(ts) - 1
        t_prev = np.where(last, 0, ts[np.minimum(calls + 1, len(ts) - 1)])
        # torch: floor((1 - eta) * t_prev) in float32, a python float times an integer tensor
        s = np.floor(np.float32(1 - self.eta) * t_prev.astype(np.float32)).astype(np.int64)
        a_t, a_s, a_prev = acp[t], acp[s], acp[t_prev]
        no_signal_check(self, a_t)
        a, b = x0_coefficients(self.prediction_type, np.sqrt(a_t), np.sqrt(1 - a_t))
        c, d = eps_coefficients(self.prediction_type, np.sqrt(a_t), np.sqrt(1 - a_t))
        # the sample at s: sqrt(a_s) * x0 + sqrt(1 - a_s) * eps, expanded over the sample and the model output
        rows = {"c_x": np.sqrt(a_s) * a + np.sqrt(1 - a_s) * c, "c_m": np.sqrt(a_s) * b + np.sqrt(1 - a_s) * d}
        noised = self.stochastic & ~last  # forward from s to t_prev with fresh noise
        keep = np.where(noised, np.sqrt(a_prev / a_s), 1.0)
        return {"c_x": keep * rows["c_x"], "c_m": keep * rows["c_m"],
                "std": np.where(noised, np.sqrt(1 - a_prev / a_s), 0.0)}

    def _update(self, row, history, model_output, sample, noise):
        prev = row["c_x"] * sample + row["c_m"] * model_output
        return history, (prev + row["std"] * noise) if self.stochastic else prev
