"""What sdx's commands need installed, checked before anything imports it.

`python -m sdx.sample`, `python -m convert`, `python -m pipelines.X` and `python -m train.X` run by a Python that
lacks one of sdx's dependencies (or, for a trainer, of the `train` extra) end with one `error:` line and exit
status 2: what is missing, which Python ran, and what to do: use the repository's `.venv` when it has them, else
make it (`make venv`, `make venv-train`). Each package's `__init__` calls `check_command`: Python imports the
packages of `-m`'s module before the module itself, with `sys.argv == ["-m"]`, so the check runs before any
import of jax, numpy or PIL, and only for a command (an `import sdx` checks nothing). The first package imported
checks everything the command needs (a `train.X` command: the `train` extra too).

The lists are pyproject.toml's (tests/test_extras.py compares them), as module -> distribution.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

REQUIRED = {  # [project] dependencies
    "jax": "jax", "flax": "flax", "optax": "optax", "ml_dtypes": "ml_dtypes", "huggingface_hub": "huggingface_hub",
    "httpx2": "httpx2", "tokenizers": "tokenizers", "numpy": "numpy", "scipy": "scipy", "PIL": "pillow",
    "tqdm": "tqdm",
}
EXTRAS = {  # [project.optional-dependencies] that commands need, by the package of their modules
    "train": {"orbax.checkpoint": "orbax-checkpoint", "grain": "grain", "pyarrow": "pyarrow",
              "tensorboardX": "tensorboardX", "absl": "absl-py"},
    "serve": {"fastapi": "fastapi", "uvicorn": "uvicorn", "pydantic": "pydantic"},
}
REPO = Path(__file__).resolve().parent.parent  # a checkout's root (with the Makefile), where `make venv` puts .venv
VENV = REPO / ".venv"


def missing(modules: dict[str, str]) -> list[str]:
    """The distributions of `modules` whose module this Python cannot import (found without importing it)."""
    out = []
    for module, distribution in modules.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing or blocked
            found = False
        if not found:
            out.append(distribution)
    return out


def _name(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _venv_has(distributions: list[str]) -> bool:
    """Whether the repository's .venv has every one of `distributions` installed (read from its metadata)."""
    installed = {_name(p.name.split("-")[0]) for p in VENV.glob("lib/python3*/site-packages/*.dist-info")}
    return bool(installed) and {_name(d) for d in distributions} <= installed


def problem(extra: str | None = None, *, required: bool = True, command: str = "") -> str | None:
    """What this Python lacks (sdx's dependencies unless not `required`, and `extra`'s) and what to do, in one
    sentence (about `python -m command` when given); None when nothing is missing."""
    lacking = missing(REQUIRED) if required else []
    extra_lacking = missing(EXTRAS[extra]) if extra else []
    if not lacking and not extra_lacking:
        return None
    what = ([f"sdx's dependencies ({', '.join(lacking)})"] if lacking else []) + \
        ([f"the `{extra}` extra ({', '.join(extra_lacking)})"] if extra_lacking else [])
    said = f"{f'python -m {command}: ' if command else ''}{sys.executable or 'this Python'} lacks {' and '.join(what)}"
    if not (REPO / "Makefile").is_file():  # an installed package, not a checkout
        return f"{said}; install them into it: pip install {' '.join(lacking + extra_lacking)}"
    here = Path.cwd().resolve() == REPO
    venv = Path(".venv") if here else VENV
    ours = Path(sys.prefix).resolve() == VENV.resolve()  # the running Python is the repository's .venv
    if not ours and _venv_has(lacking + extra_lacking):
        return f"{said}; the repository's .venv has them: use {venv / 'bin' / 'python'}, or `source " \
               f"{venv / 'bin' / 'activate'}` first"
    where, root = ("here", ".") if here else (f"in {REPO}", str(REPO))
    spec = f"'{root}[{extra}]'" if extra else root
    then = "" if ours else f", then `source {venv / 'bin' / 'activate'}`"
    return f"{said}; run `make venv{'-' + extra if extra else ''}` {where} (it installs them in {venv}){then}; or " \
           f"`pip install -e {spec}` with this Python"


def _module() -> str:
    """The module of `python -m MODULE` (sys.orig_argv), else ""."""
    argv = getattr(sys, "orig_argv", [])
    flag = next((i for i, a in enumerate(argv[1:], 1) if a.startswith("-") and not a.startswith("--")
                 and a.endswith("m")), None)
    return argv[flag + 1] if flag is not None and flag + 1 < len(argv) else ""


def check_command() -> None:
    """In `python -m PACKAGE.MODULE`, while Python imports PACKAGE: end with one `error:` line and exit status 2
    when a dependency of sdx, or of the extra PACKAGE's commands need, is missing. Anywhere else: nothing."""
    if sys.argv[:1] != ["-m"]:
        return
    module = _module()
    package = module.split(".")[0]
    message = problem(package if package in EXTRAS else None, command=module)
    if message:
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)
