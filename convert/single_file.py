"""Original single-file checkpoints (SGM/LDM layout) to and from a diffusers-keyed `Checkpoint`.

Reading (`read_single_file`): the file's keys tell the model type (`detect_model_type`); the type
names a preset of diffusers configs (`sdx.presets`), or a diffusers-layout folder given as
`config_folder` supplies them (any of model_index.json, unet/, vae/, text_encoder/, text_encoder_2/,
scheduler/, tokenizer/, tokenizer_2/; what it lacks comes from the preset). The configs generate the
key table (`convert.single_file_keys`), and every tensor of the file is either mapped through it
exactly once or matched by a named ignore pattern (EMA copies, DDPM buffers, the VAE's training
loss, position ids, OpenCLIP's logit scale); anything else is an error listing the keys.

Model types: sdxl_base, sdxl_refiner, sdxl_pix2pix, sdxl_inpaint, sd15, pix2pix, sd15_inpaint, sd21_v,
sd21, sd2_inpaint (the inpainting types: a 9-channel conv_in), and vae (a
standalone VAE file with `encoder.*`/`decoder.*` keys, as distributed for `--vae`). SD 2.x files
look the same whether trained for v-prediction (2.x at 768 px) or epsilon (2.x-base at 512 px).
sdx follows diffusers here: an SD 2.x file is taken as the 768 px v-prediction model (diffusers
configures every SD 2 file from stabilityai/stable-diffusion-2-1); pass `preset="sd21"` or a
`config_folder` whose scheduler says `"prediction_type": "epsilon"` for a 2.x-base file.

Writing (`write_single_file`) inverts the same table. The round trip sdx -> single file -> sdx is
exact. single file -> sdx -> single file gives back the same tensors under the same keys, except
the ignored ones (EMA weights, buffers), and, for SD 2.x, the unused 24th OpenCLIP layer and text
projection, which diffusers' layout does not keep.

A single file holds no tokenizer: with a config folder, its tokenizer/ and tokenizer_2/ folders are
passed on; without one, `tokenizer_specs` gives the pad token etc. to build them from sdx's built-in
CLIP vocabulary. Old key spellings (SD 1.x files saved before transformers' `text_model` wrapper) are
renamed on reading (`single_file_keys.KEY_ALIASES`).

An SDXL file's sampling markers (`edm_vpred.sigma_max`, `edm_mean`/`edm_std`, `v_pred`, `ztsnr`: CosXL,
Playground v2.5, v-prediction and zero-SNR models) set its scheduler and VAE statistics
(`convert.sampling_markers`), and writing puts them back.

The UNet's EMA copy (`model_ema.*`, in LDM files) is ignored unless `ema=True` asks for it in
place of the trained weights. A standalone VAE file (LDM or diffusers keys) gives a Checkpoint with
only a "vae" component; `read_vae` maps one onto a given VAE config (for `--vae`).

Files: safetensors (memory-mapped through `sdx.io.read_safetensors`, read lazily), or a
pickled `.ckpt`/`.pt`/`.pth`/`.bin` through `torch.load(weights_only=True)` only (never a full
unpickling; torch is imported only then, and is not a runtime dependency).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from convert import sampling_markers
from convert import single_file_keys as K
from convert.checkpoint import Checkpoint
from sdx import io, presets, weights
from sdx.errors import SdxError

_TEXT_ENCODERS = ("text_encoder", "text_encoder_2")

# --------------------------------------------------------------------------------------------------
# Model type detection: marker keys (with a shape condition where keys alone cannot tell)

_CONV_IN = K.UNET_PREFIX + "input_blocks.0.0.weight"

# model type -> (layout, preset, {marker key: required value of shape[1] or None})
_XL_BIG_G = "conditioner.embedders.1.model.ln_final.weight"
_REFINER_BIG_G = "conditioner.embedders.0.model.ln_final.weight"
_SD2_OPEN_CLIP = "cond_stage_model.model.ln_final.weight"
_SD1_CLIP = "cond_stage_model.transformer.text_model.final_layer_norm.weight"
MODEL_TYPES: dict[str, tuple[str, str, dict[str, int | None]]] = {
    "sdxl_pix2pix": ("sdxl", "sdxl_pix2pix", {_XL_BIG_G: None, _CONV_IN: 8}),
    "sdxl_inpaint": ("sdxl", "sdxl_inpaint", {_XL_BIG_G: None, _CONV_IN: 9}),
    "sdxl_base": ("sdxl", "sdxl_base", {_XL_BIG_G: None, _CONV_IN: 4}),
    "sdxl_refiner": ("sdxl_refiner", "sdxl_refiner", {_REFINER_BIG_G: None, _CONV_IN: 4}),
    "sd21_v": ("sd2", "sd21_v", {_SD2_OPEN_CLIP: None, _CONV_IN: 4}),
    "sd2_inpaint": ("sd2", "sd2_inpaint", {_SD2_OPEN_CLIP: None, _CONV_IN: 9}),
    "pix2pix": ("sd1", "pix2pix", {_SD1_CLIP: None, _CONV_IN: 8}),
    "sd15_inpaint": ("sd1", "sd15_inpaint", {_SD1_CLIP: None, _CONV_IN: 9}),
    "sd15": ("sd1", "sd15", {_SD1_CLIP: None, _CONV_IN: 4}),
    "vae": ("vae", "sd15", {"encoder.conv_in.weight": None, "decoder.conv_out.weight": None}),
}
# a type that no marker names, but that a caller may ask for (same keys as sd21_v)
_EXTRA_TYPES = {"sd21": ("sd2", "sd21")}


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if hasattr(value, "shape") else tuple(value)


def detect_model_type(shapes: Mapping[str, Any]) -> str:
    """The model type of a single file from its keys: `shapes` maps key -> array or shape.

    The in-channel count of the UNet's conv_in separates InstructPix2Pix (8) and inpainting (9) from
    text-to-image (4).
    """
    for name, (_, _, markers) in MODEL_TYPES.items():
        ok = True
        for key, channels in markers.items():
            if key not in shapes:
                ok = False
                break
            if channels is not None:
                shape = _shape(shapes[key])
                if len(shape) < 2 or shape[1] != channels:
                    ok = False
                    break
        if ok:
            return name
    looked_for = "; ".join(
        f"{name}: " + " + ".join(k if c is None else f"{k} with {c} input channels" for k, c in markers.items())
        for name, (_, _, markers) in MODEL_TYPES.items()
    )
    sample = ", ".join(sorted(shapes)[:5])
    raise SdxError(
        f"unknown single-file layout; looked for {looked_for}. The file's first keys: {sample or '(none)'}"
    )


# --------------------------------------------------------------------------------------------------
# File I/O


def _load_pickle(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise SdxError(
            f"{path}: reading a pickled checkpoint needs PyTorch (pip install 'sdx[ckpt]'), an optional "
            "dependency; or convert the file to .safetensors first"
        ) from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad pickle
        reason = " ".join(str(e).split())[:200]  # torch's messages span lines; ours is one
        raise SdxError(
            f"{path}: cannot be read with torch.load(weights_only=True) ({type(e).__name__}: {reason}); "
            "sdx never unpickles arbitrary objects. Convert it to .safetensors with a tool you trust"
        ) from None
    while isinstance(state, Mapping) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise SdxError(f"{path}: holds a {type(state).__name__}, not a state dict")
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            if value.dtype == torch.bfloat16:  # numpy has no bfloat16; ml_dtypes (a jax dependency) does
                import ml_dtypes

                out[key] = value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            else:
                out[key] = value.numpy()
    return out


def load_tensors(path) -> dict[str, np.ndarray]:
    """Tensors of a single file (safetensors, or a pickled torch checkpoint read weights-only)."""
    path = Path(path)
    if not path.is_file():
        raise SdxError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".ckpt", ".pt", ".pth", ".bin"):
        return _load_pickle(path)
    if suffix not in (".safetensors", ".sft"):
        with open(path, "rb") as f:
            head = f.read(9)
        if head[:4] == b"PK\x03\x04" or head[:2] == b"\x80\x02":  # torch's zip, or a legacy pickle
            return _load_pickle(path)
    return io.read_safetensors(path)


# --------------------------------------------------------------------------------------------------
# Configs



def _folder_configs(folder: Path) -> tuple[dict[str, dict], dict | None, dict[str, Path]]:
    """(component configs, model_index, tokenizer folders) found in a diffusers-layout folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise SdxError(f"config folder {folder}: not a directory")
    configs = {}
    for name in ("unet", "vae", *_TEXT_ENCODERS):
        cfg = io.read_json(folder / name / "config.json", optional=True)
        if cfg is not None:
            configs[name] = cfg
    scheduler = io.read_json(folder / "scheduler" / "scheduler_config.json", optional=True)
    if scheduler is not None:
        configs["scheduler"] = scheduler
    tokenizers = {t: folder / t for t in ("tokenizer", "tokenizer_2") if (folder / t).is_dir()}
    index = io.read_json(folder / "model_index.json", optional=True)
    if not configs and index is None:
        raise SdxError(
            f"config folder {folder}: no model_index.json and no <component>/config.json; "
            "expected a diffusers layout (unet/config.json, vae/config.json, text_encoder/config.json, ...)"
        )
    return configs, index, tokenizers


