"""LoRA files merged into a diffusers-keyed `Checkpoint`: W <- W + scale * (alpha / rank) * up @ down.

The result equals diffusers' `pipe.load_lora_weights(file)` + `pipe.fuse_lora(lora_scale=scale)`.

Formats (one file may target the UNet and both text encoders):

- kohya-ss / A1111 (`lora_unet_*`, `lora_te_*` / `lora_te1_*`, `lora_te2_*` with `.lora_down.weight`,
  `.lora_up.weight`, `.alpha`): a module's name is its path with dots as underscores. For the UNet
  that path is diffusers' (what kohya uses for SD 1.x) or the original SGM one (`input_blocks_4_1_...`,
  what kohya uses for SDXL), resolved through the single-file key table. Conv LoRAs (LoCon: 3x3 down,
  1x1 up) are merged as convolutions. A missing alpha means alpha = rank (kohya's rule).
- diffusers / PEFT (`unet.<module>.lora_A.weight`, `.lora_B.weight`, `text_encoder.<module>...`,
  `text_encoder_2.<module>...`): alpha from the file's `lora_adapter_metadata` (the PEFT LoraConfig
  diffusers writes: lora_alpha, alpha_pattern, use_rslora), else from `<module>.alpha` tensors,
  else alpha = rank (scale 1).
- diffusers' older names: `<module>.lora.down.weight` / `.lora.up.weight`, attention-processor
  names (`attn1.processor.to_q_lora.down.weight`, `self_attn.to_q_lora.down.weight`, `to_out_lora`),
  `lora_linear_layer`, and files whose UNet keys have no `unet.` prefix.

Not supported (an SdxError names the key): LyCORIS LoHa/LoKr, DoRA magnitudes, LoRA biases.
A LoRA module that matches no weight of the checkpoint is an error naming it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from convert import single_file_keys as K
from convert.checkpoint import Checkpoint
from convert.single_file import load_tensors
from sdx import io
from sdx.errors import SdxError

_COMPONENTS = ("unet", "text_encoder", "text_encoder_2")
_KOHYA_PREFIXES = {"lora_unet_": "unet", "lora_te1_": "text_encoder", "lora_te_": "text_encoder",
                   "lora_te2_": "text_encoder_2"}

# diffusers/PEFT key endings -> (role, module-path rewrite applied to what precedes them)
_SUFFIXES = (
    (".lora_A.weight", "down"), (".lora_B.weight", "up"),
    (".lora.down.weight", "down"), (".lora.up.weight", "up"),
    (".lora_linear_layer.down.weight", "down"), (".lora_linear_layer.up.weight", "up"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    ("_lora.down.weight", "down"), ("_lora.up.weight", "up"),  # attention processors: to_q_lora.down.weight
    (".alpha", "alpha"),
)
# diffusers' attention-processor era names (after the `_lora.down.weight` ending is cut) -> module paths
_OLD_NAMES = (
    (r"\.processor\.to_(q|k|v)$", r".to_\1"), (r"\.processor\.to_out$", ".to_out.0"),
    (r"\.self_attn\.to_(q|k|v)$", r".self_attn.\1_proj"), (r"\.self_attn\.to_out$", ".self_attn.out_proj"),
)
_UNSUPPORTED = re.compile(r".*(hada_|lokr_|dora_scale|lora_magnitude_vector|lora_B\.bias|\.diff(_b)?$).*")


def parse_lora_arg(arg: str) -> tuple[Path, float]:
    """"style.safetensors:0.8" -> (Path("style.safetensors"), 0.8); no ":SCALE" means 1.0."""
    head, sep, tail = arg.rpartition(":")
    if sep and head:
        try:
            scale = float(tail)
        except ValueError:
            scale = None  # a colon inside the path (C:\...), not a scale
        if scale is not None:
            if not math.isfinite(scale):
                raise SdxError(f"--lora {arg}: the scale must be a finite number")
            return Path(head), scale
    if not arg:
        raise SdxError("--lora needs a file: --lora FILE[:SCALE]")
    return Path(arg), 1.0


# --------------------------------------------------------------------------------------------------
# Module names of the checkpoint


def _text_canonical(key: str) -> str:
    return key if key.startswith(("text_model.", "text_projection")) else f"text_model.{key}"


class _Targets:
    """Module paths of a Checkpoint's weights, findable by diffusers path or kohya name."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.modules: dict[str, set[str]] = {}  # component -> module paths (keys minus ".weight")
        self.kohya: dict[str, dict[str, set[str]]] = {}
        for component in _COMPONENTS:
            tensors = checkpoint.tensors.get(component)
            if not tensors:
                continue
            modules = {k[: -len(".weight")] for k in tensors if k.endswith(".weight")}
            self.modules[component] = modules
            names: dict[str, set[str]] = {}
            for m in modules:
                forms = {m}
                if component != "unet":
                    forms |= {_text_canonical(m), m.removeprefix("text_model.")}
                for f in forms:
                    names.setdefault(f.replace(".", "_"), set()).add(m)
            if component == "unet" and "unet" in checkpoint.configs:
                try:
                    entries = K.unet_entries(checkpoint.configs["unet"], prefix="")
                except SdxError:
                    entries = []  # a UNet without a single-file layout: diffusers names only
                for e in entries:
                    if e.kind == K.SAME and e.original.endswith(".weight"):
                        m = e.diffusers[0][: -len(".weight")]
                        if m in modules:
                            names.setdefault(e.original[: -len(".weight")].replace(".", "_"), set()).add(m)
            self.kohya[component] = names

    def find(self, component: str, module: str, key: str) -> str:
        modules = self.modules.get(component)
        if modules is None:
            raise SdxError(f"LoRA key {key!r} targets the {component}, which this model does not have")
        candidates = [module] if component == "unet" else [module, _text_canonical(module),
                                                           module.removeprefix("text_model.")]
        for c in candidates:
            if c in modules:
                return c
        raise SdxError(f"LoRA key {key!r}: the {component} has no weight {module}.weight")

    def find_kohya(self, component: str, name: str, key: str) -> str:
        names = self.kohya.get(component)
        if names is None:
            raise SdxError(f"LoRA key {key!r} targets the {component}, which this model does not have")
        found = names.get(name)
        if not found:
            raise SdxError(f"LoRA key {key!r}: no weight of the {component} is named {name}")
        if len(found) > 1:
            raise SdxError(f"LoRA key {key!r}: {name} is ambiguous in the {component}: {sorted(found)}")
        return next(iter(found))


