"""Progress, interrupt and the queue, per caller: each caller sees and ends only its own job, a full queue answers
503 with Retry-After, a client that leaves loses its place, and SIGTERM answers the queued requests 503 and ends
the server cleanly. Two users (HTTP Basic) on the default model; a long request (150 steps at 128x128) is the one
the others watch (and interrupt: only the progress test runs one to its end, a shorter one)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import requests

from tests.serve_helpers import Server, pixels, wait_until

ALICE, BOB = ("alice", "a-secret"), ("bob", "b-secret")
LONG = {"prompt": "a red circle on a blue background", "steps": 150, "width": 128, "height": 128, "seed": 1}
WATCHED_STEPS = 40  # the request the progress test watches to its end (see there)
SHORT = {"prompt": "a green square on a white background", "steps": 4, "width": 64, "height": 64, "seed": 8}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("--api-auth", "alice:a-secret,bob:b-secret", "--queue-size", "1",
               cache=tmp_path_factory.mktemp("serve-cache"))
    yield s
    s.stop()


class Call(threading.Thread):
    """A txt2img call in the background; `response` once it returned."""

    def __init__(self, server, body, auth, **kw):
        super().__init__(daemon=True)
        self.server, self.body, self.auth, self.kw, self.response, self.error = server, body, auth, kw, None, None
        self.start()

    def run(self):
        try:
            self.response = self.server.post("/sdapi/v1/txt2img", self.body, auth=self.auth, **self.kw)
        except requests.RequestException as e:
            self.error = e

    def result(self) -> requests.Response:
        self.join(600)
        assert self.response is not None, self.error
        return self.response


def _progress(server, auth, **params) -> dict:
    r = server.get("/sdapi/v1/progress", auth=auth, params=params)
    assert r.status_code == 200, r.text
    return r.json()


def _running(server, auth) -> dict:
    """The caller's progress once its job has done a step."""
    return wait_until(lambda: (p := _progress(server, auth))["state"]["sampling_step"] > 0 and p, timeout=300)


@pytest.fixture(scope="module")
def short_alone(server):
    """Bob's short request run alone: the image any later run of it must give."""
    r = server.post("/sdapi/v1/txt2img", SHORT, auth=BOB)
    assert r.status_code == 200, r.text
    return pixels(r.json()["images"][0])


def test_progress_moves_and_is_the_callers_own(server, short_alone):
    # run to its end: WATCHED_STEPS, not LONG's 150 (one more program to compile, about 5 s, against 110 more steps
    # of about 0.3 s), watched over its first half every 50 ms (the server shares this worker's core with the calls)
    long = Call(server, {**LONG, "steps": WATCHED_STEPS, "force_task_id": "task(alice-1)"}, ALICE)
    seen = [_running(server, ALICE)]
    while long.is_alive() and len(seen) < 400 and seen[-1]["state"]["sampling_step"] < WATCHED_STEPS // 2:
        p = _progress(server, ALICE)
        if p["state"]["job_count"]:
            seen.append(p)
        assert _progress(server, BOB)["state"]["job_count"] == 0  # bob runs nothing: alice's job is not his
        assert _progress(server, BOB, id_task="task(alice-1)")["current_task"] is None
        time.sleep(0.05)
    steps = [p["state"]["sampling_step"] for p in seen]
    assert seen[0]["current_task"] == "task(alice-1)" and seen[0]["state"]["sampling_steps"] == WATCHED_STEPS
    assert steps == sorted(steps) and len(set(steps)) >= 3 and 0 < steps[0] < steps[-1] < WATCHED_STEPS
    assert all(0 < p["progress"] < 1 and p["eta_relative"] >= 0 for p in seen)
    internal = server.post("/internal/progress", {"id_task": "task(alice-1)"}, auth=ALICE).json()
    assert internal["completed"] or internal["active"]
    assert long.result().status_code == 200
    done = server.post("/internal/progress", {"id_task": "task(alice-1)"}, auth=ALICE).json()
    assert done["completed"] and not done["active"] and done["progress"] == 1


def test_an_interrupt_ends_the_callers_job_only(server, short_alone):
    long = Call(server, LONG, ALICE)
    _running(server, ALICE)
    short = Call(server, SHORT, BOB)  # queued behind alice's
    wait_until(lambda: _progress(server, BOB)["state"]["job_count"])
    assert server.post("/sdapi/v1/interrupt", auth=BOB).json() == {}  # bob's own: his queued request
    r = short.result()
    assert r.status_code == 200 and r.json()["images"] == []  # bob ended his own job, unrun
    step = _progress(server, ALICE)["state"]["sampling_step"]
    wait_until(lambda: _progress(server, ALICE)["state"]["sampling_step"] > step)  # alice's goes on
    short = Call(server, SHORT, BOB)
    wait_until(lambda: _progress(server, BOB)["state"]["job_count"])
    assert server.post("/sdapi/v1/interrupt", auth=ALICE).status_code == 200
    cut = long.result()
    assert cut.status_code == 200 and cut.json()["images"] == []
    r = short.result()
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(pixels(r.json()["images"][0]), short_alone)


def test_a_full_queue_answers_503_and_a_client_that_leaves_loses_its_place(server):
    long = Call(server, LONG, ALICE)
    _running(server, ALICE)
    leaving = Call(server, {**SHORT, "force_task_id": "task(bob-leaves)"}, BOB, timeout=1.5)
    leaving.join(30)
    assert isinstance(leaving.error, requests.Timeout)
    gone = wait_until(lambda: (p := server.post("/internal/progress", {"id_task": "task(bob-leaves)"},
                                                auth=BOB).json())["completed"] and p, timeout=30)
    assert not gone["active"] and _progress(server, ALICE)["state"]["job_count"] == 1  # dropped, alice's runs on
    waiting = Call(server, SHORT, BOB)  # the one place in the queue
    wait_until(lambda: _progress(server, BOB)["state"]["job_count"])
    full = server.post("/sdapi/v1/txt2img", SHORT, auth=BOB)
    assert full.status_code == 503 and int(full.headers["Retry-After"]) > 0, full.text
    assert "queue is full" in full.json()["detail"]
    server.post("/sdapi/v1/interrupt", auth=ALICE)
    assert long.result().status_code == 200 and waiting.result().status_code == 200


def test_sigterm_answers_the_waiting_requests_and_ends_the_server(server):
    long = Call(server, LONG, ALICE)
    _running(server, ALICE)
    waiting = Call(server, SHORT, BOB)
    wait_until(lambda: _progress(server, BOB)["state"]["job_count"])
    assert server.stop() == 0
    for call in (long, waiting):
        r = call.result()
        assert r.status_code == 503 and r.json()["detail"] == "the server is stopping", r.text
