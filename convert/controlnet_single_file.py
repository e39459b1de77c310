"""Original single-file ControlNets to and from diffusers keys: lllyasviel's ControlNet 1.0/1.1 files
(`control_v11p_sd15_canny.pth`, ...), SD 2.x ones (thibaud/controlnet-sd21) and SDXL ones in the same
layout, as `.safetensors`, `.pth` or `.ckpt`.

The layout is ControlNet-LDM's (cldm.py), under `control_model.` in files saved from the whole model, or
with no prefix in extracted ones:

    time_embed.{0,2}  label_emb.0.{0,2} (SDXL)       the UNet's encoder half, keyed as in the UNet
    input_blocks.*  middle_block.{0,1,2}               (`single_file_keys.unet_encoder_entries`)
    input_hint_block.{0, 2, ..., 4n-2}                 the conditioning image's embedding with n widths:
                                                       conv_in, blocks.0 .. blocks.{2n-3}, conv_out (the
                                                       odd indices are its SiLUs)
    zero_convs.{i}.0                                   controlnet_down_blocks.{i}: a 1x1 conv per UNet skip
    middle_block_out.0                                 controlnet_mid_block

The ControlNet 1.0 files (`control_sd15_canny.pth`) also hold the Stable Diffusion model they were
trained with (`model.diffusion_model.*`, `first_stage_model.*`, `cond_stage_model.*` and the DDPM
buffers); next to `control_model.` those are ignored by name. Anything else is an error naming the keys,
and every tensor is used once (`single_file.map_tensors`). A single file in diffusers' own keys
(`controlnet_cond_embedding.*`, as some collections share them) is read as it is.

A file holds no config. The caller's (a diffusers ControlNet config.json) describes it; without one, the
ControlNet copies the UNet of a preset, the caller's or the one its keys point to (`detect_preset`, what
diffusers' `infer_diffusers_model_type` does for ControlNets, and for SD 2.x, which diffusers reads as SD 1.5):
SDXL when it has the added embedding (`label_emb`), else SD 2.x for a 1024-wide cross-attention context
(OpenCLIP-H) and SD 1.x for 768 (CLIP-L). The conditioning channels and the embedding's widths are read
off the hint block. What the keys cannot tell (the shuffle ControlNet's global pooling, a BGR channel
order, a non-standard UNet) needs the config. A ControlNet-Union in diffusers' keys (xinsir's
`diffusion_pytorch_model_promax.safetensors`) is read so, its control types counted off `task_embedding` and its
condition transformer diffusers' (and xinsir's) default.

Writing (`to_original`) inverts the same table, under `control_model.`, which is what diffusers'
`from_single_file` (and the UIs) recognise. diffusers' own reader leaves SDXL's `label_emb` out.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from convert import single_file_keys as K
from convert.single_file import map_tensors
from sdx import diffusers_config, presets
from sdx.controlnet import ControlNetConfig
from sdx.errors import SdxError

PREFIX = "control_model."
_COMPONENT = "controlnet"
HINT = "input_hint_block"

# What tells a ControlNet's keys from other files', in each layout: its conditioning image embedding.
_FIRST_CONV = {"original": f"{HINT}.0.weight", "diffusers": "controlnet_cond_embedding.conv_in.weight"}
# SDXL's added (text_time) conditioning, in each layout
_ADDED = {"original": "label_emb.0.0.weight", "diffusers": "add_embedding.linear_1.weight"}
# The key whose output width is the embedding's k-th width (k >= 1), in each layout: each stride-2 conv
_WIDTH = {"original": lambda k: f"{HINT}.{4 * k}.weight",
          "diffusers": lambda k: f"controlnet_cond_embedding.blocks.{2 * k - 1}.weight"}
_CONV_IN = {"original": "input_blocks.0.0.weight", "diffusers": "conv_in.weight"}
_CONV_COUNT = {"original": re.compile(rf"{HINT}\.\d+\.weight"),
               "diffusers": re.compile(r"controlnet_cond_embedding\.(conv_in|blocks\.\d+|conv_out)\.weight")}
# cross-attention context width -> the preset of a ControlNet without added conditioning
_CONTEXT_PRESETS = {768: "sd15", 1024: "sd21"}
_XL_PRESET = "sdxl_base"
UNION_KEY = "task_embedding"  # a ControlNet-Union's control types (`sdx.controlnet_union`)
# What a ControlNet 1.0 file bundles besides `control_model.`: the Stable Diffusion model it was trained with.
_BUNDLED = (r"model\.diffusion_model\..*", r"first_stage_model\..*", r"cond_stage_model\..*", *K.COMMON_IGNORED)

Log = Callable[[str], None]


def layout_of(keys: Iterable[str]) -> str | None:
    """"original" or "diffusers" when `keys` (a single file's) are a ControlNet's, else None."""
    keys = set(keys)
    if _FIRST_CONV["original"] in keys or PREFIX + _FIRST_CONV["original"] in keys:
        return "original"
    return "diffusers" if _FIRST_CONV["diffusers"] in keys else None


def _unprefixed(tensors: Mapping[str, Any], where: str, log: Log) -> dict[str, Any]:
    """The ControlNet's own tensors: those under `control_model.` (without it) when there are any, the
    bundled model's ignored by name (`_BUNDLED`); else all of them."""
    if not any(k.startswith(PREFIX) for k in tensors):
        return dict(tensors)
    patterns = [re.compile(p) for p in _BUNDLED]
    other = [k for k in tensors if not k.startswith(PREFIX)]
    unknown = sorted(k for k in other if not any(p.fullmatch(k) for p in patterns))
    if unknown:
        shown = ", ".join(unknown[:10]) + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        raise SdxError(f"{where}: {len(unknown)} tensor(s) outside {PREFIX} that are not a bundled Stable "
                       f"Diffusion model's: {shown}")
    if other:
        log(f"{where}: ignoring the {len(other)} tensors of the Stable Diffusion model bundled with the ControlNet")
    return {k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)}


