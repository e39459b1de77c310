"""The environment of the test processes: the pytest workers themselves (tests/conftest.py) and every
`python` they start.

- XLA compiles with LLVM's optimisation level 0 (`TEST_XLA_FLAGS`). The suite runs tiny models for a
  few steps, so XLA's CPU compile dominates it: level 0 takes about 30 % off a training step's
  compile (34 -> 24 s for test_accumulation_equals_one_big_batch) and leaves run time on these models as
  it was. The numbers a test compares (with diffusers, between batch sizes, meshes or resumed runs) are
  computed under the same flags on both sides, or compared with tolerances float32 rounding stays far
  inside.
- Each pytest-xdist worker runs on its own share of the CPUs (`pin_worker`), and so do the processes it
  starts: two workers that each spread XLA's and torch's thread pools over every core would make each
  other's threads wait (torch's OpenMP barriers spin: with both cores busy elsewhere, a test's diffusers
  pipeline call took 13 s on torch's two threads and 1.4 s on one).
"""

from __future__ import annotations

import os

TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process, with `devices` fake CPU devices (None: one)."""
    flags = TEST_XLA_FLAGS
    if devices is not None:
        flags += f" --xla_force_host_platform_device_count={devices}"
    return flags


def child_env(*, devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a `python` process a test starts: this one's, on the CPU, with the test XLA
    flags and `devices` fake devices (None: one, whatever this process has), plus `extra`."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", **extra, "XLA_FLAGS": xla_flags(devices)}


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
