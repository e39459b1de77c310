"""A loaded model ready to generate: models on the mesh, its family, its scheduler, a `Sampler`.

    pipe = Pipeline.load(folder, dtype="bfloat16")
    images = pipe(Request(prompts=["a lighthouse"], height=1024, width=1024))  # (N, H, W, 3) in [0, 1]

The pipeline type (SD, SDXL, refiner, InstructPix2Pix, inpainting) comes from the model itself;
`controlnets` adds ControlNets that guide it (`pipelines.control`), `t2i_adapters` T2I-Adapters
(`pipelines.t2i_adapter`), `ip_adapters` IP-Adapters that read image prompts (`pipelines.image_prompt`): the
conditioning plug-ins' models, whose inputs a request gives in `Request.conditioning` (`pipelines.plugin`).
`refine` runs the SDXL base up to `high_noise_frac` and hands its latents to a refiner, as diffusers'
ensemble of expert denoisers does.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipelines import control, executables, guidance, image_prompt, t2i_adapter
from pipelines.control import Control
from pipelines.family import Family, family_of
from pipelines.image_prompt import ImagePrompt
from pipelines.plugin import Input, model_name
from pipelines.request import Request, batches, validate
from pipelines.sampler import Sampled, Sampler, working_bytes
from pipelines.t2i_adapter import AdapterImage
from sdx import mesh as meshlib
from sdx import model_folder, schedulers, weights
from sdx.errors import SdxError
from sdx.layers import Compute


class NonFiniteImages(SdxError):
    """Some images came out with NaN or inf values. images: all of them, as the call would have returned
    them; bad: {image index: what went wrong}."""

    def __init__(self, images: np.ndarray, bad: dict[int, str]):
        self.images, self.bad = images, bad
        super().__init__("; ".join(f"image {i}: {why}" for i, why in bad.items())
                         + ". The weights may overflow in this dtype (try --dtype float32) or a LoRA scale may be "
                           "too large; nothing was written for these images")


@dataclasses.dataclass(frozen=True)
class Part:
    """Some images of a sampler call (whose out may be on the host already), on the host: out (n, H, W, 3) images
    roughly in [-1, 1], or latents; bad:
    {index among them: why it came out NaN or inf}; readouts: the interventions' (`Sampled.readouts`) of these."""

    out: np.ndarray
    bad: dict[int, str]
    readouts: tuple

    @classmethod
    def of(cls, sampled: Sampled, plan, rows) -> Part:
        """Images `rows` (indices) of a sampler call of `plan`."""
        rows = list(rows)
        bad = {}
        for i, j in enumerate(rows):
            if sampled.bad_step[j]:
                bad[i] = f"the latents became NaN or inf at step {sampled.bad_step[j]} of {plan.steps}"
            elif sampled.bad_decode[j]:
                bad[i] = "the VAE decoded its finite latents to NaN or inf (in float32 too)"
        out = sampled.out if isinstance(sampled.out, np.ndarray) else meshlib.to_host(sampled.out)
        return cls(out[rows], bad, jax.tree.map(lambda a: a[rows], sampled.readouts))

    @staticmethod
    def joined(parts: list[Part], latents: bool = False) -> Generated:
        """A request's result from its parts in order: images in [0, 1] (latents as they are, with `latents`);
        `NonFiniteImages` when some came out NaN or inf."""
        out = np.concatenate([p.out for p in parts])
        out = out if latents else np.clip(out / 2 + 0.5, 0.0, 1.0)
        offsets = np.cumsum([0] + [len(p.out) for p in parts])
        bad = {int(first) + i: why for p, first in zip(parts, offsets) for i, why in p.bad.items()}
        if bad:
            raise NonFiniteImages(out, bad)
        return Generated(out, jax.tree.map(lambda *each: np.concatenate(each), *[p.readouts for p in parts]))


