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
- LyCORIS LoHa and LoKr under kohya names (`<name>.hada_w1_a`, ..., `<name>.lokr_w1`, ..., `.alpha`), as
  LyCORIS computes them in its layers' forward: LoHa ΔW = (w1_a·w1_b) ⊙ (w2_a·w2_b), or with Tucker cores
  t1/t2 for a convolution each half is einsum(t, w_b, w_a) into (out, in, kh, kw); LoKr ΔW = w1 ⊗ w2
  (Kronecker), each of w1, w2 given whole or as a product a·b (w2 also as a Tucker core with a, b). The
  scale is alpha / rank (rank: w1_b's rows; LoKr: those of whichever half is a product, 1 when neither is,
  as LyCORIS and ComfyUI read it), 1 without an alpha. LyCORIS's LoCon is kohya's LoRA, with a Tucker core
  `lora_mid` between the 1x1 down and up for a convolution.

Not supported (an SdxError names the key): DoRA magnitudes, LoRA biases, LyCORIS's other kinds (full diffs,
IA3, OFT, GLoRA, ...).
A LoRA module that matches no weight of the checkpoint is an error naming it.
"""

from __future__ import annotations

import dataclasses
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
_UNSUPPORTED = re.compile(r".*(dora_scale|lora_magnitude_vector|lora_B\.bias|\.diff(_b)?$).*")
# LyCORIS's factors (kohya-named files: `<name>.<factor>`), each its own role; which ones a module has tells its kind
_LOHA = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
_LOKR = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")


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
            role = {"lora_down.weight": "down", "lora_up.weight": "up", "lora_mid.weight": "mid",
                    "alpha": "alpha"}.get(suffix)
            if role is None and suffix in _LOHA + _LOKR:
                role = suffix
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


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One module's update in a LoRA file: its kind ("lora", "loha", "lokr") and its factors by role, and the
    factor alpha / rank that scales their product."""

    kind: str
    factors: dict[str, np.ndarray]
    scale: float

    def size(self) -> int:
        """How many numbers `product` gives, from the factors' shapes alone (checked against the weight before
        anything is multiplied: a file's factors could otherwise make an update of any size)."""
        f = self.factors
        if self.kind == "lora":
            kernel = f["mid"].shape[2:] if "mid" in f else ()  # a Tucker core's (kh, kw)
            return f["up"].shape[0] * math.prod(f["down"].shape[1:]) * math.prod(kernel)
        if self.kind == "loha":
            a, b = f["hada_w1_a"], f["hada_w1_b"]
            if "hada_t1" in f:
                return a.shape[1] * b.shape[1] * math.prod(f["hada_t1"].shape[2:])
            return a.shape[0] * math.prod(b.shape[1:])
        w1 = f["lokr_w1"].size if "lokr_w1" in f else f["lokr_w1_a"].shape[0] * f["lokr_w1_b"].shape[1]
        if "lokr_w2" in f:
            w2 = f["lokr_w2"].size
        elif "lokr_t2" in f:
            w2 = f["lokr_w2_a"].shape[1] * f["lokr_w2_b"].shape[1] * math.prod(f["lokr_t2"].shape[2:])
        else:
            w2 = f["lokr_w2_a"].shape[0] * math.prod(f["lokr_w2_b"].shape[1:])
        return w1 * w2

    def product(self) -> np.ndarray:
        """The unscaled update in float32, in the layout its factors give (reshaped to the weight by the caller)."""
        f = {role: np.asarray(a, dtype=np.float32) for role, a in self.factors.items()}
        if self.kind == "lora":
            up, down = f["up"], f["down"]
            if "mid" in f:  # LoCon's Tucker core (r, r, kh, kw) between a 1x1 down and a 1x1 up
                return _tucker(f["mid"], up.reshape(up.shape[0], -1).T, down.reshape(down.shape[0], -1))
            if down.ndim == 4 and down.shape[2:] != (1, 1):  # a kxk down after a 1x1 up (LoCon)
                if up.ndim != 4 or up.shape[2:] != (1, 1):
                    raise ValueError(f"a {down.shape[2:]} conv LoRA needs a 1x1 up weight, got {up.shape}")
                return np.einsum("or,rihw->oihw", up[:, :, 0, 0], down)
            return up.reshape(up.shape[0], -1) @ down.reshape(down.shape[0], -1)
        if self.kind == "loha":
            halves = _loha_half(f, "1"), _loha_half(f, "2")
            if halves[0].shape != halves[1].shape:  # (never broadcast one over the other)
                raise ValueError(f"its halves are {halves[0].shape} and {halves[1].shape}")
            return halves[0] * halves[1]
        w1 = f["lokr_w1"] if "lokr_w1" in f else f["lokr_w1_a"] @ f["lokr_w1_b"]
        if "lokr_w2" in f:
            w2 = f["lokr_w2"]
        elif "lokr_t2" in f:
            w2 = _tucker(f["lokr_t2"], f["lokr_w2_a"], f["lokr_w2_b"])
        else:  # b may keep a convolution's (in, kh, kw)
            a, b = f["lokr_w2_a"], f["lokr_w2_b"]
            w2 = (a @ b.reshape(b.shape[0], -1)).reshape(a.shape[0], *b.shape[1:])
        return np.kron(w1.reshape(*w1.shape, *[1] * (w2.ndim - w1.ndim)), w2)  # w1 spread over w2's kernel axes


