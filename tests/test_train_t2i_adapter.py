"""python -m train.t2i_adapter: the adapter it starts from is diffusers' script's (shapes, torch's init); its
cubic timesteps follow floor((1 - u^3) T); a step's loss and gradients equal train_t2i_adapter_sdxl.py's formula
in PyTorch (σ-form noising, the σ⁻²-weighted error of the denoised latents); end to end on the tiny SD model it
trains the adapter alone, resumes bit-identical, and writes an adapter that diffusers' from_pretrained and
sdx's --t2i-adapter read, whose image is the last validation's."""

from __future__ import annotations

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from pipelines.pipeline import Pipeline
from pipelines.request import Request
from pipelines.t2i_adapter import AdapterImage
from sdx import model_folder
from sdx import unet as U
from sdx import weights as W
from sdx.errors import SdxError
from sdx.t2i_adapter import T2IAdapter, T2IAdapterConfig
from train import config, data, denoise, objective
from train import step as steplib
from train import t2i_adapter

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

from tests.test_train_controlnet import _dataset, assert_one_error  # noqa: E402
from tests.test_train_step import CASES, NULL, SCHED, VAE, _batch, _loss_config, _models, _nchw  # noqa: E402


def test_default_adapter_is_the_scripts():
    """SDXL: train_t2i_adapter_sdxl.py's T2IAdapter(channels=(320, 640, 1280, 1280), num_res_blocks=2,
    downscale_factor=16, adapter_type="full_adapter_xl"); SD 1.5: diffusers' T2IAdapter defaults (the SD
    adapters' shape). Both fit their UNets; a random init is torch's Conv2d one."""
    xl = t2i_adapter.default_config(U.UNetConfig.preset("sdxl_base"), 8)
    assert xl == T2IAdapterConfig(channels=(320, 640, 1280, 1280), num_res_blocks=2, downscale_factor=16,
                                  adapter_type="full_adapter_xl")
    sd = t2i_adapter.default_config(U.UNetConfig.preset("sd15"), 8)
    assert sd == T2IAdapterConfig.from_diffusers_config(dict(diffusers.T2IAdapter().config))


def test_cubic_timesteps_follow_their_distribution():
    """20,000 draws against P(t <= k) = 1 - (1 - (k + 1) / T)^(1/3), the law of floor((1 - u^3) T)."""
    keys = jax.random.split(jax.random.key(0), 20_000)
    t = np.asarray(objective.timesteps(keys, 1000, cubic=True))
    assert t.min() >= 0 and t.max() <= 999
    k = np.arange(1000)
    exact = 1 - (1 - (k + 1) / 1000) ** (1 / 3)
    empirical = np.searchsorted(np.sort(t), k, side="right") / len(t)
    assert np.abs(empirical - exact).max() < 0.015  # Kolmogorov-Smirnov at 20,000 draws: ~0.0096 at p = 0.01
    assert np.mean(t >= 500) > 0.75  # the noisy half drawn 79 % of the time, not half


