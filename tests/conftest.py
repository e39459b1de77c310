"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory):
    """demo(name) -> the sdx folder of demo model `name` (random weights), built once per test session."""
    from pipelines.demo import demo_folder

    root = tmp_path_factory.mktemp("demo-models")
    return lambda name: demo_folder(name, root)
