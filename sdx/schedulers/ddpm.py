"""DDPM ancestral sampler: Ho, Jain & Abbeel 2020, "Denoising Diffusion Probabilistic Models", eq. 6-7:
sample the posterior q(x_{t-1} | x_t, x0) around the predicted x0, with the fixed variance beta-tilde
("fixed_small", or its log form) or beta ("fixed_large"); no noise at the last step.

Matches diffusers' DDPMScheduler (the step skipped to the next entry of the spaced timesteps).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.errors import SdxError
from sdx.schedulers.common import Scheduler, check_field, spaced_timesteps, x0_coefficients


@dataclasses.dataclass(frozen=True)
class DDPM(Scheduler):
    variance_type: str = "fixed_small"
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    timestep_spacing: str = "leading"
    rescale_betas_zero_snr: bool = False

    diffusers_class = "DDPMScheduler"
    fixed = {"thresholding": (False, None)}
    inert = frozenset({"dynamic_thresholding_ratio", "sample_max_value"})  # thresholding only

    def __post_init__(self):
        super().__post_init__()
        check_field(type(self), "variance_type", self.variance_type, ("fixed_small", "fixed_small_log", "fixed_large"))

    @property
    def stochastic(self):
        return True

    def _schedule(self, n):
        if n > self.num_train_timesteps:
            raise SdxError(f"num_inference_steps={n} exceeds num_train_timesteps={self.num_train_timesteps}")
        ts = spaced_timesteps(self.timestep_spacing, self.num_train_timesteps, n, self.steps_offset)
        return {"timesteps": ts.round().astype(np.int64)}

    def _table(self, schedule, begin, end):
        acp = self.alphas_cumprod.astype(np.float64)
        ts = schedule["timesteps"]
        t = ts[begin:end]
        # the previous timestep is the next entry of the schedule (of the first occurrence of t), -1 at the end
        nxt = np.array([np.flatnonzero(ts == v)[0] + 1 for v in t])
        prev_t = np.where(nxt < len(ts), ts[np.minimum(nxt, len(ts) - 1)], -1)
        a_t, a_prev = acp[t], np.where(prev_t >= 0, acp[np.maximum(prev_t, 0)], 1.0)
        if self.prediction_type == "epsilon" and (a_t == 0).any():
            raise SdxError("rescale_betas_zero_snr leaves no signal at the first timestep; an epsilon-prediction "
                           "model cannot denoise from there (use v_prediction or 'leading' spacing)")
        beta = 1 - a_t / a_prev  # the beta of this (possibly skipping) step
        a, b = x0_coefficients(self.prediction_type, np.sqrt(a_t), np.sqrt(1 - a_t))
        if self.variance_type == "fixed_large":
            variance = beta
        else:  # beta-tilde, eq. 7 ("fixed_small_log" is the same number through exp(log(.) / 2))
            variance = np.maximum((1 - a_prev) / (1 - a_t) * beta, 1e-20)
        return {"a": a, "b": b, "x0_scale": np.sqrt(a_prev) * beta / (1 - a_t),
                "sample_scale": np.sqrt(a_t / a_prev) * (1 - a_prev) / (1 - a_t),
                "std": np.where(t > 0, np.sqrt(variance), 0.0)}

    def _update(self, row, history, model_output, sample, noise):
        x0 = row["a"] * sample + row["b"] * model_output
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        return history, row["x0_scale"] * x0 + row["sample_scale"] * sample + row["std"] * noise
