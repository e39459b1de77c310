"""`python -m train.init`: the starting point of a model trained from scratch.

    python -m train.init --preset shapes --vae VAE_FOLDER --scaling_data DATA --output_dir OUT

Writes an sdx folder with the architecture of pipeline preset --preset (`sdx.presets`): the UNet and
the text encoders with random weights drawn from --seed, the built-in CLIP tokenizers, the preset's
scheduler. --vae puts a trained VAE in (a VAE folder as `python -m train.vae --vae_config` writes, or
anything `python -m sdx.sample --vae` takes); --scaling_data sets its scaling_factor to one over the
standard deviation of the posterior samples of DATA's first --scaling_samples images (the Latent
Diffusion rule), so that the diffusion model trains on latents of unit variance.

`python -m train.text_to_image --pretrained_model_name_or_path OUT` then trains the UNet; the text
encoders stay as drawn (frozen, as in every diffusers training script).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from convert.sources import check_vae_architecture, read_vae_source
from convert.demo import random_parts, write_pipeline
from sdx import io, model_folder, presets, weights
from sdx.errors import ArgumentParser, SdxError
from sdx.layers import F32
from train import data, loop, sources


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m train.init", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", required=True, choices=presets.NAMES, help="the architecture")
    p.add_argument("--output_dir", "--output-dir", required=True, help="the sdx folder to write")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--vae", help="a trained VAE of the preset's VAE architecture")
    p.add_argument("--scaling_data", "--scaling-data",
                   help="a dataset (as --dataset_name takes) to measure the VAE's scaling_factor on")
    p.add_argument("--scaling_samples", "--scaling-samples", type=int, default=512,
                   help="images of --scaling_data used (default 512)")
    p.add_argument("--image_column", "--image-column", default="image", help="--scaling_data's image column")
    p.add_argument("--resolution", type=int, help="--scaling_data's image size (default: the VAE's sample_size)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_dir")
    return p


def trained_vae(path: str, preset: presets.Preset) -> model_folder.ModelPart:
    """The VAE at `path` as a model part, checked to be the preset's VAE architecture."""
    config, tensors = read_vae_source(Path(path), preset.configs["vae"])
    vae_config = check_vae_architecture(config, preset.configs["vae"], where=f"--vae {path}")
    targets = model_folder.MODEL_KINDS["vae"].param_shapes(vae_config)
    arrays = weights.from_torch_keys(targets, tensors, where=f"--vae {path}")
    return model_folder.ModelPart("AutoencoderKL", vae_config, arrays, config)


def scaling_factor(vae: model_folder.ModelPart, dataset: str, *, column: str, count: int, resolution: int) -> float:
    """1 / std of the posterior samples (seed 0) of the first `count` images of `dataset`."""
    src = sources.open_source(dataset, sources.Columns(images=(column,), text=None, names=("pixels",)),
                              max_samples=count, seed=0)
    module = weights.materialize(model_folder.MODEL_KINDS["vae"].abstract(vae.config, F32), vae.arrays)
    transform = data.Transform(resolution=resolution, center_crop=True)
    loader = data.make_loader(src, transform, batch_size=min(64, len(src)), num_epochs=1, shuffle=False,
                              shard_index=0, shard_count=1)
    encode = jax.jit(lambda m, x, k: m.encode(x).sample(k))
    latents = [np.asarray(encode(module, jnp.asarray(b["pixels"]), jax.random.key(i))) for i, b in enumerate(loader)]
    return float(1.0 / np.concatenate(latents).std())


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    preset = presets.get(args.preset)
    out = Path(args.output_dir)
    if model_folder.is_model_folder(out) and not args.overwrite:
        raise SdxError(f"--output_dir {out} already holds a model; give --overwrite to replace it")
    if args.scaling_data and not args.vae:
        raise SdxError("--scaling_data measures a trained VAE: give --vae too")
    io.check_writable(out, "--output_dir")
    parts = random_parts(preset, args.seed, ("unet", *preset.text_encoders))
    parts["vae"] = trained_vae(args.vae, preset) if args.vae else random_parts(preset, args.seed, ("vae",))["vae"]
    if args.scaling_data:
        vae = parts["vae"]
        factor = scaling_factor(vae, args.scaling_data, column=args.image_column, count=args.scaling_samples,
                                resolution=args.resolution or vae.config.sample_size)
        parts["vae"] = model_folder.ModelPart(vae.cls, dataclasses.replace(vae.config, scaling_factor=factor), vae.arrays,
                                              {**vae.source_config, "scaling_factor": factor})
        print(f"vae scaling_factor: {factor:.5f}", file=sys.stderr)
    write_pipeline(out, preset, parts, overwrite=args.overwrite)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    loop.main(main, sys.argv[1:])
