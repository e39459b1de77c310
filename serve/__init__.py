"""`python -m sdx.serve`: AUTOMATIC1111's `/sdapi/v1` HTTP API, and a page at `/`, over one loaded model.

The routes (`serve.app`) turn a request body (`serve.bodies`, A1111's field names and defaults) into a
`pipelines.request.Request` (`serve.translate`), hand it to the engine (`serve.engine`: a bounded queue, one
worker thread; the HTTP handlers never touch JAX) and answer with PNGs carrying A1111's `parameters` text
(`serve.infotext`). serve/ sits beside train/ in the layers: it imports pipelines, convert and sdx, and nothing
imports it (`sdx/serve.py` reaches it at run time, as `sdx/sample.py` reaches the sampling command).

The server needs the `serve` extra (FastAPI, uvicorn, pydantic), which `make demo` does not install: without it
`import serve` raises an ImportError that says what to install, and `python -m sdx.serve` prints it as one
`error:` line (exit status 2).
"""

import importlib.util

EXTRA = {"fastapi": "fastapi", "uvicorn": "uvicorn", "pydantic": "pydantic"}  # module -> distribution


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # blocked, or a broken install
        return False


MISSING = [distribution for module, distribution in EXTRA.items() if not _importable(module)]
if MISSING:
    raise ImportError(f"the server needs the `serve` extra, and {', '.join(MISSING)} "
                      f"{'is' if len(MISSING) == 1 else 'are'} not installed: run `pip install -e '.[serve]'` in the "
                      "repository (or `make venv-serve`)")
