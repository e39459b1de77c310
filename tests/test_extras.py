"""An entry point that lacks an optional dependency says in one line which extra to install (exit status 2, no
traceback): each `python -m train.X` without each package of the `train` extra, `python -m sdx.serve` without each
of the `serve` extra, and `python -m convert` and `python -m sdx.sample` reading a pickled checkpoint without torch
(the `ckpt` extra). The package is made
unimportable in the child (None in sys.modules, set by a sitecustomize on its PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import serve
import train
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


@pytest.mark.parametrize("command", COMMANDS)
def test_a_trainer_without_a_package_of_the_train_extra_names_the_extra(tmp_path, command):
    module, distribution = list(train.EXTRA.items())[COMMANDS.index(command) % len(train.EXTRA)]  # each one in turn
    proc = _run_without(tmp_path, module, ["-m", f"train.{command}", "--help"])
    _one_error_line(proc, f"{distribution} is not installed", "make venv-train", "'.[train]'")


@pytest.mark.parametrize("module", sorted(serve.EXTRA))
def test_the_server_without_a_package_of_the_serve_extra_names_the_extra(tmp_path, module):
    proc = _run_without(tmp_path, module, ["-m", "sdx.serve", "--help"])
    _one_error_line(proc, f"{serve.EXTRA[module]} is not installed", "'.[serve]'")


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
