"""sdx.products: on a CPU a bfloat16 product is multiplied natively by XLA (its operands are not converted
to float32 copies) and equals the float32 product rounded once; every other product is lax.dot_general's.
The layers that use it: linear layers, and convolutions computed as one matrix product."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from sdx import products
from sdx.layers import Compute, conv, linear

pytestmark = [pytest.mark.skipif(jax.default_backend() != "cpu", reason="the bfloat16 path is XLA:CPU's"),
              pytest.mark.allow_skip]

MATMUL = (((1,), (0,)), ((), ()))


def _operands(dtype, m=48, k=96, n=40):
    r = np.random.default_rng(0)
    return (jnp.asarray(r.standard_normal((m, k)), dtype), jnp.asarray(r.standard_normal((k, n)), dtype))


def _float32_copies(fn, *args) -> set[tuple[int, ...]]:
    """The shapes XLA's optimized program of `fn(*args)` converts to float32."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return {tuple(int(d) for d in dims.split(",")) for dims in re.findall(r"= f32\[([\d,]+)\]\S* convert\(", hlo)}


def test_bfloat16_is_multiplied_without_float32_copies_and_rounded_once():
    a, b = _operands(jnp.bfloat16)
    out = products.dot_general(a, b, MATMUL)
    assert out.dtype == jnp.bfloat16
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    np.testing.assert_allclose(np.asarray(out, np.float64), exact, rtol=2**-8, atol=1e-6)
    assert _float32_copies(lambda a, b: products.dot_general(a, b, MATMUL), a, b) == set()
    assert _float32_copies(lambda a, b: lax.dot_general(a, b, MATMUL), a, b) == {a.shape, b.shape}  # what it avoids


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_other_dtypes_are_lax_dot_general(dtype):
    a, b = _operands(dtype)
    np.testing.assert_array_equal(products.dot_general(a, b, MATMUL), lax.dot_general(a, b, MATMUL))
    wide = products.dot_general(a, b, MATMUL, preferred_element_type=jnp.float32)
    assert wide.dtype == jnp.float32


def test_bfloat16_layers_multiply_without_float32_copies_of_their_operands():
    """(XLA:CPU still computes bfloat16 elementwise work, the bias's addition and the patches' padding, in
    float32: those converts are not the product's operands.)"""
    cp = Compute(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, conv="matmul")
    dense, kernel = linear(cp, 64, 32, rngs=nnx.Rngs(0)), conv(cp, 16, 8, 3, rngs=nnx.Rngs(0))
    call = lambda graphdef, state, x: nnx.merge(graphdef, state)(x)
    copies = _float32_copies(call, *nnx.split(dense), jnp.ones((4, 64), jnp.bfloat16))
    assert copies.isdisjoint({(4, 64), (64, 32)})
    copies = _float32_copies(call, *nnx.split(kernel), jnp.ones((1, 6, 6, 16), jnp.bfloat16))
    assert copies.isdisjoint({(36, 144), (144, 8)})  # the patches (B*Ho*Wo, 3*3*C), the kernel (3*3*C, O)