def test_loss_and_gradients_match_the_scripts_formula():
    """train_t2i_adapter_sdxl.py's step on an SDXL-shaped UNet, in PyTorch: x_t = x_0 + σ·ε (its Euler
    scheduler's add_noise), the UNet reads x_t / √(σ² + 1) with the adapter's maps, and the loss is the
    σ⁻²-weighted squared error of x_t − σ·ε̂ against x_0; half the captions dropped. sdx's step as
    train/t2i_adapter.py runs it, from the same draws: the same loss and adapter gradients in float32."""
    case = {**CASES[0], "p": 0.5}
    ref, unet = _models(4)
    ref.requires_grad_(False)
    adapter_config = dict(channels=[32, 64], num_res_blocks=2, downscale_factor=16, adapter_type="full_adapter_xl")
    torch.manual_seed(5)
    adapter_ref = diffusers.T2IAdapter(**adapter_config)
    config = T2IAdapterConfig.from_diffusers_config(dict(adapter_ref.config))
    adapter = W.load_torch_state(W.abstract(lambda r: T2IAdapter(config, rngs=r)),
                                 {k: v.numpy() for k, v in adapter_ref.state_dict().items()}, where="test")
    batch = _batch(6, False)
    batch["control"] = np.random.default_rng(4).uniform(0, 1, (6, 64, 64, 3)).astype(np.float32)  # 8x the latents

    graphdef, params, base = nnx.split(nnx.Dict({"unet": unet, "t2i_adapter": adapter}),
                                       nnx.All(nnx.Param, nnx.PathContains("t2i_adapter")), ...)
    cfg = dataclasses.replace(_loss_config(case), t2i_adapter=True)
    fn, constants = steplib.trained_in_part(denoise.loss_fn(graphdef, cfg), jax.tree.map(jnp.asarray, NULL), base)
    keys = steplib.sample_keys(jax.random.key(3), jnp.int32(7), jnp.asarray(batch["index"]))
    (loss, _), grads = jax.jit(jax.value_and_grad(fn, has_aux=True))(params, jax.tree.map(jnp.asarray, batch), keys,
                                                                     constants)

    # the script's step, from sdx's draws
    x0 = _nchw(objective.sample_latents(keys, jnp.asarray(batch["moments"]), VAE))
    eps = _nchw(objective.noise(keys, x0.shape[2:] + x0.shape[1:2])[0])
    t = torch.from_numpy(np.array(objective.timesteps(keys, 1000, cubic=True))).long()
    drop = torch.from_numpy(np.array(objective.empty_prompt(keys, case["p"])))
    assert 0 < int(drop.sum()) < len(t)
    euler = diffusers.EulerDiscreteScheduler(**SCHED)
    index = [(euler.timesteps == step).nonzero().item() for step in t]  # the script's get_sigmas
    sigma = euler.sigmas[index].float()[:, None, None, None]
    noisy = euler.add_noise(x0, eps, t)
    ctx = torch.where(drop[:, None, None], torch.from_numpy(NULL["context"]), torch.from_numpy(batch["context"]))
    pooled = torch.where(drop[:, None], torch.from_numpy(NULL["pooled"]), torch.from_numpy(batch["pooled"]))
    added = {"text_embeds": pooled, "time_ids": torch.from_numpy(batch["time_ids"])}
    maps = adapter_ref(_nchw(batch["control"]))
    pred = ref(noisy / (sigma**2 + 1) ** 0.5, t, ctx, added_cond_kwargs=added,
               down_intrablock_additional_residuals=maps).sample
    denoised = pred * (-sigma) + noisy
    ref_loss = torch.mean((sigma**-2.0 * (denoised.float() - x0.float()) ** 2).reshape(len(t), -1), dim=1).mean()
    ref_loss.backward()

    print("loss", float(loss), ref_loss.item())
    np.testing.assert_allclose(float(loss), ref_loss.item(), rtol=2e-5)
    flat = {".".join(map(str, p[1:])): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    assert all(p[0] == "t2i_adapter" for p, _ in nnx.to_flat_state(grads))  # the UNet does not train
    torch_grads = {k: p.grad for k, p in adapter_ref.named_parameters()}
    for name in ("adapter.conv_in.kernel", "adapter.body.1.in_conv.kernel", "adapter.body.0.resnets.1.block1.kernel",
                 "adapter.body.1.resnets.0.block2.bias"):
        theirs = torch_grads[name.replace("kernel", "weight")].numpy()
        ours = flat[name].transpose(3, 2, 0, 1) if name.endswith("kernel") else flat[name]  # HWIO -> OIHW
        err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
        print(name, "relative gradient error", err)
        assert err < 1e-4


def _argv(model, root, out, *extra):
    return ["--pretrained_model_name_or_path", str(model), "--train_data_dir", str(root), "--output_dir", str(out),
            "--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2",
            "--learning_rate", "1e-3", "--lr_warmup_steps", "0", "--proportion_empty_prompts", "0.3",
            "--report_to", "none", "--validation_prompt", "shape 1", "--validation_image", str(root / "control.png"),
            "--validation_steps", "4", "--num_validation_images", "1", "--validation_inference_steps", "2", *extra]


def test_adapter_trains_resumes_exactly_and_loads_in_sdx_and_diffusers(tmp_path, demo_models):
    model = demo_models("tiny")
    root = _dataset(tmp_path / "data")
    a, b = tmp_path / "a", tmp_path / "b"
    assert t2i_adapter.train(_argv(model, root, a)) == 0
    weights_file = a / "diffusion_pytorch_model.safetensors"
    assert sorted(p.name for p in a.iterdir() if p.is_file()) == ["config.json", "diffusion_pytorch_model.safetensors",
                                                                  "metrics.jsonl"]
    assert not (a / model_folder.SPEC_FILE).exists()
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "2", b / "checkpoints" / "2")
    assert t2i_adapter.train(_argv(model, root, b, "--resume_from_checkpoint", "latest")) == 0
    assert (b / weights_file.name).read_bytes() == weights_file.read_bytes()

    ref = diffusers.T2IAdapter.from_pretrained(a)  # diffusers reads it as its own
    assert ref.config.adapter_type == "full_adapter" and list(ref.config.channels) == [32, 64]

    # sdx's --t2i-adapter: the last validation's image
    control = (data.load_image(root / "control.png", 32)[None] + 1) / 2
    pipe = Pipeline.load(model, t2i_adapters=(str(a),))
    out = pipe(Request(prompts=["shape 1"], height=32, width=32, steps=2, seed=0, guidance_scale=7.5,
                       conditioning=[AdapterImage(image=control)]))
    grid = np.asarray(Image.open(a / "validation" / "step-000004.png"))
    assert np.abs((out[0] * 255).round().astype(int) - grid).max() <= 1

    # started from that adapter (--adapter_model_name_or_path), a run reads its weights
    c = tmp_path / "c"
    assert t2i_adapter.train(_argv(model, root, c, "--adapter_model_name_or_path", str(a), "--max_train_steps", "1",
                                   "--validation_steps", "100")) == 0
    assert (c / weights_file.name).read_bytes() != weights_file.read_bytes()  # one more step from it


