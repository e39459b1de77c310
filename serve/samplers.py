"""A1111's sampler and schedule-type names onto sdx's samplers (`sdx.schedulers.names`).

A1111 names a sampler ("DPM++ 2M") and, since 1.9, a schedule type ("Karras") apart; the older joined names
("DPM++ 2M Karras") still work. sdx's schedules are the model's own spacing ("Automatic") and the Karras,
exponential and beta sigma ladders; A1111's others (Uniform, SGM Uniform, Polyexponential, Align Your Steps,
...) are refused, as is a ladder the sampler lacks.
"""

from __future__ import annotations

import dataclasses

from sdx.errors import SdxError
from sdx.schedulers import names

# A1111's labels of the samplers it shares with sdx; sdx's other samplers are listed by their sdx names
LABELS = {
    "dpmpp_2m": "DPM++ 2M", "dpmpp_sde": "DPM++ SDE", "dpmpp_2m_sde": "DPM++ 2M SDE",
    "dpmpp_2m_sde_heun": "DPM++ 2M SDE Heun", "dpmpp_2s_a": "DPM++ 2S a", "dpmpp_3m_sde": "DPM++ 3M SDE",
    "euler_a": "Euler a", "euler": "Euler", "lms": "LMS", "heun": "Heun", "dpm2": "DPM2", "dpm2_a": "DPM2 a",
    "ddim": "DDIM", "pndm": "PLMS", "unipc": "UniPC", "lcm": "LCM",
}
# A1111's schedule types that sdx has: (name, label, sdx ladder or None for the model's own spacing)
SCHEDULES = (("automatic", "Automatic", None), ("karras", "Karras", "karras"),
             ("exponential", "Exponential", "exponential"), ("beta", "Beta", "beta"))
ETA_NEUTRAL = 1.0  # A1111's eta for the samplers without one of their own: what every webuiapi call sends


@dataclasses.dataclass(frozen=True)
class Choice:
    """A request's sampler: `sdx` its `--scheduler` name, `label` and `schedule` as the infotext shows them."""

    sdx: str
    label: str
    schedule: str | None


def label(name: str) -> str:
    return LABELS.get(name, name)


def listed() -> list[dict]:
    """GET /sdapi/v1/samplers."""
    aliases = {}
    for alias, name in names.ALIASES.items():
        aliases.setdefault(name, []).append(alias)
    return [{"name": label(n), "aliases": [n, *aliases.get(n, [])], "options": {}} for n in names.SCHEDULERS]


def schedules() -> list[dict]:
    """GET /sdapi/v1/schedulers."""
    return [{"name": n, "label": shown, "aliases": None, "default_rho": -1.0, "need_inner_model": False}
            for n, shown, _ in SCHEDULES]


def choose(sampler: str, schedule: str | None) -> Choice:
    """The sampler A1111's `sampler_name` and `scheduler` ask for, or an SdxError naming the field."""
    try:
        name, kind = names.resolve(sampler)
    except SdxError as e:
        raise SdxError(f"sampler_name: {e}") from None
    if schedule is not None and names.normalise(schedule) not in ("", "automatic"):
        found = [(shown, ladder) for n, shown, ladder in SCHEDULES if names.normalise(schedule) in (n, names.normalise(shown))]
        if not found:
            raise SdxError(f"scheduler {schedule!r}: this server has the schedule types "
                           f"{', '.join(shown for _, shown, _ in SCHEDULES)}")
        kind = found[0][1]
    shown = next(s for _, s, ladder in SCHEDULES if ladder == kind)
    full = name if kind is None else f"{name}_{kind}"
    try:
        names.resolve(full)  # a ladder this sampler lacks
    except SdxError as e:
        raise SdxError(f"scheduler: {e}") from None
    return Choice(full, label(name), None if kind is None else shown)
