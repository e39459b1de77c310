"""Reading a ControlNet from any source into a live `sdx.controlnet.ControlNetModel` (or its subclass
`sdx.controlnet_union.ControlNetUnionModel`, a ControlNet-Union: see the end).

A ControlNet source (`read_controlnet_part`) is one of:

- an sdx ControlNet folder (sdx.json + controlnet.safetensors, `convert.controlnet_folder`);
- a diffusers ControlNet folder, what `ControlNetModel.save_pretrained` writes:

      config.json                                    ControlNetModel's config (`ControlNetConfig.from_diffusers_config`)
      diffusion_pytorch_model[.VARIANT].safetensors  or a sharded `.safetensors.index[.VARIANT].json`

  or a pipeline folder holding one as controlnet/;
- a hub id `org/name` (only its config.json and the chosen weights are downloaded, from the root or controlnet/);
- an original single file (`control_v11p_sd15_canny.pth`, `.safetensors`, `.ckpt`; read by
  `convert.single_file.load_tensors`, pickles weights-only), in the layout `convert.controlnet_single_file`
  describes: its architecture is `config` (a diffusers ControlNet folder), else a preset's, by default the
  one its keys point to.

Every source ends as a `ModelPart` (sdx-keyed arrays in Flax layout, memory-mapped, the config, the diffusers
config.json) checked strictly (`sdx.weights.from_torch_keys`): every tensor used once, every shape checked,
a mismatch names the key. `load_controlnet` makes it a live model; `python -m convert` writes it in any
format (`convert.controlnet_folder.WRITERS`), after `read_if_controlnet` has told a ControlNet from a
pipeline: a single file with a ControlNet's keys (`input_hint_block`, or `controlnet_cond_embedding` in
diffusers' keys), an sdx folder whose sdx.json says ControlNetModel, a folder whose config.json does, or a
hub repo with such a config.json and no model_index.json.

A ControlNet-Union comes from the same folders and hub repos (its class "ControlNetUnionModel" in place of
"ControlNetModel"): it is told by its config.json, diffusers' class or the union's fields (xinsir's
config.json names ControlNetModel and carries num_control_type), or by its weights' `task_embedding`. It has
no original single-file layout; a single file in diffusers' keys reads (`convert.controlnet_single_file`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from convert import controlnet_folder, diffusers_folder, hub
from convert import controlnet_single_file as single
from convert.controlnet_folder import KIND, KINDS, UNION_KIND
from convert.single_file import load_tensors
from convert.sources import Log, default_variant, looks_local
from sdx import diffusers_config, io, weights
from sdx.controlnet import ControlNetConfig, ControlNetModel
from sdx.errors import SdxError
from sdx.layers import Compute
from sdx.model_folder import ModelKind, ModelPart

SUBFOLDER = "controlnet"  # where a pipeline folder or repo keeps its ControlNet


def _model_folder(path: Path) -> Path:
    """`path`, or its controlnet/ when `path` is a pipeline folder holding one there."""
    if not (path / "config.json").is_file() and (path / SUBFOLDER / "config.json").is_file():
        return path / SUBFOLDER
    return path


def resolve_controlnet(
    spec: str, *, variant: str | None = None, revision: str | None = None, cache_dir: str | Path | None = None,
    log: Log | None = None,
) -> Path:
    """The local folder of a ControlNet given as a folder or a hub id `org/name` (downloaded: config.json and
    the chosen weights only)."""
    path = Path(spec)
    if path.is_dir():
        return _model_folder(path)
    if path.exists():
        raise SdxError(f"controlnet {spec}: neither a folder nor a file")
    if looks_local(spec) or not hub.looks_like_repo_id(spec):
        raise SdxError(f"controlnet {spec}: no such folder or file (nor a hub id org/name)")
    where = f"controlnet {spec}: hub repo {spec!r}"

    def choose(listing: list[str]) -> list[str]:
        found = diffusers_folder.model_files(listing, ("", f"{SUBFOLDER}/"), variant, where=where)
        if found is None:
            raise SdxError(f"{where} has neither config.json nor {SUBFOLDER}/config.json")
        return found

    return _model_folder(hub.fetch_files(spec, choose, revision=revision, cache_dir=cache_dir, log=log))


def _kind(config: dict[str, Any], tensors=()) -> ModelKind:
    """A ControlNet-Union's kind when its config.json says so (its class or the union's fields,
    `sdx.diffusers_config.is_controlnet_union`) or its weights hold the union's `task_embedding` (xinsir's
    config.json names ControlNetModel), else a ControlNet's."""
    return UNION_KIND if diffusers_config.is_controlnet_union(config) or single.UNION_KEY in tensors else KIND


