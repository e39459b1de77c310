"""The EDM formulation (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative
Models", Table 1) that EDM-trained models (Playground v2.5, CosXL) need: a variance-exploding sample x = x0 +
sigma * noise, and the preconditioning around the network F,

    D(x; sigma) = c_skip(sigma) * x + c_out(sigma) * F(c_in(sigma) * x; c_noise(sigma))
    c_in = 1 / sqrt(sigma^2 + sigma_data^2),  c_skip = sigma_data^2 / (sigma^2 + sigma_data^2),
    c_out = sigma * sigma_data / sqrt(sigma^2 + sigma_data^2) (negated for v-prediction),  c_noise = ln(sigma) / 4,

with sigmas on Karras' rho-ladder or evenly spaced in log sigma between sigma_max and sigma_min. The
samplers (`EDMEuler`, `EDMDPMSolverMultistep`) are subclasses of `EDMScheduler`: the model sees c_in * x at
timestep c_noise, x0 = D(x; sigma), and a text-to-image run starts from noise * sqrt(sigma_max^2 + 1) (what
diffusers' init_noise_sigma is for these schedulers).

EDM samplers have no training timesteps: img2img `strength` cuts work, the refiner hand-over
(denoising_start / denoising_end, which compare timesteps with training steps) does not.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from sdx.errors import SdxError
from sdx.schedulers.common import Scheduler, _torch_linspace_f32, check_field


@dataclasses.dataclass(frozen=True)
class EDMScheduler(Scheduler):
    sigma_min: float = 0.002
    sigma_max: float = 80.0
    sigma_data: float = 0.5
    sigma_schedule: str = "karras"
    rho: float = 7.0
    final_sigmas_type: str = "zero"

    prediction_types = ("epsilon", "v_prediction")
    discrete = False
    spaced = False
    # the noise schedule is the sigma range: the base class's beta fields and spacing have no meaning here
    inert = frozenset({"beta_start", "beta_end", "beta_schedule", "trained_betas", "timestep_spacing",
                       "steps_offset"})

    def __post_init__(self):
        super().__post_init__()
        check_field(type(self), "sigma_schedule", self.sigma_schedule, ("karras", "exponential"))
        check_field(type(self), "final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))
        if not 0 < self.sigma_min < self.sigma_max:
            raise SdxError(f"scheduler config: {self.diffusers_class} needs 0 < sigma_min < sigma_max, not "
                           f"sigma_min={self.sigma_min}, sigma_max={self.sigma_max}")
        if not 0 < self.sigma_data < math.inf or not 0 < self.rho < math.inf:
            raise SdxError(f"scheduler config: {self.diffusers_class} sigma_data={self.sigma_data} and rho={self.rho} "
                           "must be positive numbers")

    def edm_sigmas(self, ramp: np.ndarray) -> np.ndarray:
        """The schedule's sigmas at `ramp` in [0, 1] (0: sigma_max), in the ramp's dtype as diffusers computes
        them (`_compute_karras_sigmas`; `_compute_exponential_sigmas`, which reads only the ramp's length)."""
        if self.sigma_schedule == "karras":
            f = ramp.dtype.type  # torch: the python scalars take the ramp's dtype
            lo, hi = self.sigma_min ** (1 / self.rho), self.sigma_max ** (1 / self.rho)
            return (f(hi) + ramp * f(lo - hi)) ** f(self.rho)
        logs = _torch_linspace_f32(math.log(self.sigma_min), math.log(self.sigma_max), len(ramp))
        return np.exp(logs)[::-1].copy()

    def with_final(self, sigmas: np.ndarray, sigma_min_end: float) -> dict[str, np.ndarray]:
        """The schedule dict: timesteps c_noise(sigma) and the sigmas with the final one appended."""
        sigmas = sigmas.astype(np.float32)
        final = sigma_min_end if self.final_sigmas_type == "sigma_min" else 0.0
        return {"timesteps": (0.25 * np.log(sigmas)).astype(np.float32),
                "sigmas": np.append(sigmas, np.float32(final)).astype(np.float32)}

    def preconditioning(self, sigma: np.ndarray) -> dict[str, np.ndarray]:
        """Rows "c_in", "a", "b" with D(x; sigma) = a * x + b * F, F the model output."""
        sigma = np.asarray(sigma, np.float64)
        norm = sigma**2 + self.sigma_data**2
        c_out = sigma * self.sigma_data / np.sqrt(norm)
        return {"c_in": 1 / np.sqrt(norm), "a": self.sigma_data**2 / norm,
                "b": c_out if self.prediction_type == "epsilon" else -c_out}

    def _init_noise_sigma(self, schedule):
        return math.sqrt(self.sigma_max**2 + 1)

    def _noise_level(self, schedule, k):
        return 1.0, schedule["sigmas"][k]

    def scale_model_input(self, state, sample):
        c_in = state.table["c_in"][state.index]
        return (sample.astype(jnp.float32) * c_in).astype(sample.dtype)
