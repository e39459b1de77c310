"""python -m train.text_to_image_lora end to end on the tiny SD model: it trains the adapters alone, resumes
bit-identical, and writes a LoRA file that sdx's `--lora` and diffusers' load_lora_weights read to the same
UNet, whose images are the ones its validations drew."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors.numpy import load_file

from convert import library as convert_lib
from convert.sources import ModelOptions
from pipelines.cli import resolve_model
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import model_folder
from train import export, shapes, text_to_image_lora

diffusers = pytest.importorskip("diffusers")

PROMPT = "a red circle on a blue background"
FLAGS = ["--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2",
         "--rank", "4", "--lora_alpha", "8", "--learning_rate", "1e-2", "--lr_warmup_steps", "0", "--report_to", "none",
         "--validation_prompt", PROMPT, "--num_validation_images", "1", "--validation_steps", "2",
         "--validation_inference_steps", "2"]


def _argv(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
            *FLAGS, *extra]


def _bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_lora_trains_resumes_exactly_and_its_file_loads_in_sdx_and_diffusers(tmp_path, demo_models):
    model = demo_models("tiny")
    data = shapes.write_dataset(tmp_path / "captions", "captions", count=8, seed=0, size=32)
    a, b = tmp_path / "a", tmp_path / "b"
    assert text_to_image_lora.train(_argv(model, data, a)) == 0
    lora_file = a / export.LORA_FILE
    assert not (a / model_folder.SPEC_FILE).exists()  # the adapters alone, no model folder
    arrays = load_file(lora_file)
    assert len(arrays) == 2 * 32 and max(np.abs(v).max() for k, v in arrays.items() if "lora_B" in k) > 0  # trained
    assert _bytes(a / "checkpoints" / "4") < (model / "unet.safetensors").stat().st_size / 4  # adapters, moments, step
    steps = [json.loads(line)["step"] for line in (a / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]

    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "2", b / "checkpoints" / "2")
    assert text_to_image_lora.train(_argv(model, data, b, "--resume_from_checkpoint", "latest")) == 0
    assert (b / export.LORA_FILE).read_bytes() == lora_file.read_bytes()

    # the sampler's --lora: the last validation's image
    merged = resolve_model(str(model), dtype="float32", cache=tmp_path / "cache", log=lambda _m: None,
                           options=ModelOptions.from_args(lora=[str(lora_file)]))
    out = Pipeline.load(merged)(Request(prompts=[PROMPT], height=32, width=32, steps=2, num_images_per_prompt=1,
                                        seed=0, guidance_scale=7.5))
    drawn = (out[0] * 255).round().astype(np.uint8)
    grid = np.asarray(Image.open(a / "validation" / "step-000004.png"))
    assert np.abs(drawn.astype(int) - grid).max() <= 1
    assert not np.array_equal(grid, np.asarray(Image.open(a / "validation" / "step-000002.png")))

    # diffusers: load_lora_weights (the folder's pytorch_lora_weights.safetensors) + fuse_lora, the same UNet
    convert_lib.convert(model, tmp_path / "diffusers", fmt="diffusers", log=lambda _m: None)
    pipe = diffusers.DiffusionPipeline.from_pretrained(tmp_path / "diffusers")
    pipe.load_lora_weights(str(a))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    theirs = {k: v.numpy() for k, v in pipe.unet.state_dict().items()}
    ours, before = model_folder.torch_state(merged, "unet"), model_folder.torch_state(model, "unet")
    assert theirs.keys() == ours.keys()
    changed = 0
    for k, w in ours.items():
        np.testing.assert_allclose(theirs[k], w, rtol=0, atol=1e-6, err_msg=k)
        changed += not np.array_equal(w, before[k])
    assert changed == 32  # each adapted projection's weight, nothing else
