"""What every architecture config shares: a frozen dataclass stored in `sdx.json` as plain JSON.

Tuples become lists on the way out and lists tuples on the way back (the dataclasses stay hashable);
a field the class does not have is an error, so a config written by a newer sdx is never half-read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from sdx.errors import SdxError


def plain(v):
    """`v` with every tuple (nested too) as a list: what JSON holds."""
    return [plain(x) for x in v] if isinstance(v, (tuple, list)) else v


def frozen(v):
    """`v` with every list (nested too) as a tuple: hashable, for a frozen dataclass field."""
    return tuple(frozen(x) for x in v) if isinstance(v, (tuple, list)) else v


class JsonConfig:
    """Mixin for the frozen config dataclasses; `label` names the config in error messages."""

    label: ClassVar[str] = "config"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: field name -> value, tuples as lists; `from_dict` reads it back."""
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise SdxError(f"{cls.label}: unknown field(s) {', '.join(unknown)} in the sdx config")
        return cls(**{k: frozen(v) for k, v in d.items()})
