"""`python -m train.X` as a user runs it, in subprocesses: diffusers' documented InstructPix2Pix command
line runs unchanged (small numbers, a local tiny model and dataset), and SIGTERM through the real loop
writes a checkpoint, exits 0 with one line saying how to resume, and the resumed run ends with the
weights of an uninterrupted one, byte for byte; so does one resumed after a SIGKILL at a random moment.
Bad files and folders are refused before a model loads, with nothing written.

The subprocesses share a JAX persistent compilation cache (a temporary folder, every program cached), so
only the first run of each program compiles it.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import child_env
from train import checkpoint, shapes

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world(tmp_path_factory, demo_models):
    root = tmp_path_factory.mktemp("cli")
    model = demo_models("tiny")  # SD 1.x-like: pix2pix widens its conv_in
    shapes.write_dataset(root / "edits", "edits", count=8, seed=0, size=32)
    shapes.write_dataset(root / "captions", "captions", count=8, seed=0, size=32)
    env = child_env(JAX_COMPILATION_CACHE_DIR=str(root / "jax"),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", SDX_CACHE=str(root / "sdx-cache"))
    return root, model, env


def _run(args, env, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600, **kw)


# diffusers' examples/instruct_pix2pix/README.md, "accelerate launch --mixed_precision="fp16"
# train_instruct_pix2pix.py" swapped for "python -m train.pix2pix", every flag as written there but
# for smaller numbers (resolution, batch, steps), local paths for $MODEL_NAME and $DATASET_ID, and no
# --push_to_hub (an upload: an error in sdx, see tests/test_train_config.py).
DIFFUSERS_COMMAND = """
--pretrained_model_name_or_path={model}
--dataset_name={data}
--enable_xformers_memory_efficient_attention
--resolution=32 --random_flip
--train_batch_size=1 --gradient_accumulation_steps=2 --gradient_checkpointing
--max_train_steps=3
--checkpointing_steps=1 --checkpoints_total_limit=1
--learning_rate=5e-05 --max_grad_norm=1 --lr_warmup_steps=0
--conditioning_dropout_prob=0.05
--mixed_precision=fp16
--seed=42
--report_to=tensorboard
--output_dir={out}
"""


def test_diffusers_pix2pix_command_line_runs_unchanged(world):
    root, model, env = world
    out = root / "ip2p"
    argv = DIFFUSERS_COMMAND.format(model=model, data=root / "edits", out=out).split()
    proc = _run(["train.pix2pix", *argv], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    notes = [l for l in proc.stderr.splitlines() if l.startswith("note: ")]
    assert len(notes) == 2 and "xformers" in notes[0] and "fp16 runs as bf16" in notes[1], notes
    spec = json.loads((out / "sdx.json").read_text())
    assert spec["pipeline_class"] == "StableDiffusionInstructPix2PixPipeline"
    assert spec["components"]["unet"]["config"]["in_channels"] == 8  # conv_in widened
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2, 3]
    assert checkpoint.complete_steps(out / "checkpoints") == [3]  # --checkpoints_total_limit=1
    assert any((out / "logs").rglob("events.out.tfevents.*"))  # --report_to=tensorboard


def _t2i(model, data, out, steps: int, *extra) -> list[str]:
    return ["train.text_to_image", "--pretrained_model_name_or_path", str(model), "--dataset_name", str(data),
            "--output_dir", str(out), "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", str(steps),
            "--checkpointing_steps", "1000", "--lr_warmup_steps", "0", "--use_ema", "--ema_decay", "0.9",
            "--report_to", "none", *extra]


STEPS = 12


@pytest.fixture(scope="module")
def straight(world) -> Path:
    """The uninterrupted run the stopped and killed ones must end equal to."""
    root, model, env = world
    proc = _run(_t2i(model, root / "captions", root / "straight", STEPS), env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root / "straight"


def test_sigterm_checkpoints_exits_0_and_resumes_to_the_same_weights(world, straight):
    root, model, env = world
    stopped = root / "stopped"

    # the same run, but long (a constant learning rate: --max_train_steps changes nothing else), stopped by
    # SIGTERM as soon as its first step is logged
    child = subprocess.Popen([sys.executable, "-m", *_t2i(model, root / "captions", stopped, 1000)], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = stopped / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "no step logged in 300 s"
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=300)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, out + err
    resume_lines = [l for l in err.splitlines() if "--resume_from_checkpoint" in l]
    assert len(resume_lines) == 1, err
    match = re.fullmatch(r"stopped at step (\d+); continue with --resume_from_checkpoint latest", resume_lines[0])
    assert match, resume_lines
    step = int(match.group(1))
    assert 1 <= step < STEPS, f"stopped at step {step}: too late to test a resume to {STEPS}"
    assert "SIGTERM received" in err
    assert checkpoint.complete_steps(stopped / "checkpoints") == [step]
    assert len((stopped / "metrics.jsonl").read_text().splitlines()) == step
    assert not (stopped / "unet.safetensors").exists()  # a stopped run exports nothing

    proc = _run(_t2i(model, root / "captions", stopped, STEPS, "--resume_from_checkpoint", "latest"), env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"resumed from step {step}" in proc.stdout + proc.stderr
    assert (stopped / "unet.safetensors").read_bytes() == (straight / "unet.safetensors").read_bytes()
    steps = [json.loads(l)["step"] for l in (stopped / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))


def test_model_names_resolve_as_the_sampler_resolves_them(world, demo_models, monkeypatch):
    """--pretrained_model_name_or_path tiny: the demo model in the sdx cache, as `--model tiny`."""
    from train import config, models

    monkeypatch.setenv("SDX_CACHE", str(demo_models.cache))
    cfg = config.parse("pix2pix", ["--pretrained_model_name_or_path", "tiny", "--dataset_name", "d"])
    assert models.resolve_folder(cfg, log=lambda _m: None) == demo_models("tiny")


KILL_SEED = 0  # fixed, so that a failure replays its draw (kill 0.152 s after step 7; what runs then still varies)


def test_kill_9_at_a_random_moment_loses_only_uncheckpointed_steps(world, straight):
    """SIGKILL while a step or a checkpoint write is under way (a checkpoint every step, the kill after a
    number of logged steps plus a delay, both drawn from `KILL_SEED`): `latest` is a complete checkpoint no
    older than the last two logged steps, and the resumed run ends with the uninterrupted run's weights."""
    root, model, env = world
    killed = root / "killed"
    rng = random.Random(KILL_SEED)
    after, delay = rng.randint(1, STEPS - 4), rng.uniform(0.0, 0.2)
    print(f"random seed {KILL_SEED}: the kill {delay:.3f} s after step {after} is logged")
    child = subprocess.Popen([sys.executable, "-m", *_t2i(model, root / "captions", killed, 1000, "--checkpointing_steps",
                                                       "1")], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        metrics = killed / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after):
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, f"{after} steps not logged in 300 s"
            time.sleep(0.005)
        time.sleep(delay)
        child.kill()
        child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    logged = len(metrics.read_text().splitlines())
    complete = checkpoint.complete_steps(killed / "checkpoints")
    latest = complete[-1] if complete else 0  # 0: killed before the first checkpoint was committed
    where = f"(random seed {KILL_SEED}: killed {delay:.3f} s after step {after} was logged; {logged} logged)"
    assert logged < STEPS, f"killed too late to test a resume to {STEPS} {where}"
    assert logged - 2 <= latest <= logged, where

    proc = _run(_t2i(model, root / "captions", killed, STEPS, "--checkpointing_steps", "1", "--resume_from_checkpoint",
                     "latest"), env)
    assert proc.returncode == 0, proc.stdout + proc.stderr + where
    assert (f"resumed from step {latest}" in proc.stdout + proc.stderr) == (latest > 0), where
    assert (killed / "unet.safetensors").read_bytes() == (straight / "unet.safetensors").read_bytes(), where
    assert not list((killed / "checkpoints").glob("*tmp*")), where  # the cut-off write's leftovers are gone


