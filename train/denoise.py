"""The denoising loss of text-to-image and InstructPix2Pix fine-tuning, on already-encoded batches.

The frozen models run first (`encode_batch`, its own jitted program): the VAE turns pixels into posterior
moments (and, for InstructPix2Pix, the input image into its latents' mode, unscaled as the pipeline makes
them), the text encoders turn token ids into the context and pooled embeddings. `--cache_latents`
stores exactly these arrays, so a cached and an uncached run train on the same numbers.

The loss (`loss_fn`) then draws, from each sample's own key: the posterior sample, the noise (offset
noise and input perturbation included), the timestep and the conditioning dropout, and returns the
(min-SNR weighted) float32 MSE between the UNet's prediction and the target of `prediction_type`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from pipelines import text as textlib
from pipelines.family import Family
from sdx.schedulers import Scheduler, training
from sdx.vae import VAEConfig
from train import objective


@dataclasses.dataclass(frozen=True)
class DenoiseConfig:
    """The static part of the loss. text_drop: probability of the null text (text-to-image's
    proportion_empty_prompts); conditioning_dropout: InstructPix2Pix's p (text, image, both)."""

    family: Family
    scheduler: Scheduler
    vae: VAEConfig
    prediction_type: str
    snr_gamma: float | None = None
    noise_offset: float = 0.0
    input_perturbation: float = 0.0
    text_drop: float = 0.0
    conditioning_dropout: float = 0.0


def encode_batch(family: Family, vae, encoders: Mapping[str, nnx.Module], batch: Mapping[str, jax.Array], dtype):
    """Pixels and token ids -> what the loss reads (frozen models, no gradients).

    batch: "pixels" (B, H, W, 3) in [-1, 1] (pix2pix: "edited_pixels" and "original_pixels"), "ids"
    {encoder: (B, 1, 77)}, "time_ids" (B, 6) for SDXL, "index" (B,). Returns "moments" (B, h, w, 2C),
    "context" (B, 77, D), "pooled" (B, P) (SDXL), "time_ids", "image_latents" (B, h, w, C) (pix2pix), "index".
    """
    target = batch["edited_pixels"] if family.pix2pix else batch["pixels"]
    dist = vae.encode(target)
    out = {"moments": jnp.concatenate([dist.mean, dist.logvar], axis=-1), "index": batch["index"]}
    out["context"], pooled = textlib.encode(family, encoders, batch["ids"], None, dtype)
    if family.xl:
        out["pooled"], out["time_ids"] = pooled, batch["time_ids"]
    if family.pix2pix:
        image = vae.encode(batch["original_pixels"]).mode()
        out["image_latents"] = image * vae.config.scaling_factor if family.scaled_image_latents else image
    return jax.lax.stop_gradient(out)


def loss_fn(graphdef, cfg: DenoiseConfig) -> functools.partial:
    """(params, batch, keys, null) -> (loss, {}) for `train.step`; `null` (the step's constants): the null
    text conditioning {"context": (77, D), "pooled": (P,)} the pipeline uses without a (negative) prompt. A
    partial of module functions and values, so a compiled step is keyed by it (`pipelines.executables`)."""
    return functools.partial(_loss, graphdef, cfg)


def _loss(graphdef, cfg: DenoiseConfig, params, batch, keys, null):
    sched = cfg.scheduler
    unet = nnx.merge(graphdef, params)
    latents = objective.sample_latents(keys, batch["moments"], cfg.vae)
    noise, noise_in = objective.noise(keys, latents.shape[1:], cfg.noise_offset, cfg.input_perturbation)
    t = objective.timesteps(keys, sched.num_train_timesteps)
    noisy = training.add_noise(sched, latents, noise_in, t)
    cond = objective.mix_conditioning(*_dropout(cfg, keys), batch, null)
    added = {"text_embeds": cond["pooled"], "time_ids": batch["time_ids"]} if cfg.family.xl else None
    model_in = noisy
    if cfg.family.pix2pix:
        model_in = jnp.concatenate([noisy, cond["image_latents"].astype(noisy.dtype)], axis=-1)  # (B, h, w, 2C)
    pred = unet(model_in, t, cond["context"], added).astype(jnp.float32)
    target = objective.target(sched, cfg.prediction_type, latents, noise, t)
    weights = None
    if cfg.snr_gamma is not None:
        weights = objective.min_snr_weights(sched, t, cfg.snr_gamma, cfg.prediction_type)
    return objective.loss(pred, target, weights), {}


def _dropout(cfg: DenoiseConfig, keys):
    """(drop_text, drop_image or None) bool[B]."""
    if cfg.family.pix2pix:
        return objective.conditioning_dropout(keys, cfg.conditioning_dropout)
    return objective.empty_prompt(keys, cfg.text_drop), None
