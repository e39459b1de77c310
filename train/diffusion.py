"""The UNet fine-tuning task behind `python -m train.text_to_image` and `python -m train.pix2pix`.

What differs between the two is small and decided by the config: the columns read, the UNet's input
(InstructPix2Pix adds the input image's latents on 4 more channels) and the conditioning dropout
(text-to-image: `--proportion_empty_prompts`; InstructPix2Pix: `--conditioning_dropout_prob` for text,
image and both). The null text conditioning is the one the pipeline uses at inference
(`pipelines.guidance.null_conditioning`), computed once.

SDXL's time ids per sample: the image's original (height, width) before resizing, the (top, left) of
the crop actually applied (after the flip), and the target (resolution, resolution).

LoRA (`--rank`, `python -m train.text_to_image_lora`): adapters (`sdx.lora`) on the UNet's attention
projections train, drawn from `--seed`; the UNet's own weights stay frozen in the step's constants. Each
validation samples the UNet with the adapters fused into it, as the sampler's `--lora` does, and the run
writes the adapters alone, `pytorch_lora_weights.safetensors` in diffusers' layout, into --output_dir.
With `--train_text_encoder`, each text encoder's attention projections get adapters too (drawn from
their own streams of `--seed`): the trained module is then the UNet and the encoders together, the
encoders run in the loss (`train.denoise`), and the file holds their adapters beside the UNet's.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipelines import text as textlib
from pipelines.guidance import null_conditioning
from pipelines.pipeline import NonFiniteImages, Pipeline
from pipelines.plugin import model_name
from pipelines.request import Request
from sdx import mesh as meshlib
from sdx import lora, model_folder, schedulers
from sdx.errors import SdxError
from train import cache as cachelib
from train import config, data, denoise, export, models, objective, sources
from train.config import TrainConfig


LORA_STREAM = 0x4C6F5241  # the adapters' initial draw: fold_in(key(--seed), this), apart from the steps' keys


def tokenizer_fn(family, tokenizers):
    """text -> {encoder: (1, 77) int32} for the data loader (each SDXL encoder reads the same caption)."""
    from pipelines.family import TOKENIZER_OF

    def tokenize(text: str) -> dict[str, np.ndarray]:
        return {e: tokenizers[TOKENIZER_OF[e]].encode([text]).ids for e in family.encoders}

    return tokenize


class DiffusionTask:
    def __init__(self, cfg: TrainConfig, mesh, log=print, restoring: bool = False):
        self.cfg, self.mesh, self.log = cfg, mesh, log
        self.folder = models.resolve_folder(cfg, log)
        m = self.models = models.load(cfg, mesh, folder=self.folder, log=log, restoring=restoring)
        fam = m.family
        text_in_step = models.text_in_step(cfg)
        trained = {"unet": m.unet} | ({e: m.encoders[e] for e in fam.encoders} if text_in_step else {})
        self.module = nnx.Dict(trained) if text_in_step else m.unet
        self.trainable = self.adapt(trained)
        text_dtype = models.computes(cfg)["text"].dtype
        sched = schedulers.from_name("ddpm", m.scheduler_config)
        prediction_type = cfg.prediction_type or sched.prediction_type
        self.loss_config = denoise.DenoiseConfig(
            family=fam, scheduler=sched, vae=m.vae.config, prediction_type=prediction_type,
            snr_gamma=cfg.snr_gamma, noise_offset=cfg.noise_offset, input_perturbation=cfg.input_perturbation,
            text_drop=cfg.proportion_empty_prompts, conditioning_dropout=cfg.conditioning_dropout_prob or 0.0,
            text_dtype=str(jnp.dtype(text_dtype)) if text_in_step else None,
            prior_loss_weight=cfg.prior_loss_weight if cfg.with_prior_preservation else None,
            timestep_bias=None if cfg.timestep_bias_strategy == "none" else objective.TimestepBias(
                cfg.timestep_bias_strategy, cfg.timestep_bias_multiplier, cfg.timestep_bias_begin,
                cfg.timestep_bias_end, cfg.timestep_bias_portion),
            dream_detail_preservation=cfg.dream_detail_preservation if cfg.dream_training else None,
            pixel_loss=self._pixel_loss(sched.num_train_timesteps),
        )
        if cfg.dream_training and prediction_type != "epsilon":
            raise SdxError(f"--dream_training needs an epsilon-prediction model; this one predicts {prediction_type} "
                           "(diffusers' DREAM is not defined for it either)")
        if self.loss_config.timestep_bias is not None:  # a range beyond the schedule is an error now, not mid-compile
            self.loss_config.timestep_bias.weights(sched.num_train_timesteps)
        self.prediction_type = prediction_type
        center_crop = cfg.center_crop or cfg.task in config.CONTROL_TASKS  # as diffusers' scripts for them do
        self.transform = data.Transform(resolution=cfg.resolution, center_crop=center_crop,
                                        random_flip=cfg.random_flip, seed=cfg.seed,
                                        tokenize=tokenizer_fn(fam, m.tokenizers),
                                        interpolation=cfg.image_interpolation_mode)
        self.constants = null_conditioning(fam, m.encoders, m.tokenizers, text_dtype)  # the loss's `null`
        if text_in_step and not fam.force_zeros:  # "" through the trained encoders, in the loss
            ids = textlib.tokenize(fam, m.tokenizers, [[""]] * len(fam.encoders), chunks=None)
            self.constants = {"ids": np.concatenate([ids[e][0] for e in fam.encoders])}  # (E, 77)
        if cfg.pixel_loss_weight:
            self.constants = {**self.constants, "vae": nnx.state(m.vae)}
        frozen = {} if text_in_step else m.encoders
        graphdef, self._frozen = nnx.split(nnx.Dict({"vae": m.vae, **frozen}))

        def encode(frozen, batch):
            mods = nnx.merge(graphdef, frozen)
            encoders = None if text_in_step else {e: mods[e] for e in fam.encoders}
            out = denoise.encode_batch(fam, mods["vae"], encoders, batch, text_dtype)
            # the step takes its batch split over every device; an fsdp-split encoder weight (SDXL's text
            # projection) would otherwise leave its output split over fsdp in its feature axis
            return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, meshlib.batch_sharding(mesh, x.ndim)), out)

        self._encode = jax.jit(encode)
        self.cache: cachelib.LatentCache | None = None
        self._pipeline: Pipeline | None = None  # `pipeline`'s, kept

    def _pixel_loss(self, num_train_timesteps: int) -> denoise.PixelLoss | None:
        cfg = self.cfg
        if not cfg.pixel_loss_weight:
            return None
        if cfg.pixel_loss_max_timestep > num_train_timesteps:
            raise SdxError(f"--pixel_loss_max_timestep {cfg.pixel_loss_max_timestep} is beyond the model's "
                           f"{num_train_timesteps} training timesteps")
        return denoise.PixelLoss(cfg.pixel_loss_weight, cfg.edge_weight, cfg.pixel_loss_max_timestep,
                                 nnx.graphdef(self.models.vae))

    def adapt(self, trained: dict[str, nnx.Module]) -> type[nnx.Variable]:
        """Make what trains, and return its variable type: with `--rank`, LoRA adapters on the trained
        models (the UNet's drawn from stream LORA_STREAM of --seed, encoder j's from LORA_STREAM + 1 + j);
        else the models' own parameters."""
        cfg = self.cfg
        if not cfg.rank:
            return nnx.Param
        for j, (name, model) in enumerate(trained.items()):
            key = jax.random.fold_in(jax.random.key(cfg.seed), LORA_STREAM + j)
            count = lora.attach(model, cfg.rank, cfg.lora_alpha or cfg.rank, key,
                                targets=lora.TARGETS if name == "unet" else lora.TEXT_TARGETS,
                                sharding=meshlib.replicated(self.mesh))
            size = sum(x.size for x in jax.tree.leaves(nnx.state(model, lora.LoRAParam)))
            self.log(f"{name}: LoRA adapters of rank {cfg.rank} on {count} attention projections ({size:,} parameters)")
        return lora.LoRAParam

    # ---- what the loop calls

    def prepare_data(self, source: sources.Source, out: Path) -> dict:
        """--cache_latents: encode the dataset once into out/cache/process-N (or reuse what is there), and
        return the loader's hooks that read it (see train/cache.py); without it, nothing to do."""
        cfg = self.cfg
        if not cfg.cache_latents:
            return {}
        key = cachelib.data_key(cfg, source, self.folder) | {
            "text_dtype": str(jnp.dtype(models.computes(cfg)["text"].dtype)), "family": repr(self.models.family),
            "text_ids": models.text_in_step(cfg)}
        encode = lambda host: self._encode(self._frozen, meshlib.put_batch(self.mesh, self.host_arrays(host)))
        self.cache = cachelib.LatentCache.open_or_build(
            out / "cache" / f"process-{jax.process_index()}", source, self.transform, encode=encode,
            batch_size=cfg.train_batch_size * jax.local_device_count(), key=key, log=self.log)
        return {"element": self.cache.element, "collate_fn": self.cache.collate}

    def host_arrays(self, host: dict) -> dict:
        """The loader's numpy batch -> the arrays the frozen encoders read."""
        fam, res = self.models.family, self.cfg.resolution
        out = {"index": np.asarray(host["index"]), "ids": {e: host["ids"][e] for e in fam.encoders}}
        for k in ("pixels", "original_pixels", "edited_pixels", "conditioning_pixels", "prior"):
            if k in host:
                out[k] = host[k]
        if fam.xl:
            n = len(out["index"])
            target = np.broadcast_to(np.asarray([res, res], np.float32), (n, 2))
            out["time_ids"] = np.concatenate([host["original_size"], host["crop_top_left"], target], axis=1).astype(np.float32)
        return out

    def step_batch(self, host: dict) -> dict:
        if self.cache is not None:
            return meshlib.put_batch(self.mesh, self.cache.gather(host))
        arrays = meshlib.put_batch(self.mesh, self.host_arrays(host))
        return self._encode(self._frozen, arrays)

    def batch_shapes(self, host: dict) -> dict:
        if self.cache is not None:
            return {k: jax.ShapeDtypeStruct(v.shape, jax.dtypes.canonicalize_dtype(v.dtype))
                    for k, v in self.cache.gather(host).items()}
        arrays = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), self.host_arrays(host))
        return jax.eval_shape(self._encode, self._frozen, arrays)

    def loss_fn(self, graphdef):
        return denoise.loss_fn(graphdef, self.loss_config)

    def learning_rate_scales(self, params, peak: float):
        """--text_encoder_lr: the encoders' adapters at text_encoder_lr / peak, the UNet's at 1 (else None)."""
        if self.cfg.text_encoder_lr is None:
            return None
        ratio = self.cfg.text_encoder_lr / peak
        return jax.tree_util.tree_map_with_path(lambda path, _: 1.0 if path[0].key == "unet" else ratio, params)

    def trained(self, module: nnx.Module) -> dict[str, nnx.Module]:
        """{component: model} of the module the loop trains: the UNet, with the text encoders when they train,
        or with the ControlNet or T2I-Adapter."""
        return dict(module.items()) if isinstance(module, nnx.Dict) else {"unet": module}

    def pipeline(self, module: nnx.Module, name: str) -> Pipeline:
        """The model's pipeline with the trained module's weights (LoRA: its adapters fused in, as `--lora`
        fuses them) and the frozen models. Its sampler is made at the first call and kept: later calls run the
        same programs with the new weights (a new one compiled them again, or read them from the cache
        folder when there is one)."""
        m = self.models
        trained = self.trained(module)
        if self.cfg.rank:
            trained = {n: lora.fused(model) for n, model in trained.items()}
        # a trained ControlNet or T2I-Adapter is the pipeline's first of its kind (`pipelines.plugin.model_name`)
        conditioners = {kind: (model_name(kind, 0),) for kind in ("controlnet", "t2i_adapter") if kind in trained}
        extra = {names[0]: trained.pop(kind) for kind, names in conditioners.items()}
        if self._pipeline is None:
            self._pipeline = Pipeline.from_models(
                {"vae": m.vae, **m.encoders, **trained, **extra}, family=m.family, tokenizers=m.tokenizers,
                mesh=self.mesh, scheduler=schedulers.from_config(m.scheduler_config), name=name,
                conditioners=conditioners)
        else:
            for n, model in {**trained, **extra}.items():
                self._pipeline.sampler.update(n, model)
            self._pipeline = dataclasses.replace(self._pipeline, name=name)
        return self._pipeline

    def validate(self, module: nnx.Module, step: int, metrics) -> None:
        cfg = self.cfg
        pipe = self.pipeline(module, f"{cfg.output_dir}@{step}")
        size = cfg.resolution
        inputs = {"prompts": list(cfg.validation_prompt), **self.validation_inputs()}
        # guidance left open: the model's own (`Pipeline.complete`)
        request = Request(height=size, width=size, steps=cfg.validation_inference_steps,
                          num_images_per_prompt=cfg.num_validation_images, seed=cfg.seed, **inputs)
        try:
            images = pipe(request)
        except NonFiniteImages as e:  # a diverging model: say so, log the rest (the bad ones black)
            self.log(f"validation at step {step}: {e}")
            images = np.nan_to_num(e.images, nan=0.0, posinf=0.0, neginf=0.0)
        metrics.image(step, "validation", _grid((images * 255).round().astype(np.uint8), cfg.num_validation_images))

    def validation_inputs(self) -> dict:
        """What a validation request takes besides its settings: InstructPix2Pix's image to edit (the prompts
        are --validation_prompt unless given here)."""
        if not self.models.family.pix2pix:
            return {}
        return {"image": data.load_image(self.cfg.val_image_url_or_path, self.cfg.resolution)[None]}

    def export(self, module: nnx.Module, out: Path) -> None:
        m = self.models
        if self.cfg.rank:  # the adapters are replicated: process 0 reads them alone
            if jax.process_index() == 0:
                arrays = {k: v for name, model in self.trained(module).items()
                          for k, v in lora.state_dict(model, prefix=name).items()}
                export.write_lora(out, arrays, base=self.cfg.pretrained_model_name_or_path, log=self.log)
            return
        entry = m.spec["components"]["unet"]  # a whole-UNet run: `module` is the UNet
        part = model_folder.ModelPart(cls=entry["class"], config=module.config,
                                      arrays=model_folder.module_arrays(module), source_config=m.unet_source_config)
        if jax.process_index() == 0:
            export.write_model(out, source=m.folder, spec=m.spec, pipeline_class=m.pipeline_class,
                               models={"unet": part}, export_format=self.cfg.export_format, log=self.log)


