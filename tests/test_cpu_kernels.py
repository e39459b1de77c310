"""pipelines.cpu_kernels: the sampler's compile options. What they do to its programs:
tests/test_sampler.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pipelines import cpu_kernels
from sdx import mesh as meshlib


def _cpu_mesh():
    return meshlib.make_mesh(devices=jax.devices("cpu")[:1])


def test_on_a_cpu_ynnpack_takes_the_matrix_products_and_reductions_and_the_schedule_saves_memory():
    assert cpu_kernels.compiler_options(_cpu_mesh()) == {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_REDUCE",
        "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


@pytest.mark.parametrize("flag, left", [
    ("--xla_cpu_experimental_ynn_fusion_type=individual_dot", "xla_cpu_scheduler_type"),
    ("--xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_DEFAULT", "xla_cpu_experimental_ynn_fusion_type"),
    ("--xla_cpu_enable_concurrency_optimized_scheduler=true", "xla_cpu_experimental_ynn_fusion_type"),
])
def test_a_choice_in_xla_flags_stands(monkeypatch, flag, left):
    monkeypatch.setenv("XLA_FLAGS", flag)
    assert list(cpu_kernels.compiler_options(_cpu_mesh())) == [left]


@pytest.mark.parametrize("options, kept", [
    ({"xla_cpu_no_such_option": ""}, {}),
    ({"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_NONE_SUCH",
      "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
     {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}),
])
def test_an_xla_without_an_option_or_its_value_goes_without_it(monkeypatch, options, kept):
    monkeypatch.setattr(cpu_kernels, "OPTIONS", options)
    cpu_kernels._takes_option.cache_clear()
    try:
        assert cpu_kernels.compiler_options(_cpu_mesh()) == kept
    finally:
        cpu_kernels._takes_option.cache_clear()


def test_bfloat16_weights_become_float32_copies_one_at_a_time():
    """XLA:CPU multiplies bfloat16 in float32 copies of the weights. With the sampler's options a chain of twelve
    products holds about one copy at a time; XLA's default schedule converts them all up front."""
    options = cpu_kernels.compiler_options(_cpu_mesh())
    if "xla_cpu_scheduler_type" not in options:
        pytest.skip("this jaxlib's XLA:CPU has no memory-optimized scheduler option")
    weights = [jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)] * 12
    x = jax.ShapeDtypeStruct((8, 512), jnp.bfloat16)

    def chain(weights, x):
        for w in weights:
            x = jax.nn.silu(x @ w)
        return x

    lowered = jax.jit(chain).lower(weights, x)
    copy = 512 * 512 * 4
    assert lowered.compile(options).memory_analysis().temp_size_in_bytes < 2 * copy
    assert lowered.compile().memory_analysis().temp_size_in_bytes >= 12 * copy
