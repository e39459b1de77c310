"""EDM DPM-Solver++ multistep sampler: the DPM-Solver++ 2M/3M steps (Lu et al. 2022, "DPM-Solver++", see
`sdx.schedulers.dpmpp_2m`) on EDM's variance-exploding samples (alpha = 1, lambda = -log sigma) and
preconditioned denoiser (`sdx.schedulers.edm`); algorithm_type "sde-dpmsolver++" for the SDE variant.

Matches diffusers' EDMDPMSolverMultistepScheduler (Playground v2.5's scheduler): solver_order 1-3 (the SDE
variant 1-2: diffusers' third-order EDM step has no SDE form), solver_type, lower_order_final, euler_at_final,
final_sigmas_type.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sdx.errors import SdxError
from sdx.schedulers.common import _torch_linspace_f32
from sdx.schedulers.dpmpp_2m import DPMSolverMultistep, check_dpm_fields, multistep_rows
from sdx.schedulers.edm import EDMScheduler


def _variance_exploding(sigma):
    return np.ones_like(sigma), sigma


@dataclasses.dataclass(frozen=True)
class EDMDPMSolverMultistep(EDMScheduler):
    solver_order: int = 2
    algorithm_type: str = "dpmsolver++"
    solver_type: str = "midpoint"
    lower_order_final: bool = True
    euler_at_final: bool = False

    diffusers_class = "EDMDPMSolverMultistepScheduler"
    fixed = {"thresholding": (False, None)}
    inert = EDMScheduler.inert | {"dynamic_thresholding_ratio", "sample_max_value"}
    _compat = DPMSolverMultistep._compat

    def __post_init__(self):
        super().__post_init__()
        check_dpm_fields(self)
        if self.stochastic and self.solver_order == 3:
            raise SdxError("scheduler config: EDMDPMSolverMultistepScheduler solver_order=3 with algorithm_type="
                           "'sde-dpmsolver++' is not supported (diffusers' third-order EDM step has no SDE form)")

    @property
    def stochastic(self):
        return self.algorithm_type == "sde-dpmsolver++"

    def _schedule(self, n):
        return self.with_final(self.edm_sigmas(_torch_linspace_f32(0, 1, n)), self.sigma_min)

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        rows = multistep_rows(self, sigmas, len(schedule["timesteps"]), begin, end, scales=_variance_exploding)
        return {**self.preconditioning(sigmas[begin:end]), **rows}

    def _history(self):
        return {"x0": (self.solver_order - 1,)}  # earlier x0 predictions, newest first

    _update = DPMSolverMultistep._update
