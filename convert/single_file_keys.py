"""The key table between the original single-file layout (SGM/LDM) and diffusers/transformers keys.

One table serves both directions. It is generated from the diffusers configs (which blocks have
attention, how many resnets and transformer layers each has), so it lists every tensor of the
model exactly: a source key that is not in it (and not on the ignore list) is an error, and so is
a table entry the source lacks.

An `Entry` pairs one original key with one diffusers key, or with three for OpenCLIP's fused
attention input projection, and says how the tensor changes between the two:

- SAME: the tensor is identical.
- CONV1X1: diffusers' Linear (out, in) is the original 1x1 conv (out, in, 1, 1) (VAE mid-block attention).
- TRANSPOSE: diffusers' Linear weight (out, in) is the original raw matrix (in, out), used as `x @ W`
  (OpenCLIP's text_projection).
- QKV: the original `in_proj_weight` (3*d, in) / `in_proj_bias` (3*d,) is q, k, v stacked along axis 0.

Original-side layout, for the record (SGM = Stability's generative-models, LDM = CompVis' latent
diffusion; their UNet and VAE keys agree):

- UNet under `model.diffusion_model.`: `time_embed.{0,2}`, `label_emb.0.{0,2}` (SDXL's added
  conditioning), `input_blocks.0.0` = conv_in, then per level `layers_per_block` entries
  `input_blocks.n.{0: resnet, 1: transformer}` and one downsampler entry `input_blocks.n.0.op`;
  `middle_block.{0,1,2}` = resnet, transformer, resnet; `output_blocks.n.{0: resnet, 1: transformer,
  1 or 2: upsampler .conv}`, `out.{0,2}` = norm and conv_out. Resnets: `in_layers.{0,2}`,
  `emb_layers.1`, `out_layers.{0,3}`, `skip_connection`. Transformers: the diffusers names.
- VAE under `first_stage_model.`: `encoder.down.i.block.j`, `encoder.down.i.downsample.conv`,
  `{encoder,decoder}.mid.{block_1,attn_1,block_2}`, `decoder.up.i` counted from the lowest
  resolution upwards in reverse (`decoder.up.{L-1-i}` = `decoder.up_blocks.i`), `norm_out`,
  `nin_shortcut`; attention `norm`, `q`, `k`, `v`, `proj_out` as 1x1 convs.
- CLIP ViT-L (OpenAI) under `cond_stage_model.transformer.` (SD 1.x) or
  `conditioner.embedders.0.transformer.` (SDXL): already transformers' keys.
- OpenCLIP under `cond_stage_model.model.` (SD 2.x), `conditioner.embedders.1.model.` (SDXL base)
  or `conditioner.embedders.0.model.` (SDXL refiner): `token_embedding`, `positional_embedding`,
  `transformer.resblocks.i.{ln_1, attn.in_proj_*, attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj}`,
  `ln_final`, `text_projection`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from sdx.errors import SdxError

SAME, CONV1X1, TRANSPOSE, QKV = "same", "conv1x1", "transpose", "qkv"

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."


@dataclasses.dataclass(frozen=True)
class Entry:
    component: str  # "unet", "vae", "text_encoder", "text_encoder_2"
    diffusers: tuple[str, ...]  # one key; three (q, k, v) for QKV
    original: str
    kind: str = SAME


def to_diffusers(entry: Entry, array: np.ndarray) -> tuple[np.ndarray, ...]:
    """The original tensor -> its diffusers tensor(s), in `entry.diffusers` order."""
    if entry.kind == SAME:
        return (array,)
    if entry.kind == CONV1X1:
        return (array.reshape(array.shape[:2]) if array.ndim == 4 else array,)
    if entry.kind == TRANSPOSE:
        return (np.ascontiguousarray(array.T),)
    if entry.kind == QKV:
        if array.shape[0] % 3:
            raise SdxError(f"{entry.original}: shape {array.shape} is not three stacked projections")
        return tuple(np.split(array, 3, axis=0))
    raise AssertionError(entry.kind)


def to_original(entry: Entry, arrays: tuple[np.ndarray, ...]) -> np.ndarray:
    """The diffusers tensor(s) of `entry` -> the original tensor."""
    if entry.kind == SAME:
        return arrays[0]
    if entry.kind == CONV1X1:
        a = arrays[0]
        return a.reshape(*a.shape, 1, 1) if a.ndim == 2 else a
    if entry.kind == TRANSPOSE:
        return np.ascontiguousarray(arrays[0].T)
    if entry.kind == QKV:
        return np.concatenate(arrays, axis=0)
    raise AssertionError(entry.kind)


def _wb(component: str, d: str, o: str, kind: str = SAME, bias: bool = True) -> list[Entry]:
    """weight (and bias) of one module `d` (diffusers) / `o` (original)."""
    out = [Entry(component, (f"{d}.weight",), f"{o}.weight", kind)]
    if bias:
        out.append(Entry(component, (f"{d}.bias",), f"{o}.bias"))
    return out


# --------------------------------------------------------------------------------------------------
# UNet

_UNET_DOWN = ("CrossAttnDownBlock2D", "DownBlock2D")
_UNET_UP = ("CrossAttnUpBlock2D", "UpBlock2D")
# config fields whose non-default values add or rename modules this table does not know
_UNET_UNSUPPORTED = {
    "class_embed_type": None,
    "encoder_hid_dim_type": None,
    "time_cond_proj_dim": None,
    "num_class_embeds": None,
    "dual_cross_attention": False,
    "only_cross_attention": False,
    "attention_type": "default",
    "mid_block_only_cross_attention": None,
    "time_embedding_type": "positional",
    "time_embedding_dim": None,
    "class_embeddings_concat": False,
    "reverse_transformer_layers_per_block": None,
}


def _per_level(value: Any, levels: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != levels:
            raise SdxError(f"UNet config: {name} has {len(value)} entries for {levels} levels")
        return list(value)
    return [value] * levels


def _unet_resnet(d: str, o: str, in_ch: int, out_ch: int) -> list[Entry]:
    pairs = [("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("time_emb_proj", "emb_layers.1"),
             ("norm2", "out_layers.0"), ("conv2", "out_layers.3")]
    if in_ch != out_ch:
        pairs.append(("conv_shortcut", "skip_connection"))
    return [e for a, b in pairs for e in _wb("unet", f"{d}.{a}", f"{o}.{b}")]


def _unet_transformer(d: str, o: str, depth: int) -> list[Entry]:
    """A Transformer2DModel: same names in both layouts."""
    names = ["norm", "proj_in", "proj_out"]
    for k in range(depth):
        t = f"transformer_blocks.{k}"
        names += [f"{t}.norm1", f"{t}.norm2", f"{t}.norm3", f"{t}.attn1.to_out.0", f"{t}.attn2.to_out.0",
                  f"{t}.ff.net.0.proj", f"{t}.ff.net.2"]
    out = [e for n in names for e in _wb("unet", f"{d}.{n}", f"{o}.{n}")]
    for k in range(depth):
        for attn in ("attn1", "attn2"):
            for proj in ("to_q", "to_k", "to_v"):
                n = f"transformer_blocks.{k}.{attn}.{proj}"
                out += _wb("unet", f"{d}.{n}", f"{o}.{n}", bias=False)
    return out


def _check_unet_config(config: Mapping[str, Any]) -> None:
    """Refuse the config fields whose values add or rename modules this table does not know."""
    for key, default in _UNET_UNSUPPORTED.items():
        if config.get(key, default) != default:
            raise SdxError(f"UNet config: {key}={config[key]!r} has no single-file layout in sdx")
    if config.get("mid_block_type", "UNetMidBlock2DCrossAttn") != "UNetMidBlock2DCrossAttn":
        raise SdxError(f"UNet config: mid_block_type={config['mid_block_type']!r} has no single-file layout in sdx")
    if config.get("addition_embed_type") not in (None, "text_time"):
        raise SdxError(f"UNet config: addition_embed_type={config['addition_embed_type']!r} is not supported")
    if not isinstance(config.get("layers_per_block", 2), int):
        raise SdxError(f"UNet config: layers_per_block={config['layers_per_block']!r} per level has no single-file "
                       "layout in sdx")


def _blocks(config: Mapping[str, Any], key: str, known: tuple[str, ...]) -> tuple[list[str], list[int]]:
    """The block types under `key` (down_block_types, up_block_types), checked, and block_out_channels."""
    types, channels = list(config[key]), list(config["block_out_channels"])
    if any(t not in known for t in types):
        raise SdxError(f"UNet config: {key}={types} have no single-file layout in sdx")
    if len(types) != len(channels):
        raise SdxError(f"UNet config: {key} and block_out_channels differ in length")
    return types, channels


def _depths(config: Mapping[str, Any], levels: int) -> list[int]:
    """Transformer layers per level (one count for every block of a level)."""
    depth = _per_level(config.get("transformer_layers_per_block", 1), levels, "transformer_layers_per_block")
    if not all(isinstance(d, int) for d in depth):
        raise SdxError(f"UNet config: transformer_layers_per_block={depth!r} per block has no single-file layout "
                       "in sdx")
    return depth


def unet_encoder_entries(config: Mapping[str, Any], prefix: str = UNET_PREFIX) -> list[Entry]:
    """The encoder half of a diffusers UNet2DConditionModel with `config` (time and added embeddings,
    conv_in, down blocks, mid block), paired with SGM/LDM keys: what a ControlNet copies of its UNet.
    `config` may be a ControlNetModel's, which has the same down-half fields."""
    _check_unet_config(config)
    down, channels = _blocks(config, "down_block_types", _UNET_DOWN)
    levels = len(channels)
    layers = config.get("layers_per_block", 2)
    depth = _depths(config, levels)

    u = lambda d, o, **kw: _wb("unet", d, prefix + o, **kw)  # noqa: E731
    out = u("time_embedding.linear_1", "time_embed.0") + u("time_embedding.linear_2", "time_embed.2")
    out += u("conv_in", "input_blocks.0.0")
    if config.get("addition_embed_type") == "text_time":
        out += u("add_embedding.linear_1", "label_emb.0.0") + u("add_embedding.linear_2", "label_emb.0.2")

    n = 1  # input_blocks index; 0 is conv_in
    out_ch = channels[0]
    for i, kind in enumerate(down):
        in_ch, out_ch = out_ch, channels[i]
        for j in range(layers):
            d, o = f"down_blocks.{i}", f"{prefix}input_blocks.{n}"
            out += _unet_resnet(f"{d}.resnets.{j}", f"{o}.0", in_ch if j == 0 else out_ch, out_ch)
            if kind == "CrossAttnDownBlock2D":
                out += _unet_transformer(f"{d}.attentions.{j}", f"{o}.1", depth[i])
            n += 1
        if i < levels - 1:
            out += u(f"down_blocks.{i}.downsamplers.0.conv", f"input_blocks.{n}.0.op")
            n += 1

    mid = channels[-1]
    out += _unet_resnet("mid_block.resnets.0", f"{prefix}middle_block.0", mid, mid)
    out += _unet_transformer("mid_block.attentions.0", f"{prefix}middle_block.1", depth[-1])
    out += _unet_resnet("mid_block.resnets.1", f"{prefix}middle_block.2", mid, mid)
    return out


