"""Samplers as pure functions of float32 arrays, numerically equal to diffusers' PyTorch schedulers.

    sched = from_config(scheduler_config)                  # the model's own scheduler_config.json
    sched = from_name("dpmpp_2m_karras", scheduler_config)  # another algorithm on the model's noise schedule
    begin, end = denoising_range(sched, steps, strength=0.6)  # img2img / refiner cut (optional)
    state = sched.set_timesteps(steps, latents.shape, begin=begin, end=end)
    # loop over state.num_calls model calls: see `Scheduler`

`--scheduler` names (sdx's, ladder suffixes, A1111/ComfyUI names) are in `sdx.schedulers.names`; training
targets (add_noise, get_velocity, snr) in `sdx.schedulers.training`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sdx.errors import SdxError
from sdx.schedulers.common import Scheduler, State, denoising_range
from sdx.schedulers.ddim import DDIM
from sdx.schedulers.ddpm import DDPM
from sdx.schedulers.deis import DEISMultistep
from sdx.schedulers.dpmpp_2m import DPMSolverMultistep
from sdx.schedulers.dpmpp_2s_ancestral import DPMSolverSinglestepAncestral
from sdx.schedulers.dpmpp_sde import DPMSolverSDE
from sdx.schedulers.dpmpp_singlestep import DPMSolverSinglestep
from sdx.schedulers.edm_dpmpp_2m import EDMDPMSolverMultistep
from sdx.schedulers.edm_euler import EDMEuler
from sdx.schedulers.euler import Euler
from sdx.schedulers.euler_ancestral import EulerAncestral
from sdx.schedulers.heun import Heun
from sdx.schedulers.kdpm2 import KDPM2
from sdx.schedulers.kdpm2_ancestral import KDPM2Ancestral
from sdx.schedulers.lcm import LCM
from sdx.schedulers.lms import LMS
from sdx.schedulers.names import SCHEDULERS, canonical, from_name
from sdx.schedulers.pndm import PNDM
from sdx.schedulers.tcd import TCD
from sdx.schedulers.unipc import UniPC

_BY_CLASS = {cls.diffusers_class: cls for cls, _ in SCHEDULERS.values() if cls.diffusers_class}


def from_config(config: Mapping[str, Any]) -> Scheduler:
    """The sampler a diffusers scheduler_config.json describes (by its `_class_name`)."""
    name = config.get("_class_name")
    if name not in _BY_CLASS:
        raise SdxError(f"scheduler config: _class_name={name!r} is not supported by sdx (supported: "
                       f"{', '.join(sorted(_BY_CLASS))}); choose one with --scheduler (see --help)")
    return _BY_CLASS[name].from_config(config)


__all__ = ["SCHEDULERS", "DDIM", "DDPM", "DEISMultistep", "DPMSolverMultistep", "DPMSolverSDE",
           "DPMSolverSinglestep", "DPMSolverSinglestepAncestral", "EDMDPMSolverMultistep", "EDMEuler", "Euler",
           "EulerAncestral", "Heun", "KDPM2", "KDPM2Ancestral", "LCM", "LMS", "PNDM", "Scheduler", "State", "TCD",
           "UniPC", "canonical", "denoising_range", "from_config", "from_name"]
