"""The server's engine (serve/batcher.py) on the random-weight `tiny` model: requests that share a compiled program
run in one sampler call, each image the bits its request gets alone at that batch size (and its lone run to XLA's
rounding across batch sizes); a cut job ends at its next step and the others of its call are untouched; calls
count per job; a bounded queue; a stop that answers the queued jobs; max_batch 1 is one job at a time; with `fixed`,
every call is full and a request's images are the same bits alone."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from pipelines.pipeline import Pipeline
from pipelines.request import Request
from serve.batcher import Batcher, buckets
from serve.engine import CUT, DONE, FAILED, INTERRUPTED, STOPPING, Job, QueueFull, Stopping

BASE = dict(height=32, width=32, steps=3)
REQUESTS = [  # different users: prompts, seeds, guidance scales and image counts all differ
    Request(prompts=["a fox"], seed=1, guidance_scale=7.0, **BASE),
    Request(prompts=["a red kite", "a boat"], seed=40, guidance_scale=3.5, **BASE),
    Request(prompts=["a lighthouse"], seed=7, guidance_scale=9.0, negative_prompts=["fog"], **BASE),
]


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.load("tiny")


class Calls:
    """Counts the sampler's calls (and their batch sizes) of a pipeline; `gate`: each model call waits for a go."""

    def __init__(self, pipe, monkeypatch, gate: threading.Semaphore | None = None):
        self.sizes, sampler = [], pipe.sampler
        run = type(sampler).__call__

        def spied(this, plan, inputs, progress=None, watch=None):
            self.sizes.append(plan.batch)

            def gated(n):
                if gate is not None:
                    assert gate.acquire(timeout=60)
                if progress is not None:
                    progress(n)
            return run(this, plan, inputs, gated, watch)

        monkeypatch.setattr(type(sampler), "__call__", spied)


def _job(pipe, request, name="job") -> Job:
    return Job(request=request, pipeline=pipe, task_id=f"task({name})", caller=name)


def _all(engine: Batcher, jobs: list[Job]) -> None:
    for job in jobs:
        engine.submit(job)
    for job in jobs:
        assert job.done.wait(300), job


def test_buckets_are_powers_of_two_of_the_devices_up_to_max_batch():
    assert buckets(8, 1) == [1, 2, 4, 8] and buckets(6, 1) == [1, 2, 4, 6] and buckets(8, 4) == [4, 8]
    assert buckets(1, 1) == [1] and buckets(3, 2) == [2, 4]


def test_different_requests_run_in_one_call_each_as_it_runs_alone(pipe, monkeypatch):
    calls = Calls(pipe, monkeypatch)
    engine = Batcher(queue_size=8, max_batch=8, wait_s=2.0)
    jobs = [_job(pipe, r, f"user{k}") for k, r in enumerate(REQUESTS)]
    _all(engine, jobs)
    engine.stop()
    assert [j.state for j in jobs] == [DONE] * 3 and calls.sizes == [4]  # 4 images in one call of 4
    assert [j.calls_done for j in jobs] == [j.calls_total for j in jobs] == [3, 3, 3]
    for job in jobs:
        n = job.request.num_images
        alone_same_size = pipe(dataclasses.replace(job.request, batch_size=4))  # padded to the call's size
        alone = pipe(job.request)  # at its own size
        np.testing.assert_array_equal(job.images, alone_same_size[:n])
        err = float(np.abs(job.images - alone).max())
        print(f"{job.caller}: bit for bit its run at batch 4; against its run at batch {n}: max abs {err:.1e}")
        assert err < 1e-5


def test_with_fixed_every_call_is_full_so_a_request_alone_gets_the_same_bits(pipe, monkeypatch):
    calls = Calls(pipe, monkeypatch)
    engine = Batcher(queue_size=8, max_batch=4, wait_s=2.0, fixed=True)
    together = [_job(pipe, r, f"user{k}") for k, r in enumerate(REQUESTS)]
    _all(engine, together)
    alone = [_job(pipe, r, f"alone{k}") for k, r in enumerate(REQUESTS[:2])]
    for job in alone:
        _all(engine, [job])
    engine.stop()
    assert calls.sizes == [4, 4, 4]  # one call for the three jobs, then one for each lone job, padded
    for a, b in zip(together, alone):
        np.testing.assert_array_equal(a.images, b.images)


