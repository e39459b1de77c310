"""An unreachable hub costs one probe of a few seconds and one error line, not a request retried five times
(about 25 s): HF_ENDPOINT at a port that refuses connections, and at one that takes them and never answers
(`convert.hub.reachable`). The process then stays offline: a repo in the hub's cache is read from it, and the
next repo asks nothing."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from convert import hub, library
from sdx.errors import SdxError
from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(params=["refused", "silent"])
def endpoint(request):
    """A hub address that refuses connections, or one that takes them and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        if request.param == "silent":
            s.listen(8)  # connections complete in the kernel's backlog; nothing ever reads or answers them
            yield f"http://127.0.0.1:{port}"
            return
    yield f"http://127.0.0.1:{port}"  # closed: refused


@pytest.fixture
def unprobed(monkeypatch, endpoint):
    """This process as at its start, its hub at `endpoint` (restored afterwards: the probe puts it offline)."""
    monkeypatch.setattr(hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "_probed", False)
    monkeypatch.setattr(hub, "_unreachable", None)
    return endpoint


def _cached(cache: Path, repo_id: str) -> Path:
    """A huggingface_hub cache holding a snapshot of `repo_id` with its model_index.json."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(COMMIT)
    snapshot = storage / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    return snapshot


def test_an_unreachable_hub_is_found_out_in_seconds_and_then_left_alone(tmp_path, unprobed):
    cache = tmp_path / "hf"
    snapshot = _cached(cache, "org/cached")
    start = time.monotonic()
    with pytest.raises(SdxError) as info:
        library.convert("org/not-cached", tmp_path / "out", cache_dir=cache)
    assert time.monotonic() - start < 8  # a probe of PROBE_SECONDS at most; five retries took about 25 s
    message = str(info.value)
    assert f"'org/not-cached': not in the local cache, and the hub is unreachable: {unprobed} gave no answer" in message
    assert "local folder" in message and "HF_HUB_OFFLINE=1" in message
    assert hub.constants.HF_HUB_OFFLINE  # offline for the rest of the process
    start = time.monotonic()
    logged = []
    assert hub.fetch("org/cached", cache_dir=cache, log=logged.append) == snapshot  # the cache serves it
    assert time.monotonic() - start < 1 and "using the cached snapshot" in logged[0]


def test_an_unreachable_hub_is_one_error_line(tmp_path, endpoint):
    proc = subprocess.run([sys.executable, "-m", "convert", "org/not-cached", str(tmp_path / "out")], cwd=tmp_path,
                          env={**child_env(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(REPO)),
                               "HF_HUB_OFFLINE": ""},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: hub repo 'org/not-cached': not in the local cache, and the hub is unreachable")
    assert "Retrying" not in proc.stdout + proc.stderr