def unet_entries(config: Mapping[str, Any], prefix: str = UNET_PREFIX) -> list[Entry]:
    """Every tensor of a diffusers UNet2DConditionModel with `config`, paired with its SGM/LDM key."""
    out = unet_encoder_entries(config, prefix)
    up, channels = _blocks(config, "up_block_types", _UNET_UP)
    levels = len(channels)
    layers = config.get("layers_per_block", 2)
    rev, rev_depth = channels[::-1], _depths(config, levels)[::-1]
    n = 0
    out_ch = rev[0]
    for i, kind in enumerate(up):
        prev_ch, out_ch = out_ch, rev[i]
        skip_ch = rev[min(i + 1, levels - 1)]
        for j in range(layers + 1):
            d, o = f"up_blocks.{i}", f"{prefix}output_blocks.{n}"
            res_in = (prev_ch if j == 0 else out_ch) + (skip_ch if j == layers else out_ch)
            out += _unet_resnet(f"{d}.resnets.{j}", f"{o}.0", res_in, out_ch)
            if kind == "CrossAttnUpBlock2D":
                out += _unet_transformer(f"{d}.attentions.{j}", f"{o}.1", rev_depth[i])
            if j == layers and i < levels - 1:
                slot = 2 if kind == "CrossAttnUpBlock2D" else 1
                out += _wb("unet", f"{d}.upsamplers.0.conv", f"{o}.{slot}.conv")
            n += 1

    out += _wb("unet", "conv_norm_out", prefix + "out.0") + _wb("unet", "conv_out", prefix + "out.2")
    return out


