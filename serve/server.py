"""Loading the model and serving it: uvicorn with the engine stopped first on SIGINT and SIGTERM, and the address
printed once the socket listens."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import uvicorn

from serve.model import Served, shown_name


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load(args: argparse.Namespace) -> Served:
    """The model the flags name, loaded as `python -m sdx.sample` loads it, and what the API lists of it."""
    from convert.textual_inversion import SDXL_L, read_embedding
    from pipelines.cli import environment
    from pipelines.model_names import resolve_model
    from pipelines.pipeline import Pipeline
    from sdx import model_folder
    from sdx.attention import default_backend
    from sdx.errors import SdxError

    cache, mesh, options = environment(args)
    model = args.model or "default"
    folder = resolve_model(model, dtype=args.dtype, cache=cache, log=_log, options=options)
    pipe = Pipeline.load(folder, dtype=args.dtype, vae_dtype=args.vae_dtype, mesh=mesh, name=model,
                         attention=args.attention or default_backend(args.dtype), controlnets=tuple(args.controlnet),
                         cache=cache, log=_log)
    plain = dataclasses.replace(pipe, conditioners={})  # the same sampler, its ControlNets left out: no units
    embeddings = {}
    for path, token in options.embeddings:
        try:
            token, vectors = read_embedding(Path(path), token)
            first = vectors.get(SDXL_L, next(iter(vectors.values())))  # SDXL's: the first text encoder's
            embeddings[token] = (int(first.shape[0]), int(first.shape[1]))
        except SdxError:  # a hub file, read in the conversion: listed by its name, its shape unknown here
            embeddings[token or Path(path).stem] = (None, None)
    return Served(pipeline=pipe, plain=plain, scheduler_config=model_folder.scheduler_config(folder),
                  title=shown_name(model), vae=shown_name(args.vae) if args.vae else None,
                  controlnets=tuple(shown_name(c) for c in args.controlnet),
                  loras=tuple((Path(p).stem, s) for p, s in options.loras), embeddings=embeddings)


class _Server(uvicorn.Server):
    """uvicorn's server that stops the engine before its own shutdown (so that requests waiting on queued jobs
    are answered, not waited for) and prints where it listens once it does."""

    def __init__(self, config: uvicorn.Config, engine, title: str):
        super().__init__(config)
        self.engine, self.title = engine, title

    def handle_exit(self, sig, frame) -> None:
        self.engine.stop()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()  # a stop asked for is a clean exit (status 0), not death by the signal

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(f"serving {self.title} at http://{host}:{port} (the API at /sdapi/v1, its schema at /docs)",
                  flush=True)


def run(args: argparse.Namespace, settings) -> None:
    """Load, then serve until SIGINT or SIGTERM (`serve.cli.Settings`)."""
    from pipelines import cli as sampling
    from serve.app import Access, create
    from serve.batcher import Batcher

    served = load(args)
    engine = Batcher(settings.queue_size, settings.max_batch, settings.batch_wait_ms / 1000, settings.fixed_batch)
    template = sampling.parser().parse_args([])
    if settings.warmup:
        started = time.perf_counter()
        plans = engine.warm(warmup_jobs(served, settings.warmup, settings.limits, template))
        _log(f"compiled {plans} program sets for --warmup in {time.perf_counter() - started:.1f} s")
    app = create(served, engine, settings.limits, Access(settings.users, settings.cors_origins), template)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=30)
    _Server(config, engine, served.title).run()
    engine.stop()
    engine.join(timeout=30)


def warmup_jobs(served: Served, sizes, limits, template: argparse.Namespace) -> list:
    """A txt2img with A1111's defaults at each --warmup size, as the jobs whose programs `Batcher.warm` compiles."""
    from serve import bodies, engine, translate

    jobs = []
    for height, width in sizes:
        planned = translate.plan(bodies.Txt2Img(prompt="", height=height, width=width), served, limits, template)
        jobs.append(engine.Job(planned.request, planned.pipeline, "warmup", "server"))
    return jobs
