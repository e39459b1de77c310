"""The environment of the test processes: the pytest workers themselves (tests/conftest.py) and every
`python` they start.

- XLA compiles for speed of compiling (`TEST_XLA_FLAGS`, the pytest workers and every process they start): LLVM
  optimisation level 0, XLA:CPU's older fusion emitters instead of its MLIR ones, and no parallel code
  generation. The suite runs tiny models for a few steps, so XLA's CPU compile is most of its time. Level 0
  alone compiles a tiny training step about a quarter faster than level 1 (which compiles and runs like the
  default level 2) but runs the MLIR emitters' loops unoptimised: a sampler at 74x90 pixels spent 40 s of a
  5-step run in reductions and softmaxes that take 3 s at level 1. With the older emitters, level 0 compiles
  faster again and runs nearly as fast as level 1 (2-core AMD EPYC VM, one process per core as the workers run:
  test_train_mesh.py's training step, compile and 2 steps, 37.5 s at level 1, 27.7 at level 0, 18.7 at level 0
  with the older emitters; a tiny_xl sampler call at 160², 5 steps, 6.2 s at level 1 and 8.3 s with these flags;
  test_remat_gives_same_output_and_gradient 30.5 -> 12.5 s, test_accumulation_equals_one_big_batch 45.0 -> 25.0
  s, test_sd_text_to_image_takes_the_control_image_size 35.4 -> 20.4-27.8 s, seven of the slowest tests 279 ->
  198-209 s; the whole suite: see docs/testing.md). And XLA's code generation is not split into parts for a
  thread pool (`--xla_cpu_parallel_codegen_split_count=1`: a worker's one core runs them one by one anyway): a
  tiny UNet's loss and gradient compiled in 1.7-1.8 s against 2.1-2.3 s, and test_train_step.py with
  test_pipelines.py took 204 / 238 s against 217 / 249 s (two runs side by side, each pinned to one core, the
  cores swapped between them; benchmarks/LOG.md). The flags are checked once per test run in a fresh `python`
  (`xla_flags`): an XLA that no longer knows one aborts at start-up, so the suite then runs without the flags it
  refuses. The numbers a test compares (with diffusers, between batch sizes, meshes or resumed runs) are
  computed under the same flags on both sides, or compared with tolerances float32 rounding stays far inside.
- JAX's persistent compilation cache is on in every test process, in one folder per test run
  (tests/conftest.py's `shared_compilation_cache`): a program one test or process compiled, another reads
  back (in the workers JAX's cache alone, so every program is still traced). The workers' time in a full
  suite on a 2-core AMD EPYC VM: 2312 s without it (19 min 47 s wall), 2179 s with it (18 min 39 s; 107
  files, 56 MB), 2176 s keeping programs of any compile time (18 min 37 s); with sdx's own executables on
  in the workers too, 2098 s (17 min 54 s), but their keys do not see what a test patches while a program
  is traced.
- Each pytest-xdist worker runs on its own share of the CPUs (`pin_worker`), and so do the processes it
  starts: two workers that each spread XLA's and torch's thread pools over every core would make each
  other's threads wait (torch's OpenMP barriers spin: with both cores busy elsewhere, a test's diffusers
  pipeline call took 13 s on torch's two threads and 1.4 s on one).
"""

from __future__ import annotations

import os
import subprocess
import sys

TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
                  "--xla_cpu_parallel_codegen_split_count=1")
_CHECKED = "SDX_TEST_XLA_FLAGS"  # the flags this XLA takes, once found, for every process of the test run


def xla_flags() -> str:
    """Those of `TEST_XLA_FLAGS` that this JAX's XLA takes (each tried in a fresh `python` once per test run,
    since XLA aborts on a flag it does not know)."""
    if _CHECKED not in os.environ:
        probe = "import jax; jax.devices()"
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        taken = [flag for flag in TEST_XLA_FLAGS
                 if subprocess.run([sys.executable, "-c", probe], env={**env, "XLA_FLAGS": flag},
                                   capture_output=True).returncode == 0]
        os.environ[_CHECKED] = " ".join(taken)
    return os.environ[_CHECKED]


def child_env(*, devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a `python` process a test starts: this one's, on the CPU, with the test XLA
    flags and `devices` fake devices (None: one, whatever this process has), plus `extra`."""
    flags = xla_flags()
    if devices is not None:
        flags += f" --xla_force_host_platform_device_count={devices}"
    return {**os.environ, "JAX_PLATFORMS": "cpu", **extra, "XLA_FLAGS": flags}


def share_compilation_cache(folder, min_compile_secs: float) -> None:
    """JAX's persistent compilation cache in `folder`, for programs that took `min_compile_secs` or more to
    compile, in every process this one starts from now on (unless its environment names another folder)."""
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(folder)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(min_compile_secs)


def pin_worker() -> None:
    """Give this pytest-xdist worker (and what it starts) its own CPUs: worker i of n takes every n-th
    CPU from the i-th, with thread pools of that size. Nothing outside a worker, or with more workers than
    CPUs."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    cpus = sorted(os.sched_getaffinity(0))
    if worker is None or not 0 < count <= len(cpus):
        return
    mine = cpus[int(worker.removeprefix("gw")) % count::count]
    os.sched_setaffinity(0, mine)
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = str(len(mine))


def configure_this_process() -> None:
    """Called once by tests/conftest.py, before JAX or torch start their thread pools."""
    pin_worker()
    os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), xla_flags()) if f)
