"""An entry point run by a Python that lacks what it needs says in one line what is missing, which Python ran and
what to do (exit status 2, no traceback; `sdx.dependencies`): every command run by a Python without sdx's
dependencies at all (`-S`: no site-packages), with and without a `.venv` beside the repository that has them; each
`python -m train.X` without each package of the `train` extra, `python -m sdx.serve` without each of the `serve`
extra; and `python -m convert` and `python -m sdx.sample`
reading a pickled checkpoint without torch (the `ckpt` extra). A package is made unimportable in the child by None
in sys.modules, set by a sitecustomize on its PYTHONPATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sdx import dependencies
from tests.processes import child_env

REPO = Path(__file__).resolve().parents[1]
COMMANDS = sorted(p.stem for p in (REPO / "train").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())


def _run_without(tmp_path: Path, module: str, argv: list[str]) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    path = os.pathsep.join(filter(None, (str(site), os.environ.get("PYTHONPATH"))))
    return subprocess.run([sys.executable, *argv], cwd=tmp_path, env=child_env(PYTHONPATH=path), capture_output=True,
                          text=True, timeout=300)


def _one_error_line(proc: subprocess.CompletedProcess, *words: str) -> None:
    print(proc.stderr)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr and all(w in proc.stderr for w in words), proc.stderr


def test_every_trainer_is_covered():
    assert len(COMMANDS) >= 12 and {"pix2pix", "text_to_image", "shapes", "vae"} <= set(COMMANDS)


def test_the_lists_of_dependencies_are_pyprojects():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = lambda specs: sorted(spec.split(">")[0].split("=")[0].split("<")[0].split("[")[0] for spec in specs)
    assert sorted(dependencies.REQUIRED.values()) == names(project["dependencies"])
    for extra, modules in dependencies.EXTRAS.items():
        assert sorted(modules.values()) == names(project["optional-dependencies"][extra])


@pytest.mark.parametrize("command", COMMANDS)
def test_a_trainer_without_a_package_of_the_train_extra_names_the_extra(tmp_path, command):
    extra = dependencies.EXTRAS["train"]
    module, distribution = list(extra.items())[COMMANDS.index(command) % len(extra)]  # each one in turn
    proc = _run_without(tmp_path, module, ["-m", f"train.{command}", "--help"])
    _one_error_line(proc, f"python -m train.{command}: ", f"the `train` extra ({distribution})", "make venv-train",
                    "[train]'")


def _checkout(tmp_path: Path, venv: bool) -> Path:
    """A copy of the repository's packages (their Python files), with a .venv that has every dependency and extra
    installed (their distributions' metadata) when `venv`."""
    repo = tmp_path / "repo"
    for pkg in ("sdx", "convert", "pipelines", "train"):
        shutil.copytree(REPO / pkg, repo / pkg, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copy(REPO / "Makefile", repo)
    if venv:
        site = repo / ".venv" / "lib" / "python3.11" / "site-packages"
        for name in [*dependencies.REQUIRED.values(), *(d for e in dependencies.EXTRAS.values() for d in e.values())]:
            (site / f"{name.replace('-', '_')}-1.0.dist-info").mkdir(parents=True)
    return repo


def _bare_python(repo: Path, command: str) -> subprocess.CompletedProcess:
    """`python -S -m COMMAND --help` in `repo`: without site-packages, this Python has none of sdx's dependencies
    (as a machine's bare python3)."""
    return subprocess.run([sys.executable, "-S", "-m", command, "--help"], cwd=repo, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=60)


ENTRY_POINTS = ["sdx.sample", "convert", "pipelines.cli", "convert.default_models", "train.shapes",
                "train.text_to_image_lora"]


@pytest.mark.parametrize("venv", [False, True], ids=["no-venv", "venv-has-them"])
@pytest.mark.parametrize("command", ENTRY_POINTS)
def test_a_command_run_by_a_python_without_the_dependencies_says_what_to_do(tmp_path, command, venv):
    proc = _bare_python(_checkout(tmp_path, venv), command)
    trainer = command.startswith("train.")
    _one_error_line(proc, f"python -m {command}: {sys.executable} lacks sdx's dependencies (jax, flax, ", "pillow",
                    *(["the `train` extra (orbax-checkpoint"] if trainer else []))
    if venv:
        assert "the repository's .venv has them: use .venv/bin/python, or `source .venv/bin/activate`" in proc.stderr
    else:
        assert f"run `make venv{'-train' if trainer else ''}` here" in proc.stderr, proc.stderr


def test_an_installed_package_without_its_dependencies_says_what_to_install(tmp_path):
    repo = _checkout(tmp_path, venv=False)
    (repo / "Makefile").unlink()  # sdx installed somewhere, not a checkout
    proc = _bare_python(repo, "sdx.sample")
    _one_error_line(proc, "lacks sdx's dependencies", "; install them into it: pip install jax flax ")


def test_a_trainer_told_to_use_the_venv_that_has_the_extra(tmp_path):
    """A Python with sdx's dependencies but not the `train` extra, beside a .venv that has it: use that one, not
    `make venv-train`."""
    repo = _checkout(tmp_path, venv=True)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['grain'] = None\n")
    proc = subprocess.run([sys.executable, "-m", "train.shapes", "--help"], cwd=repo, env=child_env(PYTHONPATH=str(site)),
                          capture_output=True, text=True, timeout=120)
    _one_error_line(proc, "python -m train.shapes: ", "lacks the `train` extra (grain)", "use .venv/bin/python")
    assert "make venv" not in proc.stderr and "sdx's dependencies" not in proc.stderr


@pytest.mark.parametrize("module", sorted(dependencies.EXTRAS["serve"]))
def test_the_server_without_a_package_of_the_serve_extra_names_the_extra(tmp_path, module):
    proc = _run_without(tmp_path, module, ["-m", "sdx.serve", "--help"])
    _one_error_line(proc, "python -m sdx.serve: ", f"the `serve` extra ({dependencies.EXTRAS['serve'][module]})",
                    "make venv-serve", "[serve]'")


@pytest.fixture(scope="module")
def pickled(tmp_path_factory) -> Path:
    import torch

    path = tmp_path_factory.mktemp("ckpt") / "model.ckpt"
    torch.save({"state_dict": {"model.diffusion_model.conv_in.weight": torch.zeros(4, 4, 3, 3)}}, path)
    return path


@pytest.mark.parametrize("argv", [["-m", "convert", "{ckpt}", "out"],
                                  ["-m", "sdx.sample", "--model", "{ckpt}", "--prompt", "x", "--quiet"]],
                         ids=["convert", "sample"])
def test_a_pickled_checkpoint_without_torch_names_the_ckpt_extra(tmp_path, pickled, argv):
    proc = _run_without(tmp_path, "torch", [a.format(ckpt=pickled) for a in argv])
    _one_error_line(proc, "needs PyTorch", "sdx[ckpt]")