def _check_configs(configs: Mapping[str, dict], tensors: Mapping[str, Any], layout: str, where: str) -> None:
    """Catch configs that describe another model than the file's, before the key table does."""
    problems = []
    conv_in = tensors.get(_CONV_IN)
    unet = configs.get("unet")
    if conv_in is not None and unet is not None:
        want = (unet["block_out_channels"][0], unet.get("in_channels", 4))
        if _shape(conv_in)[:2] != want:
            problems.append(f"the UNet's conv_in is {_shape(conv_in)}, the config says {want} (out, in)")
    for name, (style, prefix) in K.LAYOUTS.get(layout, {}).items():
        key = prefix + ("token_embedding.weight" if style == "open_clip"
                        else "text_model.embeddings.token_embedding.weight")
        if key in tensors and name in configs:
            want = (configs[name]["vocab_size"], configs[name]["hidden_size"])
            if _shape(tensors[key]) != want:
                problems.append(f"{name}'s token embedding is {_shape(tensors[key])}, the config says {want}")
    if problems:
        raise SdxError(f"{where}: the configs do not describe this file: {'; '.join(problems)}. "
                       "Pass the matching diffusers folder as the config folder (--config)")


# --------------------------------------------------------------------------------------------------
# Reading


def _ignored(key: str, patterns: Iterable[re.Pattern]) -> bool:
    return any(p.fullmatch(key) for p in patterns)


