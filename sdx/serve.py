"""`python -m sdx.serve`: the documented front door of the HTTP server, which is `serve.cli`.

Like sdx/sample.py (see its docstring), this file reaches up at run time with `importlib.import_module`, so
`import sdx` never loads a higher layer and the static import graph stays layered (tests/test_layers.py allows
these two files and no other).
"""

from __future__ import annotations

import importlib
import sys

from sdx.errors import EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """`serve.cli.main`: parse `argv` (default sys.argv[1:]), serve until SIGINT or SIGTERM, return the exit status.
    Without the `serve` extra: its one-line message (serve/__init__.py) and EXIT_USAGE."""
    try:
        command = importlib.import_module("serve.cli")
    except ImportError as e:
        if "the `serve` extra" not in str(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return command.main(argv)


if __name__ == "__main__":
    sys.exit(main())
