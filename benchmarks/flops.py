"""The floating-point work of a sampling job, counted by XLA on the model math.

`job_flops` lowers the UNet and the VAE decoder of a preset with abstract parameters (nothing is
allocated or compiled), plain `xla` attention and convolutions, and adds up XLA's cost analysis of those
lowered programs: `steps` UNet calls on the batch doubled by classifier-free guidance, one decode. The
text encoders are left out (under 0.1% of an SD 1.5 or SDXL job).

Why not `Sampler.flops`, XLA's count of the compiled programs: on a GPU, compiling hands matrix
products, convolutions and cuDNN attention to library calls that XLA's analysis does not count. For
SDXL at 1024², 25 steps on an H100 it gave 18.7 TFLOP for the job (71.0 with `xla` attention), where the
model math is 348.9. And a lowered program has no count on JAX's GPU backend (jax 0.11.2), so count on
a CPU; `python benchmarks/flops.py PRESET SIZE STEPS BATCH [--no-guidance]` prints the job's count (benchmarks/sample.py
runs it with JAX_PLATFORMS=cpu).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp
from flax import nnx  # noqa: E402

from sdx import presets, weights  # noqa: E402
from sdx.layers import Compute  # noqa: E402
from sdx.unet import UNet2DConditionModel, UNetConfig  # noqa: E402
from sdx.vae import AutoencoderKL, VAEConfig  # noqa: E402

PLAIN = Compute(attention="xla", conv="xla")


def lower(make, call, *inputs: jax.ShapeDtypeStruct) -> jax.stages.Lowered:
    """`call(model, *inputs)` for `make(rngs)`'s model, lowered with abstract parameters (nothing allocated)."""
    graphdef, params = nnx.split(weights.abstract(make))
    return jax.jit(lambda p, *a: call(nnx.merge(graphdef, p), *a)).lower(params, *inputs)


def unet_call(preset_name: str, size: int, batch: int, compute: Compute = PLAIN) -> jax.stages.Lowered:
    """One UNet call at `size`² pixels on `batch` latents (the batch the UNet sees, guidance included), its
    inputs in `compute.dtype` as the sampler feeds them (timesteps and SDXL's size numbers float32)."""
    configs = presets.get(preset_name).configs
    unet, factor, d = UNetConfig.from_diffusers_config(configs["unet"]), _factor(configs), configs["unet"]
    inputs = lambda *shapes, dtype=compute.dtype: [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    args = inputs((batch, size // factor, size // factor, unet.in_channels)) + inputs((batch,), dtype=jnp.float32)
    args += inputs((batch, 77, max(unet.cross_attention_dim)))
    if d.get("addition_embed_type") == "text_time":  # SDXL: pooled text (B, P) and six size numbers per image
        time_ids = 6
        args += inputs((batch, d["projection_class_embeddings_input_dim"] - time_ids * d["addition_time_embed_dim"]))
        args += inputs((batch, time_ids), dtype=jnp.float32)
        call = lambda m, x, t, c, te, ti: m(x, t, c, {"text_embeds": te, "time_ids": ti})
    else:
        call = lambda m, x, t, c: m(x, t, c)
    return lower(lambda rngs: UNet2DConditionModel(unet, compute, rngs=rngs), call, *args)


def unet_call_flops(preset_name: str, size: int, batch: int) -> float:
    """XLA's count of `unet_call` with plain attention and convolutions."""
    return float(unet_call(preset_name, size, batch).cost_analysis()["flops"])


def decode_flops(preset_name: str, size: int, batch: int) -> float:
    """The VAE decoder on `batch` latents of a `size`² image."""
    configs = presets.get(preset_name).configs
    vae, factor = VAEConfig.from_diffusers_config(configs["vae"]), _factor(configs)
    latents = jax.ShapeDtypeStruct((batch, size // factor, size // factor, vae.latent_channels), jnp.float32)
    lowered = lower(lambda rngs: AutoencoderKL(vae, PLAIN, rngs=rngs), lambda m, z: m.decode(z), latents)
    return float(lowered.cost_analysis()["flops"])


def job_flops(preset_name: str, size: int, steps: int, batch: int, guidance: bool = True) -> float:
    """A `batch`-image generation: `steps` UNet calls (on twice the batch with guidance) and a decode."""
    return steps * unet_call_flops(preset_name, size, batch * (2 if guidance else 1)) + decode_flops(preset_name, size, batch)


def _factor(configs) -> int:
    """Pixels per latent along a side: 2 per VAE level after the first."""
    return 2 ** (len(configs["vae"]["block_out_channels"]) - 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Print a sampling job's floating-point operations (XLA's count).")
    p.add_argument("preset")
    p.add_argument("size", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("batch", type=int)
    p.add_argument("--no-guidance", action="store_true", help="one UNet call a step on the batch, not on twice it")
    a = p.parse_args(argv)
    print(job_flops(a.preset, a.size, a.steps, a.batch, guidance=not a.no_guidance))


if __name__ == "__main__":
    main()
