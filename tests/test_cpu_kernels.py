"""pipelines.cpu_kernels: the sampler's compile options. That its programs hold no YNNPACK fusion:
tests/test_sampler.py."""

from __future__ import annotations

import jax

from pipelines import cpu_kernels
from sdx import mesh as meshlib


def _cpu_mesh():
    return meshlib.make_mesh(devices=jax.devices("cpu")[:1])


def test_on_a_cpu_ynnpack_is_off():
    assert cpu_kernels.compiler_options(_cpu_mesh()) == {"xla_cpu_experimental_ynn_fusion_type": ""}


def test_a_choice_in_xla_flags_stands(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=individual_dot")
    assert cpu_kernels.compiler_options(_cpu_mesh()) == {}


def test_an_xla_without_the_option_gets_none(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "YNNPACK_FUSIONS", "xla_cpu_no_such_option")
    cpu_kernels._knows_ynnpack.cache_clear()
    try:
        assert cpu_kernels.compiler_options(_cpu_mesh()) == {}
    finally:
        cpu_kernels._knows_ynnpack.cache_clear()