def test_plans_that_differ_run_apart_and_max_batch_one_is_one_job_at_a_time(pipe, monkeypatch):
    calls = Calls(pipe, monkeypatch)
    engine = Batcher(queue_size=8, max_batch=8, wait_s=1.0)
    other_steps = dataclasses.replace(REQUESTS[0], steps=2)
    _all(engine, [_job(pipe, REQUESTS[0], "a"), _job(pipe, other_steps, "b")])
    engine.stop()
    assert sorted(calls.sizes) == [1, 1]
    calls.sizes.clear()
    engine = Batcher(queue_size=8, max_batch=1, wait_s=1.0)
    _all(engine, [_job(pipe, r, f"u{k}") for k, r in enumerate(REQUESTS)])
    engine.stop()
    assert calls.sizes == [1, 2, 1]  # a job of two images still runs whole, alone


def test_a_cut_job_ends_at_its_next_step_and_leaves_the_others_images_alone(pipe, monkeypatch):
    gate = threading.Semaphore(0)
    Calls(pipe, monkeypatch, gate)
    engine = Batcher(queue_size=8, max_batch=8, wait_s=2.0)
    cut, kept = _job(pipe, REQUESTS[0], "cut"), _job(pipe, REQUESTS[2], "kept")
    engine.submit(cut)
    engine.submit(kept)
    gate.release(1)
    threading.Event().wait(3.0)
    cut.cut(INTERRUPTED)
    gate.release(10)
    assert cut.done.wait(300) and kept.done.wait(300)
    assert (cut.state, cut.cut_reason, cut.images, cut.calls_done) == (CUT, INTERRUPTED, None, 2)
    engine.stop()
    gate.release(10)
    alone = pipe(dataclasses.replace(REQUESTS[2], batch_size=2))
    np.testing.assert_array_equal(kept.images, alone[:1])


def test_previews_are_made_while_asked_for(pipe):
    engine = Batcher(queue_size=2, max_batch=2, wait_s=0.0)
    asked, not_asked = _job(pipe, REQUESTS[0], "asked"), _job(pipe, REQUESTS[2], "not")
    asked.wants_preview = True
    _all(engine, [asked, not_asked])
    engine.stop()
    assert asked.preview.shape == (1, 16, 16, 3) and asked.preview.dtype == np.uint8 and not_asked.preview is None


def test_a_full_queue_refuses_a_stop_answers_the_queued_and_a_failure_stays_its_own(pipe, monkeypatch):
    gate = threading.Semaphore(0)
    Calls(pipe, monkeypatch, gate)
    engine = Batcher(queue_size=1, max_batch=1, wait_s=0.0)
    running, queued = _job(pipe, REQUESTS[0], "running"), _job(pipe, REQUESTS[2], "queued")
    engine.submit(running)
    threading.Event().wait(2.0)
    engine.submit(queued)
    with pytest.raises(QueueFull):
        engine.submit(_job(pipe, REQUESTS[1], "one too many"))
    engine.stop()
    gate.release(20)
    assert queued.done.wait(60) and running.done.wait(300)
    assert queued.state == CUT and isinstance(queued.error, Stopping) and queued.calls_done == 0
    assert running.state == CUT and running.cut_reason == STOPPING and isinstance(running.error, Stopping)
    with pytest.raises(Stopping):
        engine.submit(_job(pipe, REQUESTS[0], "late"))
    engine.join(60)
    engine = Batcher(queue_size=4, max_batch=8, wait_s=1.0)
    bad, good = _job(pipe, dataclasses.replace(REQUESTS[0], steps=0), "bad"), _job(pipe, REQUESTS[2], "good")
    gate.release(100)
    _all(engine, [bad, good])
    engine.stop()
    assert bad.state == FAILED and "--steps 0" in str(bad.error) and good.state == DONE
