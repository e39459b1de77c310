"""A `python -m sdx.serve` process for the server's tests: started on a free port of 127.0.0.1 (--port 0, the
address read from the line it prints once it listens), called over plain HTTP, stopped with SIGTERM. Every wait is
bounded."""

from __future__ import annotations

import base64
import io
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import requests
from PIL import Image

from tests import processes

START_TIMEOUT_S = 600  # loading, and converting a model on a busy machine
CALL_TIMEOUT_S = 600


class Server:
    def __init__(self, *flags: str, cache: Path, auth: tuple[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", "sdx.serve", "--port", "0", "--cache", str(cache), *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=processes.child_env())
        self.auth, self.stderr = auth, []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.line = self._address_line()
        self.url = re.search(r"http://[\d.]+:\d+", self.line).group(0)

    def _address_line(self) -> str:
        found: list[str] = []
        reader = threading.Thread(target=lambda: found.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(START_TIMEOUT_S)
        if not found or not found[0]:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {''.join(self.stderr)[-3000:]}")
        return found[0]

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, **{"auth": self.auth, "timeout": CALL_TIMEOUT_S, **kw})

    def post(self, path: str, json=None, **kw) -> requests.Response:
        return requests.post(self.url + path, json=json, **{"auth": self.auth, "timeout": CALL_TIMEOUT_S, **kw})

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM, and the exit status once it ended."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def parameters(b64: str) -> str:
    return Image.open(io.BytesIO(base64.b64decode(b64))).info["parameters"]


def b64_png(picture: np.ndarray) -> str:
    out = io.BytesIO()
    Image.fromarray(picture).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def wait_until(condition, timeout: float = 120, every: float = 0.05):
    """Poll `condition()` until it is truthy (its value), at most `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")
