"""The XLA:CPU kernels the sampler's programs are compiled with: YNNPACK's fusions off.

XLA:CPU (jaxlib 0.10) hands dots, convolutions and reductions to YNNPACK fusions by default. For the
sampler's programs they cost more than they give, measured on a 2-core Sapphire Rapids VM
(benchmarks/README.md, 2026-11-26): each fusion sets itself up on a program's first run (SD 1.5's UNet
call at 256²: 6.3 s the first time, 1.9 s after; 2.1 s without them), reading an executable back spends
a quarter of its time rebuilding them, and their large convolutions and products are slower (the VAE
decode 8-15 % in both models). The one program they help in steady state is SDXL's UNet at small sizes
(its attention products have few rows: 14 % at 256², 4 % at 512²; its first call is still slower).

The choice is per compile (`compiler_options`), so programs a user builds around sdx keep XLA's default,
and so does training's step. A user who sets the option in `XLA_FLAGS` keeps that choice.
"""

from __future__ import annotations

import functools
import operator
import os

import jax
import numpy as np

YNNPACK_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"  # a comma list of fusion kinds; empty: none


def compiler_options(mesh) -> dict[str, str]:
    """The options for a program of the sampler on `mesh`: YNNPACK off on a CPU whose XLA knows the
    option (unless XLA_FLAGS sets it); none elsewhere."""
    device = mesh.devices.flat[0]
    if device.platform != "cpu" or YNNPACK_FUSIONS in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {YNNPACK_FUSIONS: ""} if _knows_ynnpack(device) else {}


@functools.lru_cache(maxsize=None)
def _knows_ynnpack(device) -> bool:
    """Whether XLA on `device` takes the option (another jaxlib may not: an unknown one is an error)."""
    try:
        jax.jit(operator.neg).lower(jax.device_put(np.float32(0), device)).compile({YNNPACK_FUSIONS: ""})
    except jax.errors.JaxRuntimeError:
        return False
    return True
