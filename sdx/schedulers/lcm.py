"""Latent Consistency Model sampler: Luo, Tan, Huang, Li & Zhao 2023, "Latent Consistency Models:
Synthesizing High-Resolution Images with Few-Step Inference", Algorithm 1 (multistep consistency sampling):
at each step the consistency function f(x, t) = c_skip(t) * x + c_out(t) * x0(x, t) maps the sample to a
clean estimate, which is noised afresh to the next timestep (no noise after the last).

The timesteps are a subset of the distillation schedule: `original_inference_steps` points spaced
T / original_inference_steps apart and ending at T - 1 (the "trailing" end), of which `num_inference_steps`
are taken evenly. The boundary scalings use the timestep times `timestep_scaling` with sigma_data = 0.5
(Song et al. 2023, "Consistency Models", with LCM's discrete-time scaling).

Matches diffusers' LCMScheduler (without custom timesteps). Its `timestep_spacing` and `steps_offset` fields
do not enter its schedule; img2img cuts follow the SDXL img2img pipelines (`denoising_range`), not
LatentConsistencyModelImg2ImgPipeline's `set_timesteps(strength=...)`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.errors import SdxError
from sdx.schedulers.common import Scheduler, x0_coefficients

SIGMA_DATA = 0.5


def distilled_timesteps(num_train: int, original_steps: int, n: int) -> np.ndarray:
    """int64[n], descending: LCM's (and TCD's) n of the `original_steps` distillation timesteps."""
    if original_steps > num_train:
        raise SdxError(f"scheduler config: original_inference_steps={original_steps} exceeds num_train_timesteps="
                       f"{num_train}")
    if n > original_steps:
        raise SdxError(f"num_inference_steps={n} exceeds original_inference_steps={original_steps}: the schedule is a "
                       "subset of the distillation schedule")
    origin = (np.arange(1, original_steps + 1) * (num_train // original_steps) - 1)[::-1]
    return origin[np.floor(np.linspace(0, original_steps, n, endpoint=False)).astype(np.int64)]


def no_signal_check(sched: Scheduler, alphas_cumprod: np.ndarray) -> None:
    """An epsilon model cannot give x0 where a zero-SNR schedule leaves no signal."""
    if sched.prediction_type == "epsilon" and (alphas_cumprod == 0).any():
        raise SdxError("rescale_betas_zero_snr leaves no signal at the first timestep; an epsilon-prediction model "
                       "cannot denoise from there (use v_prediction)")


@dataclasses.dataclass(frozen=True)
class LCM(Scheduler):
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"
    original_inference_steps: int = 50
    clip_sample: bool = False
    clip_sample_range: float = 1.0
    timestep_spacing: str = "leading"
    timestep_scaling: float = 10.0
    rescale_betas_zero_snr: bool = False

    diffusers_class = "LCMScheduler"
    spaced = False
    fixed = {"thresholding": (False, None)}
    # thresholding's; set_alpha_to_one only reaches a timestep below 0, which LCM's schedule never has
    inert = frozenset({"dynamic_thresholding_ratio", "sample_max_value", "set_alpha_to_one"})

    @property
    def stochastic(self):
        return True

    def _schedule(self, n):
        ts = distilled_timesteps(self.num_train_timesteps, self.original_inference_steps, n)
        return {"timesteps": ts}

    def _table(self, schedule, begin, end):
        acp = self.alphas_cumprod.astype(np.float64)
        ts = schedule["timesteps"]
        t = ts[begin:end]
        a_t = acp[t]
        no_signal_check(self, a_t)
        a, b = x0_coefficients(self.prediction_type, np.sqrt(a_t), np.sqrt(1 - a_t))
        scaled = t * np.float64(self.timestep_scaling)
        c_skip = SIGMA_DATA**2 / (scaled**2 + SIGMA_DATA**2)
        c_out = scaled / np.sqrt(scaled**2 + SIGMA_DATA**2)
        last = np.arange(begin, end) == len(ts) - 1  # the schedule's last call returns the clean estimate
        a_next = np.where(last, 1.0, acp[ts[np.minimum(np.arange(begin, end) + 1, len(ts) - 1)]])
        return {"a": a, "b": b, "c_skip": c_skip, "c_out": c_out, "x0_scale": np.sqrt(a_next),
                "std": np.sqrt(1 - a_next)}

    def _update(self, row, history, model_output, sample, noise):
        x0 = row["a"] * sample + row["b"] * model_output
        if self.clip_sample:
            x0 = jnp.clip(x0, -self.clip_sample_range, self.clip_sample_range)
        denoised = row["c_out"] * x0 + row["c_skip"] * sample
        return history, row["x0_scale"] * denoised + row["std"] * noise
