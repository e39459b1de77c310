"""`python -m sdx.serve`: AUTOMATIC1111's `/sdapi/v1` HTTP API, and a page at `/`, over one loaded model.

The routes (`serve.app`) turn a request body (`serve.bodies`, A1111's field names and defaults) into a
`pipelines.request.Request` (`serve.translate`), hand it to the engine (`serve.engine`: a bounded queue, one
worker thread; the HTTP handlers never touch JAX) and answer with PNGs carrying A1111's `parameters` text
(`serve.infotext`). serve/ sits beside train/ in the layers: it imports pipelines, convert and sdx, and nothing
imports it (`sdx/serve.py` reaches it at run time, as `sdx/sample.py` reaches the sampling command).

The server needs the `serve` extra (FastAPI, uvicorn, pydantic), which `make demo` does not install: without it
`import serve` raises an ImportError that says what to install (`sdx.dependencies`), and `python -m sdx.serve`
prints it as one `error:` line (exit status 2).
"""

from sdx import dependencies

_MISSING = dependencies.problem("serve", required=False, command="sdx.serve")
if _MISSING:
    raise ImportError(_MISSING)
