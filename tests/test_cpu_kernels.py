"""pipelines.cpu_kernels: the sampler's compile options. What they do to its programs:
tests/test_sampler.py."""

from __future__ import annotations

import jax
import pytest

from pipelines import cpu_kernels
from sdx import mesh as meshlib


def _cpu_mesh():
    return meshlib.make_mesh(devices=jax.devices("cpu")[:1])


def test_on_a_cpu_ynnpack_takes_the_matrix_products_alone():
    assert cpu_kernels.compiler_options(_cpu_mesh()) == {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def test_a_choice_in_xla_flags_stands(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=individual_dot")
    assert cpu_kernels.compiler_options(_cpu_mesh()) == {}


@pytest.mark.parametrize("options", [{"xla_cpu_no_such_option": ""},
                                     {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_NONE_SUCH"}])
def test_an_xla_without_the_option_or_its_value_gets_none(monkeypatch, options):
    monkeypatch.setattr(cpu_kernels, "OPTIONS", options)
    cpu_kernels._takes_options.cache_clear()
    try:
        assert cpu_kernels.compiler_options(_cpu_mesh()) == {}
    finally:
        cpu_kernels._takes_options.cache_clear()