# --------------------------------------------------------------------------------------------------
# VAE


def _vae_resnet(d: str, o: str, in_ch: int, out_ch: int) -> list[Entry]:
    pairs = [("norm1", "norm1"), ("conv1", "conv1"), ("norm2", "norm2"), ("conv2", "conv2")]
    if in_ch != out_ch:
        pairs.append(("conv_shortcut", "nin_shortcut"))
    return [e for a, b in pairs for e in _wb("vae", f"{d}.{a}", f"{o}.{b}")]


def _vae_attention(d: str, o: str) -> list[Entry]:
    out = _wb("vae", f"{d}.group_norm", f"{o}.norm")
    for a, b in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("to_out.0", "proj_out")):
        out += _wb("vae", f"{d}.{a}", f"{o}.{b}", kind=CONV1X1)
    return out


def vae_entries(config: Mapping[str, Any], prefix: str = VAE_PREFIX) -> list[Entry]:
    """Every tensor of a diffusers AutoencoderKL with `config`, paired with its LDM key."""
    channels = list(config.get("block_out_channels", [64]))
    layers = config.get("layers_per_block", 1)
    levels = len(channels)
    for key in ("down_block_types", "up_block_types"):
        types = set(config.get(key, []))
        if types - {"DownEncoderBlock2D", "UpDecoderBlock2D"}:
            raise SdxError(f"VAE config: {key}={sorted(types)} has no single-file layout in sdx")
    attention = config.get("mid_block_add_attention", True)
    out: list[Entry] = []
    for part in ("encoder", "decoder"):
        d, o = part, prefix + part
        out += _wb("vae", f"{d}.conv_in", f"{o}.conv_in") + _wb("vae", f"{d}.conv_out", f"{o}.conv_out")
        out += _wb("vae", f"{d}.conv_norm_out", f"{o}.norm_out")
        mid = channels[-1]
        out += _vae_resnet(f"{d}.mid_block.resnets.0", f"{o}.mid.block_1", mid, mid)
        out += _vae_resnet(f"{d}.mid_block.resnets.1", f"{o}.mid.block_2", mid, mid)
        if attention:
            out += _vae_attention(f"{d}.mid_block.attentions.0", f"{o}.mid.attn_1")
    out_ch = channels[0]
    for i in range(levels):
        in_ch, out_ch = out_ch, channels[i]
        for j in range(layers):
            out += _vae_resnet(f"encoder.down_blocks.{i}.resnets.{j}", f"{prefix}encoder.down.{i}.block.{j}",
                               in_ch if j == 0 else out_ch, out_ch)
        if i < levels - 1:
            out += _wb("vae", f"encoder.down_blocks.{i}.downsamplers.0.conv",
                       f"{prefix}encoder.down.{i}.downsample.conv")
    rev = channels[::-1]
    out_ch = rev[0]
    for i in range(levels):
        prev_ch, out_ch = out_ch, rev[i]
        o = f"{prefix}decoder.up.{levels - 1 - i}"
        for j in range(layers + 1):
            out += _vae_resnet(f"decoder.up_blocks.{i}.resnets.{j}", f"{o}.block.{j}",
                               prev_ch if j == 0 else out_ch, out_ch)
        if i < levels - 1:
            out += _wb("vae", f"decoder.up_blocks.{i}.upsamplers.0.conv", f"{o}.upsample.conv")
    if config.get("use_quant_conv", True):
        out += _wb("vae", "quant_conv", prefix + "quant_conv")
    if config.get("use_post_quant_conv", True):
        out += _wb("vae", "post_quant_conv", prefix + "post_quant_conv")
    return out


