"""`python -m sdx.sample`: the documented front door of the sampling command, which is `pipelines.cli`.

sdx is the bottom layer: nothing in it imports convert/, pipelines/ or train/ (tests/test_layers.py
checks every import statement with an import-linter layers contract). The command needs all of
them, yet its documented name is `python -m sdx.sample`. So this file, and only this one (the same
test allows no other), reaches up at run time with `importlib.import_module`: `import sdx` or
`import sdx.sample` never loads a higher layer, the static import graph stays layered, and the
name users type keeps working. A `runpy` hand-over would do the same for `-m` but would lose
`sdx.sample.main(argv)`, which scripts and tests call.
"""

from __future__ import annotations

import importlib

from sdx.errors import exit_without_teardown


def main(argv: list[str] | None = None) -> int:
    """`pipelines.cli.main`: parse `argv` (default sys.argv[1:]), generate, return the exit status."""
    return importlib.import_module("pipelines.cli").main(argv)


if __name__ == "__main__":
    exit_without_teardown(main())
