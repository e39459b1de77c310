"""diffusers' and transformers' `config.json` <-> the fields of sdx's architecture configs.

The UNet (`sdx.unet.UNetConfig`), the ControlNets (`sdx.controlnet.ControlNetConfig`,
`sdx.controlnet_union.ControlNetUnionConfig`), the VAE
(`sdx.vae.VAEConfig`) and the CLIP text encoders (`sdx.clip.TextEncoderConfig`) read and write the
hub's config files through this one module, under one policy for every key of such a file:

- honoured: it becomes a field of the sdx config (missing keys take the library's own default);
- fixed: sdx implements one value (or a few); any other value is an SdxError naming the key;
- inert: it changes nothing sdx computes (training-time dropout, initialiser scales, options of block
  types sdx refuses anyway) and is ignored;
- bookkeeping: what the libraries write about the file itself, ignored: keys starting with `_`
  (diffusers' ConfigMixin drops them before building a model; transformers' are names, hashes and the
  attention implementation) and, in transformers' files, `PretrainedConfig`'s generic keys (versions,
  dtypes, generation defaults);
- anything else is an SdxError naming it. An unknown key may be a newer library's way of changing
  the math, and a silently ignored one gives wrong pictures with no error anywhere.

The functions take and give plain dicts (JSON values), so this module needs none of the model code;
the config classes call it from `from_diffusers_config` / `to_diffusers_config`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from sdx.config import (
    COUNT,
    COUNT_LIST,
    COUNTS,
    DEPTH,
    DEPTHS,
    FLAG,
    FLAGS,
    NAME,
    NAMES,
    NATURAL,
    NUMBER,
    POSITIVE,
    Kind,
    check_types,
    is_list,
    list_of,
    optional,
    plain,
)
from sdx.errors import SdxError

UNET, VAE, TEXT_ENCODER = "unet config", "VAE config", "text encoder config"  # the labels in error messages


def _private(key: str) -> bool:
    """diffusers' ConfigMixin drops keys starting with `_` before building a model (`_class_name`,
    `_diffusers_version`, `_name_or_path`, ...); transformers' are names, hashes and the attention
    implementation. None reaches the math."""
    return key.startswith("_")


def check_known(label: str, d: Mapping[str, Any], known: Collection[str]) -> None:
    """Every key of `d` is `_`-private or known (honoured, fixed, inert, the library's bookkeeping);
    else an error naming the unknown ones."""
    unknown = sorted(k for k in d if k not in known and not _private(k))
    if unknown:
        raise SdxError(
            f"{label}: unknown field(s) {', '.join(unknown)}; sdx cannot tell whether they change the model "
            "(written by a newer library?), so it refuses rather than guess"
        )


def check_fixed(label: str, values: Mapping[str, Any], fixed: Mapping[str, tuple[Any, ...]]) -> None:
    """Each key of `fixed` holds one of the values sdx implements; else an error naming key and value."""
    for name, allowed in fixed.items():
        if values[name] not in allowed:
            raise SdxError(
                f"{label}: {name}={values[name]!r} is not implemented in sdx "
                f"(supported: {', '.join(repr(a) for a in allowed)})"
            )


# --------------------------------------------------------------------------------------------------
# UNet2DConditionModel (diffusers)

_CROSS_DOWN, _DOWN = "CrossAttnDownBlock2D", "DownBlock2D"
_CROSS_UP, _UP = "CrossAttnUpBlock2D", "UpBlock2D"

# diffusers 0.42 UNet2DConditionModel.__init__ defaults (tests check this table against diffusers).
UNET_DEFAULTS: dict[str, Any] = {
    "sample_size": None,
    "in_channels": 4,
    "out_channels": 4,
    "center_input_sample": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "down_block_types": (_CROSS_DOWN, _CROSS_DOWN, _CROSS_DOWN, _DOWN),
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "up_block_types": (_UP, _CROSS_UP, _CROSS_UP, _CROSS_UP),
    "only_cross_attention": False,
    "block_out_channels": (320, 640, 1280, 1280),
    "layers_per_block": 2,
    "downsample_padding": 1,
    "mid_block_scale_factor": 1,
    "dropout": 0.0,
    "act_fn": "silu",
    "norm_num_groups": 32,
    "norm_eps": 1e-05,
    "cross_attention_dim": 1280,
    "transformer_layers_per_block": 1,
    "reverse_transformer_layers_per_block": None,
    "encoder_hid_dim": None,
    "encoder_hid_dim_type": None,
    "attention_head_dim": 8,
    "num_attention_heads": None,
    "dual_cross_attention": False,
    "use_linear_projection": False,
    "class_embed_type": None,
    "addition_embed_type": None,
    "addition_time_embed_dim": None,
    "num_class_embeds": None,
    "upcast_attention": False,
    "resnet_time_scale_shift": "default",
    "resnet_skip_time_act": False,
    "resnet_out_scale_factor": 1.0,
    "time_embedding_type": "positional",
    "time_embedding_dim": None,
    "time_embedding_act_fn": None,
    "timestep_post_act": None,
    "time_cond_proj_dim": None,
    "conv_in_kernel": 3,
    "conv_out_kernel": 3,
    "projection_class_embeddings_input_dim": None,
    "attention_type": "default",
    "class_embeddings_concat": False,
    "mid_block_only_cross_attention": None,
    "cross_attention_norm": None,
    "addition_embed_type_num_heads": 64,
}

# Inert: they only configure block types sdx refuses anyway (ResnetDownsampleBlock2D,
# SimpleCrossAttn*, the "text" added embedding).
UNET_INERT = (
    "resnet_skip_time_act",
    "resnet_out_scale_factor",
    "cross_attention_norm",
    "mid_block_only_cross_attention",
    "addition_embed_type_num_heads",
)

UNET_FIXED: dict[str, tuple[Any, ...]] = {
    "act_fn": ("silu", "swish"),
    "dropout": (0, 0.0),
    "resnet_time_scale_shift": ("default",),
    "time_embedding_type": ("positional",),
    "time_embedding_act_fn": (None,),
    "timestep_post_act": (None,),
    "class_embed_type": (None,),
    "num_class_embeds": (None,),
    "class_embeddings_concat": (False,),
    "encoder_hid_dim": (None,),
    "encoder_hid_dim_type": (None,),
    "attention_type": ("default",),
    "dual_cross_attention": (False,),
    # diffusers itself refuses it: its `attention_head_dim` is the head count (diffusers issue 2011),
    # which sdx calls num_attention_heads.
    "num_attention_heads": (None,),
}


_LAYER_COUNTS: Kind = (f"{DEPTHS[0]} (one per level, or a list per level)",
                      lambda v: DEPTH[1](v) or is_list(v, DEPTHS[1]))
UNET_KINDS: dict[str, Kind] = {
    "in_channels": COUNT, "out_channels": COUNT, "block_out_channels": COUNT_LIST,
    "down_block_types": NAMES, "up_block_types": NAMES, "mid_block_type": optional(NAME),
    "layers_per_block": DEPTHS, "transformer_layers_per_block": _LAYER_COUNTS,
    "reverse_transformer_layers_per_block": optional(_LAYER_COUNTS), "attention_head_dim": COUNTS,
    "cross_attention_dim": COUNTS, "only_cross_attention": FLAGS, "use_linear_projection": optional(FLAG),
    "upcast_attention": optional(FLAG), "norm_num_groups": COUNT, "norm_eps": POSITIVE,
    "downsample_padding": NATURAL, "mid_block_scale_factor": NUMBER, "center_input_sample": FLAG,
    "conv_in_kernel": COUNT, "conv_out_kernel": COUNT, "flip_sin_to_cos": FLAG, "freq_shift": NUMBER,
    "time_embedding_dim": optional(COUNT), "time_cond_proj_dim": optional(COUNT), "addition_embed_type": optional(NAME),
    "addition_time_embed_dim": optional(COUNT), "projection_class_embeddings_input_dim": optional(COUNT),
    "sample_size": optional(COUNTS),
}


def _per_level(name: str, value, n: int, kind, label: str = UNET) -> tuple:
    """diffusers' `int or list` fields as an n-tuple; a list of the wrong length names the field."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise SdxError(f"{label}: {name} has {len(value)} entries but there are {n} levels (block_out_channels)")
        return tuple(kind(v) for v in value)
    return (kind(value),) * n


def _layer_counts(value) -> int | tuple[int, ...]:
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _strip_alias(block_type):
    """diffusers accepts `UNetRes` + a block type name as the block type itself."""
    return block_type[7:] if isinstance(block_type, str) and block_type.startswith("UNetRes") else block_type


def unet_fields(d: Mapping[str, Any], label: str = UNET) -> dict[str, Any]:
    """`UNetConfig` keyword arguments from a diffusers `unet/config.json` dict; `label` names the file in
    errors (a ControlNet's config passes its UNet fields through here)."""
    class_name = d.get("_class_name")
    if class_name not in (None, "UNet2DConditionModel", "FlaxUNet2DConditionModel"):
        raise SdxError(f"{label}: _class_name {class_name!r} is not a UNet2DConditionModel")
    check_known(label, d, UNET_DEFAULTS)
    f = {**UNET_DEFAULTS, **{k: v for k, v in d.items() if not _private(k)}}
    check_fixed(label, f, UNET_FIXED)
    if f["norm_num_groups"] is None:
        raise SdxError(f"{label}: norm_num_groups=None (no output norm) is not implemented in sdx")
    heads = f["attention_head_dim"]
    if heads is None or (isinstance(heads, (list, tuple)) and any(h is None for h in heads)):
        raise SdxError(f"{label}: attention_head_dim=None is not implemented (heads must be given per level)")
    check_types(label, f, UNET_KINDS)
    boc = tuple(f["block_out_channels"])
    n = len(boc)
    tlpb = f["transformer_layers_per_block"]
    if isinstance(tlpb, (list, tuple)):
        tlpb = tuple(_layer_counts(v) for v in tlpb)
    else:
        tlpb = (int(tlpb),) * n
    if len(tlpb) != n:
        raise SdxError(f"{label}: transformer_layers_per_block has {len(tlpb)} entries but there are {n} levels")
    rev = f["reverse_transformer_layers_per_block"]
    if rev is not None:
        rev = tuple(_layer_counts(v) for v in rev)
    sample_size = f["sample_size"]
    return dict(
        in_channels=int(f["in_channels"]),
        out_channels=int(f["out_channels"]),
        block_out_channels=boc,
        down_block_types=tuple(_strip_alias(t) for t in f["down_block_types"]),
        up_block_types=tuple(_strip_alias(t) for t in f["up_block_types"]),
        mid_block_type=f["mid_block_type"],
        layers_per_block=_per_level("layers_per_block", f["layers_per_block"], n, int, label),
        transformer_layers_per_block=tlpb,
        reverse_transformer_layers_per_block=rev,
        num_attention_heads=_per_level("attention_head_dim", heads, n, int, label),
        cross_attention_dim=_per_level("cross_attention_dim", f["cross_attention_dim"], n, int, label),
        only_cross_attention=_per_level("only_cross_attention", f["only_cross_attention"], n, bool, label),
        use_linear_projection=bool(f["use_linear_projection"]),
        upcast_attention=bool(f["upcast_attention"]),
        norm_num_groups=int(f["norm_num_groups"]),
        norm_eps=float(f["norm_eps"]),
        downsample_padding=int(f["downsample_padding"]),
        mid_block_scale_factor=float(f["mid_block_scale_factor"]),
        center_input_sample=bool(f["center_input_sample"]),
        conv_in_kernel=int(f["conv_in_kernel"]),
        conv_out_kernel=int(f["conv_out_kernel"]),
        flip_sin_to_cos=bool(f["flip_sin_to_cos"]),
        freq_shift=f["freq_shift"],
        time_embedding_dim=f["time_embedding_dim"],
        time_cond_proj_dim=f["time_cond_proj_dim"],
        addition_embed_type=f["addition_embed_type"],
        addition_time_embed_dim=f["addition_time_embed_dim"],
        projection_class_embeddings_input_dim=f["projection_class_embeddings_input_dim"],
        sample_size=tuple(sample_size) if isinstance(sample_size, (list, tuple)) else sample_size,
    )


def unet_to_diffusers(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A complete diffusers `unet/config.json` dict from `UNetConfig.to_dict()` (`UNet2DConditionModel(**d)`
    accepts it without the `_` keys)."""
    ours = {k: v for k, v in fields.items() if k != "num_attention_heads"}
    d = {**UNET_DEFAULTS, **ours, "attention_head_dim": fields["num_attention_heads"]}
    return {"_class_name": "UNet2DConditionModel", **_plain_dict(d)}


# --------------------------------------------------------------------------------------------------
# ControlNetModel (diffusers)
#
# A ControlNet is the encoder half of the UNet it steers (diffusers' `ControlNetModel.from_unet` copies
# conv_in, the embeddings, the down blocks and the mid block) plus an embedding of the conditioning image.
# Its config.json holds that half's UNet fields, read by `unet_fields` under the UNet's rules, and four
# fields of its own.

CONTROLNET = "controlnet config"

# The UNet fields ControlNetModel.__init__ takes; its defaults are UNet2DConditionModel's (diffusers 0.42).
CONTROLNET_UNET_FIELDS = (
    "in_channels", "flip_sin_to_cos", "freq_shift", "down_block_types", "mid_block_type", "only_cross_attention",
    "block_out_channels", "layers_per_block", "downsample_padding", "mid_block_scale_factor", "act_fn",
    "norm_num_groups", "norm_eps", "cross_attention_dim", "transformer_layers_per_block", "encoder_hid_dim",
    "encoder_hid_dim_type", "attention_head_dim", "num_attention_heads", "use_linear_projection",
    "class_embed_type", "addition_embed_type", "addition_time_embed_dim", "num_class_embeds", "upcast_attention",
    "resnet_time_scale_shift", "projection_class_embeddings_input_dim", "addition_embed_type_num_heads",
)
# The ControlNet's own fields, with ControlNetModel.__init__'s defaults.
CONTROLNET_OWN: dict[str, Any] = {
    "conditioning_channels": 3,
    "conditioning_embedding_out_channels": (16, 32, 96, 256),
    "global_pool_conditions": False,
    "controlnet_conditioning_channel_order": "rgb",
}
# diffusers 0.42 ControlNetModel.__init__ defaults (tests check this table against diffusers).
CONTROLNET_DEFAULTS: dict[str, Any] = {**{k: UNET_DEFAULTS[k] for k in CONTROLNET_UNET_FIELDS}, **CONTROLNET_OWN}
CONTROLNET_KINDS: dict[str, Kind] = {
    "conditioning_channels": COUNT, "conditioning_embedding_out_channels": COUNT_LIST,
    "global_pool_conditions": FLAG, "controlnet_conditioning_channel_order": NAME,
    # one value for every level: ControlNetModel.__init__ fails on a list
    "layers_per_block": DEPTH, "cross_attention_dim": COUNT,
    # the head count when given (the UNet refuses it; ControlNetModel takes `num_attention_heads or attention_head_dim`)
    "num_attention_heads": optional(COUNTS),
    # read before `unet_fields` to mirror the up half
    "down_block_types": NAMES, "transformer_layers_per_block": _LAYER_COUNTS,
}
CONTROLNET_FIXED: dict[str, tuple[Any, ...]] = {
    "controlnet_conditioning_channel_order": ("rgb", "bgr"),
    "mid_block_type": ("UNetMidBlock2DCrossAttn", "UNetMidBlock2D"),  # ControlNetModel refuses null
}


def _mirrored_up_half(down_block_types, transformer_layers_per_block) -> dict[str, Any]:
    """The up-block fields of a UNet whose down half is the ControlNet's: its down half mirrored. A
    `UNetConfig` needs an up half to be whole; a ControlNet never builds it."""
    up = [_CROSS_UP if _strip_alias(t) == _CROSS_DOWN else _UP for t in reversed(down_block_types)]
    tlpb = transformer_layers_per_block
    if DEPTH[1](tlpb) or all(DEPTH[1](v) for v in tlpb):
        return {"up_block_types": up}
    # per-resnet counts in a down level: the up half needs its own (one count per level will do)
    return {"up_block_types": up, "reverse_transformer_layers_per_block": [
        v if DEPTH[1](v) else v[0] for v in reversed(tlpb)
    ]}


def controlnet_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """`ControlNetConfig` keyword arguments from a diffusers ControlNetModel `config.json` dict; the UNet
    part is `UNetConfig` keyword arguments under "unet"."""
    class_name = d.get("_class_name")
    if class_name not in (None, "ControlNetModel", "FlaxControlNetModel"):
        raise SdxError(f"{CONTROLNET}: _class_name {class_name!r} is not implemented in sdx (only ControlNetModel)")
    return _encoder_fields(d, CONTROLNET, CONTROLNET_DEFAULTS, CONTROLNET_FIXED)


def _encoder_fields(d: Mapping[str, Any], label: str, defaults: Mapping[str, Any],
                    fixed: Mapping[str, tuple[Any, ...]]) -> dict[str, Any]:
    """The fields a ControlNet and a ControlNet-Union share, from `d` under `defaults` (every key it knows)."""
    check_known(label, d, defaults)
    f = {**defaults, **{k: v for k, v in d.items() if not _private(k)}}
    check_types(label, f, CONTROLNET_KINDS)
    check_fixed(label, f, fixed)
    unet = {k: f[k] for k in CONTROLNET_UNET_FIELDS if k != "num_attention_heads"}
    if f["num_attention_heads"] is not None:
        unet["attention_head_dim"] = f["num_attention_heads"]
    unet.update(_mirrored_up_half(f["down_block_types"], f["transformer_layers_per_block"]))
    return dict(
        unet=unet_fields(unet, label),
        conditioning_channels=int(f["conditioning_channels"]),
        conditioning_embedding_out_channels=tuple(f["conditioning_embedding_out_channels"]),
        global_pool_conditions=bool(f["global_pool_conditions"]),
        controlnet_conditioning_channel_order=f["controlnet_conditioning_channel_order"],
    )


# --------------------------------------------------------------------------------------------------
# ControlNetUnionModel (diffusers)
#
# A ControlNet-Union (xinsir's ControlNet++) is a ControlNet with a condition transformer and a control-type
# embedding: ControlNetModel's fields but mid_block_type (it always builds the cross-attention mid block), a wider
# default image embedding, and five fields of its own. xinsir's released config.json names the class
# "ControlNetModel" and carries num_control_type, so a config with any of the five is read as a union.

CONTROLNET_UNION = "controlnet-union config"
CONTROLNET_UNION_OWN: dict[str, Any] = {
    "num_control_type": 6, "num_trans_channel": 320, "num_trans_head": 8, "num_trans_layer": 1, "num_proj_channel": 320,
}
# diffusers 0.42 ControlNetUnionModel.__init__ defaults (tests check this table against diffusers).
CONTROLNET_UNION_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in CONTROLNET_DEFAULTS.items() if k != "mid_block_type"},
    "conditioning_embedding_out_channels": (48, 96, 192, 384), **CONTROLNET_UNION_OWN,
}
CONTROLNET_UNION_KINDS: dict[str, Kind] = {**{k: COUNT for k in CONTROLNET_UNION_OWN}, "num_trans_layer": DEPTH}
CONTROLNET_UNION_FIXED: dict[str, tuple[Any, ...]] = {
    "controlnet_conditioning_channel_order": ("rgb",),  # its forward refuses "bgr"
    "mid_block_type": ("UNetMidBlock2DCrossAttn",),  # what it builds, whatever a ControlNetModel config.json says
    "addition_embed_type": ("text_time",),  # SDXL's: its control types are embedded with addition_time_embed_dim
}
UNION_CLASSES = ("ControlNetUnionModel", "ControlNetModel")


def is_controlnet_union(d: Mapping[str, Any]) -> bool:
    """Whether a ControlNet `config.json` dict is a ControlNet-Union's: its class, or any of the union's fields."""
    return d.get("_class_name") == UNION_CLASSES[0] or any(k in d for k in CONTROLNET_UNION_OWN)


def controlnet_union_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """`ControlNetUnionConfig` keyword arguments from a diffusers ControlNetUnionModel `config.json` dict (or
    xinsir's, which names ControlNetModel)."""
    class_name = d.get("_class_name")
    if class_name not in (None, *UNION_CLASSES):
        raise SdxError(f"{CONTROLNET_UNION}: _class_name {class_name!r} is not a ControlNetUnionModel")
    defaults = {**CONTROLNET_UNION_DEFAULTS, "mid_block_type": CONTROLNET_UNION_FIXED["mid_block_type"][0]}
    own = {**CONTROLNET_UNION_OWN, **{k: d[k] for k in CONTROLNET_UNION_OWN if k in d}}
    check_types(CONTROLNET_UNION, own, CONTROLNET_UNION_KINDS)
    return {**_encoder_fields(d, CONTROLNET_UNION, defaults, CONTROLNET_UNION_FIXED), **own}


# --------------------------------------------------------------------------------------------------
# AutoencoderKL (diffusers)

# diffusers 0.42 AutoencoderKL.__init__ defaults, used for keys a config.json leaves out.
VAE_DEFAULTS: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ("DownEncoderBlock2D",),
    "up_block_types": ("UpDecoderBlock2D",),
    "block_out_channels": (64,),
    "layers_per_block": 1,
    "act_fn": "silu",
    "latent_channels": 4,
    "norm_num_groups": 32,
    "sample_size": 32,
    "scaling_factor": 0.18215,
    "shift_factor": None,
    "latents_mean": None,
    "latents_std": None,
    "force_upcast": True,
    "use_quant_conv": True,
    "use_post_quant_conv": True,
    "mid_block_add_attention": True,
}
VAE_HONOURED = (
    "in_channels", "out_channels", "block_out_channels", "layers_per_block", "latent_channels", "norm_num_groups",
    "use_quant_conv", "use_post_quant_conv", "mid_block_add_attention", "scaling_factor", "shift_factor",
    "latents_mean", "latents_std", "force_upcast", "sample_size",
)
VAE_FIXED: dict[str, tuple[Any, ...]] = {
    "act_fn": ("silu", "swish"),
}
_VAE_BLOCKS = {"down_block_types": "DownEncoderBlock2D", "up_block_types": "UpDecoderBlock2D"}
VAE_KINDS: dict[str, Kind] = {
    "in_channels": COUNT, "out_channels": COUNT, "down_block_types": NAMES, "up_block_types": NAMES,
    "block_out_channels": COUNT_LIST, "layers_per_block": DEPTH, "latent_channels": COUNT, "norm_num_groups": COUNT,
    "sample_size": optional(COUNTS), "scaling_factor": NUMBER, "shift_factor": optional(NUMBER),
    "latents_mean": optional(list_of(NUMBER)), "latents_std": optional(list_of(NUMBER)),
    "force_upcast": FLAG, "use_quant_conv": FLAG, "use_post_quant_conv": FLAG, "mid_block_add_attention": FLAG,
}


def vae_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """`VAEConfig` keyword arguments from a diffusers `vae/config.json` dict."""
    name = d.get("_class_name", "AutoencoderKL")
    if name != "AutoencoderKL":
        raise SdxError(f"{VAE}: _class_name={name!r} is not implemented; sdx has AutoencoderKL only")
    check_known(VAE, d, VAE_DEFAULTS)
    cfg = {**VAE_DEFAULTS, **{k: v for k, v in d.items() if not _private(k)}}
    check_fixed(VAE, cfg, VAE_FIXED)
    check_types(VAE, cfg, VAE_KINDS)
    levels = len(cfg["block_out_channels"])
    for key, want in _VAE_BLOCKS.items():
        types = list(cfg[key])
        if any(t != want for t in types):
            raise SdxError(f"{VAE}: {key}={types} is not implemented; sdx builds {want} only")
        if len(types) != levels:
            raise SdxError(f"{VAE}: {key} has {len(types)} entries but block_out_channels has {levels}")
    return {k: cfg[k] for k in VAE_HONOURED}


def vae_to_diffusers(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A complete diffusers `vae/config.json` dict from `VAEConfig.to_dict()`; `vae_fields` reads it back."""
    levels = len(fields["block_out_channels"])
    d = {**VAE_DEFAULTS, **fields, **{key: [want] * levels for key, want in _VAE_BLOCKS.items()}}
    return {"_class_name": "AutoencoderKL", **_plain_dict(d)}


# --------------------------------------------------------------------------------------------------
# CLIPTextModel / CLIPTextModelWithProjection (transformers)

# transformers.CLIPTextConfig's __init__ defaults (transformers 5.23), used for absent fields.
TEXT_ENCODER_DEFAULTS: dict[str, Any] = dict(
    vocab_size=49408, hidden_size=512, intermediate_size=2048, projection_dim=512, num_hidden_layers=12,
    num_attention_heads=8, max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
    pad_token_id=1, bos_token_id=49406, eos_token_id=49407,
)
# Training-time only: dropout is off at inference, the initialisers are overwritten by the weights.
TEXT_ENCODER_INERT = ("attention_dropout", "dropout", "initializer_factor", "initializer_range")
TEXT_ENCODER_FIXED: dict[str, tuple[Any, ...]] = {
    "model_type": ("clip_text_model",),
    "pruned_heads": ({},),  # transformers 4's head pruning would remove heads from the weights
}
TEXT_ENCODER_KINDS: dict[str, Kind] = {
    **{k: COUNT for k in ("vocab_size", "hidden_size", "intermediate_size", "projection_dim",
                          "num_attention_heads", "max_position_embeddings")},
    "num_hidden_layers": DEPTH,
    "hidden_act": NAME, "layer_norm_eps": POSITIVE,
    **{k: NATURAL for k in ("pad_token_id", "bos_token_id", "eos_token_id")},
}
# `architectures` decides the projection; absent, transformers' own default class, CLIPTextModel.
TEXT_ENCODER_ARCHITECTURES = {"CLIPTextModel": False, "CLIPTextModelWithProjection": True}

# transformers' PretrainedConfig keys (4.x and 5.x) that every model's config.json may carry: names,
# versions, dtypes, output switches, task heads and generation defaults. None changes what
# CLIPTextModel computes (pruned_heads aside: it is fixed above, and `architectures` is honoured).
TRANSFORMERS_GENERIC = frozenset({
    "transformers_version", "torch_dtype", "dtype", "use_bfloat16", "torchscript", "tf_legacy_loss",
    "return_dict", "output_hidden_states", "output_attentions", "chunk_size_feed_forward",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size",
    "tie_encoder_decoder", "tie_word_embeddings", "finetuning_task", "id2label", "label2id", "num_labels",
    "problem_type", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
    "task_specific_params", "gradient_checkpointing", "use_cache",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})


def text_encoder_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """`TextEncoderConfig` keyword arguments from a transformers `config.json` of CLIPTextModel /
    CLIPTextModelWithProjection (a projection in weights the config does not announce then fails the
    strict loader by name)."""
    archs = d.get("architectures") or ["CLIPTextModel"]
    if not NAMES[1](archs) or len(archs) != 1 or archs[0] not in TEXT_ENCODER_ARCHITECTURES:
        raise SdxError(
            f"{TEXT_ENCODER}: architectures={archs!r} is not supported; sdx reads "
            f"{' or '.join(TEXT_ENCODER_ARCHITECTURES)} (a full CLIPModel config has them under text_config)"
        )
    known = {*TEXT_ENCODER_DEFAULTS, *TEXT_ENCODER_INERT, *TEXT_ENCODER_FIXED, "architectures", *TRANSFORMERS_GENERIC}
    check_known(TEXT_ENCODER, d, known)
    check_fixed(TEXT_ENCODER, {"model_type": "clip_text_model", "pruned_heads": {}, **d}, TEXT_ENCODER_FIXED)
    get = {**TEXT_ENCODER_DEFAULTS, **d}.__getitem__
    check_types(TEXT_ENCODER, {k: get(k) for k in TEXT_ENCODER_KINDS}, TEXT_ENCODER_KINDS)
    return dict(
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")),
        num_hidden_layers=int(get("num_hidden_layers")),
        num_attention_heads=int(get("num_attention_heads")),
        max_position_embeddings=int(get("max_position_embeddings")),
        hidden_act=str(get("hidden_act")),
        layer_norm_eps=float(get("layer_norm_eps")),
        projection_dim=int(get("projection_dim")),
        with_projection=TEXT_ENCODER_ARCHITECTURES[archs[0]],
        eos_token_id=int(get("eos_token_id")),
        bos_token_id=int(get("bos_token_id")),
        pad_token_id=int(get("pad_token_id")),
    )


def text_encoder_to_transformers(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A transformers `config.json` from `TextEncoderConfig.to_dict()`; `text_encoder_fields` reads it back."""
    arch = "CLIPTextModelWithProjection" if fields["with_projection"] else "CLIPTextModel"
    rest = {k: v for k, v in fields.items() if k != "with_projection"}
    return {"architectures": [arch], "model_type": "clip_text_model", **_plain_dict(rest)}


def _plain_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    """JSON values: tuples (nested too) as lists."""
    return {k: plain(v) for k, v in d.items()}