# --------------------------------------------------------------------------------------------------
# Text encoders

def has_projection(config: Mapping[str, Any]) -> bool:
    """Whether a transformers CLIP text config is a CLIPTextModelWithProjection (by `architectures`)."""
    return "CLIPTextModelWithProjection" in (config.get("architectures") or [])


_CLIP_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
               "layer_norm1", "layer_norm2", "mlp.fc1", "mlp.fc2")


def clip_entries(component: str, config: Mapping[str, Any], prefix: str) -> list[Entry]:
    """OpenAI CLIP in transformers' layout under `prefix` (the keys only gain the prefix)."""
    e = lambda n, **kw: _wb(component, n, prefix + n, **kw)  # noqa: E731
    out = e("text_model.embeddings.token_embedding", bias=False)
    out += e("text_model.embeddings.position_embedding", bias=False)
    for i in range(config["num_hidden_layers"]):
        for n in _CLIP_LAYER:
            out += e(f"text_model.encoder.layers.{i}.{n}")
    out += e("text_model.final_layer_norm")
    if has_projection(config):
        out += e("text_projection", bias=False)
    return out


def open_clip_entries(component: str, config: Mapping[str, Any], prefix: str) -> list[Entry]:
    """OpenCLIP's text tower under `prefix`, mapped onto transformers' CLIPTextModel(WithProjection)."""
    out = [
        Entry(component, ("text_model.embeddings.token_embedding.weight",), prefix + "token_embedding.weight"),
        Entry(component, ("text_model.embeddings.position_embedding.weight",), prefix + "positional_embedding"),
    ]
    out += _wb(component, "text_model.final_layer_norm", prefix + "ln_final")
    for i in range(config["num_hidden_layers"]):
        d, o = f"text_model.encoder.layers.{i}", f"{prefix}transformer.resblocks.{i}"
        out += _wb(component, f"{d}.layer_norm1", f"{o}.ln_1") + _wb(component, f"{d}.layer_norm2", f"{o}.ln_2")
        out += _wb(component, f"{d}.self_attn.out_proj", f"{o}.attn.out_proj")
        out += _wb(component, f"{d}.mlp.fc1", f"{o}.mlp.c_fc") + _wb(component, f"{d}.mlp.fc2", f"{o}.mlp.c_proj")
        for p, name in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")):
            keys = tuple(f"{d}.self_attn.{x}_proj.{p}" for x in "qkv")
            out.append(Entry(component, keys, f"{o}.attn.{name}", QKV))
    if has_projection(config):
        out.append(Entry(component, ("text_projection.weight",), prefix + "text_projection", TRANSPOSE))
    return out


