"""The engine: queued jobs whose sampler calls share a compiled program run together, in one call.

A job's request becomes its sampler calls (`Pipeline.work`: one, or more when it asks for more images than a call
takes); the images of each call are a `Piece`. Pieces whose plans are equal but for the batch size (model, size,
steps, sampler, pipeline, the plug-ins' static parts: `pipelines.sampler.Plan`) and whose shared inputs are equal
(the guider's and the interventions' values, `pipelines.sampler.shared_values`) are stacked into one call
(`pipelines.sampler.stack`): everything else about an image (prompts, seed, guidance scale, images, ControlNet
weights and windows) is one row of the program's inputs, so users' requests with different settings run together,
each image as its own request makes it. The batch size is the smallest bucket (`buckets`: the devices times 1, 2,
4, ... up to `max_batch` images) that holds the pieces, padded with copies of the last image, so a new mix of
requests compiles nothing.

The worker takes the oldest piece, then, for up to `wait_s` while the call is not full, every compatible piece of
the jobs that arrive, oldest first; a piece larger than the room left waits for a later call, and a job larger than
`max_batch` runs alone. `max_batch` 1 is the one-at-a-time server.

Exactness: an image does not depend on the other images of its call (the same program computes every row alike:
the same bits whatever the others are), and is the image its request gets alone at the same batch size. Across
batch sizes XLA's kernels round differently (measured on a CPU: float32 latents within 2e-6 relative, 8-bit
pixels within 1 level; benchmarks/LOG.md), as the sampling command's --batch-size does; `fixed` runs every call
at the largest bucket, so that a request's images are the same bits alone as with any others.

Progress is per job: its model calls (`Job.calls_done`), and, while a client asks for it (`Job.wants_preview`), a
latent preview after each call (`serve.preview`). A cut job ends at the next step boundary; the others of its
call run on, their images unchanged.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np

from serve.engine import CUT, DONE, FAILED, STOPPING, Job, QueueFull, Stopping
from serve.preview import approx_rgb


@dataclasses.dataclass(eq=False)
class Piece:
    """Some images of a job that one sampler call makes: plan (batch: the piece's images), inputs (its rows),
    first (its first image's index among the job's), key (what pieces must share to run together)."""

    job: Job
    plan: object
    inputs: object
    first: int

    @property
    def rows(self) -> int:
        return self.plan.batch

    @property
    def key(self) -> tuple:
        from pipelines.sampler import shared_values

        return dataclasses.replace(self.plan, batch=0), shared_values(self.inputs)


def pieces(job: Job) -> list[Piece]:
    """The job's sampler calls as pieces (checked against its pipeline: an SdxError for what it cannot take)."""
    from pipelines.sampler import take_rows

    out, first = [], 0
    for plan, inputs, real in job.pipeline.work(job.request):
        out.append(Piece(job, dataclasses.replace(plan, batch=real), take_rows(inputs, range(real)), first))
        first += real
    job.calls_total = sum(p.inputs.state.num_calls for p in out)
    return out


def buckets(max_batch: int, devices: int) -> list[int]:
    """The batch sizes calls run at: devices x 1, 2, 4, ... up to max_batch images (rounded up to the devices)."""
    top = -(-max_batch // devices) * devices
    sizes = [devices]
    while sizes[-1] < top:
        sizes.append(min(2 * sizes[-1], top))
    return sizes


class _Abort(Exception):
    """Every job of the running call was cut: the call ends at a step boundary."""


class Batcher:
    """One worker thread that runs queued jobs in batches (see the module docstring). queue_size: jobs that may
    wait; max_batch: images of different jobs one call takes; wait_s: how long a call waits for more; fixed: every
    call at the largest bucket, so that an image is the same bits whether its request came alone or not."""

    def __init__(self, queue_size: int, max_batch: int, wait_s: float, fixed: bool = False):
        self._queue: collections.deque[Job] = collections.deque()
        self._size, self._max, self._wait, self._fixed = queue_size, max_batch, wait_s, fixed
        self._stopping = False
        self._changed = threading.Condition()
        self._pending: list[Piece] = []  # pieces of jobs taken from the queue, not run yet (worker only)
        self._running: list[Job] = []
        self._made: dict[Job, dict[int, object]] = {}  # job -> {first image: its `pipelines.pipeline.Part`}
        self._worker = threading.Thread(target=self._work, name="sdx-serve-batcher", daemon=True)
        self._worker.start()

    def submit(self, job: Job) -> None:
        with self._changed:
            if self._stopping:
                raise Stopping
            if sum(not j.done.is_set() for j in self._queue) >= self._size:
                raise QueueFull
            self._queue.append(job)
            self._changed.notify()

    def stop(self) -> None:
        """Refuse new jobs, end the queued ones with `Stopping`, cut the running ones at a step boundary."""
        with self._changed:
            self._stopping = True
            waiting = list(self._queue) + [p.job for p in self._pending] + list(self._running)
            self._queue.clear()
            self._changed.notify()
        for job in waiting:
            job.cut(STOPPING)

    def join(self, timeout: float | None = None) -> None:
        self._worker.join(timeout)

    def warm(self, jobs: list[Job]) -> int:
        """Compile, before serving, the programs each bucket of each job's calls runs (the jobs run nothing);
        returns how many plans were compiled."""
        from pipelines.sampler import stack

        count = 0
        for job in jobs:
            for piece in pieces(job):
                sampler = job.pipeline.sampler
                for size in [s for s in self._sizes(sampler, piece.rows) if s >= piece.rows]:
                    plan = dataclasses.replace(piece.plan, batch=size)
                    sampler.compiled(plan, sampler.place(stack([piece.inputs], plan)))
                    count += 1
        return count

    def _sizes(self, sampler, rows: int) -> list[int]:
        """The buckets of `sampler`'s mesh, up to a call of `rows` images (a job larger than max_batch alone); with
        `fixed`, the largest alone."""
        sizes = buckets(max(self._max, rows), sampler.mesh.devices.size)
        return sizes[-1:] if self._fixed else sizes

    # ---------------------------------------------------------------------------------------------- worker

    def _work(self) -> None:
        while True:
            if not self._take(block=not self._pending):
                return
            if not self._pending:
                continue
            call = self._gather()
            self._run(call)

    def _take(self, block: bool) -> bool:
        """Turn the queued jobs into pending pieces (waiting for one when `block`); False once stopping."""
        with self._changed:
            if block:
                self._changed.wait_for(lambda: self._queue or self._stopping)
            if self._stopping and not self._queue and not self._pending:
                return False
            jobs = list(self._queue)
            self._queue.clear()
        for job in jobs:
            if not job.start():  # cut while it waited: already answered
                continue
            try:
                self._pending += pieces(job)
                self._made[job] = {}
            except Exception as e:  # the route tells the user's errors (SdxError) from bugs
                job.finish(FAILED, error=e)
        return True

    def _gather(self) -> list[Piece]:
        """The next call's pieces: the oldest pending one and the compatible ones that fit, waiting up to wait_s
        for more while there is room."""
        head = self._pending[0]
        deadline = time.monotonic() + self._wait
        while True:
            call = self._fitting(head)
            room = self._max - sum(p.rows for p in call)
            left = deadline - time.monotonic()
            if room <= 0 or left <= 0 or self._stopping:
                break
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._stopping, timeout=left)
            self._take(block=False)
        for piece in call:
            self._pending.remove(piece)
        return call

    def _fitting(self, head: Piece) -> list[Piece]:
        call, rows = [head], head.rows
        for piece in self._pending[1:]:
            if piece.job.pipeline.sampler is head.job.pipeline.sampler and piece.key == head.key \
                    and rows + piece.rows <= self._max:
                call.append(piece)
                rows += piece.rows
        return call

    def _run(self, call: list[Piece]) -> None:
        from pipelines.pipeline import NonFiniteImages, Part
        from pipelines.sampler import stack

        call = [p for p in call if not self._dropped(p.job)]
        if not call:
            return
        sampler = call[0].job.pipeline.sampler
        rows = sum(p.rows for p in call)
        plan = dataclasses.replace(call[0].plan, batch=min(s for s in self._sizes(sampler, rows) if s >= rows))
        jobs = list(dict.fromkeys(p.job for p in call))
        self._running = jobs
        try:
            sampled = sampler(plan, stack([p.inputs for p in call], plan), self._progress(jobs), self._watch(call))
        except _Abort:
            return
        except Exception as e:
            for job in jobs:
                self._end(job, FAILED, error=e)
            return
        finally:
            self._running = []
        sampled = dataclasses.replace(sampled, out=_host(sampled.out))  # on the host once, for every piece
        offset = 0
        for piece in call:
            if not piece.job.done.is_set():
                self._made[piece.job][piece.first] = Part.of(sampled, plan, range(offset, offset + piece.rows))
                piece.job.call_batch = plan.batch
            offset += piece.rows
        for job in jobs:
            made = self._made.get(job)
            if job.done.is_set() or made is None or any(p.job is job for p in self._pending):
                continue
            try:
                images = Part.joined([made[first] for first in sorted(made)], job.request.output_latents).images
            except NonFiniteImages as e:
                self._end(job, FAILED, error=e)
            else:
                self._end(job, DONE, images=images)

    def _progress(self, jobs: list[Job]):
        """The sampler's progress callback: each job's model calls counted, a cut job ended at once (its rows still
        computed, ignored), the call aborted when none is left."""
        def report(calls: int) -> None:
            for job in jobs:
                if job.done.is_set():
                    continue
                job.calls_done += calls
                if job.cut_reason is not None:
                    self._end(job, CUT, error=Stopping() if job.cut_reason == STOPPING else None)
            if all(job.done.is_set() for job in jobs):
                raise _Abort

        return report

    def _watch(self, call: list[Piece]):
        """The sampler's latents callback: a preview of each job's first image of the call, while asked for."""
        def watch(latents) -> None:
            wanted = [(offset, p) for offset, p in zip(np.cumsum([0] + [p.rows for p in call]), call)
                      if p.job.wants_preview and not p.job.done.is_set()]
            if not wanted:
                return
            host = np.asarray(_host(latents))
            for offset, piece in wanted:
                piece.job.preview = approx_rgb(host[offset:offset + 1], piece.job.pipeline.family.xl)

        return watch

    def _dropped(self, job: Job) -> bool:
        """Whether `job` ended (cut, failed) before this call: its pieces are not run."""
        if job.cut_reason is not None and not job.done.is_set():
            self._end(job, CUT, error=Stopping() if job.cut_reason == STOPPING else None)
        return job.done.is_set()

    def _end(self, job: Job, state: str, images=None, error=None) -> None:
        self._made.pop(job, None)
        self._pending = [p for p in self._pending if p.job is not job]
        job.finish(state, images=images, error=error)


def _host(x):
    from sdx import mesh as meshlib

    return meshlib.to_host(x)