def _loha_half(f: dict[str, np.ndarray], i: str) -> np.ndarray:
    """LoHa's i-th factor of the Hadamard product: w_a @ w_b, or the Tucker rebuild of its core t_i."""
    a, b = f[f"hada_w{i}_a"], f[f"hada_w{i}_b"]
    if f"hada_t{i}" in f:
        return _tucker(f[f"hada_t{i}"], a, b)
    return a.reshape(a.shape[0], -1) @ b.reshape(b.shape[0], -1)


def _tucker(core: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """LyCORIS's Tucker rebuild: core (r, r, kh, kw), a (r, out), b (r, in) -> (out, in, kh, kw)."""
    return np.einsum("ijkl,ip,jr->prkl", core, a, b, optimize=True)


def _adapter(group: dict[str, np.ndarray], name: str, alpha_default) -> Adapter:
    """The Adapter of one module's weights `group` (role -> array; `name`: a key of it, for errors);
    alpha_default(rank) -> alpha when the group has none (None: alpha = rank)."""
    roles = set(group) - {"alpha"}
    kinds = {"lora" if r in ("up", "down", "mid") else "loha" if r.startswith("hada_") else "lokr" for r in roles}
    if not kinds:
        raise SdxError(f"{name!r}: an alpha without the weights it scales")
    if len(kinds) != 1:
        raise SdxError(f"{name!r}: its module mixes weights of {' and '.join(sorted(kinds))} adapters")
    kind = kinds.pop()
    if kind == "lora":
        if "down" not in group or "up" not in group:
            raise SdxError(f"{name!r} has no matching {'up' if 'down' in group else 'down'} weight")
        down, up = group["down"], group["up"]
        if down.ndim not in (2, 4) or up.ndim != down.ndim or 0 in down.shape or 0 in up.shape:
            raise SdxError(f"{name!r}: up {up.shape} and down {down.shape} are not a LoRA pair "
                           "(two non-empty matrices, or 4-D for a convolution)")
        rank = down.shape[0]
        if up.shape[1] != rank:
            raise SdxError(f"{name!r}: up {up.shape} and down {down.shape} ranks differ")
    else:
        if kind == "loha":
            needed = [{"hada_w1_a"}, {"hada_w1_b"}, {"hada_w2_a"}, {"hada_w2_b"}]
            if ("hada_t1" in group) != ("hada_t2" in group):
                raise SdxError(f"{name!r}: a LoHa module has both Tucker cores hada_t1, hada_t2 or neither")
        else:
            needed = [{"lokr_w1", "lokr_w1_a"}, {"lokr_w2", "lokr_w2_a"}]
            needed += [{"lokr_w1_b"}] if "lokr_w1_a" in group else []
            needed += [{"lokr_w2_b"}] if "lokr_w2_a" in group else []
        for options in needed:
            if not options & roles:
                raise SdxError(f"{name!r}: its {kind} module has no {' or '.join(sorted(options))} weight")
        if any(a.ndim < 2 or 0 in a.shape for r, a in group.items() if r != "alpha"):
            raise SdxError(f"{name!r}: each {kind} factor must be a non-empty matrix or more")
        # the rank alpha divides: LoHa's w1_b rows; LoKr's of whichever half is a product (none: scale 1)
        rank = next((group[k].shape[0] for k in ("hada_w1_b", "lokr_w1_b", "lokr_w2_b") if k in group), 0)
    if "alpha" in group:
        if group["alpha"].size != 1:
            raise SdxError(f"{name!r}: alpha has shape {group['alpha'].shape}, expected one number")
        alpha = float(np.asarray(group["alpha"], dtype=np.float64).reshape(-1)[0])
    else:
        alpha = alpha_default(rank) if kind == "lora" else None
    factors = {r: a for r, a in group.items() if r != "alpha"}
    return Adapter(kind, factors, alpha / rank if alpha is not None and rank else 1.0)


def lora_deltas(checkpoint: Checkpoint, path) -> dict[tuple[str, str], Adapter]:
    """(component, weight key) -> its Adapter, for every module of the LoRA file at `path`."""
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
                           "(DoRA, LoRA biases, LyCORIS full diffs)")
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
        def alpha_default(rank, component=component, module=module):
            alpha = _metadata_alpha(metadata, component, module, rank)
            return float(rank) if alpha is None else alpha
        try:
            out[component, f"{module}.weight"] = _adapter(group, source[component, module], alpha_default)
        except SdxError as e:
            raise SdxError(f"{path}: {e}") from None
    return out


def merge_lora(checkpoint: Checkpoint, path, scale: float = 1.0) -> None:
    """Merge the LoRA file at `path` into `checkpoint`'s tensors in place, with strength `scale`."""
    for (component, key), adapter in lora_deltas(checkpoint, path).items():
        weight = checkpoint.tensors[component][key]
        where = f"{path}: {component} {key}"
        if adapter.size() != math.prod(weight.shape):
            raise SdxError(f"{where}: its {adapter.kind} update has {adapter.size():,} numbers, which do not fit "
                           f"the weight {tuple(weight.shape)}")
        try:
            delta = adapter.product()
        except ValueError as e:  # factors whose inner shapes do not chain
            raise SdxError(f"{where}: its {adapter.kind} factors do not fit together ({e})") from None
        merged = np.asarray(weight, dtype=np.float32) + delta.reshape(weight.shape) * np.float32(scale * adapter.scale)
        checkpoint.tensors[component][key] = merged.astype(weight.dtype)
