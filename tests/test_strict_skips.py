"""tests/strict_skips.py: a skipped test (or a module that skips at import, as `pytest.importorskip` of a
reference that will not import) fails the run; one marked allow_skip may skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]


def _pytest(tmp_path: Path, name: str, source: str) -> subprocess.CompletedProcess:
    (tmp_path / name).write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.strict_skips", "-q", "-p", "no:cacheprovider",
                           str(tmp_path / name)], cwd=tmp_path, env=child_env(PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)


def test_a_reference_that_does_not_import_fails_the_run(tmp_path):
    proc = _pytest(tmp_path, "test_parity.py", 'import pytest\nref = pytest.importorskip("no_such_reference")\n\n'
                                               "def test_parity():\n    assert ref\n")
    print(proc.stdout[-2000:])
    assert proc.returncode != 0 and "no_such_reference" in proc.stdout and "a skip fails the run" in proc.stdout


def test_a_skip_fails_unless_the_test_allows_it(tmp_path):
    proc = _pytest(tmp_path, "test_skips.py", "import pytest\n\n"
                                              "def test_skipped():\n    pytest.skip('no reference')\n\n"
                                              "@pytest.mark.allow_skip\n"
                                              "@pytest.mark.skipif(True, reason='needs a GPU')\n"
                                              "def test_allowed():\n    pass\n\n"
                                              "@pytest.mark.xfail(reason='known')\n"
                                              "def test_xfail():\n    assert False\n")
    print(proc.stdout[-2000:])
    assert proc.returncode == 1 and "1 failed, 1 skipped, 1 xfailed" in proc.stdout, proc.stdout
