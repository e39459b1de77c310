"""`python -m sdx.serve` under load: concurrent clients, images/s and latency, batching against one at a time.

    python benchmarks/serve.py [--model default] [--size 64] [--steps 20] [--clients 1 4 8 16] [--max-batch 8]

Two servers run one after the other in this run, on the same model and cache: `--max-batch N` and `--max-batch 1`
(one request at a time, as AUTOMATIC1111, ComfyUI and Forge serve). For each number of clients, every client sends
`--requests` txt2img calls one after the other (prompts and seeds of its own, one image each, the same size and
steps for all, so they can share a compiled program); printed per server: images/s over the whole load, and the
p50 and p95 of a request's latency, and the batch sizes of the calls that made the images (info's sdx_call_batch:
`8:16` is 16 images made in calls of 8); then the batching server's time over the one-at-a-time one's (below 1:
batching is faster). Before the timed loads each server answers, untimed, one request of `batch_size` b for each
batch size b its calls can run at (1, 2, 4, ... up to --max-batch: the server's buckets), so that no load meets a
compile.

Also printed: a lone request through the server (its p50 at one client) against `python -m sdx.sample`'s own
sampling time for the same job (the "N image(s) in S s sampling" it prints, its second run in the same cache).

`--preset NAME` serves a random-weight diffusers folder of that sdx preset (`benchmarks/sample.py` builds it, no
download) instead of `--model`; `--diffusers` then adds a third server: diffusers' pipeline over the same folder
behind a one-at-a-time FastAPI server (`benchmarks/serve_diffusers.py`), under the same load (the GPU round in
benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sample import build_diffusers_folder  # noqa: E402
from serve.batcher import buckets  # noqa: E402

PROMPTS = ("a red circle on a blue background", "a yellow triangle on a purple background",
           "a white square on a black background", "a green circle on an orange background")


class Served:
    """A server process started with `command` (it prints "... at http://HOST:PORT ..." once it listens)."""

    def __init__(self, command: list[str], name: str):
        self.name = name
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=REPO)
        line = self.proc.stdout.readline()
        found = re.search(r"http://[\d.]+:\d+", line)
        if not found:
            self.proc.kill()
            sys.exit(f"{name} did not start: {line!r}")
        self.url = found.group(0)

    def txt2img(self, body: dict) -> tuple[float, int | None]:
        """(seconds, the batch size of the call that made the image: info's sdx_call_batch, None from a server
        without it) for one call, which must answer with its images."""
        t0 = time.perf_counter()
        r = requests.post(self.url + "/sdapi/v1/txt2img", json=body, timeout=3600)
        seconds = time.perf_counter() - t0
        if r.status_code != 200 or not r.json()["images"]:
            sys.exit(f"{self.name}: {r.status_code} {r.text[:500]}")
        base64.b64decode(r.json()["images"][0])
        return seconds, json.loads(r.json()["info"]).get("sdx_call_batch")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(600)


def load(server: Served, clients: int, requests_each: int, body: dict) -> tuple[float, list[float], list]:
    """(images/s, latencies, call batch sizes) of `clients` clients each sending `requests_each` calls one after
    the other."""
    def client(k: int) -> list[tuple[float, int | None]]:
        return [server.txt2img({**body, "prompt": PROMPTS[(k + i) % len(PROMPTS)], "seed": 1000 * k + i})
                for i in range(requests_each)]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = [a for each in pool.map(client, range(clients)) for a in each]
    return len(answers) / (time.perf_counter() - t0), [s for s, _ in answers], [b for _, b in answers]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def command_sampling_seconds(args, cache: str) -> float:
    """`python -m sdx.sample`'s own sampling seconds for the job (its second run; the first compiles)."""
    with tempfile.TemporaryDirectory() as out:
        flags = [sys.executable, "-m", "sdx.sample", "--model", args.model, "--prompt", PROMPTS[0], "--steps",
                 str(args.steps), "--height", str(args.size), "--width", str(args.size), "--guidance-scale", "7",
                 "--scheduler", "euler", "--long-prompt", "chunk", "--dtype", args.dtype, "--cache", cache,
                 "--output", f"{out}/x.png", "--overwrite"]
        for _ in range(2):
            run = subprocess.run(flags, capture_output=True, text=True, cwd=REPO)
            if run.returncode:
                sys.exit(run.stderr)
        sampled = re.search(r"in ([\d.]+) s sampling", run.stderr)
    return float(sampled.group(1)) if sampled else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default", help="any --model name")
    p.add_argument("--preset", help="instead of --model: a random-weight diffusers folder of this sdx preset")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--requests", type=int, default=2, help="calls each client makes, one after the other")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--batch-wait-ms", type=float, help="the batching server's gathering window (default: its own)")
    p.add_argument("--cache", help="the sdx cache both servers and the command share (default: a new folder)")
    p.add_argument("--diffusers", action="store_true", help="with --preset: also serve it through diffusers, one "
                                                                 "request at a time")
    args = p.parse_args()
    if args.diffusers and not args.preset:
        p.error("--diffusers serves the --preset's diffusers folder: give --preset")
    cache = args.cache or tempfile.mkdtemp(prefix="sdx-serve-bench-")
    if args.preset:
        args.model = str(build_diffusers_folder(args.preset, Path(cache) / f"diffusers-{args.preset}", args.dtype))
    body = {"steps": args.steps, "width": args.size, "height": args.size, "cfg_scale": 7, "sampler_name": "Euler",
            "negative_prompt": ""}
    serve = [sys.executable, "-m", "sdx.serve", "--model", args.model, "--dtype", args.dtype, "--port", "0",
             "--cache", cache, "--queue-size", str(4 * max(args.clients))]
    wait = [] if args.batch_wait_ms is None else ["--batch-wait-ms", str(args.batch_wait_ms)]
    servers = [(f"sdx --max-batch {args.max_batch}", serve + ["--max-batch", str(args.max_batch)] + wait),
               ("sdx --max-batch 1", serve + ["--max-batch", "1"])]
    if args.diffusers:
        servers.append(("diffusers, one at a time", [sys.executable, "benchmarks/serve_diffusers.py", args.model,
                                                     "--dtype", args.dtype, "--port", "0"]))
    results = {}
    for (name, command), top in zip(servers, (args.max_batch, 1, 1)):
        server = Served(command, name)
        try:
            for size in buckets(top, devices=1):  # untimed: every batch size a call of the load may run at, compiled
                server.txt2img({**body, "prompt": PROMPTS[0], "seed": 0, "batch_size": size})
            results[name] = {c: load(server, c, args.requests, body) for c in args.clients}
        finally:
            server.stop()
    print(f"{args.preset or args.model}, {args.size}x{args.size}, {args.steps} Euler steps, {args.dtype}, {args.requests} "
          "requests a client, one image each")
    print(f"{'server':<28} {'clients':>7} {'images/s':>9} {'p50 s':>8} {'p95 s':>8}  calls' batch sizes")
    for name, by_clients in results.items():
        for c, (rate, latencies, batches) in by_clients.items():
            sizes = " ".join(f"{b}:{n}" for b, n in sorted(collections.Counter(batches).items())) \
                if None not in batches else "-"
            print(f"{name:<28} {c:>7} {rate:>9.3f} {percentile(latencies, 50):>8.3f} {percentile(latencies, 95):>8.3f}"
                  f"  {sizes}")
    batched, single = (results[name] for name, _ in servers[:2])
    for c in args.clients:
        print(f"{c} clients: --max-batch {args.max_batch} takes {single[c][0] / batched[c][0]:.2f}x the time of "
              f"--max-batch 1 (images/s {batched[c][0]:.3f} against {single[c][0]:.3f})")
    if 1 in args.clients:
        lone = percentile(single[1][1], 50)
        command = command_sampling_seconds(args, cache)
        print(f"a lone request: {lone:.3f} s through the server, {command:.3f} s of the command's sampling "
              f"({lone / command:.2f}x)")


if __name__ == "__main__":
    main()
