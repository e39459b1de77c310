"""`python -m train.t2i_adapter`: T2I-Adapter training with diffusers' train_t2i_adapter_sdxl.py flags, SDXL or
SD 1.x/2.x (the model says which). The UNet, VAE and text encoders stay frozen; a T2I-Adapter learns to steer
the UNet from a control image (sketch, depth, pose, ...) given per sample in `--conditioning_image_column`.

    python -m train.t2i_adapter --pretrained_model_name_or_path stable-diffusion-xl-base-1.0 \\
        --dataset_name ./fill50k --conditioning_image_column conditioning_image --caption_column text \\
        --resolution 1024 --learning_rate 1e-5 --train_batch_size 4 --max_train_steps 5000 \\
        --validation_image ./cond.png --validation_prompt "red circle with blue background" \\
        --output_dir t2iadapter-fill50k
    python -m sdx.sample --model stable-diffusion-xl-base-1.0 --t2i-adapter t2iadapter-fill50k \\
        --t2i-adapter-image cond.png --prompt "red circle with blue background"

The adapter starts as `--adapter_model_name_or_path` (what `--t2i-adapter` reads), or as
diffusers' script builds it, drawn as torch initialises its convolutions: for SDXL its full_adapter_xl
((320, 640, 1280, 1280), 2 resnets a block, pixel-unshuffle 16); for another UNet the same rule on its widths
(`default_config`; SD 1.x/2.x: diffusers' default full_adapter, unshuffle 8). Images are resized and
center-cropped as the script does; the control image is in [0, 1]; the loss is the text-to-image one
(`train.denoise`) with the adapter's feature maps added inside the UNet's down blocks and the timesteps drawn
cubically (`train.objective.timesteps`).

The script writes its loss as the σ-weighted error of the denoised latents, (σ⁻²) · |x_t − σ·ε̂ − x_0|², with
x_t = x_0 + σ·ε: for an epsilon model that is |ε − ε̂|², the text-to-image loss sdx computes (the step's
loss and gradients are checked against the script's formula in tests/test_train_t2i_adapter.py). For a
v-prediction model the script compares that x_0 estimate with the velocity; sdx trains the v target, as its
other tasks do. The run writes the adapter as diffusers does, `config.json` and
`diffusion_pytorch_model.safetensors` in --output_dir, which `python -m sdx.sample --t2i-adapter` and diffusers'
`T2IAdapter.from_pretrained` read.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from convert.t2i_adapter import load_t2i_adapter, local_config, resolve_t2i_adapter
from pipelines import t2i_adapter as pipeline_adapter
from pipelines.t2i_adapter import AdapterImage
from sdx import mesh as meshlib
from sdx import model_folder, weights
from sdx.errors import SdxError
from sdx.t2i_adapter import FULL, FULL_XL, T2IAdapter, T2IAdapterConfig
from sdx.unet import PLAIN_DOWN, UNetConfig
from train import config, controlnet, diffusion, export, loop, models, sources
from train.config import TrainConfig

INIT_STREAM = 0x54324941  # the adapter's initial draw: fold_in(key(--seed), this)
RESNETS = 2  # resnets a block, diffusers' script's
FLAG = "--adapter_model_name_or_path"


def default_config(unet: UNetConfig, factor: int) -> T2IAdapterConfig:
    """The adapter diffusers' script builds, for `unet` and a VAE that shrinks images `factor` times: a UNet
    whose first level has no attentions (SDXL's) takes a full_adapter_xl whose maps meet each level at half the
    latents' size (unshuffle 2·factor), widths the UNet's, plus one for the mid block after a third level; any
    other a full_adapter of the UNet's widths (unshuffle `factor`). SDXL and SD 1.5 give diffusers' shapes."""
    widths = unet.block_out_channels
    if unet.down_block_types[0] == PLAIN_DOWN:
        channels = widths + (widths[-1],) if unet.levels == 3 and unet.mid_block_type is not None else widths
        return T2IAdapterConfig(channels=channels, num_res_blocks=RESNETS, downscale_factor=2 * factor,
                                adapter_type=FULL_XL)
    return T2IAdapterConfig(channels=widths, num_res_blocks=RESNETS, downscale_factor=factor, adapter_type=FULL)


class T2IAdapterTask(diffusion.DiffusionTask):
    """The text-to-image task with a T2I-Adapter trained beside the frozen UNet: the trained module is both, of
    which the adapter's parameters alone train (the UNet rides in the step's constants)."""

    def __init__(self, cfg: TrainConfig, mesh, log=print, restoring: bool = False):
        super().__init__(cfg, mesh, log, restoring)
        m = self.models
        factor = m.vae.config.downsample_factor
        compute = dataclasses.replace(models.computes(cfg, mesh)["unet"], param_dtype=jnp.float32)
        sharding = meshlib.param_sharding(mesh)
        source = cfg.adapter_model_name_or_path
        if source:
            adapter = load_t2i_adapter(source, compute=compute, sharding=sharding, cache_dir=cfg.cache_dir, log=log,
                                       flag=FLAG)
        else:
            adapter_config = default_config(m.unet.config, factor)
            abstract = weights.abstract(lambda rngs: T2IAdapter(adapter_config, compute, rngs=rngs))
            shapes = weights.param_shapes(abstract)
            key = jax.random.fold_in(jax.random.key(cfg.seed), INIT_STREAM)
            adapter = weights.materialize(abstract, models.drawn_like_torch(shapes, sorted(shapes), key),
                                          dtype=jnp.float32, sharding=sharding)
            log(f"t2i-adapter: a {adapter_config.adapter_type} of widths {list(adapter_config.channels)}, drawn as "
                "torch initialises it")
        pipeline_adapter.check_compatible(adapter, m.unet.config, factor, source or "(the default adapter)")
        check_trainable(adapter.config, cfg.resolution, source or "the default adapter")
        self.module = nnx.Dict({"unet": m.unet, "t2i_adapter": adapter})
        self.trainable = nnx.All(nnx.Param, nnx.PathContains("t2i_adapter"))
        self.loss_config = dataclasses.replace(self.loss_config, t2i_adapter=True)

    def validation_inputs(self) -> dict:
        prompts, images = controlnet.validation_pairs(self.cfg)
        return {"prompts": prompts, "conditioning": [AdapterImage(image=images)]}

    def export(self, module: nnx.Module, out: Path) -> None:
        adapter = self.trained(module)["t2i_adapter"]
        arrays = model_folder.module_arrays(adapter)
        if jax.process_index() == 0:
            export.write_t2i_adapter(out, adapter.config, arrays, log=self.log)


def check_trainable(c: T2IAdapterConfig, resolution: int, where: str) -> None:
    """Refuse an adapter the dataset's RGB control images at `resolution` cannot train, before compiling."""
    if c.in_channels != 3:
        raise SdxError(f"{FLAG} {where}: it reads {c.in_channels}-channel images; the dataset's "
                       "control images are RGB (3)")
    if resolution % c.downscale_factor:
        raise SdxError(f"--resolution {resolution}: {where} reads images whose sides are multiples of "
                       f"{c.downscale_factor} pixels")


def open_data(cfg: TrainConfig) -> sources.Source:
    """The dataset (`train.controlnet.control_data`), after --adapter_model_name_or_path's config is read and
    checked (nothing loaded) before any model."""
    if cfg.adapter_model_name_or_path:
        spec = cfg.adapter_model_name_or_path
        path = resolve_t2i_adapter(spec, cache_dir=cfg.cache_dir, flag=FLAG)
        check_trainable(local_config(path, f"{FLAG} {spec}"), cfg.resolution, spec)
    return controlnet.control_data(cfg)


def train(argv=None) -> int:
    return loop.run(config.parse("t2i_adapter", argv), T2IAdapterTask, open_data)


if __name__ == "__main__":
    loop.main(train, sys.argv[1:])
