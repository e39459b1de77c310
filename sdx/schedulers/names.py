"""`--scheduler` names: sdx's own, the sigma-ladder suffixes, and the names A1111 and ComfyUI users type.

A name is a sampler plus an optional ladder suffix, `_karras`, `_exponential` or `_beta`, for the samplers
whose diffusers class has that `use_<kind>_sigmas` field (EDM samplers: `sigma_schedule`). Without a suffix a
name means the plain spaced ladder. Typed names are normalised (case, spaces, "++" -> "pp") first, so A1111's
"DPM++ 2M SDE Karras" is dpmpp_2m_sde_karras; ComfyUI's sampler names (`dpmpp_2m_sde_gpu`,
`euler_ancestral`, ...) are aliases of sdx's ("_gpu" only says where ComfyUI computes its Brownian tree).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from sdx.errors import SdxError
from sdx.schedulers.common import SIGMA_KINDS, Scheduler
from sdx.schedulers.ddim import DDIM
from sdx.schedulers.ddpm import DDPM
from sdx.schedulers.deis import DEISMultistep
from sdx.schedulers.dpmpp_2m import DPMSolverMultistep
from sdx.schedulers.dpmpp_2s_ancestral import DPMSolverSinglestepAncestral
from sdx.schedulers.dpmpp_sde import DPMSolverSDE
from sdx.schedulers.dpmpp_singlestep import DPMSolverSinglestep
from sdx.schedulers.edm import EDMScheduler
from sdx.schedulers.edm_dpmpp_2m import EDMDPMSolverMultistep
from sdx.schedulers.edm_euler import EDMEuler
from sdx.schedulers.euler import Euler
from sdx.schedulers.euler_ancestral import EulerAncestral
from sdx.schedulers.heun import Heun
from sdx.schedulers.kdpm2 import KDPM2
from sdx.schedulers.kdpm2_ancestral import KDPM2Ancestral
from sdx.schedulers.lcm import LCM
from sdx.schedulers.lms import LMS
from sdx.schedulers.pndm import PNDM
from sdx.schedulers.tcd import TCD
from sdx.schedulers.unipc import UniPC

_SDE = {"algorithm_type": "sde-dpmsolver++"}
_DPMPP = {"algorithm_type": "dpmsolver++"}
# sdx's names: the class plus the config fields the name itself fixes
SCHEDULERS: dict[str, tuple[type[Scheduler], dict[str, Any]]] = {
    "euler": (Euler, {}),
    "euler_a": (EulerAncestral, {}),
    "heun": (Heun, {}),
    "lms": (LMS, {}),
    "ddim": (DDIM, {}),
    "ddpm": (DDPM, {}),
    "pndm": (PNDM, {}),
    "unipc": (UniPC, {}),
    "deis": (DEISMultistep, {}),
    "dpmpp_2m": (DPMSolverMultistep, {**_DPMPP, "solver_order": 2}),
    "dpmpp_2m_sde": (DPMSolverMultistep, {**_SDE, "solver_order": 2}),
    "dpmpp_2m_sde_heun": (DPMSolverMultistep, {**_SDE, "solver_order": 2, "solver_type": "heun"}),
    # k-diffusion's sample_dpmpp_3m_sde: heun-type warm-up, third order up to the last step, its D2 weight
    "dpmpp_3m_sde": (DPMSolverMultistep, {**_SDE, "solver_order": 3, "solver_type": "heun",
                                          "lower_order_final": False, "sde_third_order": "k-diffusion"}),
    "dpmpp_2s": (DPMSolverSinglestep, {**_DPMPP, "solver_order": 2}),
    "dpmpp_3s": (DPMSolverSinglestep, {**_DPMPP, "solver_order": 3}),
    "dpmpp_2s_a": (DPMSolverSinglestepAncestral, {}),
    "dpmpp_sde": (DPMSolverSDE, {}),
    "dpm2": (KDPM2, {}),
    "dpm2_a": (KDPM2Ancestral, {}),
    "lcm": (LCM, {}),
    "tcd": (TCD, {}),
    "edm_euler": (EDMEuler, {}),
    "edm_dpmpp_2m": (EDMDPMSolverMultistep, {**_DPMPP, "solver_order": 2}),
    "edm_dpmpp_2m_sde": (EDMDPMSolverMultistep, {**_SDE, "solver_order": 2}),
}

# other programs' names (normalised) for sdx's
ALIASES = {
    "euler_ancestral": "euler_a", "plms": "pndm", "uni_pc": "unipc", "uni_pc_bh2": "unipc",
    "dpm_2": "dpm2", "dpm_2_ancestral": "dpm2_a", "dpm2_ancestral": "dpm2_a",
    "dpmpp_2s_ancestral": "dpmpp_2s_a", "dpmpp_sde_gpu": "dpmpp_sde", "dpmpp_2m_sde_gpu": "dpmpp_2m_sde",
    "dpmpp_2m_sde_heun_gpu": "dpmpp_2m_sde_heun", "dpmpp_3m_sde_gpu": "dpmpp_3m_sde",
}


def normalise(text: str) -> str:
    """"DPM++ 2M SDE Karras" -> "dpmpp_2m_sde_karras": lower case, "+" -> "p", runs of spaces, dashes and
    underscores -> "_"."""
    return re.sub(r"[\s\-_]+", "_", text.strip().lower().replace("+", "p")).strip("_")


def _kinds(cls: type[Scheduler]) -> tuple[str, ...]:
    """The ladder suffixes a sampler class takes."""
    if issubclass(cls, EDMScheduler):
        return ("karras", "exponential")
    fields = {f.name for f in dataclasses.fields(cls)}
    return tuple(kind for kind in SIGMA_KINDS if f"use_{kind}_sigmas" in fields)


def resolve(text: str) -> tuple[str, str | None]:
    """(sdx sampler name, ladder kind or None) of a typed name; an unknown one is an error listing them."""
    name = normalise(text)
    name = ALIASES.get(name, name)
    if name in SCHEDULERS:
        return name, None
    base, _, kind = name.rpartition("_")
    base = ALIASES.get(base, base)
    if base in SCHEDULERS and kind in SIGMA_KINDS:
        if kind not in _kinds(SCHEDULERS[base][0]):
            raise SdxError(f"scheduler {text!r}: {base} has no {kind} sigmas (it takes "
                           f"{', '.join(_kinds(SCHEDULERS[base][0])) or 'no other ladder'})")
        return base, kind
    raise SdxError(f"unknown scheduler {text!r}; choose from {', '.join(SCHEDULERS)} (a ladder suffix _karras, "
                   "_exponential or _beta where the sampler has it), or an A1111/ComfyUI name such as "
                   "'DPM++ 2M SDE Karras' or dpmpp_2m_sde_gpu")


def canonical(text: str) -> str:
    """The sdx spelling of a typed name ("DPM++ 2M SDE Karras" -> "dpmpp_2m_sde_karras")."""
    name, kind = resolve(text)
    return name if kind is None else f"{name}_{kind}"


def from_name(text: str, config: Mapping[str, Any]) -> Scheduler:
    """Sampler `text` (a `--scheduler` name) on the noise schedule and prediction type of `config`, as
    diffusers' `XScheduler.from_config(pipe.scheduler.config, **fixed_fields)`."""
    name, kind = resolve(text)
    cls, fixed = SCHEDULERS[name]
    edm_model = str(config.get("_class_name", "")).startswith("EDM")
    if edm_model and not issubclass(cls, EDMScheduler):
        edm = [n for n, (c, _) in SCHEDULERS.items() if issubclass(c, EDMScheduler)]
        raise SdxError(f"scheduler {text!r}: this model is trained in the EDM formulation "
                       f"({config['_class_name']}); choose one of {', '.join(edm)}")
    if issubclass(cls, EDMScheduler):
        ladder = {} if kind is None else {"sigma_schedule": kind}
    else:
        ladder = {f"use_{k}_sigmas": k == kind for k in _kinds(cls)}
    return cls.from_config(config, **fixed, **ladder)


def help_text() -> str:
    """What `--scheduler` takes, for `--help`."""
    ladders = lambda name: "/".join(_kinds(SCHEDULERS[name][0]))
    listed = ", ".join(f"{n} [{ladders(n)}]" if ladders(n) else n for n in SCHEDULERS)
    return (f"the sampler: {listed}; a bracketed ladder as a suffix, e.g. dpmpp_2m_sde_karras. A1111 and ComfyUI "
            f"names work too ('DPM++ 2M SDE Karras', 'Euler a', {', '.join(ALIASES)}). Default: the model's "
            "scheduler_config.json")
