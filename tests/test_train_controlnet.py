"""python -m train.controlnet: the ControlNet it starts from is diffusers' ControlNetModel.from_unet of the
model's UNet; end to end on the tiny SD model it trains the ControlNet alone, resumes bit-identical, and
writes a ControlNet that diffusers' from_pretrained and sdx's --controlnet read, whose image is the last
validation's. The step's loss and gradients are checked against diffusers' in tests/test_train_step.py."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest
from PIL import Image

from pipelines.pipeline import Pipeline
from pipelines.request import Request
from pipelines.control import Control
from sdx import model_folder, weights
from sdx.errors import SdxError
from train import config, controlnet, data

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")


def test_from_unet_is_diffusers_from_unet(demo_models):
    """Config, copied weights and zero convolutions equal diffusers' from_unet of the same UNet; the image
    embedding's other convolutions are drawn as torch draws a Conv2d (uniform within ±1/√fan_in)."""
    folder = demo_models("tiny_xl")
    spec = model_folder.read_spec(folder)
    source = spec["components"]["unet"]["source_config"]
    part = controlnet.from_unet(source, model_folder.read_arrays(folder, "unet", spec=spec), jax.random.key(0))
    unet = diffusers.UNet2DConditionModel.from_config(source)
    unet.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in model_folder.torch_state(folder, "unet").items()})
    ref = diffusers.ControlNetModel.from_unet(unet)
    theirs = {k: v.numpy() for k, v in ref.state_dict().items()}
    ours = weights.to_torch_keys(part.arrays)
    assert ours.keys() == theirs.keys()
    drawn = [k for k in ours if k.startswith("controlnet_cond_embedding.") and "conv_out" not in k]
    assert len(drawn) == 2 * (1 + 2 * 3)  # conv_in and two convolutions per later width, kernel and bias
    for k, w in ours.items():
        if k in drawn:
            fan_in = np.prod(theirs[k.replace("bias", "weight")].shape[1:])
            assert w.shape == theirs[k].shape and 0 < np.abs(w).max() <= 1 / np.sqrt(fan_in), k
        else:
            np.testing.assert_array_equal(w, theirs[k], err_msg=k)
    assert not ours["controlnet_mid_block.weight"].any()
    listed = lambda v: list(v) if isinstance(v, tuple) else v
    written = {k: listed(v) for k, v in part.source_config.items() if not k.startswith("_")}
    assert {k: listed(ref.config[k]) for k in written} == written


def test_from_unet_needs_a_diffusers_config_and_a_vae_factor_it_can_embed():
    with pytest.raises(SdxError, match="give --controlnet_model_name_or_path"):
        controlnet.from_unet(None, {}, jax.random.key(0))
    with pytest.raises(SdxError, match="shrinks it 16 times"):
        controlnet.from_unet({"in_channels": 4}, {}, jax.random.key(0), factor=16)


def _dataset(root, count: int = 8):
    folder = root / "train"
    folder.mkdir(parents=True)
    r, rows = np.random.default_rng(0), []
    for i in range(count):
        for name in (f"{i}.png", f"c{i}.png"):
            Image.fromarray(r.integers(0, 255, (36, 40, 3), dtype=np.uint8)).save(folder / name)
        rows.append({"file_name": f"{i}.png", "conditioning_image_file_name": f"c{i}.png", "text": f"shape {i}"})
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    Image.fromarray(r.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(root / "control.png")
    return root


def test_controlnet_trains_resumes_exactly_and_loads_in_sdx_and_diffusers(tmp_path, demo_models):
    model = demo_models("tiny")
    root = _dataset(tmp_path / "data")
    a, b = tmp_path / "a", tmp_path / "b"

    def argv(out, *extra):
        return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(root), "--output_dir", str(out),
                "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2",
                "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--proportion_empty_prompts", "0.3",
                "--report_to", "none", "--validation_prompt", "shape 1", "--validation_image",
                str(root / "control.png"), "--validation_steps", "4", "--num_validation_images", "1",
                "--validation_inference_steps", "2", *extra]

    assert controlnet.train(argv(a)) == 0
    weights_file = a / "diffusion_pytorch_model.safetensors"
    assert sorted(p.name for p in a.iterdir() if p.is_file()) == ["config.json", "diffusion_pytorch_model.safetensors",
                                                                  "metrics.jsonl"]
    assert not (a / model_folder.SPEC_FILE).exists()
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "2", b / "checkpoints" / "2")
    assert controlnet.train(argv(b, "--resume_from_checkpoint", "latest")) == 0
    assert (b / weights_file.name).read_bytes() == weights_file.read_bytes()

    ref = diffusers.ControlNetModel.from_pretrained(a)  # diffusers reads it as its own
    assert float(ref.controlnet_mid_block.weight.detach().abs().max()) > 0  # the zero convolutions trained

    # sdx's --controlnet: the last validation's image
    control = (data.load_image(root / "control.png", 32)[None] + 1) / 2
    pipe = Pipeline.load(model, controlnets=(str(a),))
    out = pipe(Request(prompts=["shape 1"], height=32, width=32, steps=2, seed=0, guidance_scale=7.5,
                       conditioning=[Control(image=control)]))
    grid = np.asarray(Image.open(a / "validation" / "step-000004.png"))
    assert np.abs((out[0] * 255).round().astype(int) - grid).max() <= 1


def test_a_missing_controlnet_is_refused_before_any_model_loads(tmp_path):
    root = _dataset(tmp_path / "data", count=2)
    with pytest.raises(SdxError, match="no such folder or file"):
        controlnet.train(["--pretrained_model_name_or_path", "tiny", "--train_data_dir", str(root), "--output_dir",
                          str(tmp_path / "out"), "--controlnet_model_name_or_path", str(tmp_path / "none")])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, words", [
    (["--validation_prompt", "a", "b", "--validation_image", "x.png", "y.png", "z.png"], "give one image, one prompt"),
    (["--validation_prompt", "a"], "--validation_prompt needs --validation_image"),
    (["--random_flip"], "unrecognized arguments: --random_flip"),
    (["--rank", "4"], "unrecognized arguments: --rank"),
])
def test_bad_flags_are_one_error(capsys, extra, words):
    assert_one_error(capsys, "controlnet", extra, words)


def assert_one_error(capsys, task: str, extra: list[str], words: str) -> None:
    """`python -m train.<task>` with `extra` flags exits 2 with `words` in its one error line."""
    with pytest.raises(SystemExit) as e:
        config.parse(task, ["--pretrained_model_name_or_path", "m", "--dataset_name", "d", *extra])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_defaults_are_train_controlnet_py_s():
    c = config.parse("controlnet", ["--pretrained_model_name_or_path", "m", "--dataset_name", "d"])
    assert (c.learning_rate, c.train_batch_size, c.num_train_epochs, c.output_dir, c.resolution) == (
        5e-6, 4, 1, "controlnet-model", 512)
    assert (c.image_column, c.conditioning_image_column, c.caption_column) == ("image", "conditioning_image", "text")
