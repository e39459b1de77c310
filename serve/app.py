"""The FastAPI app: A1111's `/sdapi/v1` routes, A1111's `/internal/progress`, sd-webui-controlnet's model list,
and the page at `/`.

A generation route checks and translates the body (`serve.translate`, in a worker thread: decoding pictures is
not the event loop's work), hands a `Job` to the engine and waits for it, cutting it if the client goes away;
its answer is A1111's: base64 PNGs with the `parameters` text, the body echoed, and `info`. Errors are one line
in `detail`: 422 for what sdx cannot take (the sampling command's words), 503 with Retry-After for a full queue,
503 when the server is stopping, 500 (with no traceback) for a bug.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse

from serve import bodies, engine as engines, images, infotext, samplers, translate
from serve.security import BasicAuth, BodyLimit
from serve.tasks import Tasks, new_task_id
from sdx.errors import SdxError

PAGE = Path(__file__).parent / "page" / "index.html"
RETRY_AFTER_S = 5


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may call the server: users (HTTP Basic pairs; none: anyone) and the browser origins CORS allows."""

    users: tuple[tuple[str, str], ...] = ()
    cors_origins: tuple[str, ...] = ()


def create(served, engine, limits: translate.Limits, access: Access, template) -> FastAPI:
    """The app over `served` (`serve.model.Served`) and `engine` (`serve.engine.Engine` or another with its
    `submit`); template: the sampling command's flags at their defaults (`serve.translate.plan`)."""
    app = FastAPI(title="sdx", version=infotext.version(), summary="AUTOMATIC1111's /sdapi/v1 over sdx")
    tasks = Tasks()
    page_html = _page(served.plain)
    _errors(app)
    app.add_middleware(BodyLimit, limit=limits.max_body_bytes)
    if access.users:
        app.add_middleware(BasicAuth, users=access.users)
    if access.cors_origins:  # outermost: a browser's preflight carries no credentials
        app.add_middleware(CORSMiddleware, allow_origins=list(access.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=True)

    async def generate(body: bodies.Generation, request: Request, kind: str):
        caller = _caller(request)
        if body.force_task_id is not None and body.force_task_id in tasks:
            raise SdxError(f"force_task_id {body.force_task_id!r}: a task of that id exists already")
        planned = await run_in_threadpool(translate.plan, body, served, limits, template)
        loop, ended = asyncio.get_running_loop(), asyncio.Event()
        job = engines.Job(planned.request, planned.pipeline, body.force_task_id or new_task_id(kind), caller,
                          on_done=lambda: loop.call_soon_threadsafe(ended.set))
        try:
            engine.submit(job)
        except engines.QueueFull:
            return JSONResponse({"detail": "the queue is full (--queue-size); try again shortly"}, 503,
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        except engines.Stopping:
            return _stopping()
        tasks.add(job)
        while not ended.is_set():
            try:
                await asyncio.wait_for(ended.wait(), 0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cut(engines.DISCONNECTED)
        if isinstance(job.error, engines.Stopping):
            return _stopping()
        if job.state == engines.FAILED:
            raise job.error
        return await run_in_threadpool(_answer, job, planned, body)

    @app.post("/sdapi/v1/txt2img", response_model=bodies.Images)
    async def txt2img(body: bodies.Txt2Img, request: Request):
        return await generate(body, request, "txt2img")

    @app.post("/sdapi/v1/img2img", response_model=bodies.Images)
    async def img2img(body: bodies.Img2Img, request: Request):
        return await generate(body, request, "img2img")

    @app.get("/sdapi/v1/progress")
    def progress(request: Request, skip_current_image: bool = False, id_task: str | None = None):
        """The caller's job: by id_task, else its oldest unfinished one; idle (job_count 0) when none runs."""
        job = tasks.find(_caller(request), id_task)
        if job is None or job.done.is_set():
            return {"progress": 0.0, "eta_relative": 0.0, "state": _state(None), "current_image": None,
                    "textinfo": None, "current_task": None}
        job.wants_preview = job.wants_preview or not skip_current_image
        preview = None if skip_current_image else _preview_png(job)
        return {"progress": job.progress, "eta_relative": _eta(job) or 0.0, "state": _state(job),
                "current_image": None if preview is None else images.b64(preview),
                "textinfo": "Queued..." if job.state == engines.QUEUED else None, "current_task": job.task_id}

    @app.post("/internal/progress")
    def internal_progress(body: bodies.ProgressBody, request: Request):
        job = tasks.find(_caller(request), body.id_task)
        if job is None:
            return {"active": False, "queued": False, "paused": False, "completed": False, "progress": None,
                    "eta": None, "live_preview": None, "id_live_preview": -1, "textinfo": "Waiting..."}
        job.wants_preview = job.wants_preview or body.live_preview
        preview = _preview_png(job) if body.live_preview and job.calls_done != body.id_live_preview else None
        return {"active": job.state == engines.RUNNING, "queued": job.state == engines.QUEUED, "paused": False,
                "completed": job.done.is_set(), "progress": job.progress, "eta": _eta(job),
                "live_preview": None if preview is None else "data:image/png;base64," + images.b64(preview),
                "id_live_preview": job.calls_done if preview is not None else body.id_live_preview,
                "textinfo": "Queued..." if job.state == engines.QUEUED else None}

    @app.post("/sdapi/v1/interrupt")
    def interrupt(request: Request):
        """Ends the caller's jobs (the running one at its next step); nobody else's."""
        for job in tasks.unfinished(_caller(request)):
            job.cut(engines.INTERRUPTED)
        return {}

    @app.post("/sdapi/v1/skip")
    def skip(request: Request):
        """As interrupt: sdx makes a request's images together, so skipping the current one ends the job."""
        for job in tasks.unfinished(_caller(request)):
            job.cut(engines.SKIPPED)
        return {}

    @app.get("/sdapi/v1/options")
    def get_options():
        return served.options()

    @app.post("/sdapi/v1/options")
    def set_options(body: dict):
        served.set_options(body)

    @app.get("/sdapi/v1/sd-models")
    def sd_models():
        return [{"title": served.title, "model_name": served.title, "hash": None, "sha256": None,
                 "filename": served.title, "config": None}]

    @app.get("/sdapi/v1/sd-vae")
    def sd_vae():
        return [{"model_name": served.vae, "filename": served.vae}] if served.vae else []

    app.get("/sdapi/v1/samplers")(samplers.listed)
    app.get("/sdapi/v1/schedulers")(samplers.schedules)
    app.get("/sdapi/v1/loras")(served.loras_listed)
    app.get("/sdapi/v1/embeddings")(served.embeddings_listed)
    for route in ("upscalers", "latent-upscale-modes", "prompt-styles", "script-info", "face-restorers",
                  "hypernetworks"):
        app.add_api_route(f"/sdapi/v1/{route}", _none, methods=["GET"], name=route)  # sdx has none of these

    @app.get("/sdapi/v1/scripts")
    def scripts():
        have = ["controlnet"] if served.controlnets else []
        return {"txt2img": have, "img2img": have}

    @app.get("/controlnet/model_list")
    def controlnet_models():
        return {"model_list": list(served.controlnets)}

    @app.get("/controlnet/module_list")
    def controlnet_modules():
        return {"module_list": ["none"]}

    @app.get("/controlnet/version")
    def controlnet_version():
        return {"version": 2}

    @app.post("/sdapi/v1/png-info")
    def png_info(body: bodies.PngInfoBody):
        texts = images.texts(body.image, "image", limits.max_image_pixels)
        geninfo = texts.pop("parameters", "")
        return {"info": geninfo, "items": texts, "parameters": infotext.parse(geninfo)}

    @app.get("/sdapi/v1/memory")
    def memory():
        return _memory(served)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page():
        return page_html

    return app


def _page(pipe) -> str:
    """The page, its size and CFG fields at the model's defaults (what the sampling command would choose)."""
    from pipelines.request import Request

    chosen = pipe.complete(Request(prompts=[""]))
    return (PAGE.read_text(encoding="utf-8").replace("__SIZE__", str(chosen.height))
            .replace("__CFG__", f"{chosen.guidance_scale:g}"))


def _errors(app: FastAPI) -> None:
    @app.exception_handler(SdxError)
    async def refused(_request, e: SdxError):
        return JSONResponse({"detail": " ".join(str(e).split())}, 422)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, e: RequestValidationError):
        parts = []
        for error in e.errors():
            where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
            given = f" (got {error['input']!r})" if "input" in error and not isinstance(error["input"], dict) else ""
            parts.append(f"{where}: {error.get('msg', 'invalid')}{given}")
        return JSONResponse({"detail": "; ".join(parts)[:2000]}, 422)

    @app.exception_handler(Exception)
    async def bug(_request, e: Exception):
        return JSONResponse({"detail": f"internal error ({type(e).__name__}); the server's log has the details"}, 500)


def _none() -> list:
    return []


def _caller(request: Request) -> str:
    """Who asks: the HTTP Basic user, or without --api-auth the client's address."""
    user = request.scope.get("sdx.user")
    return user if user is not None else f"address {request.client.host if request.client else '?'}"


def _stopping() -> JSONResponse:
    return JSONResponse({"detail": "the server is stopping"}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})


def _answer(job: engines.Job, planned: translate.Planned, body: bodies.Generation) -> dict:
    from pipelines.pipeline import to_uint8

    pictures = [] if job.images is None else planned.finish(to_uint8(job.images))
    encoded = [images.b64(images.png(p, planned.shown.text(seed))) for p, seed in zip(pictures, planned.seeds)]
    echoed = body.model_dump()
    if isinstance(body, bodies.Img2Img) and not body.include_init_images:
        echoed.update(init_images=None, mask=None)
    info = infotext.info(planned.shown, planned.seeds[: len(encoded)] if job.state != engines.DONE else planned.seeds,
                         batch_size=body.batch_size, sampler_name=planned.sampler_name,
                         job_timestamp=time.strftime("%Y%m%d%H%M%S"), call_batch=job.call_batch)
    return {"images": encoded if body.send_images else [], "parameters": echoed, "info": info}


def _state(job: engines.Job | None) -> dict:
    """A1111's state dict, for one job."""
    return {"skipped": job is not None and job.cut_reason == engines.SKIPPED,
            "interrupted": job is not None and job.cut_reason == engines.INTERRUPTED, "stopping_generation": False,
            "job": job.task_id if job else "", "job_count": 0 if job is None else 1, "job_timestamp": "0",
            "job_no": 0, "sampling_step": job.calls_done if job else 0,
            "sampling_steps": job.calls_total if job else 0}


def _eta(job: engines.Job) -> float | None:
    if job.started_at is None or job.progress <= 0:
        return None
    elapsed = time.monotonic() - job.started_at
    return elapsed / job.progress - elapsed


def _preview_png(job: engines.Job) -> bytes | None:
    """The job's first image's preview, if its engine made one."""
    preview = job.preview
    if preview is None:
        return None
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(preview[0]).save(out, format="PNG")
    return out.getvalue()


def _memory(served) -> dict:
    """RAM (the host's and this process's) and the first device's memory, where it reports it."""
    ram = {"error": "unavailable"}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        with open(f"/proc/{os.getpid()}/statm", encoding="ascii") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        ram = {"free": info["MemAvailable"], "used": rss, "total": info["MemTotal"]}
    except (OSError, KeyError, ValueError, IndexError):
        pass
    device = served.pipeline.sampler.mesh.devices.flat[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        limit, used = int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))
        cuda = {"system": {"free": limit - used, "used": used, "total": limit},
                "allocated": {"current": used, "peak": int(stats.get("peak_bytes_in_use", used))}}
    else:
        cuda = {"error": f"{device.platform}: no device memory to report"}
    return {"ram": ram, "cuda": cuda}
