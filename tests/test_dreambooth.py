"""DreamBooth: the class images sampled only when missing, named as diffusers names them; each batch pairs
instance and class samples with their prompts' tokens and keys of their own, and resumes where it
stopped; bad input is one error; `python -m train.dreambooth` end to end on the tiny SD model (class
images sampled by the model, a resumed run bit-identical). The loss is checked against diffusers' in
tests/test_train_step.py."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import model_folder
from sdx.errors import SdxError
from train import config, data, dreambooth, sources
from tests.processes import child_env
from train.dreambooth_data import DreamBoothLoader, open_data, sample_class_images

REPO = Path(__file__).resolve().parent.parent


def _pictures(folder: Path, count: int, seed: int, size=(40, 48)) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(seed)
    for i in range(count):
        Image.fromarray(r.integers(0, 255, (*size, 3), dtype=np.uint8)).save(folder / f"{i:02d}.png")
    return folder


def _cfg(tmp_path, **kw) -> config.TrainConfig:
    """The run these flags describe, on tmp_path/instance unless instance_data_dir=None."""
    kw = {"instance_data_dir": tmp_path / "instance", **kw}
    argv = ["--pretrained_model_name_or_path", "tiny", "--instance_prompt", "a photo of sks dog", "--output_dir",
            str(tmp_path / "out")]
    for k, v in kw.items():
        if v is not None:
            argv += [f"--{k}"] if v is True else [f"--{k}", str(v)]
    return config.parse("dreambooth", argv)


def test_class_images_are_sampled_only_when_missing(tmp_path):
    _pictures(tmp_path / "instance", 2, seed=0)
    _pictures(tmp_path / "class", 1, seed=1)
    cfg = _cfg(tmp_path, with_prior_preservation=True, class_data_dir=tmp_path / "class", class_prompt="a dog",
               num_class_images=3, seed=7)
    source = open_data(cfg)
    assert len(source) == 3  # max(2 instance images, 3 class images), diffusers' dataset length
    calls = []
    pictures = lambda count, seed: np.random.default_rng(seed).integers(0, 255, (count, 16, 16, 3), dtype=np.uint8)

    def generate(count, seed):
        calls.append((count, seed))
        return pictures(count, seed)

    sample_class_images(source, generate, cfg, log=lambda _m: None)
    assert calls == [(2, 8)]  # the missing two, from --seed + the images already there
    made = sorted(p.name for p in (tmp_path / "class").glob("*.jpg"))
    pixels = pictures(2, 8)
    assert made == [f"{1 + j}-{hashlib.sha1(Image.fromarray(pixels[j]).tobytes()).hexdigest()}.jpg" for j in range(2)]
    assert [e.where for e in (source.classes()[i] for i in range(3))] == ["00.png", made[0], made[1]]

    sample_class_images(source, generate, cfg, log=lambda _m: None)
    assert len(calls) == 1 and len(sources.image_files(tmp_path / "class")) == 3  # enough now: nothing sampled


def _loader(tmp_path, prior: bool) -> DreamBoothLoader:
    instance = sources.FolderSource(_pictures(tmp_path / "instance", 3, seed=0), sources.Columns.images_only())
    classes = sources.FolderSource(_pictures(tmp_path / "class", 5, seed=1, size=(48, 30)),
                                   sources.Columns.images_only())
    ids = {"instance": {"text_encoder": np.full((1, 77), 1, np.int32)},
           "class": {"text_encoder": np.full((1, 77), 2, np.int32)}}
    make = lambda s, seed: data.make_loader(s, data.Transform(resolution=16, seed=seed), batch_size=2, seed=seed)
    return DreamBoothLoader(make(instance, 0), make(classes, 9) if prior else None, ids)


def test_batches_pair_instance_and_class_samples_and_resume(tmp_path):
    loader = _loader(tmp_path, prior=True)
    it = iter(loader)
    batches = [next(it) for _ in range(4)]
    b = batches[1]
    assert b["pixels"].shape == (4, 16, 16, 3)
    np.testing.assert_array_equal(b["index"], [4, 6, 5, 7])  # instance p -> 2p, class p -> 2p + 1
    np.testing.assert_array_equal(b["prior"], [False, False, True, True])
    np.testing.assert_array_equal(b["ids"]["text_encoder"][:, 0, 0], [1, 1, 2, 2])  # (B, 1, 77)
    np.testing.assert_array_equal(b["original_size"], [[40, 48], [40, 48], [48, 30], [48, 30]])  # each its own size

    state = loader.state()  # after the 4 batches returned
    resumed = _loader(tmp_path, prior=True)
    resumed.restore(state)
    want, got = next(iter(loader)), next(iter(resumed))
    for k in ("pixels", "index", "prior", "row"):
        np.testing.assert_array_equal(got[k], want[k])
    np.testing.assert_array_equal(want["index"], [16, 18, 17, 19])
    with pytest.raises(SdxError, match="same --with_prior_preservation"):
        _loader(tmp_path, prior=False).restore(state)

    alone = next(iter(_loader(tmp_path, prior=False)))
    np.testing.assert_array_equal(alone["index"], [0, 2])
    assert not alone["prior"].any()


def test_a_dataset_s_captions_are_its_rows_prompts_and_repeats_lengthen_the_epoch(tmp_path):
    """The SDXL DreamBooth LoRA script's --dataset_name / --caption_column / --repeats: each instance row
    brings its own caption's tokens; the class rows keep --class_prompt's."""
    folder = _pictures(tmp_path / "instance", 3, seed=0)
    (folder / "metadata.jsonl").write_text("\n".join(json.dumps({"file_name": f"{i:02d}.png", "text": "x" * (i + 1)})
                                                      for i in range(3)))
    cfg = _cfg(tmp_path, instance_data_dir=None, dataset_name=folder, caption_column="text", repeats=4)
    source = open_data(cfg)
    assert len(source) == 12 and [source.instance[i].text for i in (0, 4, 11)] == ["x", "xx", "xxx"]

    tokenize = lambda text: {"text_encoder": np.full((1, 77), len(text), np.int32)}
    classes = sources.FolderSource(_pictures(tmp_path / "class", 2, seed=1), sources.Columns.images_only())
    make = lambda s, seed: data.make_loader(s, data.Transform(resolution=16, seed=seed, tokenize=tokenize),
                                            batch_size=3, seed=seed)
    loader = DreamBoothLoader(make(source.instance, 0), make(classes, 9),
                              {"instance": tokenize("sks"), "class": tokenize("a dog")})
    batch = next(iter(loader))
    captions = [len(source.instance[int(r)].text) for r in batch["row"][:3]]
    np.testing.assert_array_equal(batch["ids"]["text_encoder"][:, 0, 0], captions + [5, 5, 5])


@pytest.mark.parametrize("setup, words", [
    (lambda t: None, "is not a folder"),
    (lambda t: (t / "instance").mkdir(), "holds no image files"),
    (lambda t: (_pictures(t / "instance", 1, 0), (t / "class").write_text("x")), "is a file, not a folder"),
])
def test_bad_folders_are_one_error(tmp_path, setup, words):
    setup(tmp_path)
    cfg = _cfg(tmp_path, with_prior_preservation=True, class_data_dir=tmp_path / "class", class_prompt="a dog")
    with pytest.raises(SdxError, match=words):
        open_data(cfg)


def test_command_line_refuses_a_missing_instance_folder_before_loading(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "train.dreambooth_lora", "--pretrained_model_name_or_path", "tiny",
                           "--instance_data_dir", str(tmp_path / "none"), "--instance_prompt", "a photo of sks dog",
                           "--output_dir", str(tmp_path / "out")], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: --instance_data_dir {tmp_path / 'none'} is not a folder"]
    assert not (tmp_path / "out").exists()


def test_dreambooth_samples_class_images_trains_and_resumes_exactly(tmp_path, demo_models):
    model = demo_models("tiny")
    _pictures(tmp_path / "instance", 3, seed=0)
    a, b = tmp_path / "a", tmp_path / "b"

    def argv(out, *extra):
        return ["--pretrained_model_name_or_path", str(model), "--instance_data_dir", str(tmp_path / "instance"),
                "--instance_prompt", "a photo of sks dog", "--with_prior_preservation", "--class_data_dir",
                str(tmp_path / "class"), "--class_prompt", "a photo of dog", "--num_class_images", "3",
                "--sample_batch_size", "2", "--resolution", "32", "--train_batch_size", "1", "--max_train_steps", "4",
                "--checkpointing_steps", "2", "--lr_warmup_steps", "0", "--learning_rate", "1e-3", "--report_to",
                "none", "--output_dir", str(out), *extra]

    assert dreambooth.train(argv(a)) == 0
    assert (a / model_folder.SPEC_FILE).is_file()  # the whole UNet: an sdx folder
    files = sources.image_files(tmp_path / "class")
    assert [p.name.split("-")[0] for p in files] == ["0", "1", "2"]
    # the class images are the model's own, seed 0, 2 per call: the names hold the sha1 of the pixels sampled
    images = Pipeline.load(model)(Request(prompts=["a photo of dog"], height=32, width=32, steps=50,
                                          num_images_per_prompt=3, batch_size=2, seed=0, guidance_scale=7.5))
    pixels = (images * 255).round().astype(np.uint8)
    assert [p.name.split("-")[1] for p in files] == [f"{hashlib.sha1(x.tobytes()).hexdigest()}.jpg" for x in pixels]

    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "2", b / "checkpoints" / "2")
    assert dreambooth.train(argv(b, "--resume_from_checkpoint", "latest")) == 0
    assert (b / "unet.safetensors").read_bytes() == (a / "unet.safetensors").read_bytes()
    assert (b / "unet.safetensors").read_bytes() != (model / "unet.safetensors").read_bytes()
