"""python -m train.pix2pix end to end on a tiny SDXL model and a generated edit dataset: the model it
writes samples, and a run resumed from a checkpoint ends bit-identical to the uninterrupted one."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.pipeline import Pipeline
from pipelines.request import Request
from train import pix2pix, shapes


@pytest.fixture(scope="module")
def setup(tmp_path_factory, demo_models):
    root = tmp_path_factory.mktemp("e2e")
    model = demo_models("tiny_xl")
    shapes.write_dataset(root / "ds", "edits", count=12, seed=0, size=32)
    return root, model


def _argv(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
            "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2",
            "--use_ema", "--ema_decay", "0.9", "--conditioning_dropout_prob", "0.1", "--lr_warmup_steps", "0",
            "--random_flip", "--report_to", "none", *extra]


def test_pix2pix_trains_writes_a_model_and_resumes_exactly(setup):
    root, model = setup
    a, b = root / "a", root / "b"
    Image.fromarray(np.full((40, 48, 3), 200, np.uint8)).save(root / "val.png")
    validation = ["--validation_prompt", "make the circle red", "--val_image_url_or_path", str(root / "val.png"),
                  "--num_validation_images", "2", "--validation_steps", "4", "--validation_inference_steps", "2"]
    assert pix2pix.train(_argv(model, root / "ds", a, *validation)) == 0
    grid = np.asarray(Image.open(a / "validation" / "step-000004.png"))
    assert grid.shape == (32, 64, 3) and grid.std() > 0  # two 32 px images side by side
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "2", b / "checkpoints" / "2")
    assert pix2pix.train(_argv(model, root / "ds", b, "--resume_from_checkpoint", "latest")) == 0
    assert (a / "unet.safetensors").read_bytes() == (b / "unet.safetensors").read_bytes()
    lines = (a / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(np.isfinite(float(l.split('"loss": ')[1].split(",")[0])) for l in lines)

    pipe = Pipeline.load(a)
    assert pipe.family.pix2pix
    image = np.zeros((1, 32, 32, 3), np.float32)
    out = pipe(Request(prompts=["make the circle red"], height=32, width=32, steps=2, image=image))
    assert out.shape == (1, 32, 32, 3) and np.isfinite(out).all()