# (extra flags, words the error holds): what `loop.run` refuses by looking at files, before any model loads
BAD_FILES = [
    (["--output_dir", "/proc/sdx-train"], "--output_dir /proc/sdx-train: it does not exist and cannot be made in /proc"),
    (["--output_dir", "FILE/out"], "is a file, not a folder"),
    (["--dataset_name", "/nonexistent/data"], "dataset /nonexistent/data: no such file or folder"),
    (["--original_image_column", "before"], "no column 'before'"),
    (["--edit_prompt_column", "instruction"], "no column 'instruction'"),
    (["--validation_prompt", "make it red", "--val_image_url_or_path", "FILE"], "--val_image_url_or_path FILE: cannot "
                                                                                "read the image"),
    (["--validation_prompt", "make it red", "--val_image_url_or_path", "/nonexistent.png"], "cannot read the image"),
    (["--resume_from_checkpoint", "/nonexistent/checkpoint"], "--resume_from_checkpoint /nonexistent/checkpoint: "),
    (["--pretrained_model_name_or_path", "/nonexistent/model"],
     "/nonexistent/model: no such file or folder, nor a built-in model"),
    (["--pretrained_vae_model_name_or_path", "/nonexistent/vae"], "/nonexistent/vae: no such file or folder"),
]


@pytest.mark.parametrize("extra, words", BAD_FILES)
def test_bad_files_are_refused_before_a_model_loads_and_nothing_is_written(world, tmp_path, capsys, monkeypatch,
                                                                          extra, words):
    from sdx.errors import run_command
    from train import models, pix2pix

    root, model, env = world
    monkeypatch.setenv("SDX_CACHE", env["SDX_CACHE"])
    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    (tmp_path / "file").write_text("not an image")
    extra = [a.replace("FILE", str(tmp_path / "file")) for a in extra]
    words = words.replace("FILE", str(tmp_path / "file"))
    argv = ["--pretrained_model_name_or_path", str(model), "--dataset_name", str(root / "edits"), "--resolution", "32",
            "--train_batch_size", "2", "--output_dir", str(tmp_path / "out"), *extra]
    assert run_command(lambda: pix2pix.train(argv)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and (tmp_path / "file").read_text() == "not an image"