# --------------------------------------------------------------------------------------------------
# Parsing a LoRA file into (component, module) -> {down, up, alpha}


def _split_kohya(key: str) -> tuple[str, str, str] | None:
    for prefix, component in _KOHYA_PREFIXES.items():
        if key.startswith(prefix):
            name, _, suffix = key.partition(".")
            role = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}.get(suffix)
            if role is None:
                raise SdxError(f"LoRA key {key!r}: {suffix!r} is not a LoRA weight sdx can merge")
            return component, name[len(prefix):], role
    return None


def _split_diffusers(key: str) -> tuple[str, str, str]:
    for suffix, role in _SUFFIXES:
        if key.endswith(suffix):
            path = key[: -len(suffix)]
            break
    else:
        raise SdxError(f"LoRA key {key!r} is neither a kohya (lora_unet_/lora_te*_) nor a diffusers/PEFT LoRA weight")
    head, _, rest = path.partition(".")
    if head in _COMPONENTS:
        component, module = head, rest
    elif head in ("down_blocks", "mid_block", "up_blocks", "conv_in", "conv_out", "time_embedding", "add_embedding"):
        component, module = "unet", path  # the oldest diffusers files: UNet attention processors, no prefix
    else:
        raise SdxError(f"LoRA key {key!r}: cannot tell which model it is for "
                       "(expected a unet., text_encoder. or text_encoder_2. prefix)")
    for pattern, replacement in _OLD_NAMES:
        module = re.sub(pattern, replacement, module)
    return component, module, role


