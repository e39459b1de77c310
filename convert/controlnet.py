"""Reading a diffusers ControlNet into a live `sdx.controlnet.ControlNetModel`.

A ControlNet is a diffusers model folder, what `ControlNetModel.save_pretrained` writes:

    config.json                                 ControlNetModel's config (`ControlNetConfig.from_diffusers_config`)
    diffusion_pytorch_model[.VARIANT].safetensors   or a sharded `.safetensors.index[.VARIANT].json`

given as that folder, a pipeline folder holding it as controlnet/, or a hub id `org/name` (only its
config.json and the chosen weights are downloaded, from the root or controlnet/). The weights are read
by `convert.diffusers_folder` and load with no rename table, strictly (`sdx.weights.from_torch_keys`):
every tensor used once, every shape checked, a mismatch names the key. Original single-file ControlNets
(`control_*.pth`, LDM keys) are not read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp

from convert import diffusers_folder, hub
from convert.sources import Log, default_variant, looks_local
from sdx import weights
from sdx.controlnet import ControlNetConfig, ControlNetModel
from sdx.errors import SdxError
from sdx.layers import Compute

SUBFOLDER = "controlnet"  # where a pipeline folder or repo keeps its ControlNet


def _model_folder(path: Path) -> Path:
    """`path`, or its controlnet/ when `path` is a pipeline folder holding one there."""
    if not (path / "config.json").is_file() and (path / SUBFOLDER / "config.json").is_file():
        return path / SUBFOLDER
    return path


def resolve_controlnet(
    spec: str, *, variant: str | None = None, cache_dir: str | Path | None = None, log: Log | None = None
) -> Path:
    """The local folder of a ControlNet given as a folder or a hub id `org/name` (downloaded: config.json and
    the chosen weights only)."""
    path = Path(spec)
    if path.is_dir():
        return _model_folder(path)
    if path.exists():
        raise SdxError(f"controlnet {spec}: not a folder (sdx reads diffusers ControlNet folders: config.json + "
                       "diffusion_pytorch_model.safetensors)")
    if looks_local(spec) or not hub.looks_like_repo_id(spec):
        raise SdxError(f"controlnet {spec}: no such folder (nor a hub id org/name)")
    where = f"controlnet {spec}: hub repo {spec!r}"

    def choose(listing: list[str]) -> list[str]:
        found = diffusers_folder.model_files(listing, ("", f"{SUBFOLDER}/"), variant, where=where)
        if found is None:
            raise SdxError(f"{where} has neither config.json nor {SUBFOLDER}/config.json")
        return found

    return _model_folder(hub.fetch_files(spec, choose, cache_dir=cache_dir, log=log))


def read_controlnet(
    folder: str | Path, *, variant: str | None = None
) -> tuple[ControlNetConfig, weights.SourceTensors]:
    """The config and the diffusers-keyed tensors (memory-mapped) of the ControlNet folder `folder`."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise SdxError(f"controlnet {folder}: no config.json (not a diffusers ControlNet folder)")
    config, tensors = diffusers_folder.read_model_folder(folder, "diffusers", variant)
    try:
        return ControlNetConfig.from_diffusers_config(config), tensors
    except SdxError as e:
        raise SdxError(f"{folder / 'config.json'}: {e}") from None


def load_controlnet(
    src: str | Path,
    *,
    dtype: str = "float32",
    compute: Compute | None = None,
    sharding: weights.Sharding = None,
    variant: str | None = None,
    cache_dir: str | Path | None = None,
    log: Log | None = None,
) -> ControlNetModel:
    """The live ControlNet at `src` (a folder or hub id, see `resolve_controlnet`), as
    `sdx.model_folder.load_component` loads the other models.

    dtype: parameter dtype ("float32", "bfloat16", "float16"); with a 16-bit one the fp16 variant of
      the weights is read where the folder has it (unless `variant` says otherwise).
    compute: how the model runs (activation dtype, attention backend, remat); its param_dtype is
      replaced by `dtype`. Default: Compute(dtype=dtype, param_dtype=dtype).
    sharding: one `jax.sharding.Sharding` for every parameter, or a function (path, shape) -> Sharding.
    """
    log = log or (lambda _msg: None)
    param_dtype = jnp.dtype(weights.dtype_of(dtype))
    variant = variant if variant is not None else default_variant(dtype)
    folder = resolve_controlnet(str(src), variant=variant, cache_dir=cache_dir, log=log)
    config, tensors = read_controlnet(folder, variant=variant)
    if compute is None:
        compute = Compute(dtype=param_dtype, param_dtype=param_dtype)
    else:
        compute = dataclasses.replace(compute, param_dtype=param_dtype)
    model = weights.abstract(lambda rngs: ControlNetModel(config, compute, rngs=rngs))
    log(f"controlnet: {len(tensors)} tensors from {tensors.where}")
    return weights.load_torch_state(model, tensors, where=tensors.where, dtype=param_dtype, sharding=sharding)
