"""Writing a ControlNet in each `--format`, and reading sdx's own ControlNet folder.

The sdx ControlNet folder is a standalone model folder in `sdx.model_folder`'s format:

    CONTROLNET/
      sdx.json                  the spec (below)
      controlnet.safetensors    keyed by sdx parameter path (`controlnet_down_blocks.0.kernel`), arrays in
                                Flax layout, all in the spec's dtype

    {"format": "sdx", "format_version": 1,
     "model_class": "ControlNetModel",                  # in place of a pipeline's "pipeline_class";
                                                        # "ControlNetUnionModel" for a ControlNet-Union
     "dtype": "bfloat16",
     "components": {"controlnet": {"class": "ControlNetModel", "file": "controlnet.safetensors",
                                   "config": {...ControlNetConfig.to_dict()...},
                                   "source_config": {...the diffusers config.json it came from...}}}}

The other formats are diffusers' ControlNet folder (config.json + diffusion_pytorch_model.safetensors, what
`ControlNetModel.from_pretrained` loads) and the original single file (`convert.controlnet_single_file`).
Every writer takes a `ModelPart` whose arrays were checked against its config, is atomic, refuses an
existing output unless `overwrite`, and casts the floating tensors to `dtype` on the way out.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from convert import controlnet_single_file as single, export
from sdx import io, model_folder, weights
from sdx.errors import SdxError

COMPONENT = "controlnet"
CLASS, UNION_CLASS = "ControlNetModel", "ControlNetUnionModel"
KIND = model_folder.ModelKind((CLASS,), "sdx.controlnet", "ControlNetConfig", "ControlNetModel")
UNION_KIND = model_folder.ModelKind((UNION_CLASS,), "sdx.controlnet_union", "ControlNetUnionConfig", UNION_CLASS)
KINDS = {CLASS: KIND, UNION_CLASS: UNION_KIND}  # a ControlNet's class (`ModelPart.cls`) -> its kind

Log = Callable[[str], None]


def _diffusers_config(part: model_folder.ModelPart) -> dict[str, Any]:
    """The diffusers config.json the ControlNet came from (sdx keeps it: its config has no inverse)."""
    if part.source_config is None:
        raise SdxError("this ControlNet has no diffusers config.json (source_config) to export")
    return {**part.source_config, "_class_name": part.cls}


# --------------------------------------------------------------------------------------------------
# sdx


def is_controlnet_folder(path: str | Path) -> bool:
    """Whether `path` is an sdx ControlNet folder (its sdx.json names the class)."""
    if not model_folder.is_model_folder(path):
        return False
    spec = io.read_json(Path(path) / model_folder.SPEC_FILE)
    return isinstance(spec, dict) and spec.get(model_folder.MODEL_CLASS) in KINDS


def write_sdx(part: model_folder.ModelPart, out: str | Path, *, dtype: str = "float32", overwrite: bool = False,
              log: Log | None = None) -> Path:
    """Write the ControlNet `part` as an sdx ControlNet folder at `out`."""
    log = log or (lambda _msg: None)
    out = Path(out)
    weights.check_arrays(KINDS[part.cls].param_shapes(part.config), part.arrays, where=COMPONENT)
    with model_folder.building_folder(out, overwrite=overwrite) as tmp:
        entry = model_folder.write_component(tmp, COMPONENT, part, dtype=dtype, out=out, log=log)
        spec = {"format": model_folder.FORMAT, "format_version": model_folder.FORMAT_VERSION,
                model_folder.MODEL_CLASS: part.cls, "dtype": dtype, "components": {COMPONENT: entry}}
        io.atomic_write_json(tmp / model_folder.SPEC_FILE, spec)
    log(f"wrote {out} (sdx ControlNet, {dtype})")
    return out


def read_sdx(folder: str | Path) -> model_folder.ModelPart:
    """The ControlNet of an sdx ControlNet folder: its config and memory-mapped arrays, checked."""
    folder = Path(folder)
    path = folder / model_folder.SPEC_FILE
    spec = model_folder.read_spec_file(folder)
    cls = spec.get(model_folder.MODEL_CLASS)
    if cls not in KINDS:
        raise SdxError(f"{path}: not an sdx ControlNet folder ({model_folder.MODEL_CLASS} is not "
                       f"{' or '.join(map(repr, KINDS))})")
    components = spec.get("components")
    if not isinstance(components, dict) or set(components) != {COMPONENT}:
        raise SdxError(f"{path}: a ControlNet folder's components are exactly {{{COMPONENT!r}: ...}}")
    entry = components[COMPONENT]
    model_folder.check_entry(f"{path}: components.{COMPONENT}", entry, "model")
    if spec.get("dtype") not in weights.DTYPES:
        raise SdxError(f"{path}: dtype {spec.get('dtype')!r} is not one of {', '.join(weights.DTYPES)}")
    try:
        config = KINDS[cls].config_from_dict(entry["config"])
    except SdxError as e:
        raise SdxError(f"{path}: {COMPONENT}: {e}") from None
    arrays = model_folder.component_arrays(folder, COMPONENT, entry)
    weights.check_arrays(KINDS[cls].param_shapes(config), arrays, where=str(folder / entry["file"]))
    return model_folder.ModelPart(cls=cls, config=config, arrays=arrays, source_config=entry["source_config"])


# --------------------------------------------------------------------------------------------------
# diffusers, single file


def write_diffusers(part: model_folder.ModelPart, out: str | Path, *, dtype: str = "float32",
                    overwrite: bool = False, log: Log | None = None) -> Path:
    """Write the ControlNet `part` as a diffusers ControlNet folder at `out` (`from_pretrained` loads it)."""
    log = log or (lambda _msg: None)
    out = Path(out)
    config = _diffusers_config(part)
    file = export.WEIGHTS_NAME["diffusers"]
    with model_folder.building_folder(out, overwrite=overwrite) as tmp:
        count = export.write_model(tmp, config, part.arrays, file=file, cast=weights.dtype_of(dtype), out=out)
    log(f"wrote {out} (diffusers ControlNet, {count} tensors, {dtype})")
    return out


def write_single_file(part: model_folder.ModelPart, out: str | Path, *, dtype: str = "float32",
                      overwrite: bool = False, log: Log | None = None) -> Path:
    """Write the ControlNet `part` as one original-layout safetensors file at `out` (keys under control_model.)."""
    log = log or (lambda _msg: None)
    out = Path(out)
    if part.cls != CLASS:
        raise SdxError("a ControlNet-Union has no original single-file layout: write --format sdx or diffusers")
    export.check_single_file_output(out, overwrite=overwrite)
    cast = weights.dtype_of(dtype)
    tensors = single.to_original(_diffusers_config(part), weights.to_torch_keys(part.arrays))
    out.parent.mkdir(parents=True, exist_ok=True)
    io.write_safetensors(out, [(k, weights.lazy_cast(tensors[k], cast)) for k in sorted(tensors)],
                         metadata={"format": "pt"})
    log(f"wrote {out} (single-file ControlNet, {len(tensors)} tensors, {dtype}); it holds no config: read it back "
        "with its config folder unless it is one of the released architectures")
    return out


# --format NAME -> writer(part, out, *, dtype, overwrite, log), as `convert.library.WRITERS` for pipelines
WRITERS: dict[str, Callable[..., Path]] = {"sdx": write_sdx, "diffusers": write_diffusers,
                                           "single-file": write_single_file}
