"""One model call of the sampler (its denoise program: the UNet on the guidance batch, guidance, the scheduler's
step) compiled under several sets of XLA options, and timed, in one process.

    python benchmarks/options.py --preset sdxl_base --size 1024 --batch 8 --dtype bfloat16 --attention cudnn \\
        --variant no_dot_merger xla_gpu_dot_merger_threshold_mb=0 --variant cublas xla_gpu_enable_triton_gemm=false

`sdx` is the program as the sampler compiles it (`pipelines.cpu_kernels.compiler_options`: none on a GPU);
each `--variant NAME OPTION=VALUE ...` compiles the same program again with those options added. The model
is built once and every variant runs on the same weights and inputs, so a variant costs its compile (XLA
keeps the autotuning of the kernels it has already seen) and its calls, not a fresh process: a way to try
many options inside a short lease, where benchmarks/sample.py pays a model load and three compiles for each.
Each variant starts from prepare's output, then runs `--calls` model calls, each waited for; printed per
variant, as each finishes: its compile seconds, the median of the calls after the first (the first is a
warm-up) in milliseconds, and its ratio to `sdx`'s median. An option this XLA does not take is reported
and skipped. Options passed this way are per-program; the few that XLA reads only at start-up must go in
XLA_FLAGS instead (benchmarks/gpu_round.sh's batch4_flags stage).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.sample import job_folder, machine, sdx_job  # noqa: E402


def timed_calls(program, params, prepared, calls: int) -> list[float]:
    """Seconds of each of `calls` chained model calls of `program`, starting from `prepared()`'s carry."""
    import jax

    carry, fixed = prepared()
    seconds = []
    for _ in range(calls):
        t0 = time.perf_counter()
        carry, index = program(params, carry, fixed)
        jax.block_until_ready((carry, index))
        seconds.append(time.perf_counter() - t0)
    return seconds


def parse_variant(words: list[str]) -> tuple[str, dict] | None:
    """`NAME OPTION=VALUE ...` -> (NAME, {OPTION: value}); None when it is not of that form."""
    name, *options = words
    if not options or any("=" not in o for o in options):
        return None
    return name, {k: typed(v) for k, v in (o.split("=", 1) for o in options)}


def typed(value: str):
    """An option's value as XLA takes it: true/false a bool, a whole number an int, else the text."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    return int(value) if value.lstrip("-").isdigit() else value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="sd15")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=25, help="the job's schedule (as benchmarks/sample.py's, so that the "
                                                         "sampler's programs can come from its --cache)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--guidance", type=float, default=7.0, help="1 or less: no classifier-free guidance")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--attention", default="xla")
    p.add_argument("--calls", type=int, default=6, help="model calls per variant, at most --steps; the first is a warm-up")
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar="WORD",
                   help="NAME OPTION=VALUE ...: a variant compiled with these XLA options added (repeatable)")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "sdx-bench"),
                   help="where models are built (benchmarks/sample.py's)")
    p.add_argument("--cache", help="the sampler's programs, as benchmarks/sample.py --cache keeps them")
    args = p.parse_args(argv)
    if not 2 <= args.calls <= args.steps:
        p.error("--calls: from 2 (the first is a warm-up) to --steps")
    variants = [parse_variant(v) for v in args.variant]
    for words, variant in zip(args.variant, variants):
        if variant is None:
            p.error(f"--variant {' '.join(words)}: give a name, then one or more OPTION=VALUE (an XLA option and its value)")
    args.vae_dtype = args.dtype

    import jax

    from pipelines import executables
    from sdx import mesh as meshlib

    args.folder = job_folder(args)
    pipe, request = sdx_job(args)
    plan, inputs, _ = pipe._work(request)[0]
    sampler = pipe.sampler
    inputs = sampler.place(inputs)
    t0 = time.perf_counter()
    programs = sampler.compiled(plan, inputs)
    sampler_s = time.perf_counter() - t0
    prepared = lambda: programs.prepare(sampler._prepare_params(plan), inputs)
    recipe = sampler._recipe(plan, inputs)
    carry, fixed = programs.prepare.out_info
    keep = (jax.tree.map(lambda s: s.sharding, carry), meshlib.replicated(sampler.mesh))
    params = sampler._denoise_params(plan)

    print(f"# {machine()}; {jax.devices()[0].device_kind}; preset {args.preset}, {args.size}x{args.size}, batch "
          f"{args.batch}, guidance {args.guidance:g}, {args.dtype}, attention {args.attention}; one model call, median "
          f"of {args.calls - 1} after a warm-up; `sdx` is the sampler's program (its three programs took "
          f"{sampler_s:.1f} s to compile or read), run again last to show the spread", flush=True)
    print("| variant | options | compile (s) | ms a call | / sdx |\n|---|---|---|---|---|", flush=True)
    baseline = None
    for name, options in [("sdx", None), *variants, ("sdx again", None)]:
        t0 = time.perf_counter()
        try:
            program = programs.denoise[1] if options is None else executables.compile(
                recipe.denoise_fns[1], params, carry, fixed, path=None, compiler_options={**recipe.options, **options},
                out_shardings=keep, donate_argnums=1)
        except jax.errors.JaxRuntimeError as e:
            print(f"| {name} | {shown(options)} | not taken: {str(e).splitlines()[0][:120]} | | |", flush=True)
            continue
        compile_s = time.perf_counter() - t0
        ms = 1e3 * statistics.median(timed_calls(program, params, prepared, args.calls)[1:])
        baseline = baseline or ms
        print(f"| {name} | {shown(options)} | {'—' if options is None else f'{compile_s:.1f}'} | {ms:.2f} | "
              f"{ms / baseline:.3f}× |", flush=True)
        del program
    return 0


def shown(options: dict | None) -> str:
    return "(the sampler's)" if options is None else " ".join(f"{k}={v}" for k, v in options.items())


if __name__ == "__main__":
    sys.exit(main())
