"""Training: `python -m train.X` trainers, their data and the shapes world the default models learn.

Training needs the `train` extra (checkpoints, data loading, parquet, TensorBoard files), which `make demo`
does not install. Without it, `python -m train.X` ends with one `error:` line that says what to install
(exit status 2), and `import train...` raises an ImportError with the same words.
"""

import importlib.util
import sys

EXTRA = {  # the modules of the `train` extra (pyproject.toml) -> their distributions
    "orbax.checkpoint": "orbax-checkpoint", "grain": "grain", "pyarrow": "pyarrow", "tensorboardX": "tensorboardX",
    "absl": "absl-py",
}


def _missing() -> list[str]:
    missing = []
    for module, distribution in EXTRA.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing or blocked
            found = False
        if not found:
            missing.append(distribution)
    return missing


_MISSING = _missing()
if _MISSING:
    _message = (f"training needs the `train` extra, and {', '.join(_MISSING)} {'is' if len(_MISSING) == 1 else 'are'} "
                "not installed: run `make venv-train` in the repository (it adds the extra to .venv), or "
                "`pip install -e '.[train]'` there")
    if sys.argv[:1] == ["-m"]:  # `python -m train.X`: Python is importing this package to find X
        print(f"error: {_message}", file=sys.stderr)
        raise SystemExit(2)
    raise ImportError(_message)
