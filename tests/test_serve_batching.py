"""Different users' requests sent at once to `python -m sdx.serve` run in one compiled call (`serve/batcher.py`), and
each user gets the images their request makes: the same bits as `python -m sdx.sample` with the call's batch size
(`info`'s `sdx_call_batch`), and within XLA's rounding (one 8-bit level) of the request alone."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from PIL import Image

from sdx.sample import main as sample
from tests.serve_helpers import Server, pixels

BASE = {"steps": 4, "width": 64, "height": 64, "sampler_name": "Euler"}
REQUESTS = [  # prompts, negative prompts, seeds, CFG scales and image counts of their own
    {**BASE, "prompt": "a red circle on a blue background", "seed": 3, "cfg_scale": 7},
    {**BASE, "prompt": "a white square on a black background", "negative_prompt": "a circle", "seed": 11,
     "cfg_scale": 4.5, "batch_size": 2},
    {**BASE, "prompt": "a green triangle on an orange background", "seed": 40, "cfg_scale": 9},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    s = Server("--max-batch", "8", "--batch-wait-ms", "4000", cache=cache)
    s.cache = cache
    yield s
    assert s.stop() == 0


def _at_once(server, bodies: list[dict]) -> list[dict]:
    answers = [None] * len(bodies)

    def call(k: int) -> None:
        r = server.post("/sdapi/v1/txt2img", bodies[k])
        assert r.status_code == 200, r.text
        answers[k] = r.json()

    threads = [threading.Thread(target=call, args=(k,)) for k in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return answers


def _command(server, where, body: dict, batch_size: int) -> list[np.ndarray]:
    out = where / "out"
    flags = ["--prompt", body["prompt"], "--steps", str(body["steps"]), "--height", "64", "--width", "64",
             "--seed", str(body["seed"]), "--num-images", str(body.get("batch_size", 1)), "--batch-size",
             str(batch_size), "--guidance-scale", str(body["cfg_scale"]), "--scheduler", "euler"]
    if body.get("negative_prompt"):
        flags += ["--negative-prompt", body["negative_prompt"]]
    assert sample(["--model", "default", "--cache", str(server.cache), "--output", str(out), "--quiet",
                   "--long-prompt", "chunk", "--overwrite", *flags]) == 0
    return [np.asarray(Image.open(p).convert("RGB")) for p in sorted(out.glob("*.png"))]


def test_requests_sent_at_once_run_together_each_as_it_runs_alone(server, tmp_path):
    together = _at_once(server, REQUESTS)
    for k, (body, answer) in enumerate(zip(REQUESTS, together)):
        info = json.loads(answer["info"])
        assert info["sdx_call_batch"] == 4, info  # 1 + 2 + 1 images in one call of 4
        ours = [pixels(b) for b in answer["images"]]
        command = _command(server, tmp_path / f"c{k}", body, batch_size=4)
        assert len(ours) == len(command) == body.get("batch_size", 1)
        for a, b in zip(ours, command):
            np.testing.assert_array_equal(a, b)  # bit for bit, whoever else was in the call
        alone = server.post("/sdapi/v1/txt2img", body).json()
        assert json.loads(alone["info"])["sdx_call_batch"] == body.get("batch_size", 1)
        for a, b in zip(ours, (pixels(x) for x in alone["images"])):
            apart = np.abs(a.astype(int) - b)
            print(f"request {k}: in a call of 4 against alone, 8-bit max {apart.max()}, mean {apart.mean():.4f}")
            assert apart.max() <= 1 and apart.mean() < 0.01
