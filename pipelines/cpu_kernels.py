"""The XLA:CPU kernels the sampler's programs are compiled with: YNNPACK for matrix products alone.

XLA:CPU (jaxlib 0.10) hands dots, convolutions, reductions and elementwise work around them to YNNPACK
fusions by default. Each fusion sets itself up on a program's first run, and its convolutions and fused
work are slower than XLA's own; with YNNPACK off, SDXL's UNet loses its fast matrix products instead.
YNNPACK for each matrix product alone (`INDIVIDUAL_DOT`) measured best for every program (2-core Sapphire
Rapids VM, SD 1.5 and SDXL at 256² and 512², benchmarks/README.md): against the default, the first UNet
call 0.4-4.1 s shorter, later ones equal to 5 % faster, the VAE decode 4-14 % faster.

The choice is per compile (`compiler_options`), so programs a user builds around sdx keep XLA's default,
and so does training's step. A user who sets the option in `XLA_FLAGS` keeps that choice.
"""

from __future__ import annotations

import functools
import operator
import os

import jax
import numpy as np

YNNPACK_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"
OPTIONS = {YNNPACK_FUSIONS: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def compiler_options(mesh) -> dict[str, str]:
    """The options for a program of the sampler on `mesh`: `OPTIONS` on a CPU whose XLA takes them
    (unless XLA_FLAGS sets the option); none elsewhere."""
    device = mesh.devices.flat[0]
    if device.platform != "cpu" or YNNPACK_FUSIONS in os.environ.get("XLA_FLAGS", ""):
        return {}
    return dict(OPTIONS) if _takes_options(device) else {}


@functools.lru_cache(maxsize=None)
def _takes_options(device) -> bool:
    """Whether XLA on `device` takes `OPTIONS` (another jaxlib may not: an unknown option or value is an
    error)."""
    try:
        jax.jit(operator.neg).lower(jax.device_put(np.float32(0), device)).compile(dict(OPTIONS))
    except jax.errors.JaxRuntimeError:
        return False
    return True
