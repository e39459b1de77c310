"""benchmarks/flops.py, the FLOP count behind benchmarks/sample.py's FLOP/s: its count of abstract,
lowered models equals XLA's count of the same models built with weights and compiled on this CPU, at
the shapes a sampling job gives them (latent size, guidance batch, SDXL's added conditioning)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from benchmarks import flops
from sdx import presets
from sdx.unet import UNet2DConditionModel, UNetConfig
from sdx.vae import AutoencoderKL, VAEConfig


def _compiled_flops(fn, *args) -> float:
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


@pytest.mark.parametrize("preset", ["tiny", "tiny_xl"])
def test_a_unet_call_is_counted_as_the_compiled_model(preset):
    d = presets.get(preset).configs["unet"]
    unet = UNet2DConditionModel(UNetConfig.from_diffusers_config(d), flops.PLAIN, rngs=nnx.Rngs(0))
    side = 32 // 2 ** (len(presets.get(preset).configs["vae"]["block_out_channels"]) - 1)  # latent side of 32²
    args = [jnp.zeros((2, side, side, d["in_channels"])), jnp.zeros((2,)), jnp.zeros((2, 77, d["cross_attention_dim"]))]
    if preset == "tiny_xl":
        pooled = d["projection_class_embeddings_input_dim"] - 6 * d["addition_time_embed_dim"]
        args.append({"text_embeds": jnp.zeros((2, pooled)), "time_ids": jnp.zeros((2, 6))})
    compiled = _compiled_flops(lambda m, *a: m(*a), unet, *args)
    assert flops.unet_call_flops(preset, 32, 2) == pytest.approx(compiled, rel=0.01)


def test_a_decode_is_counted_as_the_compiled_vae_and_a_job_adds_the_guidance_batch():
    cfg = VAEConfig.from_diffusers_config(presets.get("tiny").configs["vae"])
    vae = AutoencoderKL(cfg, flops.PLAIN, rngs=nnx.Rngs(0))
    compiled = _compiled_flops(lambda m, z: m.decode(z), vae, jnp.zeros((3, 16, 16, cfg.latent_channels)))
    assert flops.decode_flops("tiny", 32, 3) == pytest.approx(compiled, rel=0.01)
    unet = flops.unet_call_flops("tiny", 32, 6)  # 3 images, each with its unconditioned twin
    assert flops.job_flops("tiny", 32, 5, 3) == pytest.approx(5 * unet + flops.decode_flops("tiny", 32, 3))
    assert flops.job_flops("tiny", 32, 5, 3, guidance=False) < flops.job_flops("tiny", 32, 5, 3)
