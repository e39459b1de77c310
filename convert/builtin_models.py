"""The models named without a path: sdx's shipped default models (`default`, `default-edit`;
`convert.default_models`) and its random-weight demo models (`tiny`, `tiny_xl`; `convert.demo`). A file or folder
of that name wins over the built-in model. `python -m sdx.sample --model`, the trainers'
`--pretrained_model_name_or_path` and `python -m convert SRC` take these names."""

from __future__ import annotations

import difflib
from pathlib import Path

from convert import default_models
from convert.demo import DEMO_MODELS, demo_folder
from sdx.errors import SdxError

NAMES = (*default_models.NAMES, *DEMO_MODELS)


def folder(spec: str, cache: Path, log) -> Path | None:
    """The sdx folder of built-in model `spec`, made under `cache` on first use; None when `spec` names none."""
    if spec not in NAMES or Path(spec).exists():
        return None
    if spec in default_models.NAMES:
        log(f"{spec}: the shipped default model (trained by sdx on its shapes world)")
        return default_models.folder(spec, cache)
    log(f"{spec}: the embedded demo model (random weights, no download)")
    return demo_folder(spec, cache)


def unknown(spec: str) -> SdxError:
    """The error for a model that is no file or folder, built-in name or hub id: the names, and the near one."""
    near = difflib.get_close_matches(spec, NAMES, n=1)
    return SdxError(f"{spec}: no such file or folder, nor a built-in model ({', '.join(NAMES)}) or a hub id "
                    f"(org/name){f'; did you mean {near[0]}?' if near else ''}")
