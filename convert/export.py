"""Writing a `Checkpoint` in the layouts other tools read: a diffusers folder, or one single file.

`write_diffusers_folder` writes what `DiffusionPipeline.save_pretrained` would (and what
`from_pretrained` loads): model_index.json with the (library, class) pair of every component the
pipeline class takes (absent ones as [null, null]), each model's config.json (the diffusers or
transformers config it was converted from; a config made from sdx's own dataclass otherwise) and its
weights under torch keys (`diffusion_pytorch_model.safetensors` for diffusers models,
`model.safetensors` for transformers ones), the tokenizer folders as they are, and
scheduler/scheduler_config.json. Every tensor goes through the same strict mapping as the sdx writer
(`sdx_folder.model_parts`: each tensor used once, every parameter present, every shape checked), so a
folder we write holds exactly the model sdx would run.

`write_single_file_checkpoint` writes the original SGM/LDM single-file layout through
`convert.single_file` (the key table both directions share), one tensor in memory at a time.

Both are atomic (a half-written output never takes OUT's place) and refuse an existing OUT unless
`overwrite`. Weights are cast to `dtype` on the way out (floating tensors only).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


from convert import sdx_folder
from convert.checkpoint import Checkpoint
from sdx import io, model_folder, weights
from sdx.errors import SdxError

Log = Callable[[str], None]

WEIGHTS_NAME = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}
LIBRARY = {"unet": "diffusers", "vae": "diffusers", "text_encoder": "transformers", "text_encoder_2": "transformers"}

# The components each pipeline class's __init__ takes (diffusers 0.42), so that model_index.json
# names every one of them, as save_pretrained does: absent ones (the SDXL refiner's first text
# encoder, the safety checker sdx never has) as [null, null].
_SD_COMPONENTS = ("vae", "text_encoder", "tokenizer", "unet", "scheduler", "safety_checker", "feature_extractor",
                  "image_encoder")
_XL_COMPONENTS = ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "unet", "scheduler",
                  "image_encoder", "feature_extractor")
PIPELINE_COMPONENTS: dict[str, tuple[str, ...]] = {
    "StableDiffusionPipeline": _SD_COMPONENTS,
    "StableDiffusionImg2ImgPipeline": _SD_COMPONENTS,
    "StableDiffusionInstructPix2PixPipeline": _SD_COMPONENTS,
    "StableDiffusionInpaintPipeline": _SD_COMPONENTS,
    "StableDiffusionXLPipeline": _XL_COMPONENTS,
    "StableDiffusionXLImg2ImgPipeline": _XL_COMPONENTS,
    "StableDiffusionXLInstructPix2PixPipeline": _XL_COMPONENTS[:7],
    "StableDiffusionXLInpaintPipeline": _XL_COMPONENTS,
}


def model_index(ckpt: Checkpoint, classes: Mapping[str, str]) -> dict[str, Any]:
    """model_index.json for `ckpt`; `classes`: model component -> its class."""
    names = PIPELINE_COMPONENTS.get(ckpt.pipeline_class)
    if names is None:
        raise SdxError(f"checkpoint: pipeline class {ckpt.pipeline_class!r} cannot be written as a diffusers folder")
    index: dict[str, Any] = {"_class_name": ckpt.pipeline_class}
    for name in names:
        if name in classes:
            index[name] = [LIBRARY[name], classes[name]]
        elif name in ckpt.tokenizers:
            index[name] = ["transformers", "CLIPTokenizer"]
        elif name == model_folder.SCHEDULER:
            index[name] = ["diffusers", ckpt.configs[name]["_class_name"]]
        else:
            index[name] = [None, None]
    extra = dict(ckpt.extra)
    if "safety_checker" in names:
        extra.setdefault("requires_safety_checker", False)  # sdx writes no safety checker
    for key, value in extra.items():
        if key.startswith("_") or key in index:
            raise SdxError(f"checkpoint: model_index entry {key!r} clashes with a component or bookkeeping key")
        index[key] = value
    return index


def _model_config(name: str, part: model_folder.ModelPart) -> dict[str, Any]:
    """The config.json to write: the source's own when known, else one made from the sdx config."""
    config = dict(part.source_config) if part.source_config is not None else part.config.to_diffusers_config()
    if LIBRARY[name] == "transformers":
        config.setdefault("architectures", [part.cls])
        config.setdefault("model_type", "clip_text_model")
    else:
        config.setdefault("_class_name", part.cls)
    return config


