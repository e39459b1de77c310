"""python -m train.text_to_image_lora end to end on the tiny SD model: it trains the adapters alone, resumes
bit-identical, and writes a LoRA file that sdx's `--lora` and diffusers' load_lora_weights read to the same
UNet, whose images are the ones its validations drew; with --train_text_encoder (tiny SDXL) the same for the
UNet and both text encoders."""

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
    changed = _same_as_diffusers(model, merged, a, tmp_path / "diffusers", ("unet",))
    assert changed == {"unet": 32}  # each adapted projection's weight, nothing else


def test_text_encoder_lora_trains_resumes_from_cached_ids_and_loads_in_sdx_and_diffusers(tmp_path, demo_models):
    """--train_text_encoder on tiny_xl (the encoders at --text_encoder_lr): the file holds adapters of both
    text encoders beside the UNet's, all trained; a run resumed at step 2 with --cache_latents (token ids
    cached, the encoders run in the step) goes on as the uncached run did; the file through sdx's --lora
    and through diffusers' load_lora_weights + fuse_lora gives the same UNet and text encoders, and
    --lora's image is the last validation's."""
    model = demo_models("tiny_xl")
    data = shapes.write_dataset(tmp_path / "captions", "captions", count=8, seed=0, size=32)
    a, b = tmp_path / "a", tmp_path / "b"
    extra = ("--train_text_encoder", "--text_encoder_lr", "5e-3", "--proportion_empty_prompts", "0.25",
             "--validation_steps", "4")
    assert text_to_image_lora.train(_argv(model, data, a, *extra)) == 0
    arrays = load_file(a / export.LORA_FILE)
    # every adapter trained, but those of the first encoder's last layer: SDXL reads its next-to-last hidden state
    last = "text_encoder.text_model.encoder.layers.1."
    for prefix, count in (("unet.", 64), ("text_encoder.text_model.", 8), ("text_encoder_2.text_model.", 8)):
        ups = {k: v for k, v in arrays.items() if k.startswith(prefix) and k.endswith("lora_B.weight")}
        assert len(ups) == count, prefix
        assert all((np.abs(v).max() > 0) != k.startswith(last) for k, v in ups.items()), prefix
    assert len(arrays) == 2 * (64 + 8 + 8)

    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "2", b / "checkpoints" / "2")
    assert text_to_image_lora.train(_argv(model, data, b, *extra, "--cache_latents", "--resume_from_checkpoint",
                                          "latest")) == 0
    cached = sorted(p.name for p in (b / "cache" / "process-0").glob("*.npy"))
    assert cached == ["ids.npy", "moments.npy", "rows.npy", "time_ids.npy", "valid.npy"]
    np.testing.assert_allclose(_losses(b), _losses(a)[2:], rtol=1e-5)
    for k, v in load_file(b / export.LORA_FILE).items():
        np.testing.assert_allclose(v, arrays[k], rtol=0, atol=1e-6, err_msg=k)

    lora_file = a / export.LORA_FILE
    merged = resolve_model(str(model), dtype="float32", cache=tmp_path / "cache", log=lambda _m: None,
                           options=ModelOptions.from_args(lora=[str(lora_file)]))
    out = Pipeline.load(merged)(Request(prompts=[PROMPT], height=32, width=32, steps=2, num_images_per_prompt=1,
                                        seed=0, guidance_scale=5.0))
    grid = np.asarray(Image.open(a / "validation" / "step-000004.png"))
    assert np.abs((out[0] * 255).round().astype(int) - grid).max() <= 1
    changed = _same_as_diffusers(model, merged, a, tmp_path / "diffusers", ("unet", "text_encoder", "text_encoder_2"))
    assert changed == {"unet": 64, "text_encoder": 4, "text_encoder_2": 8}  # the trained projections


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_as_diffusers(model: Path, merged: Path, lora_dir: Path, folder: Path, components) -> dict[str, int]:
    """diffusers' pipeline of `model` with `lora_dir`'s file loaded (load_lora_weights) and fused: each of
    `components` equal to sdx's `merged` folder (--lora) to 1e-6. Returns {component: weights the LoRA
    changed}."""
    convert_lib.convert(model, folder, fmt="diffusers", log=lambda _m: None)
    pipe = diffusers.DiffusionPipeline.from_pretrained(folder)
    pipe.load_lora_weights(str(lora_dir))
    pipe.fuse_lora()
    pipe.unload_lora_weights()
    plain = lambda state: {k.removeprefix("text_model."): np.asarray(v) for k, v in state.items()
                           if not k.endswith("position_ids")}  # transformers 5 has no text_model level
    changed = {}
    for name in components:
        theirs = plain({k: v.numpy() for k, v in getattr(pipe, name).state_dict().items()})
        ours, before = plain(model_folder.torch_state(merged, name)), plain(model_folder.torch_state(model, name))
        assert theirs.keys() == ours.keys(), name
        for k, w in ours.items():
            np.testing.assert_allclose(theirs[k], w, rtol=0, atol=1e-6, err_msg=f"{name}: {k}")
        changed[name] = sum(not np.array_equal(w, before[k]) for k, w in ours.items())
    return changed
