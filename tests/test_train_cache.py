"""--cache_latents: a cached run trains on the same numbers as an uncached one (the same loss at every
step, random flips included), a resumed run reuses the cache instead of encoding again, and what cannot
be cached exactly (a crop or a caption drawn per sample) is refused with one clear error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sdx.errors import SdxError
from tests.processes import child_env
from tests.train_datasets import encode, random_picture, write_parquet
from train import cache as cachelib
from train import data, shapes, sources

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world(tmp_path_factory, demo_models):
    root = tmp_path_factory.mktemp("cache")
    shapes.write_dataset(root / "edits", "edits", count=8, seed=0, size=32)
    env = child_env(JAX_COMPILATION_CACHE_DIR=str(root / "jax"),
                    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", SDX_CACHE=str(root / "sdx-cache"))
    return root, demo_models("tiny_xl"), env


def _pix2pix(env, model, data_dir, out, *extra) -> subprocess.CompletedProcess:
    argv = ["--pretrained_model_name_or_path", str(model), "--dataset_name", str(data_dir), "--output_dir", str(out),
            "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2",
            "--random_flip", "--conditioning_dropout_prob", "0.1", "--use_ema", "--report_to", "none", *extra]
    proc = subprocess.run([sys.executable, "-m", "train.pix2pix", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cached_run_equals_uncached_and_resume_reuses_the_cache(world):
    root, model, env = world
    plain, cached = root / "plain", root / "cached"
    _pix2pix(env, model, root / "edits", plain)
    proc = _pix2pix(env, model, root / "edits", cached, "--cache_latents")
    assert "latent cache: encoding 8 samples (unflipped and flipped)" in proc.stdout + proc.stderr
    folder = cached / "cache" / "process-0"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["context.npy", "image_latents.npy", "manifest.json", "moments.npy", "pooled.npy", "rows.npy",
                     "time_ids.npy", "valid.npy"]
    assert np.load(folder / "moments.npy", mmap_mode="r").shape[0] == 16  # 8 images x (unflipped, flipped)
    assert np.load(folder / "context.npy", mmap_mode="r").shape[0] == 8  # text: once per row

    want, got = _losses(plain), _losses(cached)
    print("uncached", want, "\ncached  ", got)
    assert len(got) == 4 and len(set(got)) == 4
    np.testing.assert_allclose(got, want, rtol=1e-5)

    # resume from step 2: the cache is read, not written again
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    final = (cached / "unet.safetensors").read_bytes()
    (cached / "unet.safetensors").unlink()
    shutil.rmtree(cached / "checkpoints" / "4")
    proc = _pix2pix(env, model, root / "edits", cached, "--cache_latents", "--resume_from_checkpoint", "latest")
    log = proc.stdout + proc.stderr
    assert "resumed from step 2" in log and "latent cache: reusing" in log and "encoding" not in log
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    assert (cached / "unet.safetensors").read_bytes() == final
    np.testing.assert_allclose(_losses(cached), want, rtol=1e-5)


def _source(tmp_path, image: np.ndarray, text) -> sources.Source:
    path = write_parquet(tmp_path / "d.parquet", {"image": [encode(image)], "text": [text]}, image_columns=("image",))
    return sources.open_source(str(path), sources.Columns(images=("image",), text="text"), max_samples=None, seed=0,
                               cache_dir=None)


def test_a_random_crop_is_refused_unless_the_image_has_nothing_to_crop(tmp_path):
    wide = _source(tmp_path, random_picture(24, 40, 0), "a picture")
    with pytest.raises(SdxError, match="random crop.*--center_crop"):
        cachelib._read(wide, data.Transform(resolution=16), 0, flip=False)
    assert "images" in cachelib._read(wide, data.Transform(resolution=16, center_crop=True), 0, flip=False)
    square = _source(tmp_path, random_picture(32, 32, 0), "a picture")  # resized to 16 x 16: every crop is all of it
    assert "images" in cachelib._read(square, data.Transform(resolution=16), 0, flip=True)


def test_several_captions_per_row_are_refused(tmp_path):
    rows = _source(tmp_path, random_picture(16, 16, 0), ["a picture", "an image"])
    with pytest.raises(SdxError, match="2 captions"):
        cachelib._read(rows, data.Transform(resolution=16, center_crop=True), 0, flip=False)
