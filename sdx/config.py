"""What every architecture config shares: a frozen dataclass stored in `sdx.json` as plain JSON.

Tuples become lists on the way out and lists tuples on the way back (the dataclasses stay hashable);
a field the class does not have is an error, so a config written by a newer sdx is never half-read.
The kinds (COUNT, NUMBER, FLAG, ...) and `check_types` are how readers of JSON configs (diffusers',
transformers', the schedulers') refuse a field of the wrong type with one error naming it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from sdx.errors import SdxError


def plain(v):
    """`v` with every tuple (nested too) as a list: what JSON holds."""
    return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v


def frozen(v):
    """`v` with every list (nested too) as a tuple: hashable, for a frozen dataclass field."""
    return tuple(frozen(x) for x in v) if isinstance(v, (tuple, list)) else v


def is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_count(v) -> bool:
    return is_int(v) and v >= 1


def is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def is_list(v, each: Callable[[Any], bool]) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0 and all(each(x) for x in v)


# What a field of a JSON config must hold: (its description in an error, the test). Readers check the
# types before any conversion, so a field of the wrong type is one error naming it.
Kind = tuple[str, Callable[[Any], bool]]
COUNT: Kind = ("a positive integer", is_count)
COUNTS: Kind = ("a positive integer or a list of them", lambda v: is_count(v) or is_list(v, is_count))
COUNT_LIST: Kind = ("a non-empty list of positive integers", lambda v: is_list(v, is_count))
MAX_DEPTH = 128  # layers in one stack: released models use at most 32 (CLIP bigG); each layer is built one by one
DEPTH: Kind = (f"a layer count from 1 to {MAX_DEPTH}", lambda v: is_count(v) and v <= MAX_DEPTH)
DEPTHS: Kind = (f"{DEPTH[0]} or a list of them", lambda v: DEPTH[1](v) or is_list(v, DEPTH[1]))
NATURAL: Kind = ("an integer >= 0", lambda v: is_int(v) and v >= 0)
NUMBER: Kind = ("a finite number", is_number)
POSITIVE: Kind = ("a positive number", lambda v: is_number(v) and v > 0)
FLAG: Kind = ("true or false", lambda v: isinstance(v, bool))
FLAGS: Kind = ("true, false or a list of them",
               lambda v: isinstance(v, bool) or is_list(v, lambda x: isinstance(x, bool)))
NAME: Kind = ("a string", lambda v: isinstance(v, str))
NAMES: Kind = ("a non-empty list of strings", lambda v: is_list(v, lambda x: isinstance(x, str)))


def list_of(kind: Kind) -> Kind:
    return f"a non-empty list, each entry {kind[0]}", lambda v: is_list(v, kind[1])


def optional(kind: Kind) -> Kind:
    return f"null or {kind[0]}", lambda v: v is None or kind[1](v)


def check_types(label: str, values: Mapping[str, Any], kinds: Mapping[str, Kind]) -> None:
    """Each key of `kinds` holds a JSON value of its kind; else an error naming key and value."""
    for name, (what, ok) in kinds.items():
        if not ok(values[name]):
            shown = repr(values[name])
            raise SdxError(f"{label}: {name}={shown if len(shown) <= 60 else shown[:57] + '...'} must be {what}")


class JsonConfig:
    """Mixin for the frozen config dataclasses; `label` names the config in error messages."""

    label: ClassVar[str] = "config"
    kinds: ClassVar[Mapping[str, Kind]] = {}  # the JSON kind of each field, checked by from_dict

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: field name -> value, tuples as lists; `from_dict` reads it back."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        if not isinstance(d, Mapping):
            raise SdxError(f"{cls.label}: must be a JSON object, not {type(d).__name__}")
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise SdxError(f"{cls.label}: unknown field(s) {', '.join(unknown)} in the sdx config")
        check_types(cls.label, d, {k: kind for k, kind in cls.kinds.items() if k in d})
        return cls(**{k: frozen(v) for k, v in d.items()})
