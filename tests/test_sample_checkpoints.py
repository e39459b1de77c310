"""python -m sdx.sample on what people download: single-file checkpoints (--model file.safetensors
--config FOLDER), LoRAs (--lora FILE:SCALE) and swapped VAEs (--vae), against diffusers.

Latents and images are compared as in tests/test_pipelines.py (same --latents, `tests.tiny_models.assert_parity`),
with its helpers; the LoRAs' effect against the model without them (`assert_effect`). The tiny SD 1.x pipeline and
its LoRA files come from tests/test_lora.py's LoraSet (made with peft; kohya and diffusers/PEFT formats).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from convert import cli, library
from convert.sdx_folder import read_sdx_folder
from sdx import model_folder
from pipelines.cli import resolve_model
from sdx.sample import main

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from tests.test_lora import SCALE, LoraSet  # noqa: E402
from tests.test_pipelines import latent_shape, noise_file, reference, sample  # noqa: E402
from tests.tiny_models import Output, assert_effect, assert_parity, make_tiny_pipeline  # noqa: E402

STEPS = 2
PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def lora_sd15(tmp_path_factory) -> LoraSet:
    return LoraSet("sd15", tmp_path_factory.mktemp("lora_sd15"))


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One --cache for the module's runs: the same tiny architecture compiles once."""
    return tmp_path_factory.mktemp("cache")


def expected(pipe, noise) -> Output:
    return reference(pipe, PROMPT, negative_prompt="blurry", num_inference_steps=STEPS, guidance_scale=7.5,
                     latents=noise, height=64, width=64)


def generate(tmp_path, model, latents, cache, *args) -> Output:
    return sample(tmp_path, model, "--prompt", PROMPT, "--negative-prompt", "blurry", "--steps", str(STEPS),
                  "--guidance-scale", "7.5", "--latents", str(latents), "--height", "64", "--width", "64",
                  "--cache", str(cache), *args)


# --------------------------------------------------------------------------------------------------
# Single files


@pytest.mark.parametrize("kind", ["sd15", "sdxl"])
def test_single_file_samples_like_the_original(lora_sd15, shared_cache, tmp_path, kind):
    if kind == "sd15":
        folder, pipe = lora_sd15.folder, lora_sd15.cls.from_pretrained(lora_sd15.folder)
    else:
        folder = tmp_path / "diffusers"
        pipe = make_tiny_pipeline(kind, folder)
    path = tmp_path / "model.safetensors"
    assert cli.main([str(folder), str(path), "--format", "single-file", "-q"]) == 0
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    want = expected(pipe, noise)

    theirs = type(pipe).from_single_file(str(path), config=str(folder), local_files_only=True)
    assert_parity(expected(theirs, noise), want)
    ours = generate(tmp_path, path, latents, shared_cache, "--config", str(folder))
    assert_parity(ours, want)

    # converted once into the cache, keyed by the file: a changed file converts again
    models = shared_cache / "models"
    options = library.ModelOptions(config=str(folder))
    converted = set(models.iterdir())
    first = library.ensure_sdx_folder(path, cache_dir=models, options=options)
    assert first in converted and first.name.startswith("model-float32-")  # what the sampler converted
    assert library.ensure_sdx_folder(path, cache_dir=models, options=options) == first
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert library.ensure_sdx_folder(path, cache_dir=models, options=options) != first


# --------------------------------------------------------------------------------------------------
# LoRA


def test_lora_sample_equals_diffusers_fuse(lora_sd15, shared_cache, tmp_path):
    """Two LoRAs (kohya and diffusers/PEFT files) at 0.7 each, as diffusers' load_lora_weights + fuse_lora."""
    lora = lora_sd15
    pipe = lora.cls.from_pretrained(lora.folder)
    latents, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    plain = expected(pipe, noise)
    pipe.load_lora_weights(str(lora.kohya_file), adapter_name="kohya")
    pipe.load_lora_weights(str(lora.diffusers_file), adapter_name="peft")
    pipe.set_adapters(["kohya", "peft"], adapter_weights=[1.0, 1.0])
    pipe.fuse_lora(lora_scale=SCALE)
    pipe.unload_lora_weights()
    want = expected(pipe, noise)

    loras = ["--lora", f"{lora.kohya_file}:{SCALE}", "--lora", f"{lora.diffusers_file}:{SCALE}"]
    ours = generate(tmp_path, lora.folder, latents, shared_cache, *loras)
    assert_parity(ours, want)
    assert_effect(f"two --lora at {SCALE}", want, plain)

    # the cache entry is keyed by the LoRA files and scales
    def cached(*args):
        options = library.ModelOptions.from_args(lora=list(args))
        return resolve_model(str(lora.folder), dtype="float32", cache=shared_cache, log=lambda _m: None,
                             options=options)

    both = cached(f"{lora.kohya_file}:{SCALE}", f"{lora.diffusers_file}:{SCALE}")
    assert both == cached(f"{lora.kohya_file}:{SCALE}", f"{lora.diffusers_file}:{SCALE}")
    assert len({both, cached(f"{lora.kohya_file}:0.5", f"{lora.diffusers_file}:{SCALE}"),
                cached(str(lora.kohya_file))}) == 3