def _list(keys: Iterable[str], limit: int = 10) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _ema_source(key: str) -> str:
    """LDM's EMA copy flattens the module path: model.diffusion_model.a.b -> model_ema.diffusion_modelab."""
    return "model_ema." + key[len("model."):].replace(".", "")


def map_tensors(
    tensors: Mapping[str, np.ndarray], entries: list[K.Entry], ignored: Iterable[str], *, where: str, ema: bool = False
) -> dict[str, dict[str, np.ndarray]]:
    """Original-keyed tensors -> component -> diffusers-keyed tensors, strictly (see module doc)."""
    patterns = [re.compile(p) for p in ignored]
    table = {e.original: e for e in entries}
    unknown = [k for k in tensors if k not in table and not _ignored(k, patterns)]
    if unknown:
        raise SdxError(f"{where}: {len(unknown)} tensor(s) that no table entry or ignore rule covers: {_list(unknown)}")
    missing = [k for k in table if k not in tensors]
    if missing:
        raise SdxError(
            f"{where}: {len(missing)} tensor(s) the configs call for are missing: {_list(missing)}. "
            "If the file is a different architecture, pass its diffusers folder as the config folder (--config)"
        )
    out: dict[str, dict[str, np.ndarray]] = {}
    for entry in entries:
        source = entry.original
        if ema and source.startswith(K.UNET_PREFIX):
            source = _ema_source(source)
            if source not in tensors:
                raise SdxError(f"{where}: EMA weights asked for, but {source} (for {entry.original}) is missing")
        arrays = K.to_diffusers(entry, tensors[source])
        dest = out.setdefault(entry.component, {})
        for key, array in zip(entry.diffusers, arrays):
            dest[key] = array
    return out


