"""A skipped test fails the run, unless it is marked `allow_skip` (it needs hardware or a platform this machine
may lack: the cudnn attention tests off an NVIDIA GPU). The parity tests' references (torch, diffusers,
transformers, peft, lycoris) are test extras that `make test` installs, so a test that skips because one will not
import (a broken install, an import clash) would otherwise leave the run green with the check not done.

tests/conftest.py takes these hooks; `pytest -p tests.strict_skips` applies them to other test files."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_skip: the test may skip: it needs hardware or a platform this machine "
                                       "may lack")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("allow_skip") is None:
        _failed(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped:  # a module-level skip: `pytest.importorskip` of a reference that will not import
        _failed(report)


def _failed(report) -> None:
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"skipped ({reason}), and a skip fails the run: install the test extras (make test), or mark "
                       "the test allow_skip if it needs what this machine lacks")