@pytest.mark.parametrize("adapter, words", [
    ("none", "--adapter_model_name_or_path {}: no such folder"),
    ("gray", "it reads 1-channel images; the dataset's control images are RGB (3)"),
    ("xl", "--resolution 36: {} reads images whose sides are multiples of 16 pixels"),
])
def test_a_wrong_adapter_is_refused_before_any_model_loads(tmp_path, adapter, words):
    root = _dataset(tmp_path / "data", count=2)
    folder = tmp_path / adapter
    if adapter == "gray":
        diffusers.T2IAdapter(in_channels=1, channels=[8, 16], num_res_blocks=1, downscale_factor=2).save_pretrained(folder)
    elif adapter == "xl":
        diffusers.T2IAdapter(channels=[8, 16], num_res_blocks=1, downscale_factor=16,
                             adapter_type="full_adapter_xl").save_pretrained(folder)
    argv = ["--pretrained_model_name_or_path", str(tmp_path / "no-model"), "--train_data_dir", str(root),
            "--output_dir", str(tmp_path / "out"), "--resolution", "36", "--adapter_model_name_or_path", str(folder)]
    with pytest.raises(SdxError) as info:  # the model (missing too) is never reached
        t2i_adapter.open_data(config.parse("t2i_adapter", argv))
    assert words.format(folder) in str(info.value)


@pytest.mark.parametrize("extra, words", [
    (["--validation_prompt", "a", "b", "--validation_image", "x.png", "y.png", "z.png"], "give one image, one prompt"),
    (["--validation_prompt", "a"], "--validation_prompt needs --validation_image (the control image) for a ControlNet "
                                   "or a T2I-Adapter"),
    (["--random_flip"], "unrecognized arguments: --random_flip"),
    (["--controlnet_model_name_or_path", "x"], "unrecognized arguments: --controlnet_model_name_or_path"),
])
def test_bad_flags_are_one_error(capsys, extra, words):
    assert_one_error(capsys, "t2i_adapter", extra, words)


def test_defaults_are_train_t2i_adapter_sdxl_py_s():
    c = config.parse("t2i_adapter", ["--pretrained_model_name_or_path", "m", "--dataset_name", "d"])
    assert (c.learning_rate, c.train_batch_size, c.num_train_epochs, c.output_dir, c.resolution, c.validation_steps) == (
        5e-6, 4, 1, "t2iadapter-model", 1024, 100)
    assert (c.image_column, c.conditioning_image_column, c.caption_column) == ("image", "conditioning_image", "text")