def apply_aliases(tensors: Mapping[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """Rename the old key spellings of `single_file_keys.KEY_ALIASES` to the current ones."""
    out = dict(tensors)
    for key in tensors:
        for old, new in K.KEY_ALIASES.items():
            if key.startswith(old):
                renamed = new + key[len(old):]
                if renamed in tensors:
                    raise SdxError(f"{where}: holds both {key} and {renamed}")
                out[renamed] = out.pop(key)
    return out


def read_vae(path, config: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """A standalone VAE file (LDM keys `encoder.down.0.block.0...`, or diffusers keys
    `encoder.down_blocks.0.resnets.0...`) as diffusers-keyed tensors for a VAE with `config`.

    The architecture of every released SD/SDXL VAE is the same; the latent scaling is not, so the
    config should be the pipeline's own VAE config (e.g. `Checkpoint.configs["vae"]`).
    """
    return read_part(path, "vae", config, where=str(path))


# a lone component's file: its name in messages, its entries, the prefix its original keys have in a whole
# checkpoint, and keys that only an original-keyed file (without that prefix) has
_PARTS = {
    "vae": ("VAE", K.vae_entries, K.VAE_PREFIX, ("encoder.conv_in.weight",)),
    "unet": ("UNet", K.unet_entries, K.UNET_PREFIX, ("input_blocks.0.0.weight", "middle_block.0.in_layers.0.weight")),
}


def read_part(path, part: str, config: Mapping[str, Any], *, where: str) -> dict[str, np.ndarray]:
    """A lone UNet's or VAE's weights file (`part`) as diffusers-keyed tensors for that component with `config`:
    in diffusers keys, holding exactly the component's tensors, or in the original keys, with or without their
    checkpoint prefix (`model.diffusion_model.`, `first_stage_model.`), mapped strictly (`map_tensors`)."""
    return _part_tensors(load_tensors(Path(path)), part, config, where)


def _part_tensors(tensors: Mapping[str, np.ndarray], part: str, config: Mapping[str, Any],
                  where: str) -> dict[str, np.ndarray]:
    name, entries, prefix, original = _PARTS[part]
    entries = entries(config)
    wanted = {k: e for e in entries for k in e.diffusers}
    originals = {e.original.removeprefix(prefix) for e in entries} - set(wanted)  # keys only the original layout has
    if any(k.startswith(prefix) or k in originals for k in tensors):
        prefixed = {k if k.startswith(prefix) else prefix + k: v for k, v in tensors.items()}
        return map_tensors(prefixed, entries, K.COMMON_IGNORED, where=where)[part]
    if not any(k in wanted for k in tensors):
        raise SdxError(f"{where}: not a {name} file: its keys are neither diffusers' ({next(iter(wanted))}, ...) "
                       f"nor the original ones ({original[0]}, ...)")
    patterns = [re.compile(p) for p in K.COMMON_IGNORED]
    unknown = [k for k in tensors if k not in wanted and not _ignored(k, patterns)]
    missing = [k for k in wanted if k not in tensors]
    if unknown or missing:
        raise SdxError(f"{where}: does not hold the model's {name}: " + "; ".join(
            f"{len(keys)} tensor(s) {what}: {_list(keys)}"
            for keys, what in ((unknown, f"the model's {name} has not"), (missing, "missing")) if keys))
    # older diffusers files keep the VAE's attention projections as 1x1 convs
    return {k: K.to_diffusers(wanted[k], tensors[k])[0] for k in wanted}


def read_single_file(path, config_folder=None, *, preset: str | None = None, ema: bool = False) -> Checkpoint:
    """Read an original single-file checkpoint into a diffusers-keyed `Checkpoint`.

    config_folder: a diffusers-layout folder whose configs (and tokenizers) override the preset's.
    preset: force a model type / preset (e.g. "sd21" for an SD 2.x-base epsilon model) instead of
    the detected one; the file's keys must still fit it. For a standalone VAE file, the preset
    whose VAE config to use (default sd15's; SDXL's differs in its scaling factor only).
    ema: take the UNet from the file's EMA copy (`model_ema.*`) instead of the trained weights.
    A standalone VAE file gives a Checkpoint with only a "vae" component and no pipeline class.
    """
    path = Path(path)
    tensors = apply_aliases(load_tensors(path), str(path))
    detected = detect_model_type(tensors)
    types = {**{k: v[:2] for k, v in MODEL_TYPES.items()}, **_EXTRA_TYPES}
    if detected == "vae":
        preset_name = preset or "sd15"
        if preset_name not in presets.NAMES:
            raise SdxError(f"unknown preset {preset_name!r}; choose one of {', '.join(presets.NAMES)}")
        layout = "vae"
    else:
        model_type = preset or detected
        if model_type not in types or model_type == "vae":
            raise SdxError(f"unknown model type {model_type!r}; choose one of "
                           f"{', '.join(sorted(set(types) - {'vae'}))}")
        layout, preset_name = types[model_type]
        if layout != types[detected][0]:
            raise SdxError(f"{path}: its keys are a {detected} layout, which does not fit the requested {model_type}")
    base = presets.get(preset_name)
    configs = dict(base.configs)
    pipeline_class, extra, tokenizers = base.pipeline_class, dict(base.extra), {}
    if config_folder is not None:
        found, index, tokenizers = _folder_configs(Path(config_folder))
        configs.update(found)
        if index is not None:
            pipeline_class = index.get("_class_name", pipeline_class)
            extra = {k: v for k, v in index.items()
                     if not k.startswith("_") and not (isinstance(v, list) and len(v) == 2)}

    if layout == "sdxl":  # after the config folder: the file's own word on how it is sampled wins
        tensors = sampling_markers.read(tensors, configs, extra, pix2pix=model_type == "sdxl_pix2pix", where=str(path))
    if layout == "vae":
        return Checkpoint(pipeline_class="", configs={"vae": configs["vae"]},
                          tensors={"vae": _part_tensors(tensors, "vae", configs["vae"], str(path))})
    components = ["unet", "vae", *K.LAYOUTS[layout]]
    _check_configs(configs, tensors, layout, str(path))
    entries = K.pipeline_entries(layout, configs, components)
    mapped = map_tensors(tensors, entries, K.layout_ignored(layout, configs), where=str(path), ema=ema)
    return Checkpoint(
        pipeline_class=pipeline_class,
        configs={name: configs[name] for name in (*components, "scheduler") if name in configs},
        tensors={name: mapped[name] for name in components},
        tokenizers=tokenizers,
        extra=extra,
    )


# --------------------------------------------------------------------------------------------------
# Writing


def checkpoint_layout(checkpoint: Checkpoint) -> str:
    """sd1 / sd2 / sdxl / sdxl_refiner for a Checkpoint, from its text encoders.

    Two encoders: SDXL; the second alone: the SDXL refiner. One encoder: SD 2.x if it is OpenCLIP
    (gelu activations), SD 1.x if it is OpenAI's CLIP (quick_gelu).
    """
    present = [c for c in _TEXT_ENCODERS if c in checkpoint.tensors]
    if present == ["text_encoder", "text_encoder_2"]:
        return "sdxl"
    if present == ["text_encoder_2"]:
        return "sdxl_refiner"
    if present == ["text_encoder"]:
        act = checkpoint.configs["text_encoder"].get("hidden_act", "quick_gelu")
        return "sd2" if act == "gelu" else "sd1"
    raise SdxError("a single file needs the pipeline's text encoder(s); this checkpoint has none")


_LAYOUT_PRESETS = {"sd1": "sd15", "sd2": "sd21_v", "sdxl": "sdxl_base", "sdxl_refiner": "sdxl_refiner"}


def tokenizer_specs(checkpoint: Checkpoint) -> dict[str, dict[str, Any]]:
    """tokenizer name -> tokenizer_config facts (pad token, max length) the checkpoint's text encoders
    were trained with, for building tokenizers from sdx's built-in CLIP vocabulary when a single
    file (which holds none) is read without a config folder."""
    return presets.get(_LAYOUT_PRESETS[checkpoint_layout(checkpoint)]).tokenizers


def _canonical_text_keys(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers >= 5.6 saves CLIPTextModel without the `text_model.` prefix; the table has it."""
    return {k if k.startswith("text_model.") or k.startswith("text_projection") else f"text_model.{k}": v
            for k, v in tensors.items()}


class _Original:
    """The original-layout tensor of one table entry, computed only when it is read (`np.asarray`), so that
    a writer streaming tensors holds one at a time. `shape` and `dtype` are known without computing it."""

    def __init__(self, entry: K.Entry, arrays: tuple):
        self.entry, self.arrays = entry, arrays
        self.dtype = np.dtype(arrays[0].dtype)
        shape = tuple(arrays[0].shape)
        if entry.kind == K.CONV1X1 and len(shape) == 2:
            shape = (*shape, 1, 1)
        elif entry.kind == K.TRANSPOSE:
            shape = shape[::-1]
        elif entry.kind == K.QKV:
            shape = (sum(a.shape[0] for a in arrays), *shape[1:])
        self.shape = shape

    def __array__(self, dtype=None, copy=None):
        a = np.ascontiguousarray(K.to_original(self.entry, tuple(np.asarray(x) for x in self.arrays)))
        return a if dtype is None else a.astype(dtype, copy=False)


def single_file_tensors(checkpoint: Checkpoint, *, lazy: bool = False) -> dict[str, np.ndarray]:
    """The original-layout tensors of a Checkpoint (a full pipeline, or a VAE alone).

    lazy: array-likes computed when read (for streaming writers) instead of arrays."""
    components = [c for c in ("unet", "vae", *_TEXT_ENCODERS) if c in checkpoint.tensors]
    vae_only = components == ["vae"]
    layout = "sd1" if vae_only else checkpoint_layout(checkpoint)
    if not vae_only and "unet" not in components:
        raise SdxError("a single file needs the UNet; this checkpoint has none")
    configs = dict(checkpoint.configs)
    for c in _TEXT_ENCODERS:  # a config made in memory may lack `architectures`: the tensors tell
        if c in components and not configs[c].get("architectures"):
            arch = "CLIPTextModelWithProjection" if "text_projection.weight" in checkpoint.tensors[c] else "CLIPTextModel"
            configs[c] = {**configs[c], "architectures": [arch]}
    entries = K.pipeline_entries(layout, configs, components)
    by_key = {(e.component, k): e for e in entries for k in e.diffusers}
    source = {c: (_canonical_text_keys(checkpoint.tensors[c]) if c in _TEXT_ENCODERS else checkpoint.tensors[c])
              for c in components}
    unknown = [f"{c}: {k}" for c in components for k in source[c] if (c, k) not in by_key]
    if unknown:
        raise SdxError(f"{len(unknown)} tensor(s) have no place in the single-file layout: {_list(unknown)}")
    missing = [f"{c}: {k}" for (c, k) in by_key if k not in source[c]]
    if missing:
        raise SdxError(f"{len(missing)} tensor(s) the configs call for are missing: {_list(missing)}")
    out = {}
    for e in entries:
        array = _Original(e, tuple(source[e.component][k] for k in e.diffusers))
        key = e.original[len(K.VAE_PREFIX):] if vae_only else e.original
        out[key] = array if lazy else np.asarray(array)
    if layout == "sdxl":
        out.update(sampling_markers.write(checkpoint.configs))
    return out


def write_single_file(checkpoint: Checkpoint, path, *, dtype: np.dtype | None = None) -> int:
    """Write `checkpoint` as one safetensors file in the original SGM/LDM layout, its floating tensors
    cast to `dtype` (default: as they are); returns the number of tensors written.

    The configs are not part of that layout: an SDXL file gets the sampling markers that describe its
    scheduler (`convert.sampling_markers`); otherwise a reader gets them from the detected preset or a
    config folder. A VAE-only Checkpoint is written as a standalone VAE
    file (keys without the `first_stage_model.` prefix).
    """
    tensors = single_file_tensors(checkpoint, lazy=True)
    items = [(k, v if dtype is None or k in sampling_markers.KEYS else weights.lazy_cast(v, dtype))
             for k, v in tensors.items()]  # the markers' sigmas stay float32
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    io.write_safetensors(path, items, metadata={"format": "pt"})
    return len(items)
