"""DDIM sampler: Song, Meng & Ermon 2021, "Denoising Diffusion Implicit Models", eq. 12: predict x0 and
the noise, then move to the previous timestep's alphas_cumprod, adding eta-scaled fresh noise (eta = 0 is
the deterministic sampler every pipeline uses; eta = 1 is DDPM-like).

Matches diffusers' DDIMScheduler with step(eta=self.eta, use_clipped_model_output=False).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.errors import SdxError
from sdx.schedulers.common import Scheduler, eps_coefficients, spaced_timesteps, x0_coefficients


@dataclasses.dataclass(frozen=True)
class DDIM(Scheduler):
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    set_alpha_to_one: bool = True
    timestep_spacing: str = "leading"
    rescale_betas_zero_snr: bool = False
    eta: float = 0.0  # not a config field: the `eta` step argument of diffusers' pipelines

    diffusers_class = "DDIMScheduler"
    fixed = {"thresholding": (False, None)}
    inert = frozenset({"dynamic_thresholding_ratio", "sample_max_value"})  # thresholding only

    @property
    def stochastic(self):
        return self.eta > 0

    def _schedule(self, n):
        if n > self.num_train_timesteps:
            raise SdxError(f"num_inference_steps={n} exceeds num_train_timesteps={self.num_train_timesteps}")
        ts = spaced_timesteps(self.timestep_spacing, self.num_train_timesteps, n, self.steps_offset)
        return {"timesteps": ts.round().astype(np.int64), "ratio": np.array(self.num_train_timesteps // n)}

    def _table(self, schedule, begin, end):
        acp = self.alphas_cumprod.astype(np.float64)
        t = schedule["timesteps"][begin:end]
        prev_t = t - schedule["ratio"]
        final = 1.0 if self.set_alpha_to_one else acp[0]
        a_t, a_prev = acp[t], np.where(prev_t >= 0, acp[np.maximum(prev_t, 0)], final)
        if self.prediction_type == "epsilon" and (a_t == 0).any():
            raise SdxError("rescale_betas_zero_snr leaves no signal at the first timestep; an epsilon-prediction "
                           "model cannot denoise from there (use v_prediction or 'leading' spacing)")
        a, b = x0_coefficients(self.prediction_type, np.sqrt(a_t), np.sqrt(1 - a_t))
        c, d = eps_coefficients(self.prediction_type, np.sqrt(a_t), np.sqrt(1 - a_t))
        variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
        std = self.eta * np.sqrt(variance)
        return {"a": a, "b": b, "c": c, "d": d, "std": std,
                "x0_scale": np.sqrt(a_prev), "eps_scale": np.sqrt(1 - a_prev - std**2)}

    def _update(self, row, history, model_output, sample, noise):
        x0 = row["a"] * sample + row["b"] * model_output
        eps = row["c"] * sample + row["d"] * model_output  # from the unclipped prediction
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        prev = row["x0_scale"] * x0 + row["eps_scale"] * eps
        return history, (prev + row["std"] * noise) if self.stochastic else prev