def _metadata_alpha(metadata: Mapping[str, object], component: str, module: str, rank: int) -> float | None:
    """alpha of `module` per the PEFT LoraConfig diffusers stores as `<component>.<field>`; None if absent."""
    if f"{component}.lora_alpha" not in metadata and f"{component}.r" not in metadata:
        return None
    alpha = float(metadata.get(f"{component}.lora_alpha", metadata.get(f"{component}.r", rank)))
    for pattern, value in (metadata.get(f"{component}.alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):  # PEFT's rule for pattern keys
            alpha = float(value)
            break
    if metadata.get(f"{component}.use_rslora"):
        return alpha * rank / math.sqrt(rank)  # so that alpha / rank = alpha / sqrt(rank)
    return alpha


def lora_deltas(checkpoint: Checkpoint, path) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray, float]]:
    """(component, weight key) -> (up, down, alpha / rank) for every LoRA module in the file at `path`."""
    path = Path(path)
    tensors = load_tensors(path)
    if not tensors:
        raise SdxError(f"{path}: holds no tensors")
    metadata = {}
    if path.suffix.lower() == ".safetensors":
        raw = io.read_safetensors_metadata(path).get("lora_adapter_metadata")
        if raw:
            try:
                metadata = json.loads(raw)
            except json.JSONDecodeError:
                raise SdxError(f"{path}: its lora_adapter_metadata is not valid JSON") from None
    targets = _Targets(checkpoint)
    groups: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    source: dict[tuple[str, str], str] = {}
    for key, array in tensors.items():
        if _UNSUPPORTED.fullmatch(key):
            raise SdxError(f"{path}: {key!r} belongs to a LoRA variant sdx does not merge "
                           "(LoHa, LoKr, DoRA, LoRA biases)")
        kohya = _split_kohya(key)
        if kohya is not None:
            component, name, role = kohya
            module = targets.find_kohya(component, name, key)
        else:
            component, module, role = _split_diffusers(key)
            module = targets.find(component, module, key)
        group = groups.setdefault((component, module), {})
        if role in group:
            raise SdxError(f"{path}: {key!r} repeats the {role} weight of {component} {module}")
        group[role] = array
        source.setdefault((component, module), key)
    out = {}
    for (component, module), group in groups.items():
        if "down" not in group or "up" not in group:
            raise SdxError(f"{path}: {source[component, module]!r} has no matching "
                           f"{'up' if 'down' in group else 'down'} weight")
        down, up, name = group["down"], group["up"], source[component, module]
        if down.ndim not in (2, 4) or up.ndim != down.ndim or 0 in down.shape or 0 in up.shape:
            raise SdxError(f"{path}: {name!r}: up {up.shape} and down {down.shape} are not a LoRA pair "
                           "(two non-empty matrices, or 4-D for a convolution)")
        rank = down.shape[0]
        if up.shape[1] != rank:
            raise SdxError(f"{path}: {name!r}: up {up.shape} and down {down.shape} ranks differ")
        if "alpha" in group:
            if group["alpha"].size != 1:
                raise SdxError(f"{path}: {name!r}: alpha has shape {group['alpha'].shape}, expected one number")
            alpha = float(np.asarray(group["alpha"], dtype=np.float64).reshape(-1)[0])
        else:
            alpha = _metadata_alpha(metadata, component, module, rank)
            alpha = float(rank) if alpha is None else alpha
        out[component, f"{module}.weight"] = (up, down, alpha / rank)
    return out


def _delta(up: np.ndarray, down: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    """up @ down in float32, shaped like the weight (Linear, 1x1 conv, or kxk conv with a 1x1 up)."""
    up32, down32 = up.astype(np.float32), down.astype(np.float32)
    if down.ndim == 4 and down.shape[2:] != (1, 1):
        if up.ndim != 4 or up.shape[2:] != (1, 1):
            raise SdxError(f"{where}: a {down.shape[2:]} conv LoRA needs a 1x1 up weight, got {up.shape}")
        delta = np.einsum("or,rihw->oihw", up32[:, :, 0, 0], down32)
    else:
        delta = up32.reshape(up.shape[0], -1) @ down32.reshape(down.shape[0], -1)
    if delta.size != math.prod(shape):
        raise SdxError(f"{where}: LoRA product {delta.shape} does not fit the weight {shape}")
    return delta.reshape(shape)


def merge_lora(checkpoint: Checkpoint, path, scale: float = 1.0) -> None:
    """Merge the LoRA file at `path` into `checkpoint`'s tensors in place, with strength `scale`."""
    for (component, key), (up, down, factor) in lora_deltas(checkpoint, path).items():
        weight = checkpoint.tensors[component][key]
        delta = _delta(up, down, tuple(weight.shape), f"{path}: {component} {key}")
        merged = np.asarray(weight, dtype=np.float32) + delta * np.float32(scale * factor)
        checkpoint.tensors[component][key] = merged.astype(weight.dtype)
