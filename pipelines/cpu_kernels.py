"""The XLA:CPU options the sampler's programs and training's step are compiled with: YNNPACK for matrix
products and reductions alone, and XLA's memory-optimized scheduler.

XLA:CPU (jaxlib 0.10) hands dots, convolutions, reductions and elementwise work around them to YNNPACK
fusions by default. Each fusion sets itself up on a program's first run, and its convolutions and fused
elementwise work are slower than XLA's own; with YNNPACK off, SDXL's UNet loses its fast matrix products
instead. YNNPACK for each matrix product alone (`INDIVIDUAL_DOT`) measured best for every program against
the default (2-core Sapphire Rapids VM, SD 1.5 and SDXL at 256² and 512², benchmarks/LOG.md): the
first UNet call 0.4-4.1 s shorter, later ones equal to 5 % faster, the VAE decode 4-14 % faster. YNNPACK's
reductions as well (`REDUCE`: a softmax's maximum and sum and the exponentials between them, group
norms' sums) took SD 1.5's UNet call at 512² from 9.17 to 8.56 s, its decode from 9.86 to 9.57 s, and
SDXL's decode at 256² from 2.57 to 2.50 s; SDXL's UNet call at 256² was unchanged (2-core AMD EPYC VM).
On that VM XLA's own product is the faster one alone for tall operands (from about 1,024 rows), but
handing it the products (YNNPACK for reductions alone) made SD 1.5's UNet call at 512² 6 % faster and
SDXL's 2 % slower at 512² and 11 % slower at 256², so the products stay YNNPACK's.

XLA:CPU's default scheduler orders a program for concurrency: work that depends only on the parameters
runs first. In bfloat16 that work is converting weights to the float32 copies XLA:CPU convolves with (and
multiplied with, before `sdx.products`), so all the copies are alive at once (SDXL's UNet call at 256²,
before sdx.products: 9.6 GiB of temporaries, more than its 4.8 GiB of weights). The memory-optimized
scheduler converts each weight where it is used: 0.13 GiB, and the call took 6.9 s instead of 12.3 s
(2-core AMD EPYC VM); in float32 it changes neither the time nor, much, the memory.

The choice is per compile (`compiler_options`), so programs a user builds around sdx keep XLA's default.
Training's step takes the same options (`train.step.compile_step`): SD 1.5's UNet structure at a fifth of
its width, 256², batch 4, 3.43 s a step against 3.89 with XLA's default (best of 4, one process). A user
who sets an option in `XLA_FLAGS` keeps that choice.
"""

from __future__ import annotations

import functools
import operator
import os

import jax
import numpy as np

YNNPACK_FUSIONS = "xla_cpu_experimental_ynn_fusion_type"
SCHEDULER = "xla_cpu_scheduler_type"
OPTIONS = {YNNPACK_FUSIONS: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE",
           SCHEDULER: "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
# The XLA_FLAGS names that make each choice (XLA also still reads the scheduler's older switch).
CHOSEN_BY = {YNNPACK_FUSIONS: (YNNPACK_FUSIONS,),
             SCHEDULER: (SCHEDULER, "xla_cpu_enable_concurrency_optimized_scheduler")}


def compiler_options(mesh) -> dict[str, str]:
    """The options for a program of the sampler on `mesh`: on a CPU, each of `OPTIONS` that its XLA takes
    and XLA_FLAGS does not choose; none elsewhere."""
    device = mesh.devices.flat[0]
    if device.platform != "cpu":
        return {}
    flags = os.environ.get("XLA_FLAGS", "")
    return {name: value for name, value in OPTIONS.items()
            if not any(flag in flags for flag in CHOSEN_BY.get(name, (name,))) and _takes_option(device, name, value)}


@functools.lru_cache(maxsize=None)
def _takes_option(device, name: str, value: str) -> bool:
    """Whether XLA on `device` takes `name=value` (another jaxlib may not: an unknown option or value is an
    error)."""
    try:
        jax.jit(operator.neg).lower(jax.device_put(np.float32(0), device)).compile({name: value})
    except jax.errors.JaxRuntimeError:
        return False
    return True