@dataclasses.dataclass(frozen=True)
class Generated:
    """A generation's images (`Pipeline.__call__`'s) and readouts: for each of the request's interventions,
    what it read out (`sdx.interventions.Intervention.readout`, host arrays with the images first), or None."""

    images: np.ndarray
    readouts: tuple


@dataclasses.dataclass
class Pipeline:
    family: Family
    scheduler: schedulers.Scheduler
    tokenizers: dict
    sampler: Sampler
    factor: int  # pixels per latent pixel
    multiple: int  # sizes must be multiples of this many pixels
    channels: int  # latent channels
    default_size: int  # pixels: the UNet's sample_size times the VAE factor (what the model was trained at)
    name: str  # what was loaded, for the PNG metadata
    # {kind: the sampler's models of a conditioning plug-in's kind}, in the order a request's inputs of that kind
    # are matched to them (`INPUTS`; "controlnet": ("controlnet_0",))
    conditioners: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def load(
        cls,
        model: str | os.PathLike,
        *,
        dtype: str = "float32",
        vae_dtype: str = "float32",
        scheduler: str | None = None,
        attention: str = "xla",
        mesh=None,
        fsdp: int = 1,
        name: str | None = None,
        controlnets: tuple[str, ...] = (),
        t2i_adapters: tuple[str, ...] = (),
        ip_adapters: tuple[str, ...] = (),
        image_encoders: tuple[str | None, ...] = (),
        options=None,
        cache: str | os.PathLike | None = None,
        log=None,
        first: Callable[[Pipeline], Request] | None = None,
    ) -> Pipeline:
        """Load `model` onto `mesh` (default: every device, `fsdp` of them sharing parameters). `model` is
        anything `python -m sdx.sample --model` takes (`pipelines.model_names`): an sdx folder, a diffusers
        folder, a single-file checkpoint, a hub id, `default`, `default-edit`, `tiny`, `tiny_xl`; all but an
        sdx folder are converted once into `cache` (default `convert.library.default_cache_dir()`), with
        `options` (a `convert.sources.ModelOptions`: LoRAs, a VAE, embeddings) applied there.

        dtype: the text encoders', UNet's and ControlNets' parameters and activations; vae_dtype: the VAE's
        (float32 by default: the SDXL VAE overflows in float16). scheduler: a `--scheduler` name, or None
        for the model's own scheduler_config.json. controlnets: ControlNets (`convert.controlnet.load_controlnet`
        sources: folders, hub ids, single files), downloaded to `cache`; t2i_adapters: T2I-Adapters
        (`convert.t2i_adapter.load_t2i_adapter` sources: folders, hub ids), likewise. ip_adapters: IP-Adapter
        .safetensors files, each with its CLIP image encoder's folder in `image_encoders` (default: `image_encoder`
        beside the file; `pipelines.image_prompt.load`). first: makes the request the
        pipeline will serve first, from a pipeline over the abstract models (shapes only, no weights; its
        errors are raised before any weight is read); its stored programs are read while the weights load
        (without conditioning models).
        """
        from convert.library import default_cache_dir
        from pipelines.model_names import resolve_model

        cache = Path(cache) if cache is not None else default_cache_dir()
        folder = model if model_folder.is_model_folder(model) and (options is None or options.empty) else \
            resolve_model(str(model), dtype=dtype, cache=cache, log=log or (lambda _msg: None), options=options)
        mesh = mesh or meshlib.make_mesh(fsdp)
        spec = model_folder.read_spec(folder)
        family = family_of(spec["pipeline_class"], set(spec["components"]), spec["extra"])
        pdt = jnp.dtype(dtype)
        run = dict(attention=attention, batch_shards=mesh.devices.size)
        computes = {n: Compute(dtype=pdt, param_dtype=pdt, **run) for n in ("unet", *family.encoders)}
        computes["vae"] = Compute(dtype=jnp.dtype(vae_dtype), param_dtype=jnp.dtype(vae_dtype), **run)
        rule = meshlib.param_sharding(mesh)
        sched_cfg = model_folder.scheduler_config(folder, spec=spec)
        sched = schedulers.from_name(scheduler, sched_cfg) if scheduler else schedulers.from_config(sched_cfg)
        tokenizers = {t: model_folder.load_tokenizer(folder, t, spec=spec) for t in ("tokenizer", "tokenizer_2")
                      if t in spec["components"]}
        abstract = {n: model_folder.abstract_component(folder, n, dtype=computes[n].param_dtype, compute=computes[n],
                                                       spec=spec, abstract=executables.abstract_model)
                    for n in ("unet", "vae", *family.encoders)}
        if first is not None and not (controlnets or t2i_adapters or ip_adapters):
            placed = {n: weights.placed_abstract(m, dtype=computes[n].param_dtype, sharding=rule)
                      for n, m in abstract.items()}
            shell = cls.from_models(placed, family=family, scheduler=sched, tokenizers=tokenizers, mesh=mesh,
                                    name=name or str(model))
            shell.prefetch(first(shell))
        loaded = {  # each fills the abstract model built above
            n: model_folder.load_component(folder, n, dtype=computes[n].param_dtype, compute=computes[n], sharding=rule,
                                           spec=spec, abstract=lambda *_, empty=empty: empty)
            for n, empty in abstract.items()
        }
        extra, conditioners = _load_conditioners(
            loaded, controlnets, t2i_adapters, ip_adapters, image_encoders, dtype=dtype, compute=computes["unet"],
            sharding=rule, cache=cache / "models", log=log)
        return cls.from_models({**loaded, **extra}, family=family, scheduler=sched, tokenizers=tokenizers, mesh=mesh,
                               name=name or str(model), conditioners=conditioners)

    @classmethod
    def from_models(cls, models: dict, *, family: Family, scheduler: schedulers.Scheduler, tokenizers: dict, mesh,
                    name: str, conditioners: dict | None = None) -> Pipeline:
        """A pipeline over models already built and placed on `mesh`, {"unet", "vae", encoders..., and the
        conditioning plug-ins' models (`pipelines.plugin.model_name`)}, `conditioners` naming the latter by kind
        (see `Pipeline.conditioners`): what training validates with. Each model runs in the compute dtype it
        carries (`model.compute`)."""
        family = dataclasses.replace(family, guidance_embedded=models["unet"].config.time_cond_proj_dim is not None)
        return cls(family=family, scheduler=scheduler, tokenizers=tokenizers, sampler=Sampler(models, mesh),
                   name=name, conditioners=dict(conditioners or {}), **_shape_facts(models))

    def conditioning_models(self, kind: str) -> list:
        """The pipeline's models of a conditioning plug-in's `kind` ("controlnet", ...), in order."""
        return [self.sampler.models[name] for name in self.conditioners.get(kind, ())]

    @property
    def models(self) -> dict:
        """The models the sampler runs, by name: "unet", "vae", "text_encoder" (and "text_encoder_2"),
        ControlNets, T2I-Adapters, the IP-Adapter's parts. To run changed ones, see `replace`."""
        return dict(self.sampler.models)

    def replace(self, scheduler: schedulers.Scheduler | None = None, **models: nnx.Module) -> Pipeline:
        """This pipeline with some models (by their `models` names) or the scheduler replaced; the others are
        shared, not copied. A replacement runs in the compute dtype it carries and should live on this
        pipeline's mesh: built on a loaded model's arrays (`sdx.weights.as_class`), or loaded with this mesh's
        sharding (`sdx.model_folder.load_component(..., sharding=sdx.mesh.param_sharding(pipe.sampler.mesh))`).
        A UNet of another class compiles programs of its own.

            damped = pipe.replace(unet=as_class(pipe.models["unet"], DampedUNet))"""
        unknown = sorted(set(models) - set(self.sampler.models))
        if unknown:
            raise SdxError(f"no model named {', '.join(unknown)} in this pipeline; it has {', '.join(self.sampler.models)}")
        old = self.sampler
        sampler = Sampler({**old.models, **models}, old.mesh, compile_log=old.compile_log, chunk=old.chunk)
        return dataclasses.replace(self, scheduler=scheduler or self.scheduler, sampler=sampler,
                                   **_shape_facts(sampler.models))

    def complete(self, request: Request) -> Request:
        """`request` with what it leaves open (None) chosen as `python -m sdx.sample` chooses it for this model:
        the size of its image, else of its first control or adapter image (`Input.size`), else of its latents,
        else the model's training size (`default_size`); guidance_scale the model's (`Family.guidance_scale`);
        strength, as diffusers' pipelines: inpainting 0.9999 for SDXL, else 1.0; otherwise 0.3 for SDXL without
        ControlNets, else 0.8."""
        r, xl = request, self.family.xl
        if r.height is None or r.width is None:
            height, width = self._size_of(r)
            r = dataclasses.replace(r, height=height if r.height is None else r.height,
                                    width=width if r.width is None else r.width)
        if r.guidance_scale is None:
            r = dataclasses.replace(r, guidance_scale=self.family.guidance_scale)
        if r.strength is None:
            inpaint = r.mask is not None
            controlled = any(one.kind == Control.kind for one in r.conditioning)
            r = dataclasses.replace(r, strength=(0.9999 if xl else 1.0) if inpaint else 0.3 if xl and not controlled else 0.8)
        return r

    def _size_of(self, r: Request) -> tuple[int, int]:
        if r.image is not None:
            return tuple(r.image.shape[1:3])
        for one in _in_order(r.conditioning):
            if one.size() is not None:
                return one.size()
        for latents in (r.latents, r.init_latents):  # the diffusers layout, (N, C, h, w)
            if latents is not None:
                return latents.shape[2] * self.factor, latents.shape[3] * self.factor
        return self.default_size, self.default_size

    def __call__(self, request: Request, progress=None) -> np.ndarray:
        """Images (N, H, W, 3) float32 in [0, 1], or final latents (N, h, w, C) with output_latents. What the
        request leaves open is chosen by `complete`.

        progress: a tqdm-like bar (`total`, `update(n)`); its total grows by this request's model calls.
        """
        return self.generate(request, progress).images

    def generate(self, request: Request, progress=None) -> Generated:
        """`__call__`'s images with what the request's interventions read out, one entry each."""
        work = self.work(request)
        if progress is not None:
            progress.total = (progress.total or 0) + sum(inputs.state.num_calls for _, inputs, _ in work)
            progress.refresh()
        report = None if progress is None else progress.update
        parts = [Part.of(self.sampler(plan, inputs, report), plan, range(real)) for plan, inputs, real in work]
        return Part.joined(parts, request.output_latents)

    def work(self, request: Request) -> list:
        """[(plan, inputs, real)]: the sampler calls `request` makes (`pipelines.request.batches`; `real` of each
        call's images are the request's), once it is completed, checked and fitted to free memory."""
        request = self.complete(request)
        self.validate(request)
        return self._work(self.fitted(request))

    def prefetch(self, request: Request) -> None:
        """Start reading the stored programs `request` will run (`Sampler.prefetch`); nothing when its batch
        size depends on free memory (more images than devices: `fitting_batch` compiles to find it)."""
        request = self.complete(request)
        self.validate(request)
        if request.batch_size is None:
            if request.num_images > self.sampler.mesh.devices.size and meshlib.free_bytes(self.sampler.mesh) is not None:
                return
            request = dataclasses.replace(request, batch_size=request.num_images)
        for plan, inputs, _ in self._work(request):
            self.sampler.prefetch(plan, self.sampler.place(inputs))

    def validate(self, request: Request) -> None:
        """An SdxError, in the user's terms, for what this pipeline's models cannot take (`pipelines.request.validate`,
        each conditioning input's `check`)."""
        request = self.complete(request)
        validate(request, self.family, self.factor, self.multiple, self.sampler.models["vae"].config)
        for one, model in self.matched(request):
            one.check(request, self, model)
        guider = guidance.of_request(self.family, request.guidance_scale, request.image_guidance_scale, request.guidance)
        guidance.check_request(guider, request, self)

    def matched(self, request: Request) -> list[tuple[Input, str | None]]:
        """(input, the name of the model it goes to) for each of the request's conditioning inputs, ControlNets
        first, then T2I-Adapters, then IP-Adapters (`INPUTS`), each kind in order, then the inputs of methods with
        no model of the pipeline's (`Input.kind` None; model None); an SdxError unless the request gives one input
        per model of every kind."""
        found = []
        for kind, cls in INPUTS.items():
            given = [one for one in request.conditioning if one.kind == kind]
            models = self.conditioners.get(kind, ())
            if len(given) != len(models):
                raise SdxError(f"give one {cls.image_flag} per {cls.flag} ({len(models)}), not {len(given)}")
            found += zip(given, models)
        unknown = [type(one).__name__ for one in request.conditioning if one.kind not in (*INPUTS, None)]
        if unknown:
            raise SdxError(f"Request.conditioning: {unknown[0]} goes to a model this pipeline cannot have (its kinds: "
                           f"{', '.join(INPUTS)})")
        return found + [(one, None) for one in request.conditioning if one.kind is None]

    def _work(self, request: Request) -> list:
        request = self.complete(request)
        matched = self.matched(request)
        return batches(request, self.family, self.tokenizers, self.scheduler, factor=self.factor, channels=self.channels,
                       devices=self.sampler.mesh.devices.size,
                       plugins=lambda batch: tuple(one.plugin(batch, model, self) for one, model in matched))

    def fitted(self, request: Request) -> Request:
        """`request` with what it leaves to free memory chosen: the batch size when not given
        (`fitting_batch`); then, when a device's free memory is known (`meshlib.free_bytes`) and one image's
        VAE decode needs more than `FREE_SHARE` of it by XLA's memory analysis, `vae_tiling` for an image
        larger than the VAE's tile (ComfyUI retries a decode that ran out of memory in tiles the same way).
        The programs compiled to find out are kept: the untiled ones run when the decode fits, and the tiled
        plan runs their denoise programs (and their prepare, when it encodes no image) when it does not."""
        if request.batch_size is None:
            request = dataclasses.replace(request, batch_size=self.fitting_batch(request))
        free = meshlib.free_bytes(self.sampler.mesh)
        if free is None or request.vae_tiling or request.output_latents or not self._tiles_would_cut(request):
            return request
        plan, inputs, _ = self._work(request)[0]
        if working_bytes(self.sampler.compiled(plan, self.sampler.place(inputs)).decode) > FREE_SHARE * free:
            request = dataclasses.replace(request, vae_tiling=True)
        return request

    def _tiles_would_cut(self, request: Request) -> bool:
        """Whether a tiled VAE pass would cut the request's images (never with tiles that do not line up)."""
        try:
            return self.sampler.models["vae"].config.tiles(decoding=False).cuts(request.height, request.width)
        except SdxError:
            return False

    def fitting_batch(self, request: Request) -> int:
        """Images per compiled call when the request leaves it open: all of them, halved until the plan's
        programs need at most `FREE_SHARE` of a device's free memory by XLA's memory analysis (each size
        tried is compiled, and kept: the one that fits is the one that runs). An untiled decode that tiles
        would cut does not count: it decodes one image at a time whatever the batch, and `fitted` turns
        tiling on when it does not fit."""
        free = meshlib.free_bytes(self.sampler.mesh)
        batch, devices = request.num_images, self.sampler.mesh.devices.size
        decode = request.vae_tiling or not self._tiles_would_cut(request)
        while free is not None and batch > devices:
            plan, inputs, _ = self._work(dataclasses.replace(request, batch_size=batch))[0]
            if self.sampler.compiled(plan, self.sampler.place(inputs)).working_bytes(decode) <= FREE_SHARE * free:
                break
            batch = -(-batch // 2)
        return batch


FREE_SHARE = 0.9  # of a device's free memory a generation may plan to use (the rest: fragmentation, the host)
# the conditioning inputs a request may give, by the kind of model they go to, in the order the plug-ins act
INPUTS: dict[str, type[Input]] = {cls.kind: cls for cls in (Control, AdapterImage, ImagePrompt)}


def _in_order(inputs) -> list[Input]:
    """Conditioning inputs in `INPUTS`' order of kinds, each kind's in the order given."""
    kinds = list(INPUTS)
    return sorted(inputs, key=lambda one: kinds.index(one.kind) if one.kind in kinds else len(kinds))


def _load_conditioners(loaded: dict, controlnets, t2i_adapters, ip_adapters, image_encoders, *, dtype: str,
                       compute: Compute, sharding, cache: Path, log) -> tuple[dict, dict]:
    """({name: model} of the conditioning models, {kind: their names}) for the loaded UNet and VAE (`loaded`),
    each checked against them before the next is read; sources as `Pipeline.load` takes them."""
    from convert.controlnet import load_controlnet
    from convert.t2i_adapter import load_t2i_adapter

    unet, factor = loaded["unet"], loaded["vae"].config.downsample_factor
    models = {}
    for k, src in enumerate(controlnets):
        net = load_controlnet(src, dtype=dtype, compute=compute, sharding=sharding, cache_dir=cache, log=log,
                              abstract=executables.abstract_model)
        control.check_compatible(net, unet.config, factor, src)
        models[model_name(Control.kind, k)] = net
    adapters = []
    for k, src in enumerate(t2i_adapters):
        adapter = load_t2i_adapter(src, dtype=dtype, compute=compute, sharding=sharding, cache_dir=cache, log=log)
        t2i_adapter.check_compatible(adapter, unet.config, factor, src)
        adapters.append(adapter.config)
        models[model_name(AdapterImage.kind, k)] = adapter
    t2i_adapter.check_together(adapters, t2i_adapters)
    encoders = [*image_encoders, *[None] * (len(ip_adapters) - len(image_encoders))]
    for k, (src, encoder) in enumerate(zip(ip_adapters, encoders)):
        models |= image_prompt.load(src, encoder, unet, k, dtype=dtype, compute=compute, sharding=sharding)
    counts = {Control.kind: len(controlnets), AdapterImage.kind: len(t2i_adapters), ImagePrompt.kind: len(ip_adapters)}
    return models, {kind: tuple(model_name(kind, k) for k in range(n)) for kind, n in counts.items() if n}


def _shape_facts(models: dict) -> dict:
    """The pipeline's fields that its VAE and UNet decide."""
    factor = models["vae"].config.downsample_factor
    return dict(factor=factor, multiple=factor,  # the UNet resizes its up-sampling to its skips, as diffusers' does
                channels=models["vae"].config.latent_channels,
                default_size=_trained_size(models["unet"].config.sample_size) * factor)


def _trained_size(sample_size) -> int:
    if isinstance(sample_size, (tuple, list)):
        return int(sample_size[0])
    return int(sample_size or 64)  # diffusers' UNet2DConditionModel default


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[0, 1] floats -> 8-bit, rounded as diffusers' numpy_to_pil."""
    return (images * 255).round().astype(np.uint8)


def refine(base: Pipeline, refiner: Pipeline, request: Request, high_noise_frac: float, progress=None) -> np.ndarray:
    """SDXL base for the first `high_noise_frac` of the schedule, the refiner for the rest (what the request
    leaves open chosen by the base's `complete`)."""
    request = base.complete(request)
    latents = base(dataclasses.replace(request, denoising_end=high_noise_frac, output_latents=True), progress)
    handover = dataclasses.replace(
        request, denoising_start=high_noise_frac, denoising_end=None, latents=None,
        init_latents=latents.transpose(0, 3, 1, 2), prompts_2=None, negative_prompts_2=None,
    )
    return refiner(handover, progress)
