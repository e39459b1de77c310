"""Reading a T2I-Adapter into a live `sdx.t2i_adapter.T2IAdapter`.

A T2I-Adapter source is what diffusers' `T2IAdapter.from_pretrained` reads:

- a diffusers T2I-Adapter folder (config.json + diffusion_pytorch_model[.VARIANT].safetensors, or a sharded
  index), as `T2IAdapter.save_pretrained` writes it and the TencentARC repos hold it;
- a hub id `org/name` (only its config.json and the chosen weights are downloaded);
- an original release's single file (`t2iadapter_sketch_sd14v1.pth`, `t2iadapter_color_sd14v1.pth`, or a
  `.safetensors` of the same keys, as ComfyUI and A1111 keep them; pickles read weights-only): a full
  adapter's keys `conv_in`, `body.<k>.block1/block2/in_conv` (k = level × resnets + resnet) or a light
  adapter's `body.<level>.in_conv/out_conv`, `body.<level>.body.<resnet>.block1/block2`, renamed as diffusers'
  scripts/convert_original_t2i_adapter.py renames them (`original_keys`), the architecture read from the
  shapes (`original_config`; unshuffle 8, the SD 1.x adapters these files hold).

The tensors are checked strictly (`sdx.weights.load_torch_state`): every one used once, every shape checked,
a mismatch names the key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from convert import diffusers_folder, hub
from convert.single_file import load_tensors
from convert.sources import Log, default_variant, looks_local
from sdx import io, weights
from sdx.errors import SdxError
from sdx.layers import Compute
from sdx.t2i_adapter import FULL, LIGHT, T2IAdapter, T2IAdapterConfig

_UNSHUFFLE = 8  # the original single files' (SD 1.x adapters)
_RESNETS = 2  # resnets a level of an original full adapter whose widths never change (TencentARC's nums_rb)


def resolve_t2i_adapter(spec: str, *, variant: str | None = None, cache_dir: str | Path | None = None,
                        log: Log | None = None, flag: str = "--t2i-adapter") -> Path:
    """The local folder or single file of a T2I-Adapter, or the folder of a hub id `org/name` (downloaded:
    config.json and the chosen weights only); `flag`: what errors name it by."""
    where = f"{flag} {spec}"
    path = Path(spec)
    if path.exists():
        return path
    if looks_local(spec) or not hub.looks_like_repo_id(spec):
        raise SdxError(f"{where}: no such folder (nor a hub id org/name)")

    def choose(listing: list[str]) -> list[str]:
        found = diffusers_folder.model_files(listing, ("",), variant, where=f"{where}: hub repo")
        if found is None:
            raise SdxError(f"{where}: hub repo {spec!r} has no config.json (not a diffusers T2I-Adapter)")
        return found

    return hub.fetch_files(spec, choose, cache_dir=cache_dir, log=log)


def original_config(tensors: Mapping[str, np.ndarray], where: str) -> T2IAdapterConfig:
    """The architecture of an original single file's tensors (see the module doc), from their shapes."""
    body = sorted({int(k.split(".")[1]) for k in tensors if k.startswith("body.")})
    if not body or body != list(range(len(body))):
        raise SdxError(f"{where}: not a T2I-Adapter file (no body.0, body.1, ... keys); CoAdapters and style adapters "
                       "are not read")
    cell = _UNSHUFFLE**2
    if "conv_in.weight" in tensors:  # full: (levels x resnets) blocks
        starts = [k for k in body if f"body.{k}.in_conv.weight" in tensors]
        resnets = starts[0] if starts else _RESNETS
        if len(body) % resnets or any(k % resnets for k in starts):
            raise SdxError(f"{where}: its {len(body)} blocks do not group into levels of {resnets} resnets")
        channels = [int(tensors[f"body.{level * resnets}.block1.weight"].shape[0]) for level in range(len(body) // resnets)]
        return _config(int(tensors["conv_in.weight"].shape[1]) // cell, channels, resnets, FULL, cell, where,
                       int(tensors["conv_in.weight"].shape[1]))
    if "body.0.in_conv.weight" in tensors and "body.0.body.0.block1.weight" in tensors:  # light
        widths = [int(tensors[f"body.{level}.out_conv.weight"].shape[0]) for level in body]
        resnets = len({k.split(".")[3] for k in tensors if k.startswith("body.0.body.")})
        if len(widths) < 2 or widths[-1] != widths[-2]:
            raise SdxError(f"{where}: a light adapter's last block repeats the width before it; these are {widths}")
        return _config(int(tensors["body.0.in_conv.weight"].shape[1]) // cell, widths[:-1], resnets, LIGHT, cell, where,
                       int(tensors["body.0.in_conv.weight"].shape[1]))
    raise SdxError(f"{where}: neither a full adapter (conv_in, body.N.block1) nor a light one (body.N.in_conv, "
                   "body.N.body.M.block1)")


def _config(in_channels: int, channels, resnets: int, kind: str, cell: int, where: str, read: int) -> T2IAdapterConfig:
    if in_channels not in (1, 3) or in_channels * cell != read:
        raise SdxError(f"{where}: its first layer reads {read} channels, not 1 or 3 image channels unshuffled by "
                       f"{_UNSHUFFLE} ({cell} or {3 * cell})")
    return T2IAdapterConfig(in_channels=in_channels, channels=tuple(channels), num_res_blocks=resnets,
                            downscale_factor=_UNSHUFFLE, adapter_type=kind)


def original_keys(tensors: Mapping[str, np.ndarray], config: T2IAdapterConfig) -> dict[str, np.ndarray]:
    """An original single file's tensors under diffusers' keys (diffusers' convert_original_t2i_adapter.py)."""
    out = {}
    for key, value in tensors.items():
        parts = key.split(".")
        if parts[0] == "conv_in":
            name = f"adapter.{key}"
        elif config.adapter_type == LIGHT:  # body.L.body.R.blockN -> adapter.body.L.resnets.R.blockN
            name = "adapter." + ".".join(parts[:2] + (["resnets"] + parts[3:] if parts[2] == "body" else parts[2:]))
        else:  # body.K.X -> adapter.body.(K // R).resnets.(K % R).X, or adapter.body.(K // R).in_conv
            level, resnet = divmod(int(parts[1]), config.num_res_blocks)
            rest = ".".join(parts[2:])
            name = (f"adapter.body.{level}.{rest}" if parts[2] == "in_conv"
                    else f"adapter.body.{level}.resnets.{resnet}.{rest}")
        out[name] = value
    return out


def read_config(folder: Path, where: str) -> T2IAdapterConfig:
    """The T2IAdapterConfig of a diffusers T2I-Adapter folder's config.json."""
    file = folder / "config.json"
    if not file.is_file():
        raise SdxError(f"{where}: {folder} has no config.json (not a diffusers T2I-Adapter folder)")
    try:
        return T2IAdapterConfig.from_diffusers_config(io.read_json(file, obj=True))
    except SdxError as e:
        raise SdxError(f"{where}: {file}: {e}") from None


def local_config(path: Path, where: str) -> T2IAdapterConfig:
    """The architecture of a local T2I-Adapter: a diffusers folder's config.json, or an original single file's
    shapes."""
    return read_config(path, where) if path.is_dir() else original_config(load_tensors(path), where)


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
    """The live T2I-Adapter at `src` (a folder, hub id or original single file), its parameters in `dtype` ("float32", "bfloat16",
    "float16"; with a 16-bit one the fp16 variant of the weights is read where the folder has it); compute:
    how it runs (its param_dtype is replaced by `dtype`); sharding: one Sharding for every parameter, or a
    function (path, shape) -> Sharding; flag: what errors name it by."""
    log = log or (lambda _msg: None)
    where = f"{flag} {src}"
    variant = variant if variant is not None else default_variant(dtype)
    path = resolve_t2i_adapter(str(src), variant=variant, cache_dir=cache_dir, log=log, flag=flag)
    if path.is_file():
        tensors = load_tensors(path)
        config = original_config(tensors, where)
        tensors, source = original_keys(tensors, config), str(path)
    else:
        config = read_config(path, where)
        _, tensors = diffusers_folder.read_model_folder(path, "diffusers", variant)
        source = tensors.where
    log(f"t2i-adapter: {len(tensors)} tensors from {source}")
    param_dtype = jnp.dtype(weights.dtype_of(dtype))
    cp = dataclasses.replace(compute or Compute(dtype=param_dtype), param_dtype=param_dtype)
    model = weights.abstract(lambda rngs: T2IAdapter(config, cp, rngs=rngs))
    return weights.load_torch_state(model, tensors, where=source, dtype=param_dtype, sharding=sharding)
