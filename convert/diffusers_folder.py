"""Reading a diffusers-layout folder into a `Checkpoint`.

The layout (what `DiffusionPipeline.save_pretrained` writes and the hub repos hold):

    model_index.json             {"_class_name": "StableDiffusionXLPipeline", "unet": ["diffusers",
                                  "UNet2DConditionModel"], ..., "force_zeros_for_empty_prompt": true}
    unet/config.json             + diffusion_pytorch_model[.VARIANT].safetensors, or a sharded
    vae/config.json                diffusion_pytorch_model.safetensors.index[.VARIANT].json with its
                                   diffusion_pytorch_model[.VARIANT]-0000i-of-0000n.safetensors shards
    text_encoder/config.json     + model[.VARIANT].safetensors (or sharded, as above, transformers names)
    tokenizer/                   vocab.json, merges.txt, ... (or tokenizer.json)
    scheduler/scheduler_config.json

Only safetensors are read: pickled `.bin`/`.ckpt` weights are refused with a message saying so. The
reader is strict about the layout (unknown pipeline class, component or class is an error) and about
every file (a sharded index must match its shards exactly). The tensor keys are normalised by two
explicit rules, and nothing else is renamed or dropped:

- text encoders: `sdx.clip.transformers_state` drops the `position_ids` buffer and restores the
  `text_model.` prefix transformers 5 leaves out;
- VAE: the attention names of diffusers < 0.14 (`query`, `key`, `value`, `proj_attn`) become
  `to_q`, `to_k`, `to_v`, `to_out.0` (`OLD_VAE_ATTENTION`).

Whether every tensor then fits the model is checked by the writer (`sdx.weights.from_torch_keys`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convert.checkpoint import Checkpoint
from sdx import io, model_folder, weights
from sdx.errors import SdxError

MODEL_INDEX = "model_index.json"
SCHEDULER_CONFIG = "scheduler_config.json"

# The weights file stem of each library (diffusers' SAFETENSORS_WEIGHTS_NAME, transformers' SAFE_WEIGHTS_NAME).
WEIGHT_STEMS = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}
# Weights sdx will not read, and what to do instead.
UNREADABLE = (".bin", ".ckpt", ".pt", ".pth", ".msgpack", ".h5", ".onnx")

# Components of a pipeline sdx has no use for, each with the reason; their files are neither read nor downloaded.
IGNORED_COMPONENTS = {
    "safety_checker": "sdx has no NSFW safety checker",
    "feature_extractor": "the image processor of the safety checker",
}

# diffusers < 0.14 named the VAE mid-block attention's projections after the old AttentionBlock.
OLD_VAE_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
_OLD_VAE_KEY = re.compile(r"^(?P<block>(encoder|decoder)\.mid_block\.attentions\.\d+)\.(?P<name>query|key|value|proj_attn)\.(?P<p>weight|bias)$")


@dataclasses.dataclass(frozen=True)
class ModelIndex:
    """model_index.json, checked. components: name -> (library, class), present ones only."""

    pipeline_class: str
    components: dict[str, tuple[str, str]]
    ignored: dict[str, str]  # name -> why it is not read
    extra: dict[str, Any]


def parse_model_index(data: Any, *, where: str) -> ModelIndex:
    """Check a model_index.json dict: a pipeline class sdx has, components it knows with classes it builds."""
    if not isinstance(data, dict) or "_class_name" not in data:
        raise SdxError(f"{where}: not a diffusers model index (no \"_class_name\")")
    pipeline_class = data["_class_name"]
    if not isinstance(pipeline_class, str):
        raise SdxError(f"{where}: \"_class_name\" is {pipeline_class!r}, expected a pipeline class name")
    comps: dict[str, tuple[str, str]] = {}
    ignored: dict[str, str] = {}
    extra: dict[str, Any] = {}
    for name, value in data.items():
        if name.startswith("_"):
            continue  # _class_name, _diffusers_version, _name_or_path: bookkeeping
        if not isinstance(value, (list, tuple)):
            extra[name] = value  # force_zeros_for_empty_prompt, requires_aesthetics_score, ...
            continue
        if len(value) != 2:
            raise SdxError(f"{where}: component {name!r} is {value!r}, expected [library, class]")
        library, cls = value
        if library is None and cls is None:
            continue  # declared but absent (e.g. the refiner's text_encoder, image_encoder)
        if name in IGNORED_COMPONENTS:
            ignored[name] = IGNORED_COMPONENTS[name]
            continue
        if name in model_folder.MODEL_KINDS:
            allowed = model_folder.MODEL_KINDS[name].classes
        elif name in model_folder.TOKENIZERS:
            allowed = model_folder.TOKENIZERS[name]
        elif name == model_folder.SCHEDULER:
            allowed = None
            if not (isinstance(cls, str) and cls.endswith("Scheduler")):
                raise SdxError(f"{where}: component 'scheduler' has class {cls!r}, which is not a diffusers scheduler")
        else:
            raise SdxError(f"{where}: unknown component {name!r} ({library}, {cls}); sdx does not read it")
        if allowed is not None and cls not in allowed:
            raise SdxError(f"{where}: component {name!r} is a {cls}; sdx reads {' or '.join(allowed)} there")
        comps[name] = (str(library), str(cls))
    model_folder.check_pipeline(pipeline_class, set(comps), where=where)
    return ModelIndex(pipeline_class, comps, ignored, extra)


def read_model_index(folder: Path) -> ModelIndex:
    path = folder / MODEL_INDEX
    if not path.is_file():
        if model_folder.is_model_folder(folder):
            raise SdxError(f"{folder}: is an sdx model folder, not a diffusers folder")
        raise SdxError(f"{folder}: unknown layout: no {MODEL_INDEX} (not a diffusers folder) and no "
                       f"{model_folder.SPEC_FILE} (not an sdx folder)")
    return parse_model_index(io.read_json(path), where=str(path))



# --------------------------------------------------------------------------------------------------
# Choosing the weights file(s) of a component


@dataclasses.dataclass(frozen=True)
class WeightsChoice:
    """file: the single weights file, or the shard index; shards: the shard names found next to it."""

    file: str
    sharded: bool
    variant: str | None
    shards: tuple[str, ...] = ()

    @property
    def files(self) -> tuple[str, ...]:
        return (self.file, *self.shards)


def _single(stem: str, variant: str | None) -> str:
    return f"{stem}.{variant}.safetensors" if variant else f"{stem}.safetensors"


def _index(stem: str, variant: str | None) -> str:
    return f"{stem}.safetensors.index.{variant}.json" if variant else f"{stem}.safetensors.index.json"


def _variants(names: Collection[str], stem: str) -> set[str]:
    found = set()
    for n in names:
        m = re.fullmatch(re.escape(stem) + r"\.([\w-]+)\.safetensors", n) or re.fullmatch(
            re.escape(stem) + r"\.safetensors\.index\.([\w-]+)\.json", n
        )
        if m:
            found.add(m.group(1))
    return found


def choose_weights(names: Collection[str], library: str, variant: str | None, *, where: str) -> WeightsChoice:
    """Pick the weights among the file `names` of a component folder (a local listing or a hub listing).

    With `variant` ("fp16"): that variant when it exists, else the plain files; failing both, the one
    other variant there is. A single file wins over a shard index of the same variant.
    """
    stem = WEIGHT_STEMS.get(library)
    if stem is None:
        raise SdxError(f"{where}: component from library {library!r}; sdx reads diffusers and transformers weights")
    names = set(names)
    order: list[str | None] = [variant, None] if variant else [None]
    if not any(_single(stem, v) in names or _index(stem, v) in names for v in order):
        others = sorted(_variants(names, stem) - {variant})
        if len(others) > 1:
            raise SdxError(f"{where}: no plain weights but several variants ({', '.join(others)}); pick one with --variant")
        order = others
    for v in order:
        if _single(stem, v) in names:
            return WeightsChoice(_single(stem, v), False, v)
        if _index(stem, v) in names:
            pattern = re.compile(re.escape(stem + (f".{v}" if v else "")) + r"-\d+-of-\d+\.safetensors")
            return WeightsChoice(_index(stem, v), True, v, tuple(sorted(n for n in names if pattern.fullmatch(n))))
    pickled = sorted(n for n in names if n.endswith(UNREADABLE))
    if pickled:
        raise SdxError(
            f"{where}: only pickled or non-safetensors weights ({', '.join(pickled)}); sdx reads safetensors only. "
            f"Convert with safetensors first, e.g. diffusers/transformers `save_pretrained(..., safe_serialization=True)`"
        )
    raise SdxError(f"{where}: no weights file (expected {_single(stem, variant)} or {_index(stem, variant)})")


# --------------------------------------------------------------------------------------------------
# Reading tensors


def read_weights(folder: Path, choice: WeightsChoice) -> weights.SourceTensors:
    """The tensors of one component, memory-mapped; a shard index must match its shards exactly."""
    path = folder / choice.file
    if not choice.sharded:
        return weights.SourceTensors(io.read_safetensors(path), where=str(path))
    index = io.read_json(path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SdxError(f"{path}: not a shard index (no \"weight_map\")")
    out: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = folder / shard
        if not shard_path.is_file():
            raise SdxError(f"{path}: shard {shard} is missing (listed for {_first(weight_map, shard)!r})")
        tensors = io.read_safetensors(shard_path)
        for key in tensors:
            if weight_map.get(key) != shard:
                raise SdxError(f"{shard_path}: tensor {key!r} is not listed for this shard in {path.name}")
            out[key] = tensors[key]
    missing = sorted(set(weight_map) - set(out))
    if missing:
        raise SdxError(f"{path}: tensor {missing[0]!r} is listed for {weight_map[missing[0]]} but is not in it")
    return weights.SourceTensors(out, where=str(path))


def _first(weight_map: Mapping[str, str], shard: str) -> str:
    return next(k for k, v in weight_map.items() if v == shard)


def normalize_vae(tensors: weights.SourceTensors) -> weights.SourceTensors:
    """Rename the old VAE attention keys (OLD_VAE_ATTENTION); everything else passes unchanged."""
    out = {}
    for key, value in tensors.items():
        m = _OLD_VAE_KEY.match(key)
        new = f"{m['block']}.{OLD_VAE_ATTENTION[m['name']]}.{m['p']}" if m else key
        if new in out or (m and new in tensors):
            raise SdxError(f"{tensors.where}: tensor {key!r} is there under its old and its new name ({new!r})")
        out[new] = value
    return weights.SourceTensors(out, where=tensors.where)


def normalize_text_encoder(tensors: weights.SourceTensors) -> weights.SourceTensors:
    from sdx.clip import transformers_state

    return weights.SourceTensors(transformers_state(tensors, where=tensors.where), where=tensors.where)


NORMALIZE: dict[str, Callable[[weights.SourceTensors], weights.SourceTensors]] = {
    "vae": normalize_vae,
    "text_encoder": normalize_text_encoder,
    "text_encoder_2": normalize_text_encoder,
}


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def read_model_folder(
    folder: Path, library: str = "diffusers", variant: str | None = None
) -> tuple[dict[str, Any], weights.SourceTensors]:
    """One model's folder (a pipeline's unet/, a VAE or ControlNet repo): its config.json and the tensors
    of its chosen weights (`choose_weights`), memory-mapped, with their diffusers/transformers keys."""
    config = io.read_json(folder / "config.json", obj=True)
    return config, read_weights(folder, choose_weights(_listing(folder), library, variant, where=str(folder)))


def model_files(
    listing: Collection[str], subfolders: Collection[str], variant: str | None, *, where: str
) -> list[str] | None:
    """From a repo's file list (repo-relative paths): config.json and the chosen weights of the first of
    `subfolders` ("" for the root, "vae/", ...) that has a config.json; None when none has."""
    for sub in subfolders:
        if f"{sub}config.json" in listing:
            names = [f[len(sub):] for f in listing if f.startswith(sub) and "/" not in f[len(sub):]]
            choice = choose_weights(names, "diffusers", variant, where=f"{where}: {sub or '/'}")
            return [f"{sub}config.json", *(sub + f for f in choice.files)]
    return None


def read_diffusers_folder(
    folder: str | Path, *, variant: str | None = None, log: Callable[[str], None] | None = None
) -> Checkpoint:
    """The pipeline in a diffusers-layout `folder` as a Checkpoint (tensors memory-mapped, not loaded).

    variant: prefer `diffusion_pytorch_model.{variant}.safetensors` (e.g. "fp16") where present.
    """
    folder = Path(folder)
    log = log or (lambda _msg: None)
    if not folder.is_dir():
        raise SdxError(f"{folder}: no such folder")
    index = read_model_index(folder)
    for name, why in index.ignored.items():
        log(f"{name}: not read ({why})")
    configs: dict[str, dict] = {}
    tensors: dict[str, dict[str, np.ndarray]] = {}
    tokenizers: dict[str, Path] = {}
    for name, (library, _cls) in index.components.items():
        sub = folder / name
        if name in model_folder.MODEL_KINDS:
            config, t = read_model_folder(sub, library, variant)
            if name in NORMALIZE:
                t = NORMALIZE[name](t)
            configs[name], tensors[name] = config, t
            log(f"{name}: {len(t)} tensors from {name}/{Path(t.where).name}")
        elif name in model_folder.TOKENIZERS:
            model_folder.check_tokenizer_folder(sub, where=str(folder / MODEL_INDEX))
            tokenizers[name] = sub
        else:  # the scheduler
            configs[name] = io.read_json(sub / SCHEDULER_CONFIG, obj=True)
    return Checkpoint(index.pipeline_class, configs, tensors, tokenizers, index.extra)


def needed_files(index: ModelIndex, listing: Collection[str], variant: str | None, *, where: str) -> list[str]:
    """The repo-relative files `read_diffusers_folder(variant=variant)` will read, chosen from `listing`
    (every file path of the repo): model_index.json, configs, tokenizer files, the chosen weights only."""
    listing = set(listing)
    by_folder: dict[str, list[str]] = {}
    for path in listing:
        head, _, tail = path.rpartition("/")
        by_folder.setdefault(head, []).append(tail)
    files = [MODEL_INDEX]
    for name, (library, _) in index.components.items():
        if name in model_folder.MODEL_KINDS:
            choice = choose_weights(by_folder.get(name, []), library, variant, where=f"{where}/{name}")
            files += [f"{name}/config.json", *(f"{name}/{f}" for f in choice.files)]
        elif name in model_folder.TOKENIZERS:
            files += sorted(p for p in listing if p.startswith(f"{name}/"))
        else:
            files.append(f"{name}/{SCHEDULER_CONFIG}")
    return files
