"""The sampler's three programs timed one by one, compiled with sdx's XLA:CPU options against XLA's
defaults (or against sdx's options with some changed), in one run.

    python benchmarks/programs.py --preset sdxl_base --size 512 --steps 3 [--rounds 2] [--option NAME=VALUE ...]

sdx compiles its programs with the options of `pipelines/cpu_kernels.py` (on a CPU: which work YNNPACK
takes, the memory-optimized scheduler); `default` compiles them with none, or, given `--option`, with
sdx's options and those changed. Each choice runs in a fresh process of its own, without a compilation
cache (both compile), the two alternated `--rounds` times, on the same random-weight model as
`benchmarks/sample.py` builds. A process runs prepare and decode twice and the denoise program once per
model call of the schedule; printed per program: the first call's seconds (a program's first run sets up
what it needs: YNNPACK's fusions do) and the median of the later calls, each the median over rounds, and
the ratio sdx / default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sample import PROMPT, build_diffusers_folder, machine, run_workers  # noqa: E402

CHOICES = ("default", "sdx")


def timed(fn, *args):
    """(fn(*args) once it is computed, its seconds)."""
    import jax

    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def run_worker(args) -> dict:
    """{program: [seconds of each call]} for one choice of compile options."""
    from convert.library import ensure_sdx_folder
    from pipelines import cpu_kernels
    from pipelines.pipeline import Pipeline
    from pipelines.request import Request

    if args.worker == "default":
        options = default_options(args.option)
        cpu_kernels.compiler_options = lambda mesh: options
    folder = ensure_sdx_folder(args.folder, cache_dir=Path(args.work) / "sdx")
    pipe = Pipeline.load(folder, attention=args.attention)
    request = Request(prompts=[PROMPT], height=args.size, width=args.size, steps=args.steps, seed=0, guidance_scale=7.0)
    plan, inputs, _ = pipe._work(request)[0]
    sampler = pipe.sampler
    inputs = sampler.place(inputs)
    programs = sampler.compiled(plan, inputs)
    seconds = {"prepare": [], "denoise": [], "decode": []}
    for _ in range(2):
        (carry, fixed), s = timed(programs.prepare, sampler._prepare_params(plan), inputs)
        seconds["prepare"].append(s)
        for calls in programs.sizes:
            (carry, _), s = timed(programs.denoise[calls], sampler._denoise_params(plan), carry, fixed)
            seconds["denoise"].append(s)
        _, s = timed(programs.decode, sampler.params["vae"], carry.latents)
        seconds["decode"].append(s)
    return seconds


def default_options(changes: list[str]) -> dict[str, str]:
    """The `default` choice's compile options: none, or sdx's with each NAME=VALUE of `changes` set."""
    from pipelines import cpu_kernels

    return {**cpu_kernels.OPTIONS, **dict(c.split("=", 1) for c in changes)} if changes else {}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="sd15")
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--attention", default="chunked")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="compare against sdx's options with this one changed (repeatable), not XLA's defaults")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "sdx-bench"), help="where models are built")
    p.add_argument("--worker", choices=CHOICES, help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for change in args.option:
        if "=" not in change:
            p.error(f"--option takes NAME=VALUE (an XLA compile option and its value), not {change!r}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        print(json.dumps(run_worker(args)))
        return 0
    folder = build_diffusers_folder(args.preset, Path(args.work) / f"diffusers-{args.preset}")
    runs = {choice: [] for choice in CHOICES}
    for _ in range(args.rounds):
        results = run_workers(__file__, CHOICES, argv or sys.argv[1:], extra=("--folder", str(folder)))
        if results is None:
            return 1
        for choice, seconds in zip(CHOICES, results):
            runs[choice].append(seconds)
    print(f"# {machine()}; preset {args.preset}, {args.size}x{args.size}, {args.steps} steps, float32, "
          f"attention {args.attention}; median of {args.rounds} alternated round(s); "
          f"default = {'sdx with ' + ', '.join(args.option) if args.option else 'no options'}")
    print("| program | default: first call | default: later calls | sdx: first call | sdx: later calls | sdx / default (later) |")
    print("|---|---|---|---|---|---|")
    for program in runs["sdx"][0]:
        first = {c: statistics.median(r[program][0] for r in runs[c]) for c in CHOICES}
        later = {c: statistics.median(statistics.median(r[program][1:]) for r in runs[c]) for c in CHOICES}
        print(f"| {program} | {first['default']:.2f} | {later['default']:.2f} | {first['sdx']:.2f} | "
              f"{later['sdx']:.2f} | {later['sdx'] / later['default']:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
