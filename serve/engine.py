"""The seam between the HTTP routes and the model: a `Job` per user's call, an `Engine` that runs jobs.

A route completes a `pipelines.request.Request` (`Pipeline.complete`: nothing left open), wraps it in a `Job`
and `submit`s it; it then waits for `Job.done` and reads `images` or `error`. Only the engine's worker thread
touches JAX. An engine provides:

- `submit(job)`: queue it, or raise `QueueFull` (the route answers 503 with Retry-After) or `Stopping`;
- progress: `job.calls_total` (the model calls the job will make) and `job.calls_done` as they finish, and,
  while a client asks for it (`job.wants_preview`), `job.preview` (an (N, h, w, 3) uint8 picture of the current
  latents, `serve.preview.approx_rgb`);
- cuts: a job whose `cut(...)` was called (interrupt, skip, a client gone, the server stopping) ends at the
  next step boundary with `state` CUT; a queued one ends at once, and the engine must skip it (`start()` says
  whether a job is still to run);
- `stop()`: queued jobs end with `Stopping` (503), the running ones are cut at a step boundary; `join()`
  waits for the worker.

The engine is `serve.batcher.Batcher`, which runs compatible jobs together.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import numpy as np

QUEUED, RUNNING, DONE, FAILED, CUT = "queued", "running", "done", "failed", "cut"
INTERRUPTED, SKIPPED, DISCONNECTED, STOPPING = "interrupted", "skipped", "disconnected", "stopping"


class QueueFull(Exception):
    """The queue holds --queue-size jobs already."""


class Stopping(Exception):
    """The server is stopping: the job was not run, or was cut."""


@dataclasses.dataclass(eq=False)
class Job:
    """One user's call. request: the completed `pipelines.request.Request`; pipeline: the
    `pipelines.pipeline.Pipeline` that runs it (the loaded model with the request's sampler); task_id: A1111's
    task id; caller: who asked (the HTTP Basic user, or the client's address without --api-auth)."""

    request: object
    pipeline: object
    task_id: str
    caller: str
    state: str = QUEUED
    calls_done: int = 0
    calls_total: int = 0
    preview: np.ndarray | None = None
    wants_preview: bool = False  # a client asked for the preview: the engine makes one after each model call
    call_batch: int | None = None  # DONE: the batch size of the compiled call(s) its images came from
    images: np.ndarray | None = None  # DONE: (N, H, W, 3) floats in [0, 1]
    error: BaseException | None = None  # FAILED: what went wrong; CUT by the server stopping: Stopping
    cut_reason: str | None = None  # INTERRUPTED, SKIPPED, DISCONNECTED or STOPPING
    queued_at: float = dataclasses.field(default_factory=time.monotonic)
    started_at: float | None = None
    finished_at: float | None = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    on_done: Callable[[], None] | None = None  # called once, when the job ends (on the thread that ends it)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def cut(self, reason: str) -> None:
        """End the job at its next step boundary, or at once if it is still queued; the first reason is kept."""
        with self._lock:
            if self.cut_reason is not None or self.done.is_set():
                return
            self.cut_reason = reason
            queued = self.state == QUEUED
        if queued:
            self.finish(CUT, error=Stopping() if reason == STOPPING else None)

    def start(self) -> bool:
        """Mark the job running, unless it already ended (cut while queued): whether to run it."""
        with self._lock:
            if self.done.is_set() or self.cut_reason is not None:
                return False
            self.state, self.started_at = RUNNING, time.monotonic()
            return True

    @property
    def progress(self) -> float:
        """The share of its model calls done, 0 to 1 (1 once it ended)."""
        if self.done.is_set():
            return 1.0
        return self.calls_done / self.calls_total if self.calls_total else 0.0

    def finish(self, state: str, images: np.ndarray | None = None, error: BaseException | None = None) -> None:
        self.state, self.images, self.error, self.finished_at = state, images, error, time.monotonic()
        self.done.set()
        if self.on_done is not None:
            self.on_done()
