"""A `Checkpoint` to an sdx model folder and back (the layout itself is `sdx.model_folder`).

Writing builds each model's sdx config from its diffusers/transformers config, maps the tensors onto
the abstract model strictly (`sdx.weights.from_torch_keys`: every tensor used once, every parameter
filled, every shape checked, transposed to Flax layout) and streams them out in the asked dtype.
Reading gives the diffusers-keyed tensors back through the inverse transform (`to_torch_keys`), for the
diffusers and single-file writers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from convert.checkpoint import Checkpoint
from sdx import model_folder, weights
from sdx.errors import SdxError


def _class_of(name: str, config: dict) -> str:
    """The diffusers/transformers class a config.json describes (`_class_name` or `architectures`)."""
    kind = model_folder.MODEL_KINDS[name]
    cls = config.get("_class_name")
    if cls is None and config.get("architectures"):
        archs = config["architectures"]
        cls = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    return cls or kind.classes[0]


def model_parts(ckpt: Checkpoint) -> dict[str, model_folder.ModelPart]:
    """Each model component of `ckpt` as sdx-keyed, Flax-layout arrays (views), strictly checked."""
    unknown = sorted(set(ckpt.tensors) - set(model_folder.MODEL_KINDS))
    if unknown:
        raise SdxError(f"checkpoint: unknown model component(s) {', '.join(unknown)}")
    parts = {}
    for name in (n for n in model_folder.MODEL_KINDS if n in ckpt.tensors):
        tensors = ckpt.tensors[name]
        where = weights.where_of(tensors, name)
        if name not in ckpt.configs:
            raise SdxError(f"{where}: component {name} has tensors but no config")
        kind = model_folder.MODEL_KINDS[name]
        try:
            config = kind.config_from_diffusers(ckpt.configs[name])
        except SdxError as e:
            raise SdxError(f"{name}/config.json: {e}") from None
        cls = _class_of(name, ckpt.configs[name])
        if cls not in kind.classes:
            raise SdxError(f"{name}/config.json: class {cls!r}; sdx reads {' or '.join(kind.classes)} there")
        targets = kind.param_shapes(config)
        arrays = weights.from_torch_keys(targets, tensors, where=where)
        parts[name] = model_folder.ModelPart(cls=cls, config=config, arrays=arrays, source_config=ckpt.configs[name])
    missing = sorted(n for n in ckpt.configs if n in model_folder.MODEL_KINDS and n not in ckpt.tensors)
    if missing:
        raise SdxError(f"checkpoint: component(s) {', '.join(missing)} have a config but no tensors")
    return parts


def write_sdx_folder(
    ckpt: Checkpoint,
    out: str | Path,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Write `ckpt` as an sdx model folder at `out` (atomically; see `sdx.model_folder`)."""
    weights.dtype_of(dtype)
    if model_folder.SCHEDULER not in ckpt.configs:
        raise SdxError("checkpoint: no scheduler config")
    return model_folder.write_model_folder(
        out,
        pipeline_class=ckpt.pipeline_class,
        models=model_parts(ckpt),
        tokenizers=ckpt.tokenizers,
        scheduler=ckpt.configs[model_folder.SCHEDULER],
        extra=ckpt.extra,
        dtype=dtype,
        overwrite=overwrite,
        log=log,
    )


def read_sdx_folder(folder: str | Path) -> Checkpoint:
    """An sdx model folder as a Checkpoint: diffusers keys and torch layouts, memory-mapped views.

    The model configs are the diffusers/transformers config.json dicts the folder was converted from
    (`source_config`), or, where it has none, the sdx config's `to_diffusers_config()`.
    """
    folder = Path(folder)
    spec = model_folder.read_spec(folder)
    configs, tensors, tokenizers = {}, {}, {}
    for name, entry in spec["components"].items():
        if name in model_folder.MODEL_KINDS:
            config = entry.get("source_config")
            if config is None:
                sdx_config = model_folder.model_config(folder, name, spec=spec)
                if not hasattr(sdx_config, "to_diffusers_config"):
                    raise SdxError(f"{folder / model_folder.SPEC_FILE}: {name} has no source_config to export")
                config = sdx_config.to_diffusers_config()
            configs[name] = dict(config)
            where = str(folder / entry["file"])
            tensors[name] = weights.SourceTensors(model_folder.torch_state(folder, name, spec=spec), where=where)
        elif name in model_folder.TOKENIZERS:
            tokenizers[name] = model_folder.tokenizer_folder(folder, name, spec=spec)
        else:
            configs[name] = model_folder.scheduler_config(folder, spec=spec)
    return Checkpoint(spec["pipeline_class"], configs, tensors, tokenizers, dict(spec["extra"]))