# --------------------------------------------------------------------------------------------------
# The config a file's keys point to


def detect_preset(tensors: Mapping[str, Any], layout: str, *, where: str) -> str:
    """The preset (`sdx.presets`) whose UNet a ControlNet with these (unprefixed) keys copies."""
    if _ADDED[layout] in tensors:
        return _XL_PRESET
    key = next((k for k in sorted(tensors) if k.endswith(".attn2.to_k.weight")), None)
    if key is None:
        raise SdxError(f"{where}: a ControlNet without cross-attention, which no preset describes; pass its "
                       "diffusers config folder (--config)")
    context = np.shape(tensors[key])[-1]
    if context not in _CONTEXT_PRESETS:
        raise SdxError(f"{where}: a ControlNet for a {context}-wide text context ({key}), which no preset "
                       "describes (768: SD 1.x, 1024: SD 2.x, SDXL has label_emb); pass its diffusers config "
                       "folder (--config)")
    return _CONTEXT_PRESETS[context]


def _embedding(tensors: Mapping[str, Any], layout: str, where: str) -> dict[str, Any]:
    """The conditioning embedding's config fields, read off its convolutions' shapes."""
    convs = sum(1 for k in tensors if _CONV_COUNT[layout].fullmatch(k))
    if convs < 2 or convs % 2:
        raise SdxError(f"{where}: the conditioning embedding has {convs} convolutions; a ControlNet's has an "
                       "even number, at least 2")
    first = np.shape(tensors[_FIRST_CONV[layout]])
    try:
        widths = [first[0], *(np.shape(tensors[_WIDTH[layout](k)])[0] for k in range(1, convs // 2))]
    except KeyError as e:
        raise SdxError(f"{where}: the conditioning embedding lacks {e.args[0]}") from None
    return {"conditioning_channels": first[1], "conditioning_embedding_out_channels": widths}


def preset_config(tensors: Mapping[str, Any], layout: str, preset: str, *, where: str) -> dict[str, Any]:
    """A diffusers ControlNetModel config.json dict: the preset's UNet's down half, and the conditioning
    embedding the file has. The file's conv_in must be the preset's."""
    unet = presets.get(preset).configs["unet"]
    key = _CONV_IN[layout]
    conv_in = np.shape(tensors[key]) if key in tensors else "missing"
    want = (unet["block_out_channels"][0], unet["in_channels"], 3, 3)
    if conv_in != want:
        raise SdxError(f"{where}: its {key} is {conv_in}, the {preset} UNet's {want}: not a released architecture; "
                       "pass its diffusers config folder (--config)")
    config = {k: unet[k] for k in diffusers_config.CONTROLNET_UNET_FIELDS if k in unet}
    if UNION_KEY in tensors:  # a ControlNet-Union in diffusers' keys: its type count, the rest diffusers' defaults
        config["num_control_type"] = np.shape(tensors[UNION_KEY])[0]
    return {"_class_name": "ControlNetModel", **config, **_embedding(tensors, layout, where)}


# --------------------------------------------------------------------------------------------------
# The key table


def _conv(d: str, o: str) -> list[K.Entry]:
    """A convolution's weight and bias: `d` in diffusers' keys, `o` in the original ones."""
    return [K.Entry(_COMPONENT, (f"{d}.{p}",), f"{o}.{p}") for p in ("weight", "bias")]


def _embedding_entries(widths: int) -> list[K.Entry]:
    convs = ["conv_in", *(f"blocks.{j}" for j in range(2 * (widths - 1))), "conv_out"]
    return [e for i, name in enumerate(convs) for e in _conv(f"controlnet_cond_embedding.{name}", f"{HINT}.{2 * i}")]


def controlnet_entries(config: Mapping[str, Any]) -> list[K.Entry]:
    """Every tensor of a diffusers ControlNetModel with config.json dict `config`, paired with its
    original (unprefixed) key."""
    cfg = ControlNetConfig.from_diffusers_config(config)
    out = [dataclasses.replace(e, component=_COMPONENT) for e in K.unet_encoder_entries(config, prefix="")]
    out += _embedding_entries(len(cfg.conditioning_embedding_out_channels))
    for i in range(len(cfg.residual_channels)):
        out += _conv(f"controlnet_down_blocks.{i}", f"zero_convs.{i}.0")
    return out + _conv("controlnet_mid_block", "middle_block_out.0")


# --------------------------------------------------------------------------------------------------
# Both directions


def from_single_file(
    tensors: Mapping[str, Any], config: Mapping[str, Any] | None = None, *, preset: str | None = None, where: str,
    log: Log | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(diffusers ControlNetModel config.json dict, diffusers-keyed tensors) of a single file's tensors.
    config: the file's config.json dict; None: the one of `preset`'s UNet, by default the preset its keys
    point to (see the module doc)."""
    log = log or (lambda _msg: None)
    layout = layout_of(tensors)
    if layout is None:
        first = ", ".join(sorted(tensors)[:5]) or "(none)"
        raise SdxError(f"{where}: not a ControlNet: no {_FIRST_CONV['original']} (original layout, also under "
                       f"{PREFIX}) nor {_FIRST_CONV['diffusers']} (diffusers keys); its first keys: {first}")
    tensors = _unprefixed(tensors, where, log)
    if config is None:
        how = "as asked" if preset else "from its keys"
        preset = preset or detect_preset(tensors, layout, where=where)
        where = f"{where} (read as a ControlNet for {preset}, {how})"
        config = preset_config(tensors, layout, preset, where=where)
        log(f"{where}: conditioning embedding {config['conditioning_embedding_out_channels']}")
    config = dict(config)
    if layout == "diffusers":
        return config, tensors
    try:
        entries = controlnet_entries(config)
    except SdxError as e:
        raise SdxError(f"{where}: {e}") from None
    return config, map_tensors(tensors, entries, (), where=where)[_COMPONENT]


def to_original(config: Mapping[str, Any], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """The original-layout tensors (keys under `control_model.`) of a ControlNet's diffusers-keyed ones."""
    entries = controlnet_entries(config)
    table = {e.diffusers[0]: e for e in entries}
    unknown = sorted(set(tensors) - set(table))
    missing = sorted(set(table) - set(tensors))
    if unknown or missing:
        raise SdxError(f"the ControlNet's tensors do not fit the single-file table: unexpected "
                       f"{', '.join(unknown[:5]) or 'none'}; missing {', '.join(missing[:5]) or 'none'}")
    return {PREFIX + e.original: K.to_original(e, (tensors[e.diffusers[0]],)) for e in entries}