def write_model(folder: Path, config: Mapping[str, Any], arrays: Mapping[str, Any], *, file: str, cast,
                out: Path) -> int:
    """One model in `folder` as diffusers/transformers save it: config.json and `file` (torch keys and
    layouts, floating tensors cast to `cast`). `arrays`: sdx-keyed, Flax layout. `out`: the folder errors
    name (`folder` may be its temporary). Returns the number of tensors."""
    io.atomic_write_json(folder / "config.json", config, sort_keys=True)
    tensors = weights.to_torch_keys(arrays)
    items = [(k, weights.lazy_cast(tensors[k], cast)) for k in sorted(tensors)]
    try:
        io.write_safetensors(folder / file, items, metadata={"format": "pt"})
    except OSError as e:
        raise SdxError(f"cannot write {out / file}: {e.strerror or e}") from None
    return len(items)


def write_diffusers_folder(
    ckpt: Checkpoint,
    out: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    log: Log | None = None,
) -> Path:
    """Write `ckpt` as a diffusers-layout folder at `out` (atomically), loadable by `from_pretrained`."""
    log = log or (lambda _msg: None)
    cast = weights.dtype_of(dtype)
    if model_folder.SCHEDULER not in ckpt.configs:
        raise SdxError("checkpoint: no scheduler config")
    names = set(ckpt.tensors) | set(ckpt.tokenizers) | {model_folder.SCHEDULER}
    model_folder.check_pipeline(ckpt.pipeline_class, names, where=str(out))
    for name, folder in ckpt.tokenizers.items():
        model_folder.check_tokenizer_folder(Path(folder), where=name)
    parts = sdx_folder.model_parts(ckpt)  # strict: every tensor used once, every shape checked
    index = model_index(ckpt, {n: p.cls for n, p in parts.items()})
    with model_folder.building_folder(out, overwrite=overwrite) as tmp:
        for name, part in parts.items():
            (tmp / name).mkdir()
            file = WEIGHTS_NAME[LIBRARY[name]]
            count = write_model(tmp / name, _model_config(name, part), part.arrays, file=file, cast=cast,
                                out=Path(out) / name)
            log(f"{name}: {count} tensors -> {name}/{file}")
        for name, folder in ckpt.tokenizers.items():
            try:
                shutil.copytree(Path(folder), tmp / name, symlinks=False)
            except OSError as e:
                raise SdxError(f"cannot copy tokenizer {folder} to {Path(out) / name}: {e}") from None
        (tmp / model_folder.SCHEDULER).mkdir()
        scheduler = ckpt.configs[model_folder.SCHEDULER]
        io.atomic_write_json(tmp / model_folder.SCHEDULER / "scheduler_config.json", scheduler, sort_keys=True)
        io.atomic_write_json(tmp / "model_index.json", index, sort_keys=True)
    log(f"wrote {out} (diffusers layout, {ckpt.pipeline_class}, {dtype})")
    return Path(out)


def check_single_file_output(out: Path, *, overwrite: bool = False) -> None:
    """Refuse `out` as the single file to write: not *.safetensors, a folder, or an existing file unless
    `overwrite`."""
    if out.suffix.lower() != ".safetensors":
        raise SdxError(f"{out}: a single file is written as safetensors; name it *.safetensors")
    if out.is_dir():
        raise SdxError(f"{out} is a folder; give the path of the .safetensors file to write")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise SdxError(f"{out} exists; pass --overwrite to replace it")


def write_single_file_checkpoint(
    ckpt: Checkpoint,
    out: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    log: Log | None = None,
) -> Path:
    """Write `ckpt` as one original-layout (SGM/LDM) safetensors file at `out` (atomically).

    The file holds weights only: reading it back takes the configs from the preset its keys point
    to, or from a config folder (`--config`), as for any single file.
    """
    from convert import single_file

    log = log or (lambda _msg: None)
    cast = weights.dtype_of(dtype)
    out = Path(out)
    check_single_file_output(out, overwrite=overwrite)
    if ckpt.tensors.keys() != {"vae"}:
        sdx_folder.model_parts(ckpt)  # the same strict checks (shapes included) as every other writer
    try:
        count = single_file.write_single_file(ckpt, out, dtype=cast)
    except OSError as e:
        raise SdxError(f"cannot write {out}: {e.strerror or e}") from None
    log(f"wrote {out} (single file, {count} tensors, {dtype}); it holds no configs: read it back with its "
        "preset or --config FOLDER")
    return out
