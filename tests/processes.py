"""The environment of the test processes: the pytest workers themselves (tests/conftest.py) and every
`python` they start.

- XLA compiles with a low LLVM optimisation level: the suite runs tiny models for a few steps, so XLA's
  CPU compile is much of its time. Level 1 (`TEST_XLA_FLAGS`, the pytest workers and what they start)
  compiles as fast as the default level 2 and runs as fast. Level 0 (`TRAINING_XLA_FLAGS`, for the
  processes that train a tiny model for a few steps) compiles a training step about 30 % faster (34 ->
  24 s for test_accumulation_equals_one_big_batch on a Sapphire Rapids VM) but runs loop-emitted code
  unoptimised: a sampler at 74x90 pixels spent 40 s of a 5-step run in reductions and softmaxes that
  take 3 s at level 1 (113 s -> 27 s for test_sd_text_to_image_takes_the_control_image_size). A worker's
  flags are fixed once its JAX starts, so the training tests that run inside a worker compile at level 1
  too (test_accumulation_equals_one_big_batch: 26 -> 39 s on an AMD EPYC VM). The whole suite on that
  VM: 18 min 2 s at level 0 everywhere, 17 min 3 s at level 1 everywhere, 16 min 23 s as set here. The
  numbers a test compares (with diffusers, between batch sizes, meshes or resumed runs) are computed
  under the same flags on both sides, or compared with tolerances float32 rounding stays far inside.
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

TEST_XLA_FLAGS = "--xla_backend_optimization_level=1"
TRAINING_XLA_FLAGS = "--xla_backend_optimization_level=0"


def child_env(*, devices: int | None = None, training: bool = False, **extra: str) -> dict[str, str]:
    """The environment of a `python` process a test starts: this one's, on the CPU, with the test XLA
    flags (`training`: those of a process that trains a tiny model for a few steps) and `devices` fake
    devices (None: one, whatever this process has), plus `extra`."""
    flags = TRAINING_XLA_FLAGS if training else TEST_XLA_FLAGS
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
    os.environ["XLA_FLAGS"] = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS) if f)
