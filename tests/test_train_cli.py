"""`python -m train.X` as a user runs it, in subprocesses: diffusers' documented InstructPix2Pix command
line runs unchanged (small numbers, a local tiny model and dataset), and SIGTERM through the real loop
writes a checkpoint, exits 0 with one line saying how to resume, and the resumed run ends with the
weights of an uninterrupted one, byte for byte.

The subprocesses share a JAX persistent compilation cache (a temporary folder, every program cached), so
only the first run of each program compiles it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train import checkpoint, shapes

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world(tmp_path_factory, demo_models):
    root = tmp_path_factory.mktemp("cli")
    model = demo_models("tiny")  # SD 1.x-like: pix2pix widens its conv_in
    shapes.write_dataset(root / "edits", "edits", count=8, seed=0, size=32)
    shapes.write_dataset(root / "captions", "captions", count=8, seed=0, size=32)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(root / "jax"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "SDX_CACHE": str(root / "sdx-cache")}
    env.pop("XLA_FLAGS", None)
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


def test_sigterm_checkpoints_exits_0_and_resumes_to_the_same_weights(world):
    root, model, env = world
    straight, stopped = root / "straight", root / "stopped"
    proc = _run(_t2i(model, root / "captions", straight, STEPS), env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

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
