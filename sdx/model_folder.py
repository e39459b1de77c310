"""The sdx model folder: what `python -m convert` writes and what the sampler and trainer load.

    MODEL/
      sdx.json                    the spec (below)
      unet.safetensors            one file per model component, keyed by sdx parameter path
      vae.safetensors             (`down_blocks.0.resnets.0.conv1.kernel`), arrays already in Flax
      text_encoder.safetensors    layout (kernels HWIO / (in, out)), all in the spec's dtype
      text_encoder_2.safetensors
      tokenizer/  tokenizer_2/    the tokenizer files exactly as the source had them

sdx.json:

    {"format": "sdx", "format_version": 1,
     "pipeline_class": "StableDiffusionXLPipeline",      # model_index.json's _class_name
     "dtype": "bfloat16",                                 # of every tensor in the safetensors files
     "components": {
       "unet": {"class": "UNet2DConditionModel", "file": "unet.safetensors",
                "config": {...UNetConfig.to_dict()...},
                "source_config": {...the diffusers config.json it came from, or null...}},
       "vae": {...}, "text_encoder": {...}, "text_encoder_2": {...},
       "tokenizer": {"class": "CLIPTokenizer", "folder": "tokenizer"}, "tokenizer_2": {...},
       "scheduler": {"class": "EulerDiscreteScheduler", "config": {...scheduler_config.json...}}},
     "extra": {"force_zeros_for_empty_prompt": true}}    # model_index.json's other entries

A standalone model that is no pipeline (a ControlNet, `convert.controlnet_folder`) has a folder of the same
form: "model_class" in place of "pipeline_class", its one model component, no extra.

Loading reads nothing twice and builds no random weights: the model is built abstractly
(`sdx.weights.abstract`), the safetensors file is memory-mapped, every key and shape is checked, and
`sdx.weights.materialize` puts each tensor on the device(s) with its sharding (each device reading only
its own slice). Writing is atomic: the folder is built as `MODEL.tmp-*` next to MODEL and renamed.

This module knows the sdx side only; reading diffusers folders, hub repos and single files into a
`convert.checkpoint.Checkpoint`, and writing one here, is `convert`'s job (`convert/sdx_folder.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import os
import shutil
import tempfile
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdx import io, weights
from sdx import mesh as meshlib
from sdx.config import NAME, Kind, check_types, optional
from sdx.errors import SdxError
from sdx.layers import Compute

FORMAT = "sdx"
FORMAT_VERSION = 1
SPEC_FILE = "sdx.json"
GUIDANCE_KEY = "default_guidance_scale"  # in "extra" (model_index.json): the model's own guidance scale, an sdx key
MODEL_CLASS = "model_class"  # a standalone model's class, in its sdx.json in place of "pipeline_class"


# --------------------------------------------------------------------------------------------------
# What a pipeline is made of


@dataclasses.dataclass(frozen=True)
class ModelKind:
    """A model component: the diffusers/transformers classes it may be, and the sdx module built for it."""

    classes: tuple[str, ...]  # as model_index.json names them; the first is the default
    module: str  # "sdx.unet"
    config_class: str  # "UNetConfig": from_diffusers_config / from_dict / to_dict
    model_class: str  # "UNet2DConditionModel": Model(config, compute, *, rngs)

    def _get(self, name: str):
        return getattr(importlib.import_module(self.module), name)

    def config_from_diffusers(self, d: Mapping[str, Any]):
        return self._get(self.config_class).from_diffusers_config(d)

    def config_from_dict(self, d: Mapping[str, Any]):
        return self._get(self.config_class).from_dict(d)

    def build(self, config, compute: Compute, rngs: nnx.Rngs) -> nnx.Module:
        return self._get(self.model_class)(config, compute, rngs=rngs)

    def abstract(self, config, compute: Compute | None = None) -> nnx.Module:
        """The model `build` would make, with shapes in place of arrays: a copy of its own (loading fills
        it in place) of the one built for these arguments first in this process."""
        return nnx.merge(*self._abstract_parts(config, compute or Compute()), copy=True)

    @functools.lru_cache(maxsize=16)
    def _abstract_parts(self, config, compute: Compute) -> tuple:
        """nnx.split of the abstract model, built once (Python work: the tiny demo UNet's takes 0.5 s on a
        2-core CPU, a copy of it 0.01 s)."""
        return nnx.split(weights.abstract(lambda rngs: self.build(config, compute, rngs)))

    @functools.lru_cache(maxsize=8)
    def param_shapes(self, config) -> Mapping[str, tuple[int, ...]]:
        """Parameter path -> shape for `config` (shapes do not depend on dtype or backend; cached, since
        converting maps the tensors and then checks them again before writing). Read-only: every
        caller shares the cached table."""
        return types.MappingProxyType(weights.param_shapes(self.abstract(config)))


_CLIP = ModelKind(("CLIPTextModel", "CLIPTextModelWithProjection"), "sdx.clip", "TextEncoderConfig", "CLIPTextModel")
MODEL_KINDS: dict[str, ModelKind] = {
    "unet": ModelKind(("UNet2DConditionModel",), "sdx.unet", "UNetConfig", "UNet2DConditionModel"),
    "vae": ModelKind(("AutoencoderKL",), "sdx.vae", "VAEConfig", "AutoencoderKL"),
    "text_encoder": _CLIP,
    "text_encoder_2": dataclasses.replace(_CLIP, classes=("CLIPTextModelWithProjection", "CLIPTextModel")),
}
TOKENIZERS: dict[str, tuple[str, ...]] = {
    "tokenizer": ("CLIPTokenizer", "CLIPTokenizerFast"),
    "tokenizer_2": ("CLIPTokenizer", "CLIPTokenizerFast"),
}
SCHEDULER = "scheduler"


@dataclasses.dataclass(frozen=True)
class PipelineKind:
    """The components a pipeline class needs (all of `required`, any of `optional`)."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()


