"""`python -m train.controlnet`: ControlNet training with diffusers' train_controlnet(_sdxl).py flags, SD
1.x/2.x or SDXL (the model says which). The UNet, VAE and text encoders stay frozen; a ControlNet learns to
steer the UNet from a control image (edges, depth, pose, ...) given per sample in
`--conditioning_image_column`.

    python -m train.controlnet --pretrained_model_name_or_path stable-diffusion-v1-5 \\
        --dataset_name ./fill50k --conditioning_image_column conditioning_image --caption_column text \\
        --resolution 512 --learning_rate 1e-5 --train_batch_size 4 --max_train_steps 5000 \\
        --validation_image ./cond.png --validation_prompt "red circle with blue background" \\
        --output_dir controlnet-fill50k
    python -m sdx.sample --model stable-diffusion-v1-5 --controlnet controlnet-fill50k --control-image cond.png \\
        --prompt "red circle with blue background"

The ControlNet starts as `--controlnet_model_name_or_path`, or as diffusers' `ControlNetModel.from_unet`
makes it (`from_unet`): the UNet's conv_in, time and added embeddings, down blocks and mid block copied,
the conditioning image's embedding drawn as torch initialises a convolution (its last convolution zero),
every zero convolution zero, so the UNet starts out computing what it did. Images are resized and
center-cropped (diffusers' transforms); the control image is in [0, 1]; the loss is the text-to-image
one (`train.denoise`) with the ControlNet's residuals added to the UNet's skips and mid block. The run
writes the ControlNet as diffusers does, `config.json` and `diffusion_pytorch_model.safetensors` in
--output_dir, which `python -m sdx.sample --controlnet` and diffusers' `ControlNetModel.from_pretrained` read.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from convert.controlnet import read_controlnet_part
from convert.controlnet_folder import CLASS, KIND
from pipelines import control, executables
from pipelines.control import Control
from sdx import mesh as meshlib
from sdx import model_folder, weights
from sdx.controlnet import ControlNetConfig
from sdx.errors import SdxError
from sdx.layers import F32
from train import config, data, diffusion, export, loop, models, sources
from train.config import TrainConfig

EMBEDDING_WIDTHS = (16, 32, 96, 256)  # diffusers' conditioning_embedding_out_channels
INIT_STREAM = 0x436E4574  # the conditioning embedding's initial draw: fold_in(key(--seed), this)
COPIED = ("conv_in.", "time_embedding.", "class_embedding.", "add_embedding.", "down_blocks.", "mid_block.")
ZERO = ("controlnet_down_blocks.", "controlnet_mid_block.", "controlnet_cond_embedding.conv_out.")
# the UNet config.json fields diffusers' from_unet passes on (the others take ControlNetModel's defaults)
UNET_FIELDS = ("encoder_hid_dim", "encoder_hid_dim_type", "addition_embed_type", "addition_time_embed_dim",
               "transformer_layers_per_block", "in_channels", "flip_sin_to_cos", "freq_shift", "down_block_types",
               "only_cross_attention", "block_out_channels", "layers_per_block", "downsample_padding",
               "mid_block_scale_factor", "act_fn", "norm_num_groups", "norm_eps", "cross_attention_dim",
               "attention_head_dim", "num_attention_heads", "use_linear_projection", "class_embed_type",
               "num_class_embeds", "upcast_attention", "resnet_time_scale_shift",
               "projection_class_embeddings_input_dim", "mid_block_type")


def from_unet(unet_source_config: dict[str, Any] | None, unet_arrays, key: jax.Array,
              factor: int = 8) -> model_folder.ModelPart:
    """diffusers' `ControlNetModel.from_unet` (rgb, 3 channels) as a ModelPart: its config.json from the
    UNet's, its arrays the UNet's where copied, zero where zero, and the conditioning embedding's other
    convolutions drawn from `key` as torch's Conv2d draws them (kernel and bias uniform in ±1/√fan_in,
    fan_in = kh·kw·C_in). The embedding's widths are diffusers' (16, 32, 96, 256) for a VAE that shrinks
    images 8 times (`factor`); for a smaller factor (the tiny demo models' 2), the first log2(factor) + 1 of
    them, so that the control image is the generated image's size."""
    if unet_source_config is None:
        raise SdxError("the model's UNet has no diffusers config.json to derive a ControlNet from; give "
                       "--controlnet_model_name_or_path")
    stages = int(np.log2(factor)) + 1
    if 2 ** (stages - 1) != factor or stages > len(EMBEDDING_WIDTHS):
        raise SdxError(f"a ControlNet's image embedding halves the image up to 8 times; this VAE shrinks it {factor} "
                       "times; give --controlnet_model_name_or_path")
    source = {"_class_name": CLASS, **{k: unet_source_config[k] for k in UNET_FIELDS if k in unet_source_config},
              "conditioning_embedding_out_channels": list(EMBEDDING_WIDTHS[:stages])}
    cfg = ControlNetConfig.from_diffusers_config(source)
    shapes = weights.param_shapes(KIND.abstract(cfg, F32))
    arrays = {}
    for name, shape in shapes.items():
        if name.startswith(COPIED):
            arrays[name] = np.asarray(unet_arrays[name], np.float32)
        elif name.startswith(ZERO):
            arrays[name] = np.zeros(shape, np.float32)
    drawn = sorted(set(shapes) - set(arrays))  # controlnet_cond_embedding.conv_in and .blocks.N
    arrays |= models.drawn_like_torch(shapes, drawn, key)
    return model_folder.ModelPart(cls=CLASS, config=cfg, arrays=arrays, source_config=source)


class ControlNetTask(diffusion.DiffusionTask):
    """The text-to-image task with a ControlNet trained beside the frozen UNet: the trained module is both,
    of which the ControlNet's parameters alone train (the UNet rides in the step's constants)."""

    def __init__(self, cfg: TrainConfig, mesh, log=print, restoring: bool = False):
        super().__init__(cfg, mesh, log, restoring)
        m = self.models
        if cfg.controlnet_model_name_or_path:
            part = read_controlnet_part(cfg.controlnet_model_name_or_path, cache_dir=cfg.cache_dir, log=log)
        else:
            arrays = model_folder.read_arrays(m.folder, "unet", spec=m.spec)
            part = from_unet(m.unet_source_config, arrays, jax.random.fold_in(jax.random.key(cfg.seed), INIT_STREAM),
                             factor=m.vae.config.downsample_factor)
            log("controlnet: the UNet's encoder half copied, its zero convolutions zero (diffusers' from_unet)")
        compute = dataclasses.replace(models.computes(cfg, mesh)["unet"], param_dtype=jnp.float32)
        net = weights.materialize(executables.abstract_model(KIND, part.config, compute), part.arrays,
                                  dtype=jnp.float32, sharding=meshlib.param_sharding(mesh))
        control.check_compatible(net, m.unet.config, m.vae.config.downsample_factor,
                                 cfg.controlnet_model_name_or_path or "the ControlNet")
        self.source_config = part.source_config
        self.module = nnx.Dict({"unet": m.unet, "controlnet": net})
        self.trainable = nnx.All(nnx.Param, nnx.PathContains("controlnet"))
        self.loss_config = dataclasses.replace(self.loss_config, controlnet=True)

    def validation_inputs(self) -> dict:
        prompts, images = validation_pairs(self.cfg)
        return {"prompts": prompts, "conditioning": [Control(image=images)]}

    def export(self, module: nnx.Module, out: Path) -> None:
        net = self.trained(module)["controlnet"]
        part = model_folder.ModelPart(cls=CLASS, config=net.config, arrays=model_folder.module_arrays(net),
                                      source_config=self.source_config)
        if jax.process_index() == 0:
            export.write_controlnet(out, part, log=self.log)


def validation_pairs(cfg: TrainConfig) -> tuple[list[str], np.ndarray]:
    """diffusers' pairing of --validation_prompt and --validation_image: as many of each, one image for every
    prompt, or every image with the one prompt. -> (prompts, control images (N, res, res, 3) in [0, 1])."""
    prompts, paths = list(cfg.validation_prompt), list(cfg.validation_image)
    if len(prompts) == 1:
        prompts = prompts * len(paths)
    if len(paths) == 1:
        paths = paths * len(prompts)
    return prompts, np.stack([(data.load_image(p, cfg.resolution) + 1) / 2 for p in paths])


def open_data(cfg: TrainConfig) -> sources.Source:
    """The dataset (`control_data`), after --controlnet_model_name_or_path is read (its config and weights
    checked, nothing loaded) before any model."""
    if cfg.controlnet_model_name_or_path:
        read_controlnet_part(cfg.controlnet_model_name_or_path, cache_dir=cfg.cache_dir)
    return control_data(cfg)


def control_data(cfg: TrainConfig) -> sources.Source:
    """The dataset with its image, control image and caption columns (a missing one is an error naming the
    columns found), the validation's control images decoded now, not first at the first validation (a
    ControlNet's run and a T2I-Adapter's)."""
    for path in cfg.validation_image:
        try:
            data.load_image(path, cfg.resolution)
        except SdxError as e:
            raise SdxError(f"--validation_image {e}") from None
    columns = sources.Columns(images=(cfg.image_column, cfg.conditioning_image_column), text=cfg.caption_column,
                              names=("pixels", "conditioning_pixels"))
    spec = cfg.dataset_name or cfg.train_data_dir
    return sources.open_source(spec, columns, max_samples=cfg.max_train_samples, seed=cfg.seed, cache_dir=cfg.cache_dir)


def train(argv=None) -> int:
    return loop.run(config.parse("controlnet", argv), ControlNetTask, open_data)


if __name__ == "__main__":
    loop.main(train, sys.argv[1:])
