"""A disk that fills up while sdx writes: one `error:` line naming the file, exit status 2, no partial file,
and what was there before left byte for byte.

In-process, the write raises ENOSPC part-way (the writer's own callback). In subprocesses, the kernel
refuses the write: the file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored) makes every write past N
bytes fail with EFBIG as a full disk fails with ENOSPC, without privileges or a tmpfs mount, and reaches
every writer alike: Python's, PIL's and tensorstore's (Orbax checkpoints). Reading is not limited.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdx import io
from sdx.errors import SdxError
from tests.processes import child_env
from train import checkpoint, shapes

REPO = Path(__file__).resolve().parent.parent
FULL = "File too large; free some space or write elsewhere"


def test_a_write_cut_off_by_enospc_leaves_the_old_file_and_no_temporary_one(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"the user's file")

    def write(f):
        f.write(b"x" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(SdxError, match=f"cannot write {target}: No space left on device; free some space"):
        io.atomic_write(target, write)
    assert target.read_bytes() == b"the user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


# `python -m MODULE ARGS` with the file-size limit set first (Python ignores SIGXFSZ from its start)
LAUNCH = ("import resource, runpy, sys; limit = int(sys.argv.pop(1)); "
          "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)); "
          "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def _limited(limit: int, args: list[str], env: dict) -> subprocess.CompletedProcess:
    """`python -m ARGS` where no file can grow past `limit` bytes."""
    return subprocess.run([sys.executable, "-c", LAUNCH, str(limit), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), proc.stderr
    return last


@pytest.fixture(scope="module")
def setting(demo_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    env = child_env(SDX_CACHE=str(root / "sdx-cache"))
    return demo_models("tiny"), root, env


def test_an_image_on_a_full_disk(setting, tmp_path):
    model, root, env = setting
    image = tmp_path / "image.png"
    image.write_bytes(b"the user's picture")
    proc = _limited(2000, ["sdx.sample", "--model", str(model), "--prompt", "a red circle", "--steps", "2", "--output",
                           str(image), "--overwrite", "--no-compilation-cache", "--cache", str(root / "cache")], env)
    assert _error_line(proc) == f"error: cannot write {image}: {FULL}"
    assert "Traceback" not in proc.stderr
    assert image.read_bytes() == b"the user's picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image.png"]


@pytest.mark.parametrize("fmt, name", [("sdx", "out"), ("diffusers", "out"), ("single-file", "out.safetensors")])
def test_a_converted_model_on_a_full_disk(setting, tmp_path, fmt, name):
    model, _, env = setting
    proc = _limited(65536, ["convert", str(model), str(tmp_path / name), "--format", fmt], env)
    line = _error_line(proc)
    assert line.startswith(f"error: cannot write {tmp_path / name}") and line.endswith(FULL), line
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_on_a_full_disk(setting, tmp_path):
    """The checkpoint's cut-off write is removed; `latest` finds nothing to resume from. Orbax and
    tensorstore print their own logs and tracebacks of the failed write around sdx's one error line (their
    background threads', not sdx's: the process exits 2 through sdx's error)."""
    model, root, env = setting
    data = root / "captions"
    if not data.exists():
        shapes.write_dataset(data, "captions", count=8, seed=0, size=32)
    out = tmp_path / "run"
    proc = _limited(200_000, ["train.text_to_image", "--pretrained_model_name_or_path", str(model), "--dataset_name",
                              str(data), "--output_dir", str(out), "--resolution", "32", "--train_batch_size", "2",
                              "--max_train_steps", "3", "--checkpointing_steps", "1", "--report_to", "none"],
                    {**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "no-cache")})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: checkpoint: cannot write {out / 'checkpoints' / '1'}: {FULL} (no complete one yet)"], \
        proc.stderr
    assert checkpoint.complete_steps(out / "checkpoints") == []
    assert list((out / "checkpoints").iterdir()) == []
