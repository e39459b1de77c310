"""A loaded model ready to generate: models on the mesh, its family, its scheduler, a `Sampler`.

    pipe = Pipeline.load(folder, dtype="bfloat16")
    images = pipe(Request(prompts=["a lighthouse"], height=1024, width=1024))  # (N, H, W, 3) in [0, 1]

The pipeline type (SD, SDXL, refiner, InstructPix2Pix) comes from the model itself. `refine` runs
the SDXL base up to `high_noise_frac` and hands its latents to a refiner, as diffusers' ensemble of
expert denoisers does.
"""

from __future__ import annotations

import dataclasses
import os
import jax
import jax.numpy as jnp
import numpy as np

from pipelines.family import Family, family_of
from pipelines.request import Request, batches, validate
from pipelines.sampler import Sampler
from sdx import mesh as meshlib
from sdx import model_folder, schedulers
from sdx.layers import Compute


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

    @classmethod
    def load(
        cls,
        folder: str | os.PathLike,
        *,
        dtype: str = "float32",
        vae_dtype: str = "float32",
        scheduler: str | None = None,
        attention: str = "xla",
        mesh=None,
        fsdp: int = 1,
        name: str | None = None,
    ) -> Pipeline:
        """Load an sdx model folder onto `mesh` (default: every device, `fsdp` of them sharing parameters).

        dtype: the text encoders' and UNet's parameters and activations; vae_dtype: the VAE's (float32
        by default: the SDXL VAE overflows in float16). scheduler: a `--scheduler` name, or None for
        the model's own scheduler_config.json.
        """
        mesh = mesh or meshlib.make_mesh(fsdp)
        spec = model_folder.read_spec(folder)
        family = family_of(spec["pipeline_class"], set(spec["components"]), spec["extra"])
        pdt = jnp.dtype(dtype)
        computes = {n: Compute(dtype=pdt, param_dtype=pdt, attention=attention) for n in ("unet", *family.encoders)}
        computes["vae"] = Compute(dtype=jnp.dtype(vae_dtype), param_dtype=jnp.dtype(vae_dtype), attention=attention)
        rule = meshlib.param_sharding(mesh)
        loaded = {
            n: model_folder.load_component(folder, n, dtype=computes[n].param_dtype, compute=computes[n], sharding=rule, spec=spec)
            for n in ("unet", "vae", *family.encoders)
        }
        sched_cfg = model_folder.scheduler_config(folder, spec=spec)
        sched = schedulers.from_name(scheduler, sched_cfg) if scheduler else schedulers.from_config(sched_cfg)
        tokenizers = {t: model_folder.load_tokenizer(folder, t, spec=spec) for t in ("tokenizer", "tokenizer_2")
                      if t in spec["components"]}
        return cls.from_models(loaded, family=family, scheduler=sched, tokenizers=tokenizers, mesh=mesh,
                               name=name or str(folder))

    @classmethod
    def from_models(cls, models: dict, *, family: Family, scheduler: schedulers.Scheduler, tokenizers: dict, mesh,
                    name: str) -> Pipeline:
        """A pipeline over models already built and placed on `mesh`, {"unet", "vae", encoders...}: what
        training validates with. Each model runs in the compute dtype it carries (`model.compute`)."""
        factor = models["vae"].config.downsample_factor
        return cls(
            family=family,
            scheduler=scheduler,
            tokenizers=tokenizers,
            sampler=Sampler(models, mesh),
            factor=factor,
            multiple=factor,  # the UNet resizes its up-sampling to its skips, as diffusers' does
            channels=models["vae"].config.latent_channels,
            default_size=_trained_size(models["unet"].config.sample_size) * factor,
            name=name,
        )

    def __call__(self, request: Request, progress=None) -> np.ndarray:
        """Images (N, H, W, 3) float32 in [0, 1], or final latents (N, h, w, C) with output_latents.

        progress: a tqdm-like bar (`total`, `update(n)`); its total grows by this request's model calls.
        """
        validate(request, self.family, self.factor, self.multiple)
        devices = self.sampler.mesh.devices.size
        work = batches(request, self.family, self.tokenizers, self.scheduler, factor=self.factor, channels=self.channels,
                       devices=devices)
        if progress is not None:
            progress.total = (progress.total or 0) + sum(inputs.state.num_calls for _, inputs, _ in work)
            progress.refresh()
        report = None if progress is None else progress.update
        outs = [meshlib.to_host(self.sampler(plan, inputs, report))[:real] for plan, inputs, real in work]
        out = np.concatenate(outs)
        return out if request.output_latents else np.clip(out / 2 + 0.5, 0.0, 1.0)


def _trained_size(sample_size) -> int:
    if isinstance(sample_size, (tuple, list)):
        return int(sample_size[0])
    return int(sample_size or 64)  # diffusers' UNet2DConditionModel default


def to_uint8(images: np.ndarray) -> np.ndarray:
    """[0, 1] floats -> 8-bit, rounded as diffusers' numpy_to_pil."""
    return (images * 255).round().astype(np.uint8)


def refine(base: Pipeline, refiner: Pipeline, request: Request, high_noise_frac: float, progress=None) -> np.ndarray:
    """SDXL base for the first `high_noise_frac` of the schedule, the refiner for the rest."""
    latents = base(dataclasses.replace(request, denoising_end=high_noise_frac, output_latents=True), progress)
    handover = dataclasses.replace(
        request, denoising_start=high_noise_frac, denoising_end=None, latents=None,
        init_latents=latents.transpose(0, 3, 1, 2), prompts_2=None, negative_prompts_2=None,
    )
    return refiner(handover, progress)