def _parsed(config: dict[str, Any], where: str | Path, tensors=()) -> ControlNetConfig:
    try:
        return _kind(config, tensors).config_from_diffusers(config)
    except SdxError as e:
        raise SdxError(f"{where}: {e}") from None


def _part(config: dict[str, Any], tensors, *, where: str, config_where: str | Path) -> ModelPart:
    """A ControlNet's diffusers config.json dict and diffusers-keyed tensors as a `ModelPart`, strictly;
    `where`, `config_where`: what errors name for the tensors and the config."""
    kind = _kind(config, tensors)
    parsed = _parsed(config, config_where, tensors)
    arrays = weights.from_torch_keys(kind.param_shapes(parsed), tensors, where=where)
    return ModelPart(cls=kind.classes[0], config=parsed, arrays=arrays, source_config=dict(config))


def _diffusers_part(folder: Path, variant: str | None, log: Log) -> ModelPart:
    if not (folder / "config.json").is_file():
        raise SdxError(f"controlnet {folder}: no config.json (not a diffusers ControlNet folder, nor an sdx one)")
    config, tensors = diffusers_folder.read_model_folder(folder, "diffusers", variant)
    log(f"controlnet: {len(tensors)} tensors from {tensors.where}")
    return _part(config, tensors, where=tensors.where, config_where=folder / "config.json")


def _config_folder(config: str | Path) -> dict[str, Any]:
    """The ControlNet config.json of `config`: a diffusers ControlNet folder, or a pipeline folder's controlnet/."""
    path = Path(config)
    if not path.is_dir():
        raise SdxError(f"config {config}: not a folder (a diffusers ControlNet folder with its config.json)")
    file = _model_folder(path) / "config.json"
    d = io.read_json(file, obj=True)
    _parsed(d, file)
    return d


def _file_part(path: Path, tensors, config: str | Path | None, preset: str | None, log: Log) -> ModelPart:
    if config is not None and preset is not None:
        raise SdxError(f"controlnet {path}: a config folder or a preset describes it, not both")
    log(f"controlnet: single file {path}" + (f" described by {config or preset}" if config or preset else ""))
    config_json = _config_folder(config) if config is not None else None
    config_json, tensors = single.from_single_file(tensors, config_json, preset=preset, where=str(path), log=log)
    return _part(config_json, tensors, where=str(path), config_where=path)


def read_controlnet_part(
    src: str | Path,
    *,
    config: str | Path | None = None,
    preset: str | None = None,
    variant: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    log: Log | None = None,
) -> ModelPart:
    """The ControlNet at `src` (any source of the module doc), checked strictly. For a single-file `src`:
    config, a diffusers ControlNet folder describing it, or preset, the `sdx.presets` name whose UNet it
    copies (default: the preset its keys point to)."""
    log = log or (lambda _msg: None)
    path = Path(src)
    if path.is_file():
        return _file_part(path, load_tensors(path), config, preset, log)
    if config is not None or preset is not None:
        raise SdxError(f"controlnet {src}: a config folder or preset describes a single file; this is not one "
                       "(its config is its own)")
    if controlnet_folder.is_controlnet_folder(path):
        log(f"controlnet: sdx folder {path}")
        return controlnet_folder.read_sdx(path)
    folder = resolve_controlnet(str(src), variant=variant, revision=revision, cache_dir=cache_dir, log=log)
    return _diffusers_part(folder, variant, log)


