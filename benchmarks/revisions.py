"""`python -m sdx.sample` end to end at this tree against another revision of sdx, in one run on one machine.

    python benchmarks/revisions.py REV [--preset sd15] [--size 512] [--steps 4] [--repeats 5]

REV (a commit, branch or tag) is checked out in a temporary git worktree. Both trees sample the same random-weight
diffusers folder of the preset (`benchmarks/sample.py` builds it, no download), each with a cache of its own warmed
by one untimed run (the conversion and the compiled programs), then alternately `--repeats` times: the wall time of a
fresh process making one image, as a user waits for it. Printed: each tree's times and median, and this tree's median
over REV's (below 1: this tree is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sample import build_diffusers_folder, machine  # noqa: E402


def seconds(tree: Path, model: Path, cache: Path, args: argparse.Namespace) -> float:
    """Wall seconds of `python -m sdx.sample` run from `tree`'s packages."""
    command = [sys.executable, "-m", "sdx.sample", "--model", str(model), "--prompt", "a lighthouse", "--steps",
               str(args.steps), "--height", str(args.size), "--width", str(args.size), "--cache", str(cache),
               "--output", str(cache / "out.png"), "--overwrite", "--quiet"]
    t0 = time.perf_counter()
    run = subprocess.run(command, cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"{tree}: {run.stderr[-2000:]}")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rev", help="the revision to compare with (a commit, branch or tag)")
    p.add_argument("--preset", default="sd15")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="sdx-revisions-") as tmp:
        tmp = Path(tmp)
        subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "base"), args.rev], cwd=REPO, check=True,
                       capture_output=True)
        try:
            model = build_diffusers_folder(args.preset, tmp / "model", "float32")
            trees = {"this tree": REPO, args.rev: tmp / "base"}
            caches = {name: tmp / f"cache-{k}" for k, name in enumerate(trees)}
            for name, tree in trees.items():  # untimed: conversion and compiles
                seconds(tree, model, caches[name], args)
            times = {name: [] for name in trees}
            for _ in range(args.repeats):
                for name, tree in trees.items():
                    times[name].append(seconds(tree, model, caches[name], args))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "base")], cwd=REPO, capture_output=True)
    print(f"# {machine()}; preset {args.preset}, {args.size}x{args.size}, {args.steps} steps, one image, float32, "
          "a fresh process each")
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values):.2f} s ({', '.join(f'{v:.2f}' for v in values)})")
    this, base = (statistics.median(v) for v in times.values())
    print(f"this tree / {args.rev}: {this / base:.2f}x")


if __name__ == "__main__":
    main()
