"""Writing the trained model: an sdx folder in --output_dir itself, optionally a diffusers folder too; or,
for a LoRA run, the adapters alone (`write_lora`); or a trained ControlNet (`write_controlnet`) or
T2I-Adapter (`write_t2i_adapter`).

`python -m sdx.sample --model OUTPUT_DIR` loads the result. The output folder also holds checkpoints,
logs and validation images, so the model is built complete in a temporary folder beside it and its
entries are then moved in one by one with `os.replace`, `sdx.json` last: a reader never sees a spec
that names files not yet in place. The frozen models (VAE, text encoders) and tokenizers are copied
from the source folder unchanged; the UNet is the trained one (the EMA weights when EMA is on).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from convert import library as convert_lib
from sdx import io, model_folder
from sdx.t2i_adapter import T2IAdapterConfig

LORA_FILE = "pytorch_lora_weights.safetensors"  # the name diffusers' save_lora_weights and load_lora_weights use


def write_model(
    out: Path,
    *,
    source: Path,
    spec: Mapping,
    pipeline_class: str,
    models: Mapping[str, model_folder.ModelPart | None],
    export_format: str = "sdx",
    log=print,
) -> Path:
    """Write the sdx folder into `out`. models: {component: new ModelPart, or None to copy the source's}."""
    parts = {}
    for name, entry in spec["components"].items():
        if name not in model_folder.MODEL_KINDS:
            continue
        part = models.get(name)
        if part is None:
            part = model_folder.ModelPart(
                cls=entry["class"], config=model_folder.model_config(source, name, spec=spec),
                arrays=model_folder.read_arrays(source, name, spec=spec), source_config=entry.get("source_config"),
            )
        parts[name] = part
    tokenizers = {n: model_folder.tokenizer_folder(source, n, spec=spec)
                  for n in spec["components"] if n in model_folder.TOKENIZERS}
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".model-", dir=out) as tmp:
        built = model_folder.write_model_folder(
            Path(tmp) / "model", pipeline_class=pipeline_class, models=parts, tokenizers=tokenizers,
            scheduler=model_folder.scheduler_config(source, spec=spec), extra=spec["extra"], dtype="float32",
        )
        entries = sorted(built.iterdir(), key=lambda p: p.name == model_folder.SPEC_FILE)  # the spec last
        for entry in entries:
            target = out / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(entry, target)
    log(f"model written to {out} (python -m sdx.sample --model {out})")
    if export_format == "diffusers":
        convert_lib.convert(out, out / "diffusers", fmt="diffusers", overwrite=True, log=lambda _m: None)
        log(f"diffusers folder written to {out / 'diffusers'}")
    return out


def _beside_checkpoints(out: Path, build: Callable[[Path], Path]) -> None:
    """The diffusers model folder `build(folder)` writes, moved into `out` beside the checkpoints: built in a
    temporary folder, then moved in, config.json last."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".model-", dir=out) as tmp:
        built = build(Path(tmp) / "model")
        for entry in sorted(built.iterdir(), key=lambda p: p.name == "config.json"):
            os.replace(entry, out / entry.name)


def write_controlnet(out: Path, part: model_folder.ModelPart, *, log=print) -> Path:
    """Write a trained ControlNet into `out` as diffusers' save_pretrained does (config.json and
    diffusion_pytorch_model.safetensors beside the checkpoints)."""
    from convert import controlnet_folder

    _beside_checkpoints(out, lambda folder: controlnet_folder.write_diffusers(part, folder))
    log(f"ControlNet written to {out} (python -m sdx.sample --controlnet {out}; diffusers' "
        "ControlNetModel.from_pretrained)")
    return out


def write_t2i_adapter(out: Path, config: T2IAdapterConfig, arrays: Mapping, *, log=print) -> Path:
    """Write a trained T2I-Adapter (its config and sdx-keyed arrays) into `out` as diffusers' save_pretrained
    does (config.json and diffusion_pytorch_model.safetensors beside the checkpoints)."""
    from convert import export as convert_export

    def build(folder: Path) -> Path:
        folder.mkdir()
        convert_export.write_model(folder, config.to_diffusers_config(), arrays,
                                   file=convert_export.WEIGHTS_NAME["diffusers"], cast=np.float32, out=out)
        return folder

    _beside_checkpoints(out, build)
    log(f"T2I-Adapter written to {out} (python -m sdx.sample --t2i-adapter {out}; diffusers' "
        "T2IAdapter.from_pretrained)")
    return out


def write_lora(out: Path, arrays: Mapping, *, base: str, log=print) -> Path:
    """Write a LoRA's `sdx.lora.state_dict` as `out`/pytorch_lora_weights.safetensors (atomically)."""
    path = out / LORA_FILE
    io.write_safetensors(path, arrays, metadata={"format": "pt"})
    log(f"LoRA written to {path} (python -m sdx.sample --model {base} --lora {path})")
    return path
