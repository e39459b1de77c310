"""Samplers as pure functions of float32 arrays, numerically equal to diffusers' PyTorch schedulers.

    sched = from_config(scheduler_config)                  # the model's own scheduler_config.json
    sched = from_name("dpmpp_2m_karras", scheduler_config)  # another algorithm on the model's noise schedule
    begin, end = denoising_range(sched, steps, strength=0.6)  # img2img / refiner cut (optional)
    state = sched.set_timesteps(steps, latents.shape, begin=begin, end=end)
    # loop over state.num_calls model calls: see `Scheduler`

Training targets (add_noise, get_velocity, snr) live in `sdx.schedulers.training`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sdx.errors import SdxError
from sdx.schedulers.common import Scheduler, State, denoising_range
from sdx.schedulers.ddim import DDIM
from sdx.schedulers.ddpm import DDPM
from sdx.schedulers.dpmpp_2m import DPMSolverMultistep
from sdx.schedulers.euler import Euler
from sdx.schedulers.euler_ancestral import EulerAncestral
from sdx.schedulers.heun import Heun
from sdx.schedulers.lms import LMS
from sdx.schedulers.pndm import PNDM
from sdx.schedulers.unipc import UniPC

# `--scheduler` names: the class plus the config fields the name itself fixes
SCHEDULERS: dict[str, tuple[type[Scheduler], dict[str, Any]]] = {
    "euler": (Euler, {}),
    "euler_a": (EulerAncestral, {}),
    "heun": (Heun, {}),
    "ddim": (DDIM, {}),
    "ddpm": (DDPM, {}),
    "pndm": (PNDM, {}),
    "lms": (LMS, {}),
    "dpmpp_2m": (DPMSolverMultistep, {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": False}),
    "dpmpp_2m_karras": (DPMSolverMultistep, {"algorithm_type": "dpmsolver++", "solver_order": 2,
                                             "use_karras_sigmas": True}),
    "unipc": (UniPC, {}),
}
_BY_CLASS = {cls.diffusers_class: cls for cls, _ in SCHEDULERS.values()}


def from_config(config: Mapping[str, Any]) -> Scheduler:
    """The sampler a diffusers scheduler_config.json describes (by its `_class_name`)."""
    name = config.get("_class_name")
    if name not in _BY_CLASS:
        raise SdxError(f"scheduler config: _class_name={name!r} is not supported by sdx (supported: "
                       f"{', '.join(sorted(_BY_CLASS))}); choose one with --scheduler {{{','.join(SCHEDULERS)}}}")
    return _BY_CLASS[name].from_config(config)


def from_name(name: str, config: Mapping[str, Any]) -> Scheduler:
    """Sampler `name` (a `--scheduler` choice) on the noise schedule and prediction type of `config`, as
    diffusers' `XScheduler.from_config(pipe.scheduler.config, **fixed_fields)`."""
    if name not in SCHEDULERS:
        raise SdxError(f"unknown scheduler {name!r} (choose from {', '.join(SCHEDULERS)})")
    cls, fixed = SCHEDULERS[name]
    return cls.from_config(config, **fixed)


__all__ = ["SCHEDULERS", "DDIM", "DDPM", "DPMSolverMultistep", "Euler", "EulerAncestral", "Heun", "LMS", "PNDM",
           "Scheduler", "State", "UniPC", "denoising_range", "from_config", "from_name"]
