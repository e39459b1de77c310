"""The project's shape, checked: the import layers (import-linter) and the declared dependencies (deptry).

sdx (models, schedulers, weights, mesh) is the core and imports nothing above it; convert/ may use
sdx; pipelines/ may use both; train/ and serve/ may use all three, and not each other (pyproject's
[tool.importlinter]). Every
third-party import in the packages is a declared dependency, and the test extra's (torch,
diffusers, ...) are imported by tests/ and benchmarks/ only (pyproject's [tool.deptry]). Each check
is also run once on a planted violation, so a configuration that checks nothing fails here.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sdx", "convert", "pipelines", "train", "serve")
HIGHER = {"sdx": ("convert", "pipelines", "train", "serve")}
# The files in sdx allowed to reach a higher layer at run time (see their docstrings): the documented commands.
RUNTIME_HAND_OVER = {"sdx/sample.py": "pipelines.cli", "sdx/serve.py": "serve.cli"}


def _tool(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return str(path)


def _run(*cmd: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def _copy_packages(dest: Path) -> None:
    """The packages' Python files and pyproject.toml, for running a tool on a planted violation."""
    shutil.copy(REPO / "pyproject.toml", dest / "pyproject.toml")
    for pkg in PACKAGES:
        for src in (REPO / pkg).rglob("*.py"):
            target = dest / src.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, target)


# --------------------------------------------------------------------------------------------------
# Layers


def test_layers_are_kept():
    r = _run(_tool("lint-imports"), "--no-cache")
    assert r.returncode == 0, r.stdout + r.stderr


def test_an_upward_import_breaks_the_layers(tmp_path):
    _copy_packages(tmp_path)
    (tmp_path / "sdx" / "upward.py").write_text("def f():\n    from pipelines import cli\n    return cli\n")
    r = _run(_tool("lint-imports"), "--no-cache", cwd=tmp_path)
    assert r.returncode != 0 and "sdx.upward -> pipelines.cli" in r.stdout, r.stdout + r.stderr


def _runtime_imports(path: Path) -> list[str]:
    """Module names given as literals to importlib.import_module, runpy.run_module/run_path or __import__."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        arg = node.args[0]
        if name in ("import_module", "run_module", "run_path", "__import__") and isinstance(arg, ast.Constant):
            found.append(str(arg.value))
    return found


def test_only_the_command_shims_reach_up_at_run_time():
    """Import statements are import-linter's; a run-time import names its module in a string. In sdx,
    only sdx/sample.py and sdx/serve.py (the documented `python -m sdx.sample` and `python -m sdx.serve`) may
    name a higher layer so."""
    reaching = {}
    for path in sorted((REPO / "sdx").rglob("*.py")):
        up = [m for m in _runtime_imports(path) if m.split(".")[0] in HIGHER["sdx"] or "/" in m]
        if up:
            reaching[path.relative_to(REPO).as_posix()] = up[0] if len(up) == 1 else up
    assert reaching == RUNTIME_HAND_OVER


@pytest.mark.parametrize("command, package", [("sample", "pipelines"), ("serve", "serve")])
def test_the_command_shims_run_their_commands(command, package):
    r = _run(sys.executable, "-m", f"sdx.{command}", "--help")
    assert r.returncode == 0 and r.stdout.startswith(f"usage: python -m sdx.{command}"), r.stdout + r.stderr
    r = _run(sys.executable, "-c", f"import sys, sdx.{command}; assert '{package}' not in sys.modules")
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------------------------------
# Dependencies


def _deptry(report: Path, *args: str, cwd: Path = REPO) -> tuple[subprocess.CompletedProcess, list[dict]]:
    r = _run(_tool("deptry"), ".", "--no-ansi", "--json-output", str(report), *args, cwd=cwd)
    return r, json.loads(report.read_text()) if report.exists() else []


def _issues(issues: list[dict]) -> list[str]:
    return [f"{i['location']['file']}: {i['error']['code']} {i['error']['message']}" for i in issues]


def test_every_import_in_the_packages_is_declared(tmp_path):
    r, issues = _deptry(tmp_path / "report.json")
    assert r.returncode == 0 and not issues, _issues(issues) or r.stdout + r.stderr


def test_every_import_in_tests_and_benchmarks_is_declared(tmp_path):
    """Here the test extra counts as a dependency like any other; nothing has to use every one."""
    r, issues = _deptry(tmp_path / "report.json", "--exclude", r"\.venv|\.git|build|" + "|".join(PACKAGES),
                        "--optional-dependencies-dev-groups", "", "--ignore", "DEP002")
    assert r.returncode == 0 and not issues, _issues(issues) or r.stdout + r.stderr


def test_an_undeclared_or_test_only_import_is_caught(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    _copy_packages(project)
    (project / "convert" / "planted.py").write_text("import diffusers\nimport yaml\nimport surely_not_a_package\n")
    r, issues = _deptry(tmp_path / "report.json", cwd=project)
    found = {(i["module"], i["error"]["code"]) for i in issues if i["location"]["file"].endswith("planted.py")}
    # a test-only package; pyyaml, installed as huggingface_hub's dependency (DEP003) or not at all; nothing
    assert {("diffusers", "DEP004"), ("surely_not_a_package", "DEP001")} <= found, _issues(issues)
    assert found & {("yaml", "DEP003"), ("yaml", "DEP001")}, _issues(issues)
    assert r.returncode != 0
