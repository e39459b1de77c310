"""The models of a fine-tuning run: the trainable UNet, the frozen VAE and text encoders, tokenizers.

`load` resolves `--pretrained_model_name_or_path` exactly as `python -m sdx.sample --model` does
(sdx folder, diffusers folder, single file or hub id, converted once into the cache; an optional
`--pretrained_vae_model_name_or_path` swaps the VAE), then places every model on the mesh by the
inference sharding rule. The UNet keeps float32 master weights whatever the compute dtype
(`--mixed_precision bf16` computes in bfloat16); the VAE always runs in float32 (the SDXL VAE overflows
in float16); the frozen text encoders take the compute dtype.

InstructPix2Pix from a text-to-image model widens the UNet's conv_in from 4 to 8 input channels: the
new channels' kernel is zero, the pretrained kernel and bias are kept, so the widened model starts out
computing exactly what the pretrained one did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert import library as convert_lib
from convert.sources import ModelOptions
from pipelines import executables
from pipelines.model_names import resolve_model
from pipelines.family import Family, family_of
from sdx import attention
from sdx import mesh as meshlib
from sdx import model_folder, weights
from sdx.errors import SdxError
from sdx.layers import Compute
from train.config import TrainConfig

PIX2PIX_CLASS = {False: "StableDiffusionInstructPix2PixPipeline", True: "StableDiffusionXLInstructPix2PixPipeline"}


@dataclasses.dataclass
class Models:
    """folder: the source sdx folder; spec: its sdx.json; family: what the *trained* model is (pix2pix
    after widening); unet: trainable (abstract when restoring, see `load`); vae, encoders: frozen;
    pipeline_class / unet_source_config: what the exported model folder says."""

    folder: Path
    spec: dict[str, Any]
    family: Family
    pipeline_class: str
    unet: nnx.Module
    vae: nnx.Module
    encoders: dict[str, nnx.Module]
    tokenizers: dict[str, Any]
    scheduler_config: dict[str, Any]
    unet_source_config: dict[str, Any] | None


def resolve_folder(cfg: TrainConfig, log=print) -> Path:
    """The sdx folder of `--pretrained_model_name_or_path` (converted into the cache if it is not one; a
    default or demo model name, `default`, `tiny`, ..., found or built there as `python -m sdx.sample
    --model` does)."""
    options = ModelOptions.from_args(vae=cfg.pretrained_vae_model_name_or_path)
    return resolve_model(cfg.pretrained_model_name_or_path, dtype="float32", cache=convert_lib.default_cache_dir(),
                         log=log, options=options, variant=cfg.variant, revision=cfg.revision)


def unet_frozen(cfg: TrainConfig) -> bool:
    """Whether the UNet's own weights stay as they are: LoRA trains adapters, ControlNet a ControlNet, a
    T2I-Adapter run the adapter, textual inversion new words."""
    return bool(cfg.rank) or cfg.task in ("controlnet", "t2i_adapter", "textual_inversion")


def text_in_step(cfg: TrainConfig) -> bool:
    """Whether the text encoders run inside the step, on token ids: their LoRA adapters or new words train."""
    return cfg.train_text_encoder or cfg.task == "textual_inversion"


def computes(cfg: TrainConfig, mesh=None) -> dict[str, Compute]:
    """How each model runs on `mesh` (whose devices split the batch): the UNet trains in the compute dtype
    with float32 master weights (frozen, under LoRA or when a ControlNet trains, it is kept in the compute
    dtype, as diffusers' scripts keep it, and only the adapters or the ControlNet are float32); the text
    encoders run in the compute dtype, their layers rematerialised under `--gradient_checkpointing` when
    they train; without `--attention`, each model takes the sampler's backend for its dtype (`chunked` on
    a CPU: benchmarks/LOG.md, a training step 0.73× the time of `xla`'s)."""
    dtype = jnp.bfloat16 if cfg.mixed_precision == "bf16" else jnp.float32
    shards = mesh.devices.size if mesh is not None else 1
    run = lambda d: dict(attention=cfg.attention or attention.default_backend(d), batch_shards=shards)
    return {
        "unet": Compute(dtype=dtype, param_dtype=dtype if unet_frozen(cfg) else jnp.float32,
                        remat=cfg.gradient_checkpointing, **run(dtype)),
        "vae": Compute(dtype=jnp.float32, param_dtype=jnp.float32, **run(jnp.float32)),
        "text": Compute(dtype=dtype, param_dtype=dtype, remat=cfg.gradient_checkpointing and text_in_step(cfg),
                        **run(dtype)),
    }


def load(cfg: TrainConfig, mesh, *, folder: Path, log=print, restoring: bool = False) -> Models:
    """restoring: a resumed run's UNet, whose weights come from the checkpoint: built abstract (its shapes,
    dtypes and shardings), its weights neither read nor placed (SDXL's are 10 GB in float32). A frozen UNet
    (`unet_frozen`) is read either way: the checkpoint holds the adapters or the ControlNet alone."""
    spec = model_folder.read_spec(folder)
    source = family_of(spec["pipeline_class"], set(spec["components"]), spec["extra"])
    if source.aesthetic:
        raise SdxError(f"{cfg.pretrained_model_name_or_path}: fine-tuning the SDXL refiner is not supported")
    if source.inpaint:
        raise SdxError(f"{cfg.pretrained_model_name_or_path}: fine-tuning an inpainting model (a 9-channel UNet) is "
                       "not supported; start from a text-to-image model")
    if cfg.task != "pix2pix" and source.pix2pix:
        raise SdxError(f"{cfg.pretrained_model_name_or_path} is an InstructPix2Pix model; use python -m train.pix2pix")
    pix2pix = cfg.task == "pix2pix"
    restoring = restoring and not unet_frozen(cfg)
    pipeline_class = PIX2PIX_CLASS[source.xl] if pix2pix else spec["pipeline_class"]
    family = family_of(pipeline_class, set(spec["components"]), spec["extra"])
    cp = computes(cfg, mesh)
    rule = meshlib.param_sharding(mesh)
    load_one = lambda name, c, read=True: model_folder.load_component(
        folder, name, dtype=c.param_dtype, compute=c, sharding=rule, spec=spec, abstract=executables.abstract_model,
        read=read)
    entry = spec["components"]["unet"]
    unet_source = entry.get("source_config")
    if pix2pix and not source.pix2pix:
        unet, unet_source = _widened_unet(folder, spec, cp["unet"], rule, log, read=not restoring)
    else:
        unet = load_one("unet", cp["unet"], read=not restoring)
    return Models(
        folder=folder, spec=spec, family=family, pipeline_class=pipeline_class, unet=unet,
        vae=load_one("vae", cp["vae"]),
        encoders={n: load_one(n, cp["text"]) for n in family.encoders},
        tokenizers={t: model_folder.load_tokenizer(folder, t, spec=spec)
                    for t in ("tokenizer", "tokenizer_2") if t in spec["components"]},
        scheduler_config=model_folder.scheduler_config(folder, spec=spec),
        unet_source_config=unet_source,
    )


def widen_conv_in(arrays: dict[str, np.ndarray], in_channels: int) -> dict[str, np.ndarray]:
    """conv_in's kernel (kh, kw, C_in, C_out) padded with zeros to `in_channels` inputs; bias kept."""
    kernel = arrays["conv_in.kernel"]
    extra = in_channels - kernel.shape[2]
    if extra < 0:
        raise SdxError(f"conv_in has {kernel.shape[2]} input channels, more than {in_channels}")
    pad = np.zeros((*kernel.shape[:2], extra, kernel.shape[3]), kernel.dtype)
    return {**arrays, "conv_in.kernel": np.concatenate([kernel, pad], axis=2)}


def _widened_unet(folder: Path, spec, compute: Compute, rule, log, read: bool):
    """The pretrained UNet with 8 input channels (noisy latents + the input image's latents); abstract
    (placed, no weights read) unless `read`."""
    kind = model_folder.MODEL_KINDS["unet"]
    config = dataclasses.replace(model_folder.model_config(folder, "unet", spec=spec), in_channels=8)
    model = executables.abstract_model(kind, config, compute)
    source = spec["components"]["unet"].get("source_config")
    source = None if source is None else {**source, "in_channels": 8}
    if not read:
        return weights.placed_abstract(model, dtype=jnp.float32, sharding=rule), source
    arrays = widen_conv_in(dict(model_folder.read_arrays(folder, "unet", spec=spec)), 8)
    weights.check_arrays(weights.param_shapes(model), arrays, where="unet (conv_in widened to 8 channels)")
    log("unet: conv_in widened from 4 to 8 input channels (new channels zero, kernel and bias kept)")
    return weights.materialize(model, arrays, dtype=jnp.float32, sharding=rule), source


def drawn_like_torch(shapes: Mapping[str, tuple[int, ...]], names: Sequence[str], key: jax.Array) -> dict[str, np.ndarray]:
    """{name: float32 array}: each of `names` (an sdx parameter path, a convolution's or linear layer's kernel
    or bias, with its shape in `shapes`) drawn as torch initialises a Conv2d or Linear: uniform in ±1/√fan_in,
    fan_in every axis of the layer's kernel but the last (kaiming_uniform with a=√5, and its bias rule); the
    i-th name from fold_in(key, i)."""
    out = {}
    for i, name in enumerate(names):
        kernel = shapes[name.rsplit(".", 1)[0] + ".kernel"]  # (kh, kw, C_in, C_out) or (in, out)
        bound = 1.0 / np.sqrt(np.prod(kernel[:-1]))
        draw = jax.random.uniform(jax.random.fold_in(key, i), shapes[name], minval=-bound, maxval=bound)
        out[name] = np.asarray(draw, np.float32)
    return out
