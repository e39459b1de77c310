"""`python -m sdx.sample --prompts-file`: each line is the image its own command would make, one compile for
lines of one shape, a killed run continues where it stopped, and a bad file is refused before any work."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdx.sample import main

REPO = Path(__file__).resolve().parents[1]
LINES = 8  # enough that a run killed after its first images has more to do


def _lines() -> list[str]:
    lines = [f"a shape number {i}" for i in range(LINES)]
    lines[1] = json.dumps({"prompt": "a red circle", "seed": 7, "guidance_scale": 3.0, "negative_prompt": "blur"})
    return lines


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im)


@pytest.fixture(scope="module")
def prompts(demo_models, tmp_path_factory) -> Path:
    """The prompts file; the tiny demo model is built into `demo_models.cache`."""
    demo_models("tiny")
    file = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    file.write_text("# a comment, then an empty line\n\n" + "\n".join(_lines()) + "\n")
    return file


def _argv(prompts: Path, out: Path, cache: Path) -> list[str]:
    return ["--model", "tiny", "--prompts-file", str(prompts), "--steps", "3", "--output", str(out), "--cache", str(cache)]


@pytest.fixture(scope="module")
def reference(prompts, demo_models) -> tuple[Path, str]:
    """The images of an uninterrupted run, and what it printed."""
    out, err = prompts.parent / "out", io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(_argv(prompts, out, demo_models.cache)) == 0
    return out, err.getvalue()


def test_each_line_is_the_image_its_own_command_makes_with_one_compile(reference, demo_models, tmp_path):
    out, err = reference
    assert err.count("compiled in") == 1, err  # every line has the same shapes: one set of programs
    assert "images/s" in err
    assert sorted(p.name for p in out.iterdir()) == [f"{i:05d}.png" for i in range(LINES)]
    single = tmp_path / "single.png"
    assert main(["--model", "tiny", "--prompt", "a red circle", "--seed", "7", "--guidance-scale", "3.0",
                 "--negative-prompt", "blur", "--steps", "3", "--output", str(single), "--cache", str(demo_models.cache),
                 "--quiet"]) == 0
    np.testing.assert_array_equal(_pixels(out / "00001.png"), _pixels(single))
    with Image.open(out / "00001.png") as im:
        meta = json.loads(im.info["sdx"])
    assert (meta["prompt"], meta["seed"], meta["guidance_scale"], meta["negative_prompt"]) == ("a red circle", 7, 3.0, "blur")
    assert not np.array_equal(_pixels(out / "00000.png"), _pixels(out / "00002.png"))


def test_a_run_killed_midway_continues_where_it_stopped(prompts, reference, demo_models, tmp_path):
    """SIGKILL once a few images are written; the run started again skips them and writes the same images
    an uninterrupted run writes (no file is ever half written)."""
    reference, out = reference[0], tmp_path / "out"
    command = [sys.executable, "-m", "sdx.sample", *_argv(prompts, out, demo_models.cache)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(command + ["--quiet"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(list(out.glob("*.png"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    first = len(list(out.glob("*.png")))
    assert 2 <= first < LINES, f"{first} images before the kill: the run was not cut midway"

    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    skipped = int(again.stderr.split(" of ")[0].split()[-1])
    assert skipped >= first and f"{skipped} of {LINES} prompts are already written" in again.stderr
    assert "images/s" in again.stderr  # the last line, printed just before the command leaves without teardown
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [f"{i:05d}.png" for i in range(LINES)]
    for i in range(LINES):
        np.testing.assert_array_equal(_pixels(out / f"{i:05d}.png"), _pixels(reference / f"{i:05d}.png"))
    nothing = subprocess.run(command + ["--quiet"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert nothing.returncode == 0 and "model" not in nothing.stderr  # all written: no model is even loaded


@pytest.mark.parametrize(
    "content, extra, expected",
    [
        ('{"prompt": 3}', [], 'line 1: the JSON object needs a "prompt" string'),
        ('{"prompt": "x", "sed": 1}', [], "line 1: unknown setting sed"),
        ('x\n{"prompt": "x", "steps": "4"}', [], 'line 2: "steps" must be an int'),
        ('{"prompt": "x", "steps": true}', [], '"steps" must be an int'),
        ('{"prompt": "x", "guidance_scale": "high"}', [], '"guidance_scale" must be a float'),
        ('{"prompt": "x", "steps": 0}', [], "line 1: --steps 0 must be a positive integer"),
        ('{"prompt": "x", "strength": 2, "image": "PICTURE"}', [], "line 1: --strength 2.0 must be in [0, 1]"),
        ('{"prompt": "x", "image": "/nonexistent/in.png"}', [], "line 1: --image /nonexistent/in.png: cannot read"),
        ('{"prompt": "x"', [], "must be one JSON object"),
        ("# only a comment\n\n", [], "no prompts in it"),
        (b"\xff\xfe bad bytes", [], "cannot read it as UTF-8"),
        (None, [], "cannot read it"),
        ("x", ["--prompt", "y"], "--prompt and --prompts-file do not go together"),
        ("x", ["--grid", "GRID"], "--grid and --prompts-file do not go together"),
        ("x", ["--output", "OUT/one.png"], "it is the folder the images go to"),
        ("x", ["--output", "/proc/sdx-out"], "cannot be made in /proc: it is on proc"),
        ("x", ["--output", "FOREIGN"], "00000.png exists and is not the image asked for"),
    ],
)
def test_bad_prompts_files_are_refused_before_any_work(tmp_path, capsys, monkeypatch, content, extra, expected):
    import pipelines.cli

    monkeypatch.setattr(pipelines.cli, "resolve_model", lambda *a, **k: pytest.fail("a model was resolved"))
    Image.new("RGB", (64, 64)).save(tmp_path / "picture.png")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "00000.png").write_bytes(b"the user's own file")
    names = {"PICTURE": str(tmp_path / "picture.png"), "GRID": str(tmp_path / "grid.png"), "OUT": str(tmp_path / "out"),
             "FOREIGN": str(foreign)}
    file = tmp_path / "prompts.txt"
    if isinstance(content, str):
        file.write_text(_replace(content, names))
    elif content is not None:
        file.write_bytes(content)
    extra = [_replace(a, names) for a in extra]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    argv = ["--prompts-file", str(file), "--output", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), *extra]
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert (foreign / "00000.png").read_bytes() == b"the user's own file"


def _replace(text: str, names: dict[str, str]) -> str:
    for name, value in names.items():
        text = text.replace(name, value)
    return text
