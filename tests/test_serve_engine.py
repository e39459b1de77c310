"""The server's engine (serve/engine.py) with a stand-in pipeline: one job at a time, model calls counted, a cut
job ended at its next step, a bounded queue, and a stop that answers the queued jobs."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serve.engine import CUT, DONE, FAILED, INTERRUPTED, Engine, Job, QueueFull, Stopping, STOPPING
from sdx.errors import SdxError


class Stepper:
    """A pipeline that makes `calls` model calls, each waiting for a go from the test (None: no waiting)."""

    def __init__(self, calls: int, gate: threading.Semaphore | None = None, fail: Exception | None = None):
        self.calls, self.gate, self.fail, self.ran = calls, gate, fail, []

    def __call__(self, request, progress=None):
        self.ran.append(request)
        progress.total = (progress.total or 0) + self.calls
        progress.refresh()
        for _ in range(self.calls):
            if self.gate is not None:
                assert self.gate.acquire(timeout=30)
            if self.fail is not None:
                raise self.fail
            progress.update(1)
        return np.full((1, 2, 2, 3), 0.5, np.float32)


def _job(pipeline, name: str = "a") -> Job:
    return Job(request=name, pipeline=pipeline, task_id=f"task({name})", caller="someone")


def test_a_job_runs_and_its_calls_are_counted():
    engine, job = Engine(queue_size=2), _job(Stepper(5))
    engine.submit(job)
    assert job.done.wait(30)
    assert (job.state, job.calls_done, job.calls_total, job.progress) == (DONE, 5, 5, 1.0)
    assert job.images.shape == (1, 2, 2, 3) and job.error is None and job.started_at <= job.finished_at
    engine.stop()
    engine.join(30)


def test_a_cut_job_ends_at_its_next_step_and_the_next_job_runs():
    gate = threading.Semaphore(0)
    engine, slow, after = Engine(queue_size=2), _job(Stepper(10, gate), "slow"), _job(Stepper(2), "after")
    engine.submit(slow)
    engine.submit(after)
    gate.release(3)
    threading.Event().wait(0.2)
    slow.cut(INTERRUPTED)
    gate.release(10)
    assert slow.done.wait(30) and after.done.wait(30)
    assert (slow.state, slow.cut_reason, slow.images, slow.error) == (CUT, INTERRUPTED, None, None)
    assert 3 <= slow.calls_done < 10  # it stopped at the step after the cut
    assert after.state == DONE
    engine.stop()


def test_a_full_queue_refuses_and_a_stop_answers_the_queued_and_cuts_the_running():
    gate = threading.Semaphore(0)
    engine = Engine(queue_size=1)
    running, queued = _job(Stepper(10, gate), "running"), _job(Stepper(1), "queued")
    engine.submit(running)
    assert not running.done.wait(0.3) and running.state == "running"
    engine.submit(queued)
    with pytest.raises(QueueFull):
        engine.submit(_job(Stepper(1), "one too many"))
    engine.stop()
    gate.release(10)
    assert queued.done.wait(30) and running.done.wait(30)
    assert queued.state == CUT and isinstance(queued.error, Stopping) and queued.calls_done == 0
    assert running.state == CUT and running.cut_reason == STOPPING and isinstance(running.error, Stopping)
    with pytest.raises(Stopping):
        engine.submit(_job(Stepper(1), "late"))
    engine.join(30)


def test_a_failing_job_keeps_its_error_and_the_engine_goes_on():
    engine = Engine(queue_size=2)
    bad, good = _job(Stepper(3, fail=SdxError("--steps 0 must be a positive integer")), "bad"), _job(Stepper(1))
    engine.submit(bad)
    engine.submit(good)
    assert bad.done.wait(30) and good.done.wait(30)
    assert bad.state == FAILED and str(bad.error) == "--steps 0 must be a positive integer"
    assert good.state == DONE
    engine.stop()


def test_a_job_cut_while_queued_ends_at_once_frees_its_place_and_never_runs():
    gate = threading.Semaphore(0)
    engine, first = Engine(queue_size=1), _job(Stepper(1, gate), "first")
    ended = []
    waiting = Job(request="waiting", pipeline=Stepper(1), task_id="task(w)", caller="c", on_done=lambda: ended.append(1))
    engine.submit(first)
    assert not first.done.wait(0.3) and first.state == "running"
    engine.submit(waiting)
    waiting.cut(INTERRUPTED)
    assert waiting.done.is_set() and waiting.state == CUT and not first.done.is_set()  # not after the running job
    waiting.cut(INTERRUPTED)
    after = _job(Stepper(1), "after")
    engine.submit(after)  # the cut job's place is free
    gate.release()
    assert after.done.wait(30) and after.state == DONE
    assert first.done.wait(30)
    engine.stop()
    engine.join(30)
    assert waiting.pipeline.ran == [] and ended == [1]
