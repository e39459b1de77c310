"""The denoising loss of text-to-image and InstructPix2Pix fine-tuning, on already-encoded batches.

The frozen models run first (`encode_batch`, its own jitted program): the VAE turns pixels into posterior
moments (and, for InstructPix2Pix, the input image into its latents' mode, unscaled as the pipeline makes
them), the text encoders turn token ids into the context and pooled embeddings. `--cache_latents`
stores exactly these arrays, so a cached and an uncached run train on the same numbers.

The loss (`loss_fn`) then draws, from each sample's own key: the posterior sample, the noise (offset
noise and input perturbation included), the timestep and the conditioning dropout, and returns the
(min-SNR weighted) float32 MSE between the UNet's prediction and the target of `prediction_type`; with
--pixel_loss_weight, plus the weighted pixel error of the picture the prediction implies (`PixelLoss`).

`--train_text_encoder` (LoRA adapters on the text encoders too): the encoders are trained, so they run
inside the loss on the batch's token ids, and `encode_batch` passes the ids through instead. A dropped
caption is then the empty prompt's ids encoded by the same adapted encoders (diffusers' empty captions),
or, for a model that uses zeros for no prompt (SDXL's force_zeros_for_empty_prompt), zeros as before.
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
class PixelLoss:
    """--pixel_loss_weight: `weight` times the batch mean of each sample's pixel error (`objective.pixel_error`,
    edges weighed by `edge_weight`) of its predicted clean latents (`objective.predicted_x0`) decoded by the
    frozen VAE against its clean latents decoded, counted where the sample's timestep is below `max_timestep`
    (above it the prediction implies little of the picture, and at zero terminal SNR nothing). `vae`: the VAE's
    graphdef; its state is the step's constants' "vae"."""

    weight: float
    edge_weight: float
    max_timestep: int
    vae: nnx.GraphDef


@dataclasses.dataclass(frozen=True)
class DenoiseConfig:
    """The static part of the loss. text_drop: probability of the null text (text-to-image's
    proportion_empty_prompts); conditioning_dropout: InstructPix2Pix's p (text, image, both); text_dtype:
    the text encoders' compute dtype when they train (run in the loss), None when the batch holds their
    output; prior_loss_weight: DreamBooth's prior preservation (the batch's "prior" flags its class images,
    half of it), or None; controlnet: a ControlNet trains, its residuals (of the batch's "control" image)
    added to the frozen UNet's skips and mid block; t2i_adapter: a T2I-Adapter trains, its feature maps (of
    the batch's "control" image) added inside the frozen UNet's down blocks, the timesteps drawn cubically
    (`objective.timesteps`); timestep_bias: the timesteps' weights (None: uniform);
    dream_detail_preservation: DREAM's p (`objective.dream`), or None without DREAM."""

    family: Family
    scheduler: Scheduler
    vae: VAEConfig
    prediction_type: str
    snr_gamma: float | None = None
    noise_offset: float = 0.0
    input_perturbation: float = 0.0
    text_drop: float = 0.0
    conditioning_dropout: float = 0.0
    text_dtype: str | None = None
    prior_loss_weight: float | None = None
    controlnet: bool = False
    t2i_adapter: bool = False
    timestep_bias: objective.TimestepBias | None = None
    dream_detail_preservation: float | None = None
    pixel_loss: PixelLoss | None = None


def encode_batch(family: Family, vae, encoders: Mapping[str, nnx.Module] | None, batch: Mapping[str, jax.Array],
                 dtype):
    """Pixels and token ids -> what the loss reads (frozen models, no gradients).

    batch: "pixels" (B, H, W, 3) in [-1, 1] (pix2pix: "edited_pixels" and "original_pixels"), "ids"
    {encoder: (B, 1, 77)}, "time_ids" (B, 6) for SDXL, "index" (B,), "prior" (B,) bool under DreamBooth's
    prior preservation (passed through), "conditioning_pixels" (B, H, W, 3) in [-1, 1] for a ControlNet or a
    T2I-Adapter.
    Returns "moments" (B, h, w, 2C), "context" (B, 77, D), "pooled" (B, P) (SDXL), "time_ids",
    "image_latents" (B, h, w, C) (pix2pix), "control" (B, H, W, 3) in [0, 1], "prior", "index".
    encoders None (they train, `DenoiseConfig.text_dtype`): "ids" (B, E, 77), each encoder's in
    `family.encoders` order, instead of "context" and "pooled".
    """
    target = batch["edited_pixels"] if family.pix2pix else batch["pixels"]
    dist = vae.encode(target)
    out = {"moments": jnp.concatenate([dist.mean, dist.logvar], axis=-1), "index": batch["index"]}
    if encoders is None:
        out["ids"] = jnp.concatenate([batch["ids"][e] for e in family.encoders], axis=1)  # (B, E, 77)
    else:
        out["context"], pooled = textlib.encode(family, encoders, batch["ids"], None, dtype)
        if family.xl:
            out["pooled"] = pooled
    if family.xl:
        out["time_ids"] = batch["time_ids"]
    if "prior" in batch:  # DreamBooth's class images (B,)
        out["prior"] = batch["prior"]
    if "conditioning_pixels" in batch:  # a ControlNet's image, [-1, 1] -> [0, 1] (B, H, W, 3)
        out["control"] = (batch["conditioning_pixels"] + 1) / 2
    if family.pix2pix:
        image = vae.encode(batch["original_pixels"]).mode()
        out["image_latents"] = image * vae.config.scaling_factor if family.scaled_image_latents else image
    return jax.lax.stop_gradient(out)


def loss_fn(graphdef, cfg: DenoiseConfig) -> functools.partial:
    """(params, batch, keys, constants) -> (loss, aux) for `train.step`; `constants` (the step's): the null
    text conditioning {"context": (77, D), "pooled": (P,)} the pipeline uses without a (negative) prompt, and
    with `cfg.pixel_loss` the VAE's state in "vae" (aux: its "pixel_error"; else aux is {}). A partial of
    module functions and values, so a compiled step is keyed by it (`pipelines.executables`).

    graphdef: the UNet's; with `cfg.text_dtype`, an nnx.Dict's of "unet" and each of `family.encoders`,
    and the null conditioning is {"ids": (E, 77)}, the empty prompt's ids, unless the family uses zeros for no prompt;
    with `cfg.controlnet`, an nnx.Dict's of "unet" and "controlnet"; with `cfg.t2i_adapter`, of "unet" and
    "t2i_adapter"."""
    return functools.partial(_loss, graphdef, cfg)


def _loss(graphdef, cfg: DenoiseConfig, params, batch, keys, constants):
    sched = cfg.scheduler
    model = nnx.merge(graphdef, params)
    latents = objective.sample_latents(keys, batch["moments"], cfg.vae)
    noise, noise_in = objective.noise(keys, latents.shape[1:], cfg.noise_offset, cfg.input_perturbation)
    t = objective.timesteps(keys, sched.num_train_timesteps, cfg.timestep_bias, cubic=cfg.t2i_adapter)
    noisy = training.add_noise(sched, latents, noise_in, t)
    drop_text, drop_image = _dropout(cfg, keys)
    unet = model["unet"] if isinstance(model, nnx.Dict) else model
    if cfg.text_dtype is None:
        cond = objective.mix_conditioning(drop_text, drop_image, batch, constants)
    else:
        cond = _encoded(cfg, model, batch, drop_text, constants)
    added = {"text_embeds": cond["pooled"], "time_ids": batch["time_ids"]} if cfg.family.xl else None

    def predict(x):  # the model's output for noisy latents x
        model_in = x
        if cfg.family.pix2pix:
            model_in = jnp.concatenate([x, cond["image_latents"].astype(x.dtype)], axis=-1)  # (B, h, w, 2C)
        residuals = {}
        if cfg.controlnet:
            down, mid = model["controlnet"](model_in, t, cond["context"], batch["control"], 1.0, added)
            residuals = {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
        if cfg.t2i_adapter:
            residuals = {"down_intrablock_additional_residuals": tuple(model["t2i_adapter"](batch["control"]))}
        return unet(model_in, t, cond["context"], added, **residuals).astype(jnp.float32)

    target = objective.target(sched, cfg.prediction_type, latents, noise, t)
    if cfg.dream_detail_preservation is not None:
        first = jax.lax.stop_gradient(predict(noisy))
        noisy, target = objective.dream(sched, t, noise, noisy, target, first, cfg.dream_detail_preservation)
    pred = predict(noisy)
    weights = None
    if cfg.snr_gamma is not None:
        weights = objective.min_snr_weights(sched, t, cfg.snr_gamma, cfg.prediction_type)
    if cfg.prior_loss_weight is not None:
        weights = objective.prior_preservation_weights(batch["prior"], weights, cfg.prior_loss_weight)
    total = objective.loss(pred, target, weights)
    if cfg.pixel_loss is None:
        return total, {}
    pixel = _pixel_error(cfg, constants["vae"], latents, noisy, pred, t)
    return total + cfg.pixel_loss.weight * pixel, {"pixel_error": pixel}


def _pixel_error(cfg: DenoiseConfig, vae_state, latents, noisy, pred, t):
    """f32: `PixelLoss`'s batch mean, before its weight."""
    px = cfg.pixel_loss
    vae = nnx.merge(px.vae, vae_state)
    counted = t < px.max_timestep
    safe_t = jnp.where(counted, t, 0)  # the others' x0 is never used; this keeps it (and its gradient) finite
    x0 = objective.predicted_x0(cfg.scheduler, cfg.prediction_type, noisy, pred, safe_t)
    decode = lambda z: vae.decode(cfg.vae.from_latents(z)).astype(jnp.float32)  # (B, H, W, 3)
    err = objective.pixel_error(decode(x0), jax.lax.stop_gradient(decode(latents)), px.edge_weight)
    return jnp.mean(jnp.where(counted, err, 0.0))


def _dropout(cfg: DenoiseConfig, keys):
    """(drop_text, drop_image or None) bool[B]."""
    if cfg.family.pix2pix:
        return objective.conditioning_dropout(keys, cfg.conditioning_dropout)
    return objective.empty_prompt(keys, cfg.text_drop), None


def _encoded(cfg: DenoiseConfig, models, batch, drop_text, null):
    """The conditioning of the batch's token ids "ids" (B, E, 77) through the trained encoders `models`; a
    dropped caption is the empty prompt's ids null["ids"] (E, 77), or zeros after encoding (force_zeros)."""
    fam, ids = cfg.family, batch["ids"]
    if not fam.force_zeros:
        ids = jnp.where(drop_text[:, None, None], null["ids"][None].astype(ids.dtype), ids)
    per_encoder = {e: ids[:, j, None] for j, e in enumerate(fam.encoders)}  # (B, 1, 77) each
    context, pooled = textlib.encode(fam, {e: models[e] for e in fam.encoders}, per_encoder, None,
                                     jnp.dtype(cfg.text_dtype))
    cond = {**batch, "context": context} | ({} if pooled is None else {"pooled": pooled})
    return objective.mix_conditioning(drop_text, None, cond, null) if fam.force_zeros else cond
