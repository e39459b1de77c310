"""The generation as three ahead-of-time compiled programs and a Python loop over the model calls.

- prepare (text encoders, VAE encoder, the conditioning plug-ins' models): token ids -> the UNet batch of
  conditioning the guidance lays out, its text context projected by every attention of the UNet that reads
  it; what each plug-in makes once per image (`pipelines.plugin`: a ControlNet's projections of the text, a
  T2I-Adapter's feature maps, an IP-Adapter's image keys and values); the initial latents (noise, img2img's
  noised image latents, or given latents); InstructPix2Pix's image latents; inpainting's mask and
  masked-image latents.
- denoise (UNet, and the plug-ins' models that run at every call, ControlNets): `chunk` model calls as a
  `lax.fori_loop` from the call the scheduler state has reached, each: scale the input, the guider's
  prediction from the assembled model (`pipelines.denoiser`), the scheduler step, then what follows a step
  (inpainting's blending, the readouts, NaN tracking); the latents and scheduler state are donated from one
  call to the next.
- decode (VAE decoder): latents -> images.

The VAE (prepare's encoder, decode's decoder) takes one image per device at a time (`_in_turns`), so its
working memory does not grow with the batch.

Inpainting, as diffusers' StableDiffusion(XL)InpaintPipeline: a 9-channel inpainting UNet reads the
latents, the mask (the pixel mask at latent size) and the masked image's latents concatenated; an
ordinary 4-channel model instead has the known region put back after every step: the input image's
latents noised to the level of the next call (clean after the last), outside the mask.

Non-finite values are caught, never written as black images: each model call records, per image, the
first call after which its latents hold a NaN or an inf (`Carry.first_bad`), and decode reports which
images came out non-finite. A VAE that runs in a lower precision than float32 decodes those images
again in float32 (the float16 SDXL VAE overflows); what is still non-finite is returned in
`Sampled.bad_step` / `Sampled.bad_decode` for the caller to report.

`Sampler.__call__` runs prepare, then denoise until the schedule is done, reporting `progress(calls)`
as each denoise call finishes (while the next one is already queued), then decode. Why not one
program with the loop inside: reporting from a compiled loop needs a host callback
(`jax.debug.callback`), and JAX's persistent compilation cache refuses executables with host
callbacks, so nothing would be kept across runs. These programs have none (see
`enable_compilation_cache`), and `pipelines.executables` keeps them on disk under a key computed without
tracing, so a warm start neither traces, lowers nor compiles them.

The price of one model call per denoise call (`chunk=1`, the default) is the host's work per call,
mostly passing the UNet's parameter arrays: measured 1-2 ms per call against one fused loop on the
tiny demo model on a 2-core CPU (its model call takes 16 ms there; `chunk=4` brings it under 0.5 ms).
On an accelerator, dispatch is asynchronous and that work overlaps the previous call.

`Plan` holds everything that fixes shapes or control flow (static: a new value compiles anew);
`Inputs` holds everything else (traced: prompts as token ids, noise, keys, guidance scales, images, the
scheduler's tables), so a new prompt, seed or guidance scale reuses the compiled programs. Programs are
compiled once per plan and kept in memory.

Randomness per image, never per call: image j's key is `fold_in(PRNGKey(seed), j)` (see
`pipelines.request`). Its initial noise is the key's own draw, its img2img VAE posterior sample is drawn
from `fold_in(key, Stream.POSTERIOR)` and a stochastic sampler's noise at call c of the full schedule from
`fold_in(fold_in(key, Stream.STEP_NOISE), c)` (DPM++ SDE: from its Brownian path of
`fold_in(key, Stream.STEP_NOISE)`, `Scheduler.draw_noise`), each for image j alone: an image is the same at any
batch size, with or without guidance, on one device or a mesh.

Host memory on a CPU: the weights are their files' pages, used in place (`sdx.weights`); loading has the OS
read them into its page cache and a program maps each as it first reads it. Once prepare is done, the text
encoders' pages are unmapped again (`weights.unmap`), so they and the UNet's never count in the process at
once: SDXL in float32 at 256² peaks at 10.9 GiB instead of 13.6 (2-core VM, benchmarks/LOG.md). The next
prepare maps them back from the page cache (SDXL's: 0.1-0.2 s).

Sharding: the generation batch is split over every device of the mesh (`sdx.mesh.batch_sharding`),
parameters are placed by the loader (replicated, or FSDP-split), and XLA inserts the collectives. The
programs hand each other arrays with the shardings the first one chose.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pipelines import cpu_kernels, executables, guidance, host_memory, masks, text
from pipelines.denoiser import Denoiser
from pipelines.family import Family
from pipelines.guidance import Conditioning, Guidance, Scales
from pipelines.plugin import DENOISE, PREPARE, ModelCall, Ready
from sdx import interventions
from sdx import mesh as meshlib
from sdx import weights
from sdx.layers import TextContext
from sdx.schedulers import Scheduler, State

START_NOISE, START_IMAGE, START_LATENTS = "noise", "image", "latents"


class Stream(enum.IntEnum):
    """The `fold_in` constant of each draw taken from an image's key (its initial noise is the key's own)."""

    STEP_NOISE = 1  # stochastic samplers' noise, then folded with the call index
    POSTERIOR = 2  # img2img's (and inpainting's) VAE posterior sample of the input image
    MASKED_POSTERIOR = 3  # inpainting models: the VAE posterior sample of the masked image


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static part of a generation.

    batch: images per compiled call; height/width: pixels; steps: inference steps of the full schedule;
    begin/end: which model calls of it run (img2img strength, refiner hand-over, denoising_end);
    guidance: the branches each UNet call evaluates and how they combine;
    start: "noise" (text-to-image), "image" (img2img: encode, then noise to the first call's level),
    "latents" (continue given latents as they are: the refiner after the base);
    decode: return images (True) or final latents (False); chunks: 77-token text chunks per prompt;
    inpaint: a mask says what to repaint (`Inputs.mask`); blank_rows: a zero
    negative branch skips its cross-attentions (`Guidance.blank_rows`; set where `BLANK_ROWS_PLATFORMS` says);
    vae_tiling: the VAE encodes and decodes images larger than its tile in overlapping tiles (`sdx.vae_tiles`);
    interventions: what the request asks to change in the UNet (`sdx.interventions.Intervention`s), and
    `guidance` the guider, each as `sdx.interventions.split` leaves it: its traced fields None (their values
    are `Inputs.interventions` and `Inputs.guider`); weighting: how the prompts' token weights enter the
    conditioning (`pipelines.text.Weighting`; the weights are `Inputs.prompt_weights`); plugins: the conditioning
    plug-ins (`pipelines.plugin.Plugin`), split the same way (their values: `Inputs.plugins`).
    """

    family: Family
    scheduler: Scheduler
    guidance: Guidance
    batch: int
    height: int
    width: int
    steps: int
    begin: int
    end: int
    start: str = START_NOISE
    decode: bool = True
    chunks: int = 1
    clip_skip: int | None = None
    inpaint: bool = False
    blank_rows: bool = False
    vae_tiling: bool = False
    interventions: tuple = ()
    weighting: text.Weighting = text.PLAIN
    plugins: tuple = ()

    def encodes(self) -> bool:
        """Whether the prepare program runs the VAE's encoder (img2img, inpainting, InstructPix2Pix)."""
        return self.start == START_IMAGE or self.inpaint or self.family.inpaint or self.family.pix2pix

    def seen_by(self, program: str) -> Plan:
        """The plan as `program` ("prepare" or "denoise") reads it: `vae_tiling` only where that program runs
        the VAE (prepare when it encodes), so a plan that differs from another only there shares its programs
        and their files (`Pipeline.fitted`'s fallback to tiles, a `--vae-tiling` run after an untiled one)."""
        reads_tiling = program == "prepare" and self.encodes()
        return self if reads_tiling else dataclasses.replace(self, vae_tiling=False)

    def models(self, program: str) -> list[str]:
        """The `Sampler.models` names the plug-ins read in `program` (PREPARE or DENOISE), each once, in order."""
        return list(dict.fromkeys(name for plugin in self.plugins for name in plugin.models(program)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Inputs:
    """The traced part. B is Plan.batch; h, w the latent size; C the latent channels.

    ids / negative_ids: {encoder: (B, chunks, 77) int32}; zero_negative: (B,) bool, True where the
    negative conditioning is zeros (SDXL's force_zeros_for_empty_prompt); noise: (B, h, w, C) initial
    noise; keys: (B, 2) uint32, each image's PRNG key; scales: the guidance scales, (B,) each; time_ids /
    negative_time_ids: (B, 5 or 6) SDXL micro-conditioning (zeros (B, 0) otherwise); image: (B, H, W, 3)
    in [-1, 1] for img2img and InstructPix2Pix, (B, h, w, C) latents for start="latents", (B, 0, 0, 0)
    otherwise; mask: (B, H, W, 1) 1.0 where inpainting repaints, (0, 0, 0, 0) otherwise; state: the
    scheduler's tables for calls [begin, end); guider: the values of the guider's traced fields,
    interventions: those of each intervention's (`Plan.interventions`; `sdx.interventions.split`'s leaves),
    replicated; prompt_weights: {"positive", "negative"} -> {encoder: `pipelines.text.TokenWeights`} of ids
    and negative_ids (None with `Plan.weighting` "none"); plugins: each plug-in's traced values
    (`Plan.plugins`), every one with the batch's rows first.

    Everything but the scheduler's tables, the guider's and the interventions' values is one row per image, so
    the inputs of requests that share a plan (and those three) stack into one batch.
    """

    ids: dict[str, jax.Array]
    negative_ids: dict[str, jax.Array]
    zero_negative: jax.Array
    noise: jax.Array
    keys: jax.Array
    scales: Scales
    time_ids: jax.Array
    negative_time_ids: jax.Array
    image: jax.Array
    mask: jax.Array
    state: State
    guider: tuple = ()
    interventions: tuple = ()
    prompt_weights: dict | None = None
    plugins: tuple = ()


# `Inputs`' fields with one row per image (arrays, or pytrees of them, with the batch's rows first); the others
# (the scheduler's tables, the guider's and the interventions' values) are the same for every row
PER_ROW = ("ids", "negative_ids", "zero_negative", "noise", "keys", "scales", "time_ids", "negative_time_ids", "image",
           "mask", "prompt_weights", "plugins")


def take_rows(inputs: Inputs, rows) -> Inputs:
    """`inputs` of some of its images: `rows` (indices) of every per-row field (`PER_ROW`; an image or mask that is
    absent, (0, 0, 0, 0), stays so); the rest as it is."""
    pick = lambda a: a if np.shape(a)[0] == 0 else np.asarray(a)[np.asarray(rows)]  # noqa: E731
    return dataclasses.replace(inputs, **{f: jax.tree.map(pick, getattr(inputs, f)) for f in PER_ROW})


def stack(parts: list[Inputs], plan: Plan) -> Inputs:
    """The inputs of one call of `plan` (its batch) made of `parts`' rows (inputs of the same plan but for its
    batch, and the same shared values), in order, the last row repeated to fill the batch; the scheduler's
    state made for the batch."""
    rows = sum(np.shape(p.noise)[0] for p in parts)
    if rows > plan.batch:
        raise ValueError(f"{rows} rows for a batch of {plan.batch}")

    def join(*leaves):
        if np.shape(leaves[0])[0] == 0:
            return leaves[0]
        joined = np.concatenate([np.asarray(a) for a in leaves])
        return np.concatenate([joined, np.repeat(joined[-1:], plan.batch - rows, axis=0)])

    noise = np.shape(parts[0].noise)
    state = plan.scheduler.set_timesteps(plan.steps, (plan.batch, *noise[1:]), begin=plan.begin, end=plan.end)
    fields = {f: jax.tree.map(join, *[getattr(p, f) for p in parts]) for f in PER_ROW}
    return dataclasses.replace(parts[0], state=state, **fields)


def shared_values(inputs: Inputs) -> bytes:
    """What `inputs` hold that is the same for every row (the guider's and the interventions' values): requests
    whose plans are equal and whose shared values are equal can be `stack`ed into one call."""
    return b"".join(np.asarray(a).tobytes() for a in jax.tree.leaves((inputs.guider, inputs.interventions)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Carry:
    """What each model call changes: latents (B, h, w, C) float32, the scheduler state, first_bad
    (B,) int32: the model call (1-based, in the full schedule) after which an image's latents first held
    a NaN or an inf, 0 while they are finite; and readouts: each asked intervention's buffer
    (`sdx.interventions.Intervention.readout`, None for most)."""

    latents: jax.Array
    state: State
    first_bad: jax.Array
    readouts: tuple = ()


@dataclasses.dataclass(frozen=True)
class Sampled:
    """A sampler call's result: out (B, H, W, 3) images or (B, h, w, C) latents; bad_step (B,) host int:
    `Carry.first_bad` at the end; bad_decode (B,) host bool: finite latents whose decoded image is not
    finite even in float32; readouts: `Carry.readouts` at the end, on the host."""

    out: jax.Array
    bad_step: np.ndarray
    bad_decode: np.ndarray
    readouts: tuple = ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Known:
    """Inpainting with a 4-channel model: the input image's latents (B, h, w, C), the latent-size mask
    (B, h, w, 1), 1.0 where repainted, and the initial noise (B, h, w, C) they are noised with."""

    latents: jax.Array
    mask: jax.Array
    noise: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fixed:
    """What every model call reads and none changes: the UNet batch's conditioning (B * branches rows),
    its context as the UNet's `text_context` (every attention's keys and values of it, projected once),
    each image's key (B, 2), the guidance scales, what a 4-channel model's inpainting puts back, the guider's,
    the interventions' and the plug-ins' traced values (`Inputs.guider`, `Inputs.interventions`,
    `Inputs.plugins`) and what each plug-in's prepare made (`prepared`). What the interventions place on the
    UNet rides in `text.interventions`."""

    cond: Conditioning
    text: TextContext
    keys: jax.Array
    scales: Scales
    known: Known | None = None
    guider: tuple = ()
    interventions: tuple = ()
    plugins: tuple = ()
    prepared: tuple = ()


def enable_compilation_cache(path: str | os.PathLike | None, min_compile_secs: float = 1.0) -> None:
    """Turn on JAX's persistent compilation cache in `path` (None: leave it off), for programs that took
    at least `min_compile_secs` to compile, and with it the sampler's own executables in `path`/executables
    (`pipelines.executables`)."""
    if path is None:
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_secs)


def _per_image(keys: jax.Array, stream: Stream, draw: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """draw(key) from each image's `stream` sub-key, stacked on a leading batch axis."""
    return jax.vmap(lambda k: draw(jax.random.fold_in(k, int(stream))))(keys)


def _in_turns(fn: Callable, x: jax.Array, devices: int):
    """fn(x) for a VAE pass over a (B, ...) batch split over `devices`, run as a loop of B / devices turns of
    one image per device: a VAE's working memory grows with its batch (SDXL's decoder at 1024², bf16: 3 GiB
    an image by XLA's analysis on a CPU, 12 GiB for four at once), the loop's stays one image's. Turn i
    takes image i of each device's share. fn: (devices, ...) -> a pytree of (devices, ...) arrays."""
    b = x.shape[0]
    if b <= devices:
        return fn(x)
    turns = x.reshape(devices, b // devices, *x.shape[1:]).swapaxes(0, 1)  # (B, ...) -> (B/D, D, ...)
    out = jax.lax.map(fn, turns)
    return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(b, *o.shape[2:]), out)  # (B/D, D, ...) -> (B, ...)


# The backends on which SDXL's zero negative branch skips its cross-attentions (`Plan.blank_rows`, set
# when a request is planned). Not GPUs until measured there: a GPU's XLA reads a conditional's predicate
# back to the host, a wait in each attention (benchmarks/gpu_round.sh's blank_rows stage measures it).
BLANK_ROWS_PLATFORMS: tuple[str, ...] = ("cpu",)


def _prepare(graphdefs, params, inputs: Inputs, plan: Plan, dtype, devices: int) -> tuple[Carry, Fixed]:
    """Conditioning (with the UNet's projections of its context), what the plug-ins make once per image, and
    the initial latents. `dtype`: the UNet's compute dtype, for what it reads; `devices`: the mesh's, over which
    the VAE encodes in turns (`_in_turns`)."""
    models = {name: nnx.merge(graphdefs[name], params[name]) for name in params}
    guide, unet = interventions.bind(plan.guidance, inputs.guider), models["unet"]
    encode = functools.partial(models["vae"].encode, tiled=plan.vae_tiling)
    mask = masks.latent_mask(inputs.mask, models["vae"].config.downsample_factor) if plan.inpaint else None
    both, context = _conditioning(models, inputs, plan, guide, encode, mask, dtype, devices)
    x, known = _initial_latents(plan, inputs, models["vae"].config, encode, mask, devices)
    # SDXL's zero negative branch: its cross-attentions are skipped, behind a `lax.cond` per attention
    blank = guide.blank_rows(plan.family) if plan.blank_rows else None
    plugins = [interventions.bind(p, v) for p, v in zip(plan.plugins, inputs.plugins)]
    ready = Ready(both, guide, blank, unet, dtype, plan.family)
    prepared = tuple(plugin.prepare(models, ready) for plugin in plugins)
    asked = [interventions.bind(s, v) for s, v in zip(plan.interventions, inputs.interventions)]
    text = _unet_context(plan, unet, both.context, blank, (guide, *asked))
    fixed = Fixed(both, text, inputs.keys, inputs.scales, known, inputs.guider, inputs.interventions, inputs.plugins,
                  prepared)
    at = _readout(plan, guide, x, context)
    return Carry(x, inputs.state, jnp.zeros(x.shape[:1], jnp.int32), tuple(one.readout(at) for one in asked)), fixed


def _conditioning(models, inputs: Inputs, plan: Plan, guide: Guidance, encode: Callable, mask, dtype,
                  devices: int) -> tuple[Conditioning, jax.Array]:
    """(The UNet batch's conditioning as the guider lays it out, the prompts' own context (B, S, D)): the
    prompts' (and negative prompts') text, SDXL's time ids, and the channels concatenated to the UNet's input."""
    fam = plan.family
    encoders = {name: models[name] for name in fam.encoders}
    weights = inputs.prompt_weights or {"positive": None, "negative": None}
    context, pooled = text.encode(fam, encoders, inputs.ids, plan.clip_skip, dtype, plan.weighting, weights["positive"])
    extra = None  # channels concatenated to the UNet's input
    if fam.pix2pix:  # the image's latents ride along on the UNet's input channels, unscaled (the paper's setup)
        extra = _in_turns(encode, inputs.image, devices).mode()
        if fam.scaled_image_latents:
            extra = extra * models["vae"].config.scaling_factor
    elif fam.inpaint:  # the mask and the masked image's latents (masked pixels 0, mid-grey)
        masked = _sample_latents(models["vae"].config, encode, inputs.image * (inputs.mask < 0.5), inputs.keys,
                                 Stream.MASKED_POSTERIOR, devices)
        extra = jnp.concatenate([mask, masked], axis=-1)
    extra = None if extra is None else extra.astype(dtype)
    cond = Conditioning(context, pooled, inputs.time_ids.astype(dtype), extra)
    negative = None
    if guide.branches > 1:  # InstructPix2Pix's guidance lays out its image branches itself
        neg_context, neg_pooled = guidance.negative_conditioning(fam, encoders, inputs.negative_ids, inputs.zero_negative,
                                                                 dtype, plan.weighting, weights["negative"])
        negative = Conditioning(neg_context, neg_pooled, inputs.negative_time_ids.astype(dtype),
                                None if fam.pix2pix else extra)
    return guide.conditioning(cond, negative), context


def _initial_latents(plan: Plan, inputs: Inputs, vae_config, encode: Callable, mask,
                     devices: int) -> tuple[jax.Array, Known | None]:
    """(The latents the first model call reads, what a 4-channel model's inpainting puts back after each call)."""
    state = inputs.state
    blend = plan.inpaint and not plan.family.inpaint
    image_latents = None
    if plan.start == START_IMAGE or blend:
        image_latents = _sample_latents(vae_config, encode, inputs.image, inputs.keys, Stream.POSTERIOR, devices)
    if plan.start == START_NOISE:
        x = inputs.noise * state.init_noise_sigma
    elif plan.start == START_IMAGE:
        x = plan.scheduler.add_noise(state, image_latents, inputs.noise)
    else:
        x = inputs.image.astype(jnp.float32)
    return x, Known(image_latents, mask, inputs.noise) if blend else None


def _unet_context(plan: Plan, unet, context: jax.Array, blank, placed: tuple) -> TextContext:
    """The UNet's `text_context` of the UNet batch's context, carrying the interventions of the guider and the
    request (`placed`) with the schedule's length."""
    text = unet.text_context(context, blank)
    found = interventions.installed(unet, placed)
    if not (found.attention or found.sites):
        return text
    calls = len(plan.scheduler.timesteps(plan.steps))
    return dataclasses.replace(text, interventions=dataclasses.replace(found, calls=calls))


def _readout(plan: Plan, guide: Guidance, latents: jax.Array, context: jax.Array, index=None) -> interventions.Readout:
    """Where the sampler is, for the interventions' readouts (`sdx.interventions.Readout`)."""
    return interventions.Readout(latents.shape[0], tuple(latents.shape[1:3]), context.shape[1], guide.branches,
                                 guide.text_branch, len(plan.scheduler.timesteps(plan.steps)), index)


def _sample_latents(config, encode: Callable, images: jax.Array, keys: jax.Array, stream: Stream,
                    devices: int) -> jax.Array:
    """(B, H, W, 3) images -> (B, h, w, C) scaled latents of a VAE posterior sample (`encode`: the VAE's, of
    `config`), each image's from its own `stream` key (diffusers' `retrieve_latents(..., sample_mode="sample")`
    times the scaling factor); encoded in turns over `devices`."""
    posterior = _in_turns(encode, images, devices)
    eps = _per_image(keys, stream, lambda k: jax.random.normal(k, posterior.mean.shape[1:]))
    return config.to_latents(posterior.mean + posterior.std * eps)


def _denoise(graphdefs, params, carry: Carry, fixed: Fixed, plan: Plan, calls: int) -> tuple[Carry, jax.Array]:
    """`calls` model calls from where `carry.state` is. Also returns the state's call index, a small
    output the driver waits on to report progress (the carry itself is donated to the next call).
    graphdefs/params: {"unet", the plug-ins' denoise models (`Plan.models`)}."""
    models = {name: nnx.merge(graphdefs[name], params[name]) for name in params}
    sched, guide = plan.scheduler, interventions.bind(plan.guidance, fixed.guider)
    asked = [interventions.bind(s, v) for s, v in zip(plan.interventions, fixed.interventions)]
    plugins = tuple(zip((interventions.bind(p, v) for p, v in zip(plan.plugins, fixed.plugins)), fixed.prepared))
    shared = guidance.shared_rows(guide, plan.interventions, plan.family)  # rows whose input the UNet reads once

    def call(_, carry: Carry) -> Carry:
        st, x = carry.state, carry.latents
        c = plan.begin + st.index  # call index in the full schedule, so a refiner continues the base's stream
        latents_in = sched.scale_model_input(st, x).astype(models["unet"].compute.dtype)
        at = ModelCall(latents_in, st.timestep, st.index, fixed.cond, guide.branches, shared, models["unet"])
        model = Denoiser(models, _at_call(fixed.text, c), at, plugins, fixed.scales)
        step = guidance.Step(model, x, guide.model_input(latents_in, fixed.cond, shared), st.timestep, st, sched,
                             fixed.scales)
        out, records = interventions.capture(guide.predict, step)
        noise = _step_noise(sched, st, fixed.keys, c, x)
        st, x = sched.step(st, out, x, noise)
        return _after_step(plan, guide, asked, fixed, carry, st, x, records, c)

    carry = jax.lax.fori_loop(0, calls, call, carry)
    return carry, carry.state.index


def _at_call(text: TextContext, index: jax.Array) -> TextContext:
    """The UNet's context with the model call's index in the full schedule for its interventions."""
    placed = text.interventions
    return text if placed is None else dataclasses.replace(text, interventions=dataclasses.replace(placed, step=index))


def _step_noise(sched: Scheduler, state: State, keys: jax.Array, index: jax.Array, x: jax.Array) -> jax.Array | None:
    """A stochastic sampler's noise for model call `index` of the full schedule, each image's from its own key."""
    if not sched.stochastic:
        return None
    return _per_image(keys, Stream.STEP_NOISE, lambda k: sched.draw_noise(state, k, index, x.shape[1:]))


def _after_step(plan: Plan, guide: Guidance, asked: list, fixed: Fixed, carry: Carry, state: State, x: jax.Array,
                records: dict, index: jax.Array) -> Carry:
    """The carry after model call `index`: a 4-channel model's inpainting puts the known region back at the next
    call's noise level, the interventions fold in what they recorded, and images whose latents became NaN or inf
    are noted (`Carry.first_bad`)."""
    if fixed.known is not None:
        known = fixed.known
        x = (1 - known.mask) * plan.scheduler.add_noise(state, known.latents, known.noise) + known.mask * x
    at = _readout(plan, guide, carry.latents, fixed.cond.context, index)
    readouts = tuple(one.accumulate(buffer, records, at) for one, buffer in zip(asked, carry.readouts))
    newly_bad = (carry.first_bad == 0) & ~_finite(x)
    return Carry(x, state, jnp.where(newly_bad, index + 1, carry.first_bad), readouts)


def working_bytes(program: jax.stages.Compiled) -> int:
    """What a program allocates per device beyond its inputs: its temporaries and outputs, by XLA's own
    memory analysis, read once per program: on a GPU the analysis takes a tenth of a second or more a
    program, and `Pipeline.fitted` asks for it at every generation whose batch size is left open."""
    if program not in _WORKING_BYTES:
        stats = program.memory_analysis()
        _WORKING_BYTES[program] = stats.temp_size_in_bytes + stats.output_size_in_bytes
    return _WORKING_BYTES[program]


_WORKING_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # program -> working_bytes(program)


def _finite(x: jax.Array) -> jax.Array:
    """(B, ...) -> (B,) bool: every value of the image finite."""
    return jnp.isfinite(x).all(axis=tuple(range(1, x.ndim)))


def _decode(graphdef, params, latents: jax.Array, devices: int, tiled: bool) -> tuple[jax.Array, jax.Array]:
    """Images (B, H, W, 3) float32 and which of them are finite (B,), decoded in turns over `devices`, in
    tiles if `tiled` (`Plan.vae_tiling`)."""
    vae = nnx.merge(graphdef, params)
    decode = functools.partial(vae.decode, tiled=tiled)
    images = _in_turns(decode, vae.config.from_latents(latents), devices).astype(jnp.float32)
    return images, _finite(images)


def _float32_vae(vae: nnx.Module) -> nnx.Module:
    """`vae` computing in float32 with its parameters cast to float32 (shardings kept)."""
    f32 = dataclasses.replace(vae.compute, dtype=jnp.dtype(jnp.float32), param_dtype=jnp.dtype(jnp.float32))
    graphdef = nnx.graphdef(weights.abstract(lambda rngs: type(vae)(vae.config, f32, rngs=rngs)))
    return nnx.merge(graphdef, jax.tree.map(lambda a: a.astype(jnp.float32), nnx.state(vae)))


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """A plan's programs before compiling: the functions, the sizes of the denoise calls, the compiler
    options and each program's file (`executables.path_of`; None: not kept, `KEYED`: known once compiled)."""

    prepare_fn: functools.partial
    denoise_fns: dict[int, functools.partial]
    decode_fn: functools.partial | None
    sizes: tuple[int, ...]
    options: dict
    prepare_path: Path | None
    denoise_paths: dict[int, Path | None | str]
    decode_path: Path | None | str

    def paths(self) -> list[Path | None | str]:
        return [self.prepare_path, *self.denoise_paths.values(), self.decode_path]


@dataclasses.dataclass(frozen=True)
class _Programs:
    """One plan's compiled programs. sizes: the model calls of each denoise call, in order; denoise:
    a program per distinct size; decode: None when the plan returns latents."""

    prepare: Callable
    denoise: dict[int, Callable]
    sizes: tuple[int, ...]
    decode: Callable | None

    def working_bytes(self, decode: bool = True) -> int:
        """What running the plan allocates per device beyond the resident parameters: the largest of its
        programs' (`working_bytes`), the decode's left out unless `decode`."""
        decodes = [self.decode] if self.decode and decode else []
        return max(map(working_bytes, [self.prepare, *self.denoise.values(), *decodes]))

    def flops(self) -> float:
        """Floating-point operations of one run of the plan, by XLA's own cost analysis of each program.
        The analysis counts a loop's body once, so a denoise program's count is one model call's; a loop
        inside a model is counted once too (the `chunked` attention's blocks: use `xla` to count). On a GPU
        the count leaves out what compiling hands to cuBLAS and cuDNN (benchmarks/flops.py counts the model
        math instead)."""
        count = lambda p: float(p.cost_analysis().get("flops", 0.0))
        per_call = {n: count(d) for n, d in self.denoise.items()}
        return count(self.prepare) + sum(per_call[n] * n for n in self.sizes) + (count(self.decode) if self.decode else 0.0)


class Sampler:
    """Compiles and runs the programs for a set of loaded models on a mesh.

    models: {"unet", "vae", "text_encoder"[, "text_encoder_2"], and the conditioning plug-ins' (ControlNets,
    T2I-Adapters, IP-Adapters and their image encoders: `pipelines.plugin.model_name`)} live nnx modules (already
    placed);
    chunk: model calls per denoise call; compile_log: called with (plan, seconds) after each plan's
    programs are compiled; compilations counts those plans.
    """

    def __init__(self, models: Mapping[str, nnx.Module], mesh, compile_log: Callable | None = None, chunk: int = 1):
        self.models = dict(models)
        split = {name: nnx.split(model) for name, model in self.models.items()}
        self.graphdefs = {name: g for name, (g, _) in split.items()}
        self.params = {name: p for name, (_, p) in split.items()}
        self.mesh = mesh
        self.chunk = chunk
        self.compile_log = compile_log
        self._programs: dict[Plan, _Programs] = {}
        self._compiled: dict[tuple, object] = {}  # `_once`'s
        self.compilations = 0
        self._decode32 = {}  # Plan.vae_tiling -> (jitted decode, float32 VAE parameters), made when first needed
        self._unmap_encoders = mesh.devices.flat[0].platform == "cpu"

    def update(self, name: str, module: nnx.Module) -> None:
        """Model `name` replaced by `module`, of the same graph definition and shardings (new weights: a
        training run's latest, validated every N steps). The compiled programs stay: they take the
        parameters as arguments."""
        graphdef, params = nnx.split(module)
        if graphdef != self.graphdefs[name]:
            raise ValueError(f"Sampler.update: the new {name!r} is not built like the old one; make a new Sampler")
        self.models[name], self.params[name] = module, params

    def flops(self) -> dict[Plan, float]:
        """{plan: XLA's count of the floating-point operations of one run} for every plan compiled so far."""
        return {plan: programs.flops() for plan, programs in self._programs.items()}

    def place(self, inputs: Inputs) -> Inputs:
        """Batch axes split over the mesh (the scheduler's sample-shaped history on its batch axis, the
        4th from the end), everything else replicated."""
        batched = lambda a: jax.device_put(a, meshlib.batch_sharding(self.mesh, np.ndim(a)))
        rep = lambda a: jax.device_put(a, meshlib.replicated(self.mesh))

        def history(a):  # (..., B, h, w, C)
            spec = meshlib.batch_sharding(self.mesh, 4).spec
            return jax.device_put(a, NamedSharding(self.mesh, PartitionSpec(*[None] * (np.ndim(a) - 4), *spec)))

        state = jax.tree.map(rep, dataclasses.replace(inputs.state, history={}))
        return Inputs(
            ids=jax.tree.map(batched, inputs.ids),
            negative_ids=jax.tree.map(batched, inputs.negative_ids),
            zero_negative=batched(inputs.zero_negative),
            noise=batched(inputs.noise),
            keys=batched(inputs.keys),
            scales=jax.tree.map(batched, inputs.scales),
            time_ids=batched(inputs.time_ids),
            negative_time_ids=batched(inputs.negative_time_ids),
            image=batched(inputs.image) if np.shape(inputs.image)[0] else rep(inputs.image),
            mask=batched(inputs.mask) if np.shape(inputs.mask)[0] else rep(inputs.mask),
            state=dataclasses.replace(state, history=jax.tree.map(history, inputs.state.history)),
            guider=jax.tree.map(rep, inputs.guider),
            interventions=jax.tree.map(rep, inputs.interventions),
            prompt_weights=jax.tree.map(batched, inputs.prompt_weights),
            plugins=jax.tree.map(batched, inputs.plugins),
        )

    def _prepare_params(self, plan: Plan) -> dict:
        return {name: self.params[name] for name in ("vae", "unet", *plan.family.encoders, *plan.models(PREPARE))}

    def _denoise_params(self, plan: Plan) -> dict:
        return {name: self.params[name] for name in ("unet", *plan.models(DENOISE))}

    def _recipe(self, plan: Plan, inputs: Inputs) -> _Recipe:
        """What the plan's programs are made of, and their files (`inputs`: placed, for their shapes and
        shardings). Parameters may be abstract (`jax.ShapeDtypeStruct` with their shardings): the files are
        keyed by shapes, dtypes and shardings alone."""
        params = self._prepare_params(plan)
        graphdefs = {name: self.graphdefs[name] for name in params}
        devices = self.mesh.devices.size
        prepare_fn = functools.partial(_prepare, graphdefs, plan=plan.seen_by("prepare"),
                                       dtype=self.models["unet"].compute.dtype, devices=devices)
        n = inputs.state.num_calls
        sizes = (self.chunk,) * (n // self.chunk) + ((n % self.chunk,) if n % self.chunk else ())
        unet_params = self._denoise_params(plan)
        unet_graphdefs = {name: self.graphdefs[name] for name in unet_params}
        denoise_fns = {calls: functools.partial(_denoise, unet_graphdefs, plan=plan.seen_by("denoise"), calls=calls)
                       for calls in set(sizes)}
        decode_fn = (functools.partial(_decode, self.graphdefs["vae"], devices=devices, tiled=plan.vae_tiling)
                     if plan.decode else None)

        # denoise and decode also take prepare's outputs: their keys name prepare's, so a warm start reads
        # all three files at once. A prepare without a key (a researcher's own text encoder or VAE class)
        # leaves them keyed by all their arguments, known once prepare is compiled.
        options = cpu_kernels.compiler_options(self.mesh)
        prepare_path = executables.path_of(prepare_fn, (params, inputs), {}, options)
        after = lambda fn, fn_params, **jit_options: (
            executables.KEYED if prepare_path is None else
            executables.path_of(fn, (fn_params,), jit_options, options, after=prepare_path))
        denoise_paths = {calls: after(fn, unet_params, donate_argnums=1) for calls, fn in denoise_fns.items()}
        decode_path = after(decode_fn, self.params["vae"]) if plan.decode else None
        return _Recipe(prepare_fn, denoise_fns, decode_fn, sizes, options, prepare_path, denoise_paths, decode_path)

    def prefetch(self, plan: Plan, inputs: Inputs) -> None:
        """Start reading the plan's stored programs in the background (`executables.prefetch`), for
        `compiled` to take: a `Pipeline.load` shell over abstract models does it while the weights load."""
        executables.prefetch(self._recipe(plan, inputs).paths())

    def _once(self, key: tuple, make: Callable):
        """make(), the first time `key` is asked for; then what it made."""
        if key not in self._compiled:
            self._compiled[key] = make()
        return self._compiled[key]

    def compiled(self, plan: Plan, inputs: Inputs) -> _Programs:
        """The plan's programs, compiled on first use (`inputs`: placed, for their shapes and shardings), or
        read from `pipelines.executables`' files, side by side (`executables.prefetch`)."""
        if plan in self._programs:
            return self._programs[plan]
        t0 = time.perf_counter()
        r = self._recipe(plan, inputs)
        executables.prefetch(r.paths())
        # prepare and denoise are compiled once per plan as they read it (`Plan.seen_by`), denoise also per
        # prepare's output shapes and shardings: plans that differ only in what they do not read share them
        prepare = self._once(("prepare", plan.seen_by("prepare")), lambda: executables.compile(
            r.prepare_fn, self._prepare_params(plan), inputs, path=r.prepare_path, compiler_options=r.options))
        carry, fixed = prepare.out_info  # shapes and the shardings XLA chose: the other programs keep them
        keep = (jax.tree.map(lambda s: s.sharding, carry), meshlib.replicated(self.mesh))
        info = (tuple(jax.tree.leaves(prepare.out_info)), jax.tree.structure(prepare.out_info))
        denoise = self._once(("denoise", plan.seen_by("denoise"), *info), lambda: {
            calls: executables.compile(fn, self._denoise_params(plan), carry, fixed, path=r.denoise_paths[calls],
                                       compiler_options=r.options, out_shardings=keep, donate_argnums=1)
            for calls, fn in r.denoise_fns.items()})
        decode = executables.compile(r.decode_fn, self.params["vae"], carry.latents, path=r.decode_path,
                                     compiler_options=r.options) if plan.decode else None
        self._programs[plan] = _Programs(prepare, denoise, r.sizes, decode)
        host_memory.trim()  # what XLA freed after compiling or reading the programs
        self.compilations += 1
        if self.compile_log:
            self.compile_log(plan, time.perf_counter() - t0)
        return self._programs[plan]

    def __call__(self, plan: Plan, inputs: Inputs, progress: Callable[[int], None] | None = None,
                 watch: Callable[[jax.Array], None] | None = None) -> Sampled:
        """Images (B, H, W, 3) float32 roughly in [-1, 1], or latents (B, h, w, C) when not plan.decode,
        with what came out non-finite. progress(n) is called as each denoise call's n model calls finish;
        watch(latents) after each denoise call is queued, with its latents (B, h, w, C) on the device: valid
        until watch returns (the next call takes over their buffer), so reading them waits for the call."""
        meshlib.check_batch(self.mesh, plan.batch)
        inputs = self.place(inputs)
        programs = self.compiled(plan, inputs)
        carry, fixed = programs.prepare(self._prepare_params(plan), inputs)
        if self._unmap_encoders:  # the encoders' file pages leave the process until the next prepare
            jax.block_until_ready((carry, fixed))
            only_prepare = set(plan.models(PREPARE)) - set(plan.models(DENOISE))  # an IP-Adapter's image encoder
            weights.unmap([self.params[name] for name in (*plan.family.encoders, *sorted(only_prepare))])
        queued = []  # (index output, calls) of denoise calls not yet reported
        for calls in programs.sizes:
            carry, index = programs.denoise[calls](self._denoise_params(plan), carry, fixed)
            if watch is not None:
                watch(carry.latents)
            if progress is not None:
                queued.append((index, calls))
                if len(queued) > 1:  # report a call once done, while the next one already waits on the device
                    _report(progress, *queued.pop(0))
        out, finite = carry.latents, None
        if programs.decode is not None:
            out, finite = programs.decode(self.params["vae"], carry.latents)
        for done in queued:
            _report(progress, *done)
        bad_step = meshlib.to_host(carry.first_bad)
        bad_decode = np.zeros(plan.batch, bool) if finite is None else (bad_step == 0) & ~meshlib.to_host(finite)
        if bad_decode.any() and self.models["vae"].compute.dtype != jnp.float32:
            out, finite = self._in_float32(out, carry.latents, bad_decode, plan.vae_tiling)
            bad_decode = bad_decode & ~meshlib.to_host(finite)
        return Sampled(out, bad_step, bad_decode, jax.tree.map(meshlib.to_host, carry.readouts))

    def _in_float32(self, images: jax.Array, latents: jax.Array, redo: np.ndarray,
                    tiled: bool) -> tuple[jax.Array, jax.Array]:
        """`images` with the `redo` ones decoded again by the VAE in float32 (in tiles if `tiled`), and which
        are now finite."""
        if tiled not in self._decode32:
            graphdef, params = nnx.split(_float32_vae(self.models["vae"]))
            self._decode32[tiled] = (
                jax.jit(functools.partial(_decode, graphdef, devices=self.mesh.devices.size, tiled=tiled)), params)
        decode, params = self._decode32[tiled]
        again, finite = decode(params, latents)
        mask = jnp.asarray(redo)[:, None, None, None]
        return jnp.where(mask, again, images), finite


def _report(progress: Callable[[int], None], index: jax.Array, calls: int) -> None:
    index.block_until_ready()
    progress(calls)
