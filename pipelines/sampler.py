"""The whole generation as one jitted function: text encoding, every sampler step, guidance, VAE decode.

`Plan` holds everything that fixes shapes or control flow (static: a new value compiles anew);
`Inputs` holds everything else (traced: prompts as token ids, noise, guidance scales, images, the
scheduler's tables), so a new prompt, seed or guidance scale reuses the compiled program. Programs are
compiled ahead of time (`jit(...).lower(...).compile()`) once per plan and kept in memory; JAX's
persistent compilation cache (see `enable_compilation_cache`) keeps them across runs.

Sharding: the generation batch is split over every device of the mesh (`sdx.mesh.batch_sharding`),
parameters are placed by the loader (replicated, or FSDP-split), and XLA inserts the collectives.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipelines import guidance, text
from pipelines.family import Family
from sdx import mesh as meshlib
from sdx.schedulers import Scheduler, State

START_NOISE, START_IMAGE, START_LATENTS = "noise", "image", "latents"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static part of a generation.

    batch: images per compiled call; height/width: pixels; steps: inference steps of the full schedule;
    begin/end: which model calls of it run (img2img strength, refiner hand-over, denoising_end);
    cfg: whether the negative branch runs (diffusers skips it for guidance_scale <= 1);
    start: "noise" (text-to-image), "image" (img2img: encode, then noise to the first step's level),
    "latents" (continue given latents as they are: the refiner after the base);
    decode: return images (True) or final latents (False); chunks: 77-token text chunks per prompt.
    """

    family: Family
    scheduler: Scheduler
    batch: int
    height: int
    width: int
    steps: int
    begin: int
    end: int
    cfg: bool
    start: str = START_NOISE
    decode: bool = True
    chunks: int = 1
    clip_skip: int | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Inputs:
    """The traced part. B is Plan.batch; h, w the latent size; C the latent channels.

    ids / negative_ids: {encoder: (B, chunks, 77) int32}; zero_negative: (B,) 1.0 where the negative
    conditioning is zeros (SDXL's force_zeros_for_empty_prompt); noise: (B, h, w, C) initial noise;
    key: PRNG key for stochastic samplers and the img2img VAE sample; scales: (3,) guidance scale,
    image guidance scale, guidance rescale; time_ids / negative_time_ids: (B, 5 or 6) SDXL
    micro-conditioning (zeros (B, 0) otherwise); image: (B, H, W, 3) in [-1, 1] for img2img and
    InstructPix2Pix, (B, h, w, C) latents for start="latents", (B, 0, 0, 0) otherwise; state: the
    scheduler's tables for calls [begin, end).
    """

    ids: dict[str, jax.Array]
    negative_ids: dict[str, jax.Array]
    zero_negative: jax.Array
    noise: jax.Array
    key: jax.Array
    scales: jax.Array
    time_ids: jax.Array
    negative_time_ids: jax.Array
    image: jax.Array
    state: State


def enable_compilation_cache(path: str | os.PathLike | None) -> None:
    """Turn on JAX's persistent compilation cache in `path` (None: leave it off)."""
    if path is None:
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


# The progress hook the compiled loop calls once per model call. A module-level slot, not a closure, so
# that a cached executable reports to whichever run is current (callbacks arrive on XLA's own threads).
_progress: list[Callable[[int], None] | None] = [None]


def set_progress(callback: Callable[[int], None] | None) -> None:
    _progress[0] = callback


def _report(i) -> None:
    if _progress[0] is not None:
        _progress[0](int(i))


