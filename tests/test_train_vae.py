"""`python -m train.vae` end to end on a tiny VAE and a generated dataset.

From random weights (--vae_config): the loss falls when the VAE overfits a repeated batch, and the VAE
folder it writes (diffusers' layout) loads in diffusers' AutoencoderKL and reconstructs what sdx's VAE
read from the same folder (the `--vae` path of the sampler and the converter) reconstructs; on two devices,
resumed exactly. From a pipeline: the sdx folder written has the new VAE and every other component byte for
byte; with --unet_latents its decoder learns from the latents the pipeline's own img2img draws.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from convert.sources import read_vae_source
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import weights
from sdx.layers import Compute
from sdx.vae import AutoencoderKL, VAEConfig
from tests.processes import child_env
from train import shapes, sources
from train import vae as vaetask

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vae")
    shapes.write_dataset(root / "two", "captions", count=2, seed=0, size=32)  # one repeated batch
    env = child_env(JAX_COMPILATION_CACHE_DIR=str(root / "jax"), SDX_CACHE=str(root / "sdx-cache"))
    return root, env


def _train_vae(env, *argv) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "train.vae", "--resolution", "32", "--train_batch_size", "2",
                           "--report_to", "none", "--checkpointing_steps", "1000", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_vae_from_random_weights_overfits_resumes_and_loads_in_diffusers(world):
    """On two devices (the random weights placed on the mesh as loaded ones are), and resumed from the
    checkpoint at step 38 to the same bytes."""
    root, env = world
    env = {**env, "XLA_FLAGS": child_env(devices=2)["XLA_FLAGS"]}
    out, resumed = root / "from-config", root / "from-config-resumed"
    argv = ("--vae_config", "tiny", "--dataset_name", str(root / "two"), "--max_train_steps", "40",
            "--learning_rate", "2e-3", "--train_batch_size", "1", "--checkpointing_steps", "38")
    proc = _train_vae(env, *argv, "--output_dir", str(out))
    assert "on 2 devices" in proc.stdout + proc.stderr
    losses = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 40
    first, last = np.mean(losses[:3]), np.mean(losses[-3:])
    print("loss", first, "->", last)
    assert last < 0.5 * first
    shutil.copytree(out / "checkpoints" / "38", resumed / "checkpoints" / "38")
    _train_vae(env, *argv, "--output_dir", str(resumed), "--resume_from_checkpoint", "latest")
    name = "diffusion_pytorch_model.safetensors"
    assert (resumed / name).read_bytes() == (out / name).read_bytes()

    # diffusers' layout: config.json + diffusion_pytorch_model.safetensors, nothing sdx-specific
    assert sorted(p.name for p in out.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")) == [
        "config.json", "diffusion_pytorch_model.safetensors", ]
    theirs = diffusers.AutoencoderKL.from_pretrained(out).eval()
    config, tensors = read_vae_source(out, {})
    ours = weights.load_torch_state(
        weights.abstract(lambda r: AutoencoderKL(VAEConfig.from_diffusers_config(config), rngs=r)), tensors, where="test")

    x = np.random.default_rng(0).uniform(-1, 1, (2, 3, 32, 24)).astype(np.float32)  # NCHW, not square
    with torch.no_grad():
        want = theirs(torch.from_numpy(x)).sample.numpy().transpose(0, 2, 3, 1)  # decode(posterior mode)
    got = np.asarray(ours(jnp.asarray(x.transpose(0, 2, 3, 1))))
    err = float(np.abs(got - want).max())
    print("reconstruction max abs difference", err)
    assert err < 1e-5 * max(1.0, float(np.abs(want).max()))
    assert float(np.abs(want).std()) > 0.05  # a real picture came out, not a constant


def test_vae_from_a_pipeline_changes_only_the_vae(world, demo_models):
    root, env = world
    model = demo_models("tiny")
    out = root / "from-pipeline"
    _train_vae(env, "--pretrained_model_name_or_path", str(model), "--dataset_name", str(root / "two"),
               "--output_dir", str(out), "--max_train_steps", "2", "--learning_rate", "1e-3")
    spec, source = json.loads((out / "sdx.json").read_text()), json.loads((model / "sdx.json").read_text())
    assert spec["pipeline_class"] == source["pipeline_class"]
    assert spec["components"].keys() == source["components"].keys()
    changed = load_file(out / "vae.safetensors")
    before = load_file(model / "vae.safetensors")
    assert changed.keys() == before.keys()
    assert any(not np.array_equal(changed[k], before[k]) for k in changed)
    files = sorted(p.relative_to(model) for p in model.rglob("*") if p.is_file() and p.name != "sdx.json")
    assert Path("unet.safetensors") in files and any(p.parts[0] == "tokenizer" for p in files)
    for rel in files:
        if rel != Path("vae.safetensors"):
            assert (out / rel).read_bytes() == (model / rel).read_bytes(), rel


def test_decoder_only_keeps_the_encoder(world, demo_models):
    """--decoder_only: the encoder side (encoder, quant_conv) is written back byte for byte, so latents a
    diffusion model was trained on stay valid; the decoder side learns (the loss falls on a repeated batch)."""
    root, env = world
    model = demo_models("tiny")
    out = root / "decoder-only"
    _train_vae(env, "--pretrained_model_name_or_path", str(model), "--dataset_name", str(root / "two"),
               "--output_dir", str(out), "--max_train_steps", "20", "--learning_rate", "2e-3", "--decoder_only",
               "--adam_weight_decay", "0.5")  # a large decay: it must not reach the frozen weights either
    losses = [json.loads(l)["loss"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    print("loss", losses[0], "->", losses[-1])
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3])
    changed, before = load_file(out / "vae.safetensors"), load_file(model / "vae.safetensors")
    encoder_side = [k for k in before if k.split(".")[0] in ("encoder", "quant_conv")]
    decoder_side = [k for k in before if k not in encoder_side]
    assert encoder_side and decoder_side
    for k in encoder_side:
        assert changed[k].tobytes() == before[k].tobytes(), k
    assert all(not np.array_equal(changed[k], before[k]) for k in decoder_side if k.endswith("kernel"))


def test_unet_latents_are_what_the_pipeline_draws_by_img2img(world, demo_models):
    """--unet_latents 0.5 0.3: the cache holds each picture and, in the decoder's units, the final latents the
    pipeline's own img2img draws from it and its caption (batch b at the b-th strength in turn, seed --seed + b);
    the loss decodes those (no KL term), and only the decoder side changes."""
    root, env = world
    model = demo_models("tiny")
    data = root / "four"
    shapes.write_dataset(data, "captions", count=4, seed=3, size=32)
    out = root / "unet-latents"
    _train_vae(env, "--pretrained_model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir",
               str(out), "--max_train_steps", "2", "--learning_rate", "1e-3", "--decoder_only", "--center_crop",
               "--unet_latents", "0.5", "0.3", "--seed", "4")
    cache = out / "cache" / "process-0"
    pixels, drawn = np.load(cache / "pixels.npy"), np.load(cache / "unet_latents.npy")
    source = sources.open_source(str(data), sources.Columns(images=("image",), text="text", names=("pixels",)))
    pipe = Pipeline.load(model, dtype="float32")
    for b, strength in enumerate((0.5, 0.3)):  # two batches of two pictures
        rows = slice(2 * b, 2 * b + 2)
        latents = pipe(Request(prompts=[source[i].text for i in range(4)][rows], image=pixels[rows], height=32,
                               width=32, seed=4 + b, strength=strength, output_latents=True))
        want = np.asarray(pipe.models["vae"].config.from_latents(jnp.asarray(latents)))
        np.testing.assert_allclose(drawn[rows], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(drawn[:2], drawn[2:], atol=1e-2)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics and all("kl_per_element" not in m and m["loss"] > 0 for m in metrics)
    changed, before = load_file(out / "vae.safetensors"), load_file(model / "vae.safetensors")
    for k in before:
        assert (changed[k].tobytes() == before[k].tobytes()) == (k.split(".")[0] in ("encoder", "quant_conv")), k


def test_each_validation_after_the_first_runs_the_compiled_reconstruction(jax_events):
    """VAETask.validate with two VAEs of one structure (a run's weights at two validations): the second call
    compiles nothing, and each picture is its own VAE's reconstruction (originals over reconstructions)."""
    config = vaetask.vae_config("tiny")
    task = types.SimpleNamespace(fixed=np.random.default_rng(0).uniform(-1, 1, (2, 32, 32, 3)).astype(np.float32))
    pictures = []
    metrics = types.SimpleNamespace(image=lambda step, tag, grid: pictures.append(grid))
    compiles = jax_events("backend_compile")
    vaes = [AutoencoderKL(config, Compute(), rngs=nnx.Rngs(seed)) for seed in (0, 1)]
    vaetask.VAETask.validate(task, vaes[0], 1, metrics)
    before = len(compiles)
    vaetask.VAETask.validate(task, vaes[1], 2, metrics)
    assert len(compiles) == before
    for vae, picture in zip(vaes, pictures):
        recon = np.clip(np.asarray(vae(jnp.asarray(task.fixed))), -1, 1)
        expected = ((np.concatenate(list(recon), axis=1) + 1) * 127.5).round()
        assert np.abs(picture[32:].astype(int) - expected).max() <= 1
    assert not np.array_equal(pictures[0][32:], pictures[1][32:])
