"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest

from tests import processes

processes.configure_this_process()


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory):
    """demo(name) -> the sdx folder of demo model `name` (random weights), built once per test session, where
    `python -m sdx.sample --model NAME` finds it when $SDX_CACHE is `demo.cache`."""
    from pipelines.demo import demo_folder

    cache = tmp_path_factory.mktemp("sdx-cache")

    def demo(name: str):
        return demo_folder(name, cache / "models")

    demo.cache = cache
    return demo