def _generate(graphdef, params, inputs: Inputs, plan: Plan):
    models = nnx.merge(graphdef, params)
    unet, vae = models["unet"], models["vae"]
    fam, sched, state = plan.family, plan.scheduler, inputs.state
    dtype = unet.conv_in.kernel.dtype
    enc = {name: models[name] for name in fam.encoders}

    context, pooled = text.encode(fam, enc, inputs.ids, plan.clip_skip, dtype)
    if plan.cfg:
        neg_context, neg_pooled = text.encode(fam, enc, inputs.negative_ids, plan.clip_skip, dtype)
        keep = (1.0 - inputs.zero_negative).astype(dtype)
        neg_context = neg_context * keep[:, None, None]
        neg_pooled = None if neg_pooled is None else neg_pooled * keep[:, None]

    vae_cfg = vae.config
    latent_key, step_key = jax.random.split(inputs.key)
    if plan.start == START_NOISE:
        x = inputs.noise * state.init_noise_sigma
    elif plan.start == START_IMAGE:
        z = vae.encode(inputs.image.astype(vae_dtype(vae))).sample(latent_key)
        x = sched.add_noise(state, vae_cfg.to_latents(z).astype(jnp.float32), inputs.noise)
    else:
        x = inputs.image.astype(jnp.float32)

    if fam.pix2pix:  # the image's latents ride along on the UNet's input channels, unscaled (the paper's setup)
        image_latents = vae.encode(inputs.image.astype(vae_dtype(vae))).mode()
        if fam.scaled_image_latents:
            image_latents = image_latents * vae_cfg.scaling_factor
        image_latents = image_latents.astype(dtype)
        if plan.cfg:
            image_latents = jnp.concatenate([image_latents, image_latents, jnp.zeros_like(image_latents)])

    # the UNet batch: [text] or [negative, text] or pix2pix's [text, negative, negative]
    if not plan.cfg:
        ctx, added_text, time_ids = context, pooled, inputs.time_ids
    elif fam.pix2pix:
        ctx = jnp.concatenate([context, neg_context, neg_context])
        added_text = None if pooled is None else jnp.concatenate([pooled, neg_pooled, neg_pooled])
        time_ids = jnp.concatenate([inputs.time_ids] * 3)
    else:
        ctx = jnp.concatenate([neg_context, context])
        added_text = None if pooled is None else jnp.concatenate([neg_pooled, pooled])
        time_ids = jnp.concatenate([inputs.negative_time_ids, inputs.time_ids])
    added = {"text_embeds": added_text, "time_ids": time_ids.astype(dtype)} if fam.xl else None
    copies = (3 if fam.pix2pix else 2) if plan.cfg else 1
    g, g_image, phi = inputs.scales[0], inputs.scales[1], inputs.scales[2]

    def body(i, carry):
        st, x = carry
        model_in = jnp.concatenate([sched.scale_model_input(st, x)] * copies).astype(dtype)
        if fam.pix2pix:
            model_in = jnp.concatenate([model_in, image_latents], axis=-1)
        t = jnp.broadcast_to(st.timestep, (model_in.shape[0],))
        out = unet(model_in, t, ctx, added).astype(jnp.float32)
        if plan.cfg and fam.pix2pix:
            txt, img, unc = jnp.split(out, 3)
            out = guidance.rescale(guidance.pix2pix(txt, img, unc, g, g_image), txt, phi)
        elif plan.cfg:
            unc, txt = jnp.split(out, 2)
            out = guidance.rescale(guidance.classifier_free(unc, txt, g), txt, phi)
        noise = jax.random.normal(jax.random.fold_in(step_key, i), x.shape, jnp.float32) if sched.stochastic else None
        st, x = sched.step(st, out, x, noise)
        jax.debug.callback(_report, i)
        return st, x

    _, x = jax.lax.fori_loop(0, state.num_calls, body, (state, x))
    if not plan.decode:
        return x
    image = vae.decode(vae_cfg.from_latents(x).astype(vae_dtype(vae)))
    return image.astype(jnp.float32)


def vae_dtype(vae) -> jnp.dtype:
    return vae.decoder.conv_in.kernel.dtype


class Sampler:
    """Compiles and runs `_generate` for a set of loaded models on a mesh.

    models: {"unet", "vae", "text_encoder"[, "text_encoder_2"]} live nnx modules (already placed);
    compile_log: called with (plan, seconds) after each compilation.
    """

    def __init__(self, models: Mapping[str, nnx.Module], mesh, compile_log: Callable | None = None):
        self.graphdef, self.params = nnx.split(nnx.Dict(dict(models)))
        self.mesh = mesh
        self.compile_log = compile_log
        self._compiled: dict[Plan, Callable] = {}
        self.compilations = 0

    def place(self, inputs: Inputs) -> Inputs:
        """Batch axes split over the mesh, everything else replicated."""
        batched = lambda a: jax.device_put(a, meshlib.batch_sharding(self.mesh, np.ndim(a)))
        rep = lambda a: jax.device_put(a, meshlib.replicated(self.mesh))
        return Inputs(
            ids=jax.tree.map(batched, inputs.ids),
            negative_ids=jax.tree.map(batched, inputs.negative_ids),
            zero_negative=batched(inputs.zero_negative),
            noise=batched(inputs.noise),
            key=rep(inputs.key),
            scales=rep(inputs.scales),
            time_ids=batched(inputs.time_ids),
            negative_time_ids=batched(inputs.negative_time_ids),
            image=batched(inputs.image) if np.shape(inputs.image)[0] else rep(inputs.image),
            state=jax.tree.map(rep, inputs.state),
        )

    def compiled(self, plan: Plan, inputs: Inputs):
        if plan not in self._compiled:
            t0 = time.perf_counter()
            fn = jax.jit(lambda params, inp: _generate(self.graphdef, params, inp, plan))
            self._compiled[plan] = fn.lower(self.params, inputs).compile()
            self.compilations += 1
            if self.compile_log:
                self.compile_log(plan, time.perf_counter() - t0)
        return self._compiled[plan]

    def __call__(self, plan: Plan, inputs: Inputs) -> jax.Array:
        meshlib.check_batch(self.mesh, plan.batch)
        inputs = self.place(inputs)
        return self.compiled(plan, inputs)(self.params, inputs)