_SD = PipelineKind(("unet", "vae", "text_encoder", "tokenizer", "scheduler"))
_SDXL = PipelineKind(("unet", "vae", "text_encoder_2", "tokenizer_2", "scheduler"), ("text_encoder", "tokenizer"))
PIPELINES: dict[str, PipelineKind] = {
    "StableDiffusionPipeline": _SD,
    "StableDiffusionImg2ImgPipeline": _SD,
    "StableDiffusionInstructPix2PixPipeline": _SD,
    "StableDiffusionInpaintPipeline": _SD,
    "LatentConsistencyModelPipeline": _SD,  # SD 1.x with an LCM UNet (time_cond_proj_dim) and LCMScheduler
    "LatentConsistencyModelImg2ImgPipeline": _SD,
    "StableDiffusionXLPipeline": _SDXL,
    "StableDiffusionXLImg2ImgPipeline": _SDXL,  # the refiner has no first text encoder
    "StableDiffusionXLInstructPix2PixPipeline": _SDXL,
    "StableDiffusionXLInpaintPipeline": _SDXL,
}


def check_pipeline(pipeline_class: str, components: set[str], *, where: str) -> PipelineKind:
    """The pipeline's kind, after checking that `components` are what it needs (no more, no less)."""
    if pipeline_class not in PIPELINES:
        raise SdxError(
            f"{where}: unknown pipeline class {pipeline_class!r}; sdx reads {', '.join(PIPELINES)}"
        )
    kind = PIPELINES[pipeline_class]
    missing = [c for c in kind.required if c not in components]
    if missing:
        raise SdxError(f"{where}: {pipeline_class} needs component(s) {', '.join(missing)}, which are absent")
    extra = sorted(components - set(kind.required) - set(kind.optional))
    if extra:
        raise SdxError(f"{where}: component(s) {', '.join(extra)} are not part of a {pipeline_class}")
    if ("text_encoder" in components) != ("tokenizer" in components):
        raise SdxError(f"{where}: text_encoder and tokenizer come together; only one of them is present")
    return kind


