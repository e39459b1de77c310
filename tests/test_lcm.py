"""Few-step models: an LCM UNet's guidance embedding (`time_cond_proj_dim`), and LCM sampling through the CLI
against diffusers' LatentConsistencyModelPipeline (a tiny SD 1.x with an LCM UNet) and an LCM-LoRA on a tiny
SDXL (StableDiffusionXLPipeline + LCMScheduler + load_lora_weights, as diffusers' LCM-LoRA guide runs it).

LCM adds fresh noise after every step but the last: diffusers' scheduler is handed sdx's own noise for each
image and step (`pipelines.sampler`: fold_in(fold_in(key_j, STEP_NOISE), call)), and both start from the same
initial latents, so the images must agree at the whole-pipeline bar of `tests.tiny_models.Bar`.
"""

from __future__ import annotations

from unittest import mock

import diffusers
import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

from pipelines import guidance
from pipelines.family import family_of
from pipelines.request import image_keys
from pipelines.sampler import Stream
from sdx import unet as U
from tests.test_pipelines import latent_shape, noise_file, reference, sample
from tests.test_unet import CASES, _inputs, _sdx_unet, _torch_unet
from tests.tiny_models import assert_effect, assert_parity, make_tiny_pipeline, perturb

STEPS = 4
PROMPT = "a red fox in the snow"


def test_guidance_scale_embedding_matches_diffusers():
    """To 1e-4: the angles reach w * 1000 radians, where one float32 rounding of a frequency moves a sine by that."""
    w = torch.tensor([0.0, 1.5, 7.5])
    for dim in (32, 33):
        ref = diffusers.LatentConsistencyModelPipeline.get_guidance_scale_embedding(None, w, embedding_dim=dim)
        np.testing.assert_allclose(np.asarray(U.guidance_scale_embedding(jnp.asarray(w.numpy()), dim)), ref.numpy(),
                                   atol=1e-4)


def test_lcm_unet_matches_diffusers():
    d = dict(CASES["sdxl"], time_cond_proj_dim=16)
    cfg = U.UNetConfig.from_diffusers_config(d)
    assert cfg.time_cond_proj_dim == 16
    torch_model = _torch_unet(d)
    model = _sdx_unet(cfg, torch_model)
    x, t, ctx, added = _inputs(cfg, (16, 16))
    w_emb = np.random.default_rng(1).standard_normal((2, 16)).astype(np.float32)
    with torch.no_grad():
        ref = torch_model(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(ctx),
                          timestep_cond=torch.from_numpy(w_emb),
                          added_cond_kwargs={k: torch.from_numpy(v) for k, v in added.items()}).sample.numpy()
    run = nnx.jit(lambda m, cond: m(jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(t), jnp.asarray(ctx),
                                    jax.tree.map(jnp.asarray, added), timestep_cond=cond))
    out = np.asarray(run(model, jnp.asarray(w_emb))).transpose(0, 3, 1, 2)
    assert float(np.abs(out - ref).max()) <= 1e-4 * float(np.abs(ref).max())


def test_an_embedded_guidance_scale_runs_no_guidance_branch():
    sd = family_of("LatentConsistencyModelPipeline", {"text_encoder"}, {})
    assert isinstance(guidance.choose(sd, 7.5, 1.0), guidance.ClassifierFree)
    embedded = guidance.choose(sd.__class__(**{**sd.__dict__, "guidance_embedded": True}), 8.5, 1.0)
    assert isinstance(embedded, guidance.Unguided) and embedded.branches == 1
    assert isinstance(guidance.choose(sd, 1.0, 1.0), guidance.Unguided)  # LCM-LoRA's guidance 1 (or 0)


def sdx_step_noise(seed: int, images: int, call: int, shape_nchw) -> torch.Tensor:
    """The noise sdx's sampler draws for each image at model call `call` (NCHW, for diffusers)."""
    keys = image_keys(seed, images)
    draw = lambda k: jax.random.normal(jax.random.fold_in(jax.random.fold_in(k, int(Stream.STEP_NOISE)), call),
                                       (shape_nchw[2], shape_nchw[3], shape_nchw[1]), jnp.float32)
    return torch.from_numpy(np.stack([np.asarray(draw(k)) for k in keys]).transpose(0, 3, 1, 2))


