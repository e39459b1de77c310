"""Reading a T2I-Adapter into a live `sdx.t2i_adapter.T2IAdapter`.

A T2I-Adapter source is what diffusers' `T2IAdapter.from_pretrained` reads:

- a diffusers T2I-Adapter folder (config.json + diffusion_pytorch_model[.VARIANT].safetensors, or a sharded
  index), as `T2IAdapter.save_pretrained` writes it and the TencentARC repos hold it;
- a hub id `org/name` (only its config.json and the chosen weights are downloaded).

The tensors are checked strictly (`sdx.weights.load_torch_state`): every one used once, every shape checked,
a mismatch names the key. The original release's `.pth` files are not read: use their diffusers
conversions (`TencentARC/t2iadapter_*_sd14v1`, `TencentARC/t2i-adapter-*-sdxl-1.0`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp

from convert import diffusers_folder, hub
from convert.sources import Log, default_variant, looks_local
from sdx import io, weights
from sdx.errors import SdxError
from sdx.layers import Compute
from sdx.t2i_adapter import T2IAdapter, T2IAdapterConfig


def resolve_t2i_adapter(spec: str, *, variant: str | None = None, cache_dir: str | Path | None = None,
                        log: Log | None = None, flag: str = "--t2i-adapter") -> Path:
    """The local folder of a T2I-Adapter given as a folder or a hub id `org/name` (downloaded: config.json and
    the chosen weights only); `flag`: what errors name it by."""
    where = f"{flag} {spec}"
    path = Path(spec)
    if path.is_dir():
        return path
    if path.exists():
        raise SdxError(f"{where}: not a folder (a diffusers T2I-Adapter folder: config.json and its weights)")
    if looks_local(spec) or not hub.looks_like_repo_id(spec):
        raise SdxError(f"{where}: no such folder (nor a hub id org/name)")

    def choose(listing: list[str]) -> list[str]:
        found = diffusers_folder.model_files(listing, ("",), variant, where=f"{where}: hub repo")
        if found is None:
            raise SdxError(f"{where}: hub repo {spec!r} has no config.json (not a diffusers T2I-Adapter)")
        return found

    return hub.fetch_files(spec, choose, cache_dir=cache_dir, log=log)


def read_config(folder: Path, where: str) -> T2IAdapterConfig:
    """The T2IAdapterConfig of a diffusers T2I-Adapter folder's config.json."""
    file = folder / "config.json"
    if not file.is_file():
        raise SdxError(f"{where}: {folder} has no config.json (not a diffusers T2I-Adapter folder)")
    try:
        return T2IAdapterConfig.from_diffusers_config(io.read_json(file, obj=True))
    except SdxError as e:
        raise SdxError(f"{where}: {file}: {e}") from None


def load_t2i_adapter(
    src: str | Path,
    *,
    dtype: str = "float32",
    compute: Compute | None = None,
    sharding: weights.Sharding = None,
    variant: str | None = None,
    cache_dir: str | Path | None = None,
    log: Log | None = None,
    flag: str = "--t2i-adapter",
) -> T2IAdapter:
    """The live T2I-Adapter at `src` (a folder or hub id), its parameters in `dtype` ("float32", "bfloat16",
    "float16"; with a 16-bit one the fp16 variant of the weights is read where the folder has it); compute:
    how it runs (its param_dtype is replaced by `dtype`); sharding: one Sharding for every parameter, or a
    function (path, shape) -> Sharding; flag: what errors name it by."""
    log = log or (lambda _msg: None)
    where = f"{flag} {src}"
    variant = variant if variant is not None else default_variant(dtype)
    folder = resolve_t2i_adapter(str(src), variant=variant, cache_dir=cache_dir, log=log, flag=flag)
    config = read_config(folder, where)
    _, tensors = diffusers_folder.read_model_folder(folder, "diffusers", variant)
    log(f"t2i-adapter: {len(tensors)} tensors from {tensors.where}")
    param_dtype = jnp.dtype(weights.dtype_of(dtype))
    cp = dataclasses.replace(compute or Compute(dtype=param_dtype), param_dtype=param_dtype)
    model = weights.abstract(lambda rngs: T2IAdapter(config, cp, rngs=rngs))
    return weights.load_torch_state(model, tensors, where=tensors.where, dtype=param_dtype, sharding=sharding)