def check_tokenizer_folder(folder: Path, *, where: str) -> None:
    """A CLIP tokenizer folder holds vocab.json + merges.txt (the released repos) or tokenizer.json (transformers 5)."""
    if not folder.is_dir():
        raise SdxError(f"{where}: tokenizer folder {folder} does not exist")
    if not ((folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()) and not (
        folder / "tokenizer.json"
    ).is_file():
        raise SdxError(f"{where}: tokenizer folder {folder} has neither vocab.json + merges.txt nor tokenizer.json")


# --------------------------------------------------------------------------------------------------
# The spec


def is_model_folder(path: str | os.PathLike) -> bool:
    return (Path(path) / SPEC_FILE).is_file()


def read_spec_file(folder: str | os.PathLike) -> dict[str, Any]:
    """sdx.json of `folder`, checked for format and version only (a pipeline's or a standalone model's)."""
    path = Path(folder) / SPEC_FILE
    if not path.is_file():
        raise SdxError(f"{folder}: not an sdx model folder (no {SPEC_FILE})")
    spec = io.read_json(path)
    if not isinstance(spec, dict) or spec.get("format") != FORMAT:
        raise SdxError(f"{path}: not an sdx spec (\"format\" is not \"{FORMAT}\")")
    if spec.get("format_version") != FORMAT_VERSION:
        raise SdxError(
            f"{path}: format_version {spec.get('format_version')!r} is not {FORMAT_VERSION}, the one this sdx reads"
        )
    return spec


def read_spec(folder: str | os.PathLike) -> dict[str, Any]:
    """sdx.json of `folder`, checked for format, version and pipeline components."""
    path = Path(folder) / SPEC_FILE
    spec = read_spec_file(folder)
    if MODEL_CLASS in spec and "pipeline_class" not in spec:
        raise SdxError(f"{path}: an sdx {spec[MODEL_CLASS]} folder, not a pipeline")
    spec.setdefault("extra", {})
    check_types(str(path), {k: spec.get(k) for k in _SPEC_KINDS}, _SPEC_KINDS)
    weights.dtype_of(spec["dtype"])
    check_pipeline(spec["pipeline_class"], set(spec["components"]), where=str(path))
    for name, entry in spec["components"].items():
        check_entry(f"{path}: components.{name}", entry,
                    SCHEDULER if name == SCHEDULER else "tokenizer" if name in TOKENIZERS else "model")
    return spec


def check_entry(where: str, entry: Any, kind: str) -> None:
    """Check the fields of a component entry of sdx.json of `kind` ("model", "tokenizer", "scheduler")."""
    if not isinstance(entry, dict):
        raise SdxError(f"{where} must be an object, not {type(entry).__name__}")
    check_types(where, {k: entry.get(k) for k in _ENTRY_KINDS[kind]}, _ENTRY_KINDS[kind])


# sdx.json's fields, and those of each kind of component entry
_OBJECT: Kind = ("an object", lambda v: isinstance(v, dict))
_SPEC_KINDS: dict[str, Kind] = {"pipeline_class": NAME, "dtype": NAME, "components": _OBJECT, "extra": _OBJECT}
_ENTRY_KINDS: dict[str, dict[str, Kind]] = {
    "model": {"class": NAME, "file": NAME, "config": _OBJECT, "source_config": optional(_OBJECT)},
    "tokenizer": {"class": NAME, "folder": NAME},
    SCHEDULER: {"class": optional(NAME), "config": _OBJECT},
}


def _entry(spec: Mapping[str, Any], folder: Path, name: str) -> dict[str, Any]:
    if name not in spec["components"]:
        present = ", ".join(spec["components"])
        raise SdxError(f"{folder / SPEC_FILE}: no component {name!r} (it has {present})")
    return spec["components"][name]


def _model_kind(name: str, folder: Path) -> ModelKind:
    if name not in MODEL_KINDS:
        raise SdxError(f"{folder / SPEC_FILE}: {name!r} is not a model component ({', '.join(MODEL_KINDS)})")
    return MODEL_KINDS[name]


def model_config(folder: str | os.PathLike, name: str, *, spec: Mapping[str, Any] | None = None):
    """The sdx config object (UNetConfig, VAEConfig, TextEncoderConfig) of model component `name`."""
    folder = Path(folder)
    spec = spec or read_spec(folder)
    try:
        return _model_kind(name, folder).config_from_dict(_entry(spec, folder, name)["config"])
    except SdxError as e:
        raise SdxError(f"{folder / SPEC_FILE}: {name}: {e}") from None


def scheduler_config(folder: str | os.PathLike, *, spec: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The scheduler_config.json dict (diffusers' own keys, `_class_name` included)."""
    spec = spec or read_spec(folder)
    return dict(_entry(spec, Path(folder), SCHEDULER)["config"])


def tokenizer_folder(folder: str | os.PathLike, name: str = "tokenizer", *, spec: Mapping[str, Any] | None = None) -> Path:
    spec = spec or read_spec(folder)
    return Path(folder) / _entry(spec, Path(folder), name)["folder"]


def load_tokenizer(folder: str | os.PathLike, name: str = "tokenizer", *, spec: Mapping[str, Any] | None = None):
    """`sdx.tokenizer.CLIPTokenizer` for tokenizer component `name` ("tokenizer" or "tokenizer_2")."""
    from sdx.tokenizer import CLIPTokenizer

    return CLIPTokenizer.from_folder(tokenizer_folder(folder, name, spec=spec))


def read_arrays(folder: str | os.PathLike, name: str, *, spec: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """{sdx parameter path: memory-mapped array in the stored dtype} of model component `name` (unchecked)."""
    folder = Path(folder)
    spec = spec or read_spec(folder)
    _model_kind(name, folder)
    return component_arrays(folder, name, _entry(spec, folder, name))


def component_arrays(folder: Path, name: str, entry: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The memory-mapped arrays of the file sdx.json's `entry` lists for model component `name` (unchecked)."""
    path = Path(folder) / entry["file"]
    if not path.is_file():
        raise SdxError(f"{path}: missing (listed in {SPEC_FILE} for {name})")
    meta = io.read_safetensors_metadata(path)
    if meta.get("component", name) != name:
        raise SdxError(f"{path}: holds component {meta['component']!r}, but {SPEC_FILE} lists it for {name!r}")
    return io.read_safetensors(path)


def _np_dtype(dtype) -> np.dtype:
    return weights.dtype_of(dtype) if isinstance(dtype, str) else np.dtype(jnp.dtype(dtype))


def abstract_component(
    folder: str | os.PathLike,
    name: str,
    *,
    dtype=None,
    compute: Compute | None = None,
    spec: Mapping[str, Any] | None = None,
    abstract: Callable[[ModelKind, Any, Compute], nnx.Module] | None = None,
) -> nnx.Module:
    """The abstract model (shapes only) `load_component` fills, from the same arguments."""
    folder = Path(folder)
    spec = spec or read_spec(folder)
    param_dtype = _param_dtype(dtype, spec)
    if compute is None:
        compute = Compute(dtype=jnp.dtype(param_dtype), param_dtype=jnp.dtype(param_dtype))
    else:
        compute = dataclasses.replace(compute, param_dtype=jnp.dtype(param_dtype))
    return (abstract or ModelKind.abstract)(_model_kind(name, folder), model_config(folder, name, spec=spec), compute)


def _param_dtype(dtype, spec: Mapping[str, Any]) -> np.dtype:
    return _np_dtype(dtype if dtype is not None else spec["dtype"])


def load_component(
    folder: str | os.PathLike,
    name: str,
    *,
    dtype=None,
    compute: Compute | None = None,
    sharding: weights.Sharding = None,
    spec: Mapping[str, Any] | None = None,
    abstract: Callable[[ModelKind, Any, Compute], nnx.Module] | None = None,
    read: bool = True,
) -> nnx.Module:
    """The live sdx model of component `name` ("unet", "vae", "text_encoder", "text_encoder_2").

    dtype: parameter dtype ("float32", "bfloat16", "float16" or a jnp dtype); default: as stored.
    compute: how the model runs (activation dtype, attention backend, remat); its param_dtype is
      replaced by the parameter dtype above. Default: Compute(dtype=param dtype, param_dtype=param dtype).
    sharding: one `jax.sharding.Sharding` for every parameter, or a function (path, shape) -> Sharding
      (e.g. `sdx.mesh.param_sharding(mesh)`); None puts everything on the default device.
    abstract: (kind, config, compute) -> the abstract model to fill; default `ModelKind.abstract`
      (`pipelines.executables.abstract_model` keeps it on disk).
    read: False reads no weights: the parameters stay `jax.ShapeDtypeStruct`s with the dtypes and shardings
      loading would give them (what a resumed training run restores its checkpoint onto).
    """
    folder = Path(folder)
    spec = spec or read_spec(folder)
    model = abstract_component(folder, name, dtype=dtype, compute=compute, spec=spec, abstract=abstract)
    if not read:
        return weights.placed_abstract(model, dtype=_param_dtype(dtype, spec), sharding=sharding)
    arrays = read_arrays(folder, name, spec=spec)
    where = str(folder / _entry(spec, folder, name)["file"])
    weights.check_arrays(weights.param_shapes(model), arrays, where=where)
    return weights.materialize(model, arrays, dtype=_param_dtype(dtype, spec), sharding=sharding)


def torch_state(folder: str | os.PathLike, name: str, *, spec: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Model component `name` as a diffusers/transformers state dict (torch keys and layouts; views, not copies)."""
    return weights.to_torch_keys(read_arrays(folder, name, spec=spec))


def module_arrays(model: nnx.Module) -> dict[str, np.ndarray]:
    """{parameter path: host numpy array} of a live model (gathered from its devices), for `write_model_folder`.
    In a multi-host job every process must call it: a parameter split over hosts is gathered collectively."""
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, p)): meshlib.to_host(v.get_value()) for p, v in nnx.to_flat_state(state)}


# --------------------------------------------------------------------------------------------------
# Writing


def check_output_folder(out: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Refuse `out` as a folder to write: a file or link there, or a non-empty folder unless `overwrite`."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise SdxError(f"{out} exists and is not a folder; choose another output path")
        if any(out.iterdir()) and not overwrite:
            raise SdxError(f"{out} exists and is not empty; pass --overwrite to replace it")


@contextlib.contextmanager
def building_folder(out: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder next to `out`; on success it becomes `out` by one rename.

    An existing non-empty `out` is refused unless `overwrite` (then it is replaced only once the new
    folder is complete). On failure the temporary folder is removed and `out` is untouched.
    """
    out = Path(out)
    check_output_folder(out, overwrite=overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
        os.chmod(tmp, io.default_mode(folder=True))  # mkdtemp makes 0700
    except OSError as e:
        raise SdxError(f"cannot create {out}: {e.strerror or e}") from None
    old = None
    try:
        try:
            yield tmp
        except SdxError as e:  # a write that failed names the file it was for, not the temporary one
            raise SdxError(str(e).replace(str(tmp), str(out))) from None
        io.fsync_dir(tmp)
        if out.exists():
            if any(out.iterdir()):
                old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
                os.rmdir(old)
                os.rename(out, old)
            else:
                out.rmdir()
        try:
            os.rename(tmp, out)
        except OSError as e:
            if old is not None:
                os.rename(old, out)
            raise SdxError(f"cannot move the finished folder into place at {out}: {e.strerror or e}") from None
        io.fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@dataclasses.dataclass
class ModelPart:
    """One model component to write: `arrays` keyed by sdx parameter path, in Flax layout, any float dtype."""

    cls: str  # "UNet2DConditionModel", "CLIPTextModelWithProjection", ...
    config: Any  # its sdx config object (to_dict())
    arrays: Mapping[str, np.ndarray]
    source_config: dict[str, Any] | None = None  # the diffusers/transformers config.json, kept for export


def write_component(
    folder: Path, name: str, part: ModelPart, *, dtype: str, out: Path, log: Callable[[str], None]
) -> dict[str, Any]:
    """Write model component `name` (its arrays already checked) as `folder/NAME.safetensors`, floating
    tensors cast to `dtype`; its sdx.json entry. `out`: the folder errors name (`folder` is its temporary)."""
    file = f"{name}.safetensors"
    cast = weights.dtype_of(dtype)
    items = [(k, weights.lazy_cast(part.arrays[k], cast)) for k in sorted(part.arrays)]
    try:
        io.write_safetensors(
            folder / file, items,
            metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION), "component": name, "dtype": dtype},
        )
    except OSError as e:
        raise SdxError(f"cannot write {Path(out) / file}: {e.strerror or e}") from None
    log(f"{name}: {len(items)} tensors -> {file}")
    return {"class": part.cls, "file": file, "config": part.config.to_dict(), "source_config": part.source_config}


def write_model_folder(
    out: str | os.PathLike,
    *,
    pipeline_class: str,
    models: Mapping[str, ModelPart],
    tokenizers: Mapping[str, str | os.PathLike],
    scheduler: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write an sdx model folder (see the module docstring). Each model's arrays are checked strictly
    against its config's abstract model, cast to `dtype` (floating tensors only) and streamed out."""
    out = Path(out)
    log = log or (lambda _msg: None)
    weights.dtype_of(dtype)
    names = set(models) | set(tokenizers) | {SCHEDULER}
    check_pipeline(pipeline_class, names, where=str(out))
    for name in models:
        if name not in MODEL_KINDS:
            raise SdxError(f"{out}: {name!r} is not a model component ({', '.join(MODEL_KINDS)})")
    for name, src in tokenizers.items():
        if name not in TOKENIZERS:
            raise SdxError(f"{out}: {name!r} is not a tokenizer component ({', '.join(TOKENIZERS)})")
        check_tokenizer_folder(Path(src), where=name)
    comps: dict[str, Any] = {}
    with building_folder(out, overwrite=overwrite) as tmp:
        for name in (n for n in MODEL_KINDS if n in models):
            part = models[name]
            kind = MODEL_KINDS[name]
            if part.cls not in kind.classes:
                raise SdxError(f"{name}: class {part.cls!r} is not one sdx builds for it ({', '.join(kind.classes)})")
            weights.check_arrays(kind.param_shapes(part.config), part.arrays, where=name)
            comps[name] = write_component(tmp, name, part, dtype=dtype, out=out, log=log)
        for name in (n for n in TOKENIZERS if n in tokenizers):
            try:
                shutil.copytree(Path(tokenizers[name]), tmp / name, symlinks=False)
            except OSError as e:
                raise SdxError(f"cannot copy tokenizer {tokenizers[name]} to {out / name}: {e}") from None
            comps[name] = {"class": "CLIPTokenizer", "folder": name}
        comps[SCHEDULER] = {"class": scheduler.get("_class_name"), "config": dict(scheduler)}
        spec = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "pipeline_class": pipeline_class,
            "dtype": dtype, "components": comps, "extra": dict(extra or {}),
        }
        io.atomic_write_json(tmp / SPEC_FILE, spec)
    log(f"wrote {out} ({pipeline_class}, {dtype})")
    return out


def resave(src: str | os.PathLike, out: str | os.PathLike, *, dtype: str, overwrite: bool = False, log=None) -> Path:
    """Copy an sdx model folder with its tensors cast to `dtype` (checked against the configs on the way)."""
    src = Path(src)
    if Path(out).resolve() == src.resolve():
        raise SdxError(f"{out}: the output must differ from the source folder")
    spec = read_spec(src)
    models = {}
    for name, entry in spec["components"].items():
        if name in MODEL_KINDS:
            models[name] = ModelPart(
                cls=entry["class"], config=model_config(src, name, spec=spec),
                arrays=read_arrays(src, name, spec=spec), source_config=entry.get("source_config"),
            )
    return write_model_folder(
        out, pipeline_class=spec["pipeline_class"], models=models,
        tokenizers={n: tokenizer_folder(src, n, spec=spec) for n in spec["components"] if n in TOKENIZERS},
        scheduler=scheduler_config(src, spec=spec), extra=spec["extra"], dtype=dtype, overwrite=overwrite, log=log,
    )