def with_sdx_noise(pipe, *args, **kwargs):
    """diffusers' pipeline run with its LCM scheduler drawing sdx's noise (seed 0, the CLI's default)."""
    calls = []

    def randn(shape, **_):
        calls.append(None)
        return sdx_step_noise(0, shape[0], len(calls) - 1, shape)

    with mock.patch("diffusers.schedulers.scheduling_lcm.randn_tensor", randn):
        return reference(pipe, *args, **kwargs)


def lcm_unet(base: diffusers.UNet2DConditionModel) -> diffusers.UNet2DConditionModel:
    """`base` with an LCM guidance embedding (time_cond_proj_dim 32), perturbed and scaled so that its effect
    is well above the parity bar."""
    config = {k: v for k, v in base.config.items() if not k.startswith("_")}
    unet = diffusers.UNet2DConditionModel(**{**config, "time_cond_proj_dim": 32})
    unet.load_state_dict(base.state_dict(), strict=False)
    perturb(unet.time_embedding.cond_proj, torch.Generator().manual_seed(5))
    with torch.no_grad():
        unet.time_embedding.cond_proj.weight.mul_(20.0)
    return unet.eval()


def test_lcm_unet_pipeline_matches_diffusers(tmp_path):
    """A tiny SD 1.x LCM (LatentConsistencyModelPipeline: its UNet embeds guidance_scale - 1, no negative
    branch), 4 steps of LCMScheduler, through the CLI."""
    base = make_tiny_pipeline("sd15", tmp_path / "base")
    unet = lcm_unet(base.unet)
    pipe = diffusers.LatentConsistencyModelPipeline(
        vae=base.vae, text_encoder=base.text_encoder, tokenizer=base.tokenizer, unet=unet,
        scheduler=diffusers.LCMScheduler.from_config(base.scheduler.config), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    folder = tmp_path / "lcm"
    pipe.save_pretrained(folder)
    path, noise = noise_file(tmp_path, latent_shape(pipe, 2, 32, 32))
    run = dict(num_inference_steps=STEPS, guidance_scale=8.5, latents=noise, height=32, width=32,
               num_images_per_prompt=2)
    ref = with_sdx_noise(pipe, PROMPT, **run)
    ours = sample(tmp_path, folder, "--prompt", PROMPT, "--num-images", "2", "--steps", str(STEPS),
                  "--guidance-scale", "8.5", "--latents", str(path), "--height", "32", "--width", "32")
    assert_parity(ours, ref)
    assert_effect("--guidance-scale 8.5 (the LCM UNet's embedding, against 3)", ref,
                  with_sdx_noise(pipe, PROMPT, **{**run, "guidance_scale": 3.0}))


def lcm_lora(pipe, where):
    """A UNet-only LoRA for `pipe` (random, non-zero), saved as diffusers' pytorch_lora_weights.safetensors."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    torch.manual_seed(4)
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                     target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2"]))
    layers = {k: v.detach().clone() for k, v in get_peft_model_state_dict(pipe.unet).items()}
    type(pipe).save_lora_weights(where, unet_lora_layers=layers)
    pipe.unet.delete_adapters("default")
    return where / "pytorch_lora_weights.safetensors"


def test_lcm_lora_on_sdxl_matches_diffusers(tmp_path):
    """diffusers' LCM-LoRA recipe: the model's own scheduler config as LCMScheduler, the LoRA loaded, 4 steps,
    guidance 1 (one UNet call a step)."""
    folder = tmp_path / "sdxl"
    base = make_tiny_pipeline("sdxl", folder)
    file = lcm_lora(base, tmp_path / "lora")
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(folder)
    pipe.scheduler = diffusers.LCMScheduler.from_config(pipe.scheduler.config)
    pipe.load_lora_weights(str(file))
    path, noise = noise_file(tmp_path, latent_shape(pipe, 1, 64, 64))
    run = dict(num_inference_steps=STEPS, guidance_scale=1.0, latents=noise, height=64, width=64)
    ref = with_sdx_noise(pipe, PROMPT, **run)
    ours = sample(tmp_path, folder, "--prompt", PROMPT, "--steps", str(STEPS), "--guidance-scale", "1",
                  "--scheduler", "lcm", "--lora", str(file), "--latents", str(path), "--height", "64", "--width", "64")
    assert_parity(ours, ref)
    pipe.unload_lora_weights()
    assert_effect("--lora (the LCM-LoRA, against none)", ref, with_sdx_noise(pipe, PROMPT, **run))
