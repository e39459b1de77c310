"""A model's repeated block as an XLA computation of its own on a CPU, so XLA:CPU orders a short sequence
of kernels per block instead of one for the whole model.

XLA inlines every call, so a UNet or a text encoder compiles to one long sequence of kernels (thunks).
XLA:CPU's runtime orders a sequence by a graph it builds each time it compiles a program or reads one
back: every kernel tested against every earlier one for shared buffers, then a transitive reduction, so
the work grows with the square of the sequence's length. For SDXL's UNet that graph was half of reading
the compiled program back (2-core CPU, 256²: about 2 of 4 s; benchmarks/LOG.md).

`call(block, *args)` is `block(*args)` as a call XLA keeps (the frontend attribute `inlineable="false"`
on a non-inlined jit): XLA:CPU runs it as one call thunk with a sequence, and a graph, of its own. The
kernels inside are the ones XLA would have made inline: the speed is the same, and so are float32
results, bit for bit (in bfloat16 a block's output is rounded where it leaves the call, as torch rounds
it, where inlined XLA may keep float32 across the boundary). Elsewhere than on a CPU the block is called
as is: the GPU and TPU compilers get the programs they always got.

A block called this way must not change its own variables (they go in and are not returned): true of
every sdx block, whose only state is its parameters. What it records (`sdx.interventions.record`) comes out
with its output.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.experimental.xla_metadata import set_xla_metadata

from sdx import interventions


def call(block: nnx.Module, *args):
    """block(*args), on a CPU as a computation XLA does not inline."""
    if jax.default_backend() != "cpu":
        return block(*args)
    graphdef, state = nnx.split(block)
    # The attribute goes on the call that makes the outputs, not (as a `with` block would put it) on every
    # jitted function the block calls inside too.
    out, records = set_xla_metadata(_program(graphdef)(state, args), inlineable="false")
    interventions.forward(records)
    return out


@functools.cache
def _program(graphdef: nnx.GraphDef):
    """The jitted block of `graphdef` (one per kind of block, so each is traced once per input shapes),
    returning its output and what it recorded."""
    return jax.jit(lambda state, args: interventions.capture(nnx.merge(graphdef, state), *args), inline=False)