def test_lora_through_convert_equals_diffusers_fuse(lora_sd15, tmp_path):
    lora = lora_sd15
    want = lora.reference(lora.kohya_file)
    out = tmp_path / "out"
    assert cli.main([str(lora.folder), str(out), "--format", "diffusers", "--lora", f"{lora.kohya_file}:{SCALE}",
                     "-q"]) == 0
    theirs = lora.cls.from_pretrained(out)
    for c, tensors in want.items():
        got = {k: v.numpy() for k, v in getattr(theirs, c).state_dict().items()}
        assert set(got) == set(tensors), c
        for k, w in tensors.items():
            np.testing.assert_allclose(got[k], w, rtol=0, atol=1e-6, err_msg=f"{c} {k}")


# --------------------------------------------------------------------------------------------------
# --vae and errors through python -m sdx.sample


def test_vae_option_reaches_the_sampled_model(lora_sd15, shared_cache, tmp_path):
    from tests.test_export import state, tiny_vae

    pipe = lora_sd15.cls.from_pretrained(lora_sd15.folder)
    vae = tiny_vae(pipe, tmp_path / "vae", seed=9, scaling_factor=0.3)
    folder = resolve_model(str(lora_sd15.folder), dtype="float32", cache=shared_cache, log=lambda _m: None,
                           options=library.ModelOptions(vae=str(tmp_path / "vae")))
    got = {k: np.asarray(v) for k, v in read_sdx_folder(folder).tensors["vae"].items()}
    for k, w in state(vae).items():
        np.testing.assert_array_equal(got[k], w, err_msg=k)
    assert model_folder.model_config(folder, "vae").scaling_factor == 0.3


def _fails(capsys, tmp_path, *args) -> str:
    capsys.readouterr()
    argv = ["--prompt", "x", "--output", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--quiet", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_sample_errors_are_one_line(lora_sd15, tmp_path, capsys):
    from safetensors.numpy import save_file

    from tests.test_export import tiny_vae

    folder = str(lora_sd15.folder)
    bad = tmp_path / "bad.safetensors"
    save_file({"lora_unet_down_blocks_0_nowhere.lora_down.weight": np.ones((2, 32), np.float32),
               "lora_unet_down_blocks_0_nowhere.lora_up.weight": np.ones((32, 2), np.float32)}, str(bad))
    assert "lora_unet_down_blocks_0_nowhere" in _fails(capsys, tmp_path, "--model", folder, "--lora", f"{bad}:0.5")
    tiny_vae(lora_sd15.cls.from_pretrained(folder), tmp_path / "vae", seed=2, block_out_channels=[32, 32])
    err = _fails(capsys, tmp_path, "--model", folder, "--vae", str(tmp_path / "vae"))
    assert "architecture differs" in err and "block_out_channels" in err
    junk = tmp_path / "junk.safetensors"
    save_file({"model.something.weight": np.zeros((2, 2), np.float32)}, str(junk))
    assert "looked for" in _fails(capsys, tmp_path, "--model", str(junk))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(lora_sd15.kohya_file.read_bytes()[:-100])
    assert str(cut) in _fails(capsys, tmp_path, "--model", folder, "--lora", str(cut))
    assert "--config applies to single-file" in _fails(capsys, tmp_path, "--model", folder, "--config", folder)
    assert "--preset applies to single-file" in _fails(capsys, tmp_path, "--model", folder, "--preset", "sd21")
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())
