"""Many images in one process: `python -m sdx.sample --prompts-file` over N prompts, with the process's
resident memory sampled as it goes.

    python benchmarks/long_run.py --images 500 [--model default] [--steps 30]

The prompts are the shapes world's 168 combinations (`train.shapes_eval.combinations`), cycling, each
line its own seed. The sampler runs in a subprocess; its VmRSS (/proc/PID/status) is read every 0.2 s and
recorded against the number of images written so far. Printed: RSS once the first image is written and
at the last one, the largest RSS seen after the first image, the number of compiles the run reported,
and images per second from the run's own summary line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the repository's `train` package, not benchmarks/train.py beside this file

from train.shapes import Scene  # noqa: E402
from train.shapes_eval import combinations  # noqa: E402


def prompts(n: int) -> list[str]:
    return [json.dumps({"prompt": Scene(*c).prompt(), "seed": i})
            for i, c in zip(range(n), itertools.cycle(combinations()))]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=500)
    p.add_argument("--model", default="default")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "prompts.jsonl").write_text("\n".join(prompts(args.images)) + "\n")
        out = tmp / "out"
        command = [sys.executable, "-m", "sdx.sample", "--model", args.model, "--prompts-file", str(tmp / "prompts.jsonl"),
                   "--steps", str(args.steps), "--output", str(out)]
        with open(tmp / "stderr.txt", "w") as log:  # a file, not a pipe: nothing waits on a full pipe
            proc = subprocess.Popen(command, cwd=REPO, stderr=log)
            samples = []  # (images written, RSS MiB)
            while proc.poll() is None:
                rss = rss_mib(proc.pid)
                if rss is not None:
                    samples.append((len(list(out.glob("*.png"))) if out.is_dir() else 0, rss))
                time.sleep(0.2)
        err = (tmp / "stderr.txt").read_text()
    if proc.returncode != 0:
        sys.exit(f"the sampler failed:\n{err}")
    after_first = [rss for written, rss in samples if written >= 1]
    summary = [line for line in err.splitlines() if "images/s" in line]
    print(f"{args.images} images of --model {args.model}, {args.steps} steps, one process")
    print(f"RSS after the first image: {after_first[0]:.0f} MiB; at the last sample ({samples[-1][0]} images): "
          f"{after_first[-1]:.0f} MiB; largest after the first image: {max(after_first):.0f} MiB")
    print(f"compiles reported: {err.count('compiled in')}")
    print(summary[-1] if summary else "no summary line")


if __name__ == "__main__":
    main()