def _config_class(folder: Path) -> str | None:
    config = io.read_json(folder / "config.json", optional=True)
    return config.get("_class_name") if isinstance(config, dict) else None


def _hub_config_class(repo: str, *, revision: str | None, cache_dir: str | Path | None, log: Log) -> str | None:
    """The class a hub repo's root config.json names, None for a pipeline repo (model_index.json) or one without."""

    def choose(listing: list[str]) -> list[str]:
        if diffusers_folder.MODEL_INDEX in listing or "config.json" not in listing:
            return [name for name in (diffusers_folder.MODEL_INDEX,) if name in listing]
        return ["config.json"]

    folder = hub.fetch_files(repo, choose, revision=revision, cache_dir=cache_dir, log=log)
    return None if (folder / diffusers_folder.MODEL_INDEX).is_file() else _config_class(folder)


def read_if_controlnet(src: str | Path, **options: Any) -> ModelPart | None:
    """The ControlNet at `src` when it is one (see the module doc), else None: `python -m convert` reads
    anything else as a pipeline. `options`: `read_controlnet_part`'s. A single file is read once here
    (memory-mapped when it is safetensors)."""
    log = options.get("log") or (lambda _msg: None)
    path = Path(src)
    if path.is_file():
        tensors = load_tensors(path)
        if single.layout_of(tensors) is None:
            return None
        return _file_part(path, tensors, options.get("config"), options.get("preset"), log)
    if path.is_dir():
        found = controlnet_folder.is_controlnet_folder(path) or _config_class(path) in KINDS
    else:
        found = _hub_config_class(str(src), revision=options.get("revision"), cache_dir=options.get("cache_dir"),
                                  log=log) in KINDS
    return read_controlnet_part(src, **options) if found else None


def load_controlnet(
    src: str | Path,
    *,
    dtype: str = "float32",
    compute: Compute | None = None,
    sharding: weights.Sharding = None,
    variant: str | None = None,
    cache_dir: str | Path | None = None,
    log: Log | None = None,
    config: str | Path | None = None,
    abstract: Callable[[ModelKind, Any, Compute], nnx.Module] | None = None,
) -> ControlNetModel:
    """The live ControlNet at `src` (a folder, hub id or single file, see `read_controlnet_part`), as
    `sdx.model_folder.load_component` loads the other models.

    dtype: parameter dtype ("float32", "bfloat16", "float16"); with a 16-bit one the fp16 variant of
      the weights is read where a diffusers folder has it (unless `variant` says otherwise).
    compute: how the model runs (activation dtype, attention backend, remat); its param_dtype is
      replaced by `dtype`. Default: Compute(dtype=dtype, param_dtype=dtype).
    sharding: one `jax.sharding.Sharding` for every parameter, or a function (path, shape) -> Sharding.
    config: for a single file, the diffusers ControlNet folder whose config.json describes it.
    abstract: (kind, config, compute) -> the abstract model to fill, as for `load_component`.
    """
    param_dtype = jnp.dtype(weights.dtype_of(dtype))
    variant = variant if variant is not None else default_variant(dtype)
    part = read_controlnet_part(src, config=config, variant=variant, cache_dir=cache_dir, log=log)
    if compute is None:
        compute = Compute(dtype=param_dtype, param_dtype=param_dtype)
    else:
        compute = dataclasses.replace(compute, param_dtype=param_dtype)
    model = (abstract or ModelKind.abstract)(KINDS[part.cls], part.config, compute)
    return weights.materialize(model, part.arrays, dtype=param_dtype, sharding=sharding)