def _grid(images: np.ndarray, columns: int) -> np.ndarray:
    """(N, H, W, 3) uint8 -> one (rows * H, columns * W, 3) picture."""
    n, h, w, c = images.shape
    rows = -(-n // columns)
    padded = np.zeros((rows * columns, h, w, c), np.uint8)
    padded[:n] = images
    return padded.reshape(rows, columns, h, w, c).transpose(0, 2, 1, 3, 4).reshape(rows * h, columns * w, c)


def open_data(cfg: TrainConfig) -> "sources.Source":
    """The dataset with this task's columns (a missing column is an error naming the ones found)."""
    if cfg.task == "pix2pix":
        columns = sources.Columns(images=(cfg.original_image_column, cfg.edited_image_column),
                               text=cfg.edit_prompt_column, names=("original_pixels", "edited_pixels"))
    else:
        columns = sources.Columns(images=(cfg.image_column,), text=cfg.caption_column, names=("pixels",))
    spec = cfg.dataset_name or cfg.train_data_dir
    if cfg.task == "pix2pix" and cfg.validation_prompt:  # decoded now, not first at the first validation
        try:
            data.load_image(cfg.val_image_url_or_path, cfg.resolution)
        except SdxError as e:
            raise SdxError(f"--val_image_url_or_path {e}") from None
    return sources.open_source(spec, columns, max_samples=cfg.max_train_samples, seed=cfg.seed, cache_dir=cfg.cache_dir)