# --------------------------------------------------------------------------------------------------
# Layouts: which text encoder sits where, and what a file may carry besides the model

# Tensors a single file may hold that are not part of the model, ignored by name (regex, full match).
COMMON_IGNORED = (
    r"model_ema\..*",  # the EMA copy of the UNet (flattened names) and its decay / num_updates
    r"(betas|alphas_cumprod|alphas_cumprod_prev|sqrt_alphas_cumprod|sqrt_one_minus_alphas_cumprod"
    r"|log_one_minus_alphas_cumprod|sqrt_recip_alphas_cumprod|sqrt_recipm1_alphas_cumprod|posterior_variance"
    r"|posterior_log_variance_clipped|posterior_mean_coef1|posterior_mean_coef2|logvar|lvlb_weights)",  # DDPM buffers
    r"denoiser\.(sigmas|log_sigmas)",  # SGM's discretisation buffers
    r"(first_stage_model\.)?loss\..*",  # the VAE's training loss (LPIPS, discriminator)
    r".*\.position_ids",  # transformers' position-id buffer
    # OpenCLIP's contrastive temperature and causal-mask buffer
    r"(cond_stage_model|conditioner\.embedders\.\d)\.model\.(logit_scale|attn_mask)",
)

# Older spellings some files use, renamed on reading (and written in the current form): SD 1.x files
# saved from transformers' CLIPTextModel before its `text_model` wrapper (A1111 renames the same).
KEY_ALIASES = {
    f"cond_stage_model.transformer.{part}.": f"cond_stage_model.transformer.text_model.{part}."
    for part in ("embeddings", "encoder", "final_layer_norm")
}

# layout -> text encoder component -> (style, key prefix)
LAYOUTS: dict[str, dict[str, tuple[str, str]]] = {
    "sd1": {"text_encoder": ("clip", "cond_stage_model.transformer.")},
    "sd2": {"text_encoder": ("open_clip", "cond_stage_model.model.")},
    "sdxl": {"text_encoder": ("clip", "conditioner.embedders.0.transformer."),
             "text_encoder_2": ("open_clip", "conditioner.embedders.1.model.")},
    "sdxl_refiner": {"text_encoder_2": ("open_clip", "conditioner.embedders.0.model.")},
}


def layout_ignored(layout: str, configs: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...]:
    """Ignore patterns of `layout`: the common ones, plus SD 2.x's unused OpenCLIP parts.

    SD 2.x conditions on the penultimate layer of its 24-layer OpenCLIP-H, so diffusers keeps 23
    layers and no projection: the file's later layers and its text_projection are ignored.
    """
    out = list(COMMON_IGNORED)
    if layout == "sd2":
        prefix = re.escape(LAYOUTS["sd2"]["text_encoder"][1])
        kept = configs["text_encoder"]["num_hidden_layers"]
        out.append(prefix + r"text_projection")
        out.append(prefix + rf"transformer\.resblocks\.(?!(?:{'|'.join(map(str, range(kept)))})\.)\d+\..*")
    return tuple(out)


def pipeline_entries(layout: str, configs: Mapping[str, Mapping[str, Any]], components: Iterable[str]) -> list[Entry]:
    """The whole table for `layout`, over the `components` present (a subset of unet/vae/text encoders)."""
    components = set(components)
    out: list[Entry] = []
    if "unet" in components:
        out += unet_entries(configs["unet"])
    if "vae" in components:
        out += vae_entries(configs["vae"])
    for name, (style, prefix) in LAYOUTS[layout].items():
        if name in components:
            make = clip_entries if style == "clip" else open_clip_entries
            out += make(name, configs[name], prefix)
    return out
