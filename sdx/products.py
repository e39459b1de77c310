"""The matrix product of sdx's linear layers and of convolutions computed as one (`sdx.conv`).

On a CPU a bfloat16 product asks XLA for a float32 result and casts it back. XLA:CPU multiplies bfloat16
natively only when the result is float32; a bfloat16 result makes it convert both operands to float32
copies first (2048³, 2-core AMD EPYC VM with AVX512-BF16: 379 GFLOP/s against 176). Either way each
product accumulates in float32 and is rounded to bfloat16 once, so the values are the same to summation
order. Elsewhere, and for other dtypes (float16 gains nothing on XLA:CPU), it is `lax.dot_general`. Not
measured on a CPU without AVX512-BF16, where the native product may not be the faster one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kw):
    """`lax.dot_general`, with a bfloat16 product on a CPU computed as above."""
    if (preferred_element_type is None and lhs.dtype == rhs.dtype == jnp.bfloat16
            and jax.default_backend() == "cpu"):
        out = lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type=jnp.float32, **kw)
        return out.astype(jnp.bfloat16)
    return lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type=preferred_element_type, **kw)
