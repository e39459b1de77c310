"""Named pipelines as diffusers sees them: the config.json of every component, plus model_index facts.

A preset is what a diffusers-layout repo says about its architecture, written out so that nothing
has to be downloaded to understand a single-file checkpoint (`convert.single_file`) or to build a
demo model: `unet`, `vae`, `text_encoder`[, `text_encoder_2`] and `scheduler` config dicts in
diffusers'/transformers' own format (the model configs in `sdx.unet`, `sdx.vae`, `sdx.clip` read them
with `from_diffusers_config`), the pipeline class, the non-component entries of model_index.json
(`force_zeros_for_empty_prompt`, `requires_aesthetics_score`, ...) and the tokenizer settings that
differ between repos (the pad token: OpenAI's CLIP tokenizers pad with <|endoftext|>, the OpenCLIP
ones of SD 2.x and SDXL's second encoder with "!").

The values are those of the hub repos' config.json files as published (written from the files'
contents as known to the sdx authors, cross-checked against copies quoted in public code, since the
hub is not reachable from the build machines); bookkeeping fields (`_diffusers_version`,
`_name_or_path`, `torch_dtype`, `transformers_version`) are left out. `sdxl_pix2pix` is SDXL base with
an 8-channel `conv_in`, which is what diffusers' `train_instruct_pix2pix_sdxl.py` produced for
diffusers/sdxl-instructpix2pix-768.

`tiny` / `tiny_xl` are small random-weight architectures for demos and smoke tests (SD 1.x-like and
SDXL-like), using the real CLIP vocabulary so that the real tokenizers fit them. Their UNets have one
resnet per level going down (two going up): the test suite compiles them hundreds of times, and a
training step's compile grows with the depth (tests/mesh_train_child.py's run: 112 s with two, 78 s with
one). The parity tests of `tests/test_unet.py` keep UNets of two layers per level.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from sdx.errors import SdxError


@dataclasses.dataclass(frozen=True)
class Preset:
    """name: the preset's name. source: the hub repo the configs describe (None for the tiny ones).
    pipeline_class: model_index.json's `_class_name`.
    configs: component -> config.json dict ("unet", "vae", "text_encoder"[, "text_encoder_2"], "scheduler").
    extra: model_index.json entries that are not components.
    tokenizers: tokenizer component ("tokenizer", "tokenizer_2") -> tokenizer_config facts.
    """

    name: str
    source: str | None
    pipeline_class: str
    configs: dict[str, dict[str, Any]]
    extra: dict[str, Any]
    tokenizers: dict[str, dict[str, Any]]

    @property
    def text_encoders(self) -> tuple[str, ...]:
        return tuple(c for c in ("text_encoder", "text_encoder_2") if c in self.configs)


# --------------------------------------------------------------------------------------------------
# Building blocks shared by several repos

_SCALED_LINEAR = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "num_train_timesteps": 1000,
    "trained_betas": None,
}


def _unet(**fields) -> dict[str, Any]:
    """A UNet2DConditionModel config: the fields every SD/SDXL repo states, then the repo's own."""
    base = {
        "_class_name": "UNet2DConditionModel",
        "act_fn": "silu",
        "center_input_sample": False,
        "downsample_padding": 1,
        "flip_sin_to_cos": True,
        "freq_shift": 0,
        "in_channels": 4,
        "layers_per_block": 2,
        "mid_block_scale_factor": 1,
        "norm_eps": 1e-05,
        "norm_num_groups": 32,
        "out_channels": 4,
    }
    return {**base, **fields}


def _vae(**fields) -> dict[str, Any]:
    levels = len(fields.get("block_out_channels", [128, 256, 512, 512]))
    base = {
        "_class_name": "AutoencoderKL",
        "act_fn": "silu",
        "block_out_channels": [128, 256, 512, 512],
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "in_channels": 3,
        "latent_channels": 4,
        "layers_per_block": 2,
        "norm_num_groups": 32,
        "out_channels": 3,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
    }
    return {**base, **fields}


def _clip_text(architecture: str = "CLIPTextModel", **fields) -> dict[str, Any]:
    """A transformers CLIPTextConfig dict (the released SD repos all say eos_token_id=2, a legacy value
    that makes transformers pool at the argmax token id, i.e. <|endoftext|>)."""
    base = {
        "architectures": [architecture],
        "model_type": "clip_text_model",
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "dropout": 0.0,
        "eos_token_id": 2,
        "initializer_factor": 1.0,
        "initializer_range": 0.02,
        "layer_norm_eps": 1e-05,
        "max_position_embeddings": 77,
        "pad_token_id": 1,
        "vocab_size": 49408,
    }
    return {**base, **fields}


# OpenAI CLIP ViT-L/14's text tower (SD 1.x, SDXL's first encoder).
_CLIP_L = _clip_text(
    hidden_act="quick_gelu", hidden_size=768, intermediate_size=3072, num_attention_heads=12,
    num_hidden_layers=12, projection_dim=768,
)
# OpenCLIP ViT-H/14 as SD 2.x uses it: 24 layers trained, the penultimate one's output used, so
# diffusers keeps 23 layers (plus the final layer norm).
_OPEN_CLIP_H = _clip_text(
    hidden_act="gelu", hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
    num_hidden_layers=23, projection_dim=512,
)
# OpenCLIP ViT-bigG/14 with its text projection (SDXL's second encoder, the refiner's only one).
_OPEN_CLIP_BIG_G = _clip_text(
    "CLIPTextModelWithProjection", hidden_act="gelu", hidden_size=1280, intermediate_size=5120,
    num_attention_heads=20, num_hidden_layers=32, projection_dim=1280,
)

_OPENAI_TOKENIZER = {"pad_token": "<|endoftext|>", "model_max_length": 77, "do_lower_case": True}
_OPEN_CLIP_TOKENIZER = {"pad_token": "!", "model_max_length": 77, "do_lower_case": True}

_SD1_UNET = _unet(
    attention_head_dim=8,
    block_out_channels=[320, 640, 1280, 1280],
    cross_attention_dim=768,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    sample_size=64,
)

_SD2_UNET = _unet(
    attention_head_dim=[5, 10, 20, 20],
    block_out_channels=[320, 640, 1280, 1280],
    cross_attention_dim=1024,
    down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
    dual_cross_attention=False,
    num_class_embeds=None,
    only_cross_attention=False,
    use_linear_projection=True,
)

_SDXL_UNET = _unet(
    addition_embed_type="text_time",
    addition_embed_type_num_heads=64,
    addition_time_embed_dim=256,
    attention_head_dim=[5, 10, 20],
    block_out_channels=[320, 640, 1280],
    class_embed_type=None,
    class_embeddings_concat=False,
    conv_in_kernel=3,
    conv_out_kernel=3,
    cross_attention_dim=2048,
    cross_attention_norm=None,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    dual_cross_attention=False,
    encoder_hid_dim=None,
    encoder_hid_dim_type=None,
    mid_block_only_cross_attention=None,
    mid_block_type="UNetMidBlock2DCrossAttn",
    num_attention_heads=None,
    num_class_embeds=None,
    only_cross_attention=False,
    projection_class_embeddings_input_dim=2816,  # 1280 pooled text + 6 time ids x 256
    resnet_out_scale_factor=1.0,
    resnet_skip_time_act=False,
    resnet_time_scale_shift="default",
    sample_size=128,
    time_cond_proj_dim=None,
    time_embedding_act_fn=None,
    time_embedding_dim=None,
    time_embedding_type="positional",
    timestep_post_act=None,
    transformer_layers_per_block=[1, 2, 10],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    upcast_attention=None,
    use_linear_projection=True,
)

# SGM's sd_xl_refiner.yaml: model_channels 384, channel_mult 1,2,4,4, num_head_channels 64 (hence 6/12/24/24
# heads), attention at the middle two levels, transformer_depth 4, context 1280 (OpenCLIP-bigG alone).
_SDXL_REFINER_UNET = {
    **_SDXL_UNET,
    "attention_head_dim": [6, 12, 24, 24],
    "block_out_channels": [384, 768, 1536, 1536],
    "cross_attention_dim": 1280,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "projection_class_embeddings_input_dim": 2560,  # 1280 pooled text + 5 ids (size, crop, aesthetic score) x 256
    "transformer_layers_per_block": 4,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
}

_SDXL_VAE = _vae(force_upcast=True, sample_size=1024, scaling_factor=0.13025)

_SDXL_SCHEDULER = {
    "_class_name": "EulerDiscreteScheduler",
    **_SCALED_LINEAR,
    "clip_sample": False,
    "interpolation_type": "linear",
    "prediction_type": "epsilon",
    "sample_max_value": 1.0,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "use_karras_sigmas": False,
}

_PNDM = {
    "_class_name": "PNDMScheduler",
    **_SCALED_LINEAR,
    "clip_sample": False,
    "set_alpha_to_one": False,
    "skip_prk_steps": True,
    "steps_offset": 1,
}


def _tiny_text(architecture: str = "CLIPTextModel", **fields) -> dict[str, Any]:
    return _clip_text(
        architecture, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2,
        projection_dim=32, **fields,
    )


_TINY_VAE = _vae(block_out_channels=[32, 64], layers_per_block=1, sample_size=128)

# --------------------------------------------------------------------------------------------------
# The presets

_PRESETS: dict[str, Preset] = {}


def _add(name: str, source: str | None, pipeline_class: str, configs: dict, extra=None, tokenizers=None):
    _PRESETS[name] = Preset(name, source, pipeline_class, configs, dict(extra or {}), dict(tokenizers or {}))


_add(
    "sdxl_base", "stabilityai/stable-diffusion-xl-base-1.0", "StableDiffusionXLPipeline",
    {"unet": _SDXL_UNET, "vae": _SDXL_VAE, "text_encoder": _CLIP_L, "text_encoder_2": _OPEN_CLIP_BIG_G,
     "scheduler": _SDXL_SCHEDULER},
    extra={"force_zeros_for_empty_prompt": True},
    tokenizers={"tokenizer": _OPENAI_TOKENIZER, "tokenizer_2": _OPEN_CLIP_TOKENIZER},
)
_add(
    "sdxl_refiner", "stabilityai/stable-diffusion-xl-refiner-1.0", "StableDiffusionXLImg2ImgPipeline",
    {"unet": _SDXL_REFINER_UNET, "vae": _SDXL_VAE, "text_encoder_2": _OPEN_CLIP_BIG_G,
     "scheduler": _SDXL_SCHEDULER},
    extra={"force_zeros_for_empty_prompt": False, "requires_aesthetics_score": True},
    tokenizers={"tokenizer_2": _OPEN_CLIP_TOKENIZER},
)
_add(
    "sd15", "runwayml/stable-diffusion-v1-5", "StableDiffusionPipeline",
    {"unet": _SD1_UNET, "vae": _vae(sample_size=512), "text_encoder": _CLIP_L, "scheduler": _PNDM},
    tokenizers={"tokenizer": _OPENAI_TOKENIZER},
)
_add(
    "sd21", "stabilityai/stable-diffusion-2-1-base", "StableDiffusionPipeline",
    {"unet": {**_SD2_UNET, "sample_size": 64, "upcast_attention": False}, "vae": _vae(sample_size=512),
     "text_encoder": _OPEN_CLIP_H, "scheduler": {**_PNDM, "prediction_type": "epsilon"}},
    extra={"requires_safety_checker": False},
    tokenizers={"tokenizer": _OPEN_CLIP_TOKENIZER},
)
_add(
    "sd21_v", "stabilityai/stable-diffusion-2-1", "StableDiffusionPipeline",
    {"unet": {**_SD2_UNET, "sample_size": 96, "upcast_attention": True}, "vae": _vae(sample_size=768),
     "text_encoder": _OPEN_CLIP_H,
     "scheduler": {"_class_name": "DDIMScheduler", **_SCALED_LINEAR, "clip_sample": False,
                   "prediction_type": "v_prediction", "set_alpha_to_one": False, "skip_prk_steps": True,
                   "steps_offset": 1}},
    extra={"requires_safety_checker": False},
    tokenizers={"tokenizer": _OPEN_CLIP_TOKENIZER},
)
_add(
    "pix2pix", "timbrooks/instruct-pix2pix", "StableDiffusionInstructPix2PixPipeline",
    {"unet": {**_SD1_UNET, "in_channels": 8}, "vae": _vae(sample_size=512), "text_encoder": _CLIP_L,
     "scheduler": {"_class_name": "EulerAncestralDiscreteScheduler", **_SCALED_LINEAR, "clip_sample": False,
                   "prediction_type": "epsilon", "set_alpha_to_one": False, "skip_prk_steps": True,
                   "steps_offset": 1}},
    tokenizers={"tokenizer": _OPENAI_TOKENIZER},
)
_add(
    "sdxl_pix2pix", "diffusers/sdxl-instructpix2pix-768", "StableDiffusionXLInstructPix2PixPipeline",
    {"unet": {**_SDXL_UNET, "in_channels": 8}, "vae": _SDXL_VAE, "text_encoder": _CLIP_L,
     "text_encoder_2": _OPEN_CLIP_BIG_G, "scheduler": _SDXL_SCHEDULER},
    extra={"force_zeros_for_empty_prompt": True},
    tokenizers={"tokenizer": _OPENAI_TOKENIZER, "tokenizer_2": _OPEN_CLIP_TOKENIZER},
)
# Inpainting: the base architectures with a 9-channel conv_in (noisy latents, the mask, the masked
# image's latents), as runwayml/stable-diffusion-inpainting, stabilityai/stable-diffusion-2-inpainting and
# diffusers/stable-diffusion-xl-1.0-inpainting-0.1 publish them.
_add(
    "sd15_inpaint", "runwayml/stable-diffusion-inpainting", "StableDiffusionInpaintPipeline",
    {"unet": {**_SD1_UNET, "in_channels": 9}, "vae": _vae(sample_size=512), "text_encoder": _CLIP_L,
     "scheduler": _PNDM},
    tokenizers={"tokenizer": _OPENAI_TOKENIZER},
)
_add(
    "sd2_inpaint", "stabilityai/stable-diffusion-2-inpainting", "StableDiffusionInpaintPipeline",
    {"unet": {**_SD2_UNET, "in_channels": 9, "sample_size": 64, "upcast_attention": False},
     "vae": _vae(sample_size=512), "text_encoder": _OPEN_CLIP_H, "scheduler": {**_PNDM, "prediction_type": "epsilon"}},
    extra={"requires_safety_checker": False},
    tokenizers={"tokenizer": _OPEN_CLIP_TOKENIZER},
)
_add(
    "sdxl_inpaint", "diffusers/stable-diffusion-xl-1.0-inpainting-0.1", "StableDiffusionXLInpaintPipeline",
    {"unet": {**_SDXL_UNET, "in_channels": 9}, "vae": _SDXL_VAE, "text_encoder": _CLIP_L,
     "text_encoder_2": _OPEN_CLIP_BIG_G, "scheduler": _SDXL_SCHEDULER},
    extra={"force_zeros_for_empty_prompt": True, "requires_aesthetics_score": False},
    tokenizers={"tokenizer": _OPENAI_TOKENIZER, "tokenizer_2": _OPEN_CLIP_TOKENIZER},
)
_add(
    "tiny", None, "StableDiffusionPipeline",
    {"unet": _unet(
        attention_head_dim=8, block_out_channels=[32, 64], cross_attention_dim=32, layers_per_block=1,
        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
        sample_size=32),
     "vae": _TINY_VAE, "text_encoder": _tiny_text(hidden_act="quick_gelu"),
     "scheduler": {**_SDXL_SCHEDULER}},
    tokenizers={"tokenizer": _OPENAI_TOKENIZER},
)
_add(
    "tiny_xl", None, "StableDiffusionXLPipeline",
    # the two text encoders differ in width, as CLIP-L and bigG do (diffusers tells them apart by it)
    {"unet": {**_SDXL_UNET, "attention_head_dim": [2, 4], "block_out_channels": [32, 64], "layers_per_block": 1,
              "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 64 + 6 * 8,
              "cross_attention_dim": 32 + 64, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
              "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "transformer_layers_per_block": [1, 2],
              "sample_size": 32},
     "vae": {**_TINY_VAE, "scaling_factor": 0.13025, "force_upcast": True},
     "text_encoder": _tiny_text(hidden_act="quick_gelu"),
     "text_encoder_2": {**_tiny_text("CLIPTextModelWithProjection", hidden_act="gelu"), "hidden_size": 64,
                        "intermediate_size": 128, "projection_dim": 64},
     "scheduler": {**_SDXL_SCHEDULER}},
    extra={"force_zeros_for_empty_prompt": True},
    tokenizers={"tokenizer": _OPENAI_TOKENIZER, "tokenizer_2": _OPEN_CLIP_TOKENIZER},
)

# The architecture of the shipped default models (`--model default`, `default-edit`), trained by sdx on
# its shapes world at 64x64 (train/recipe.sh): SDXL's structure (two text encoders, clip skip, pooled
# embedding, time ids) at a small width, a 3-level VAE (64x64 -> 16x16x4). A zero terminal SNR schedule
# with v-prediction and trailing timesteps (Lin et al. 2023): with SDXL's schedule the last training step
# still shows the picture's mean colour, so a model trained on flat backgrounds learns to read the
# background from the noise instead of the prompt, and draws a random one from pure noise. The VAE's
# scaling_factor is measured when it is trained. Its GroupNorms have 8 groups, not diffusers' 32: with 32 over
# 32 channels every channel is normalised alone, so a flat region's value (the colour) is lost at each norm and
# the decoder must smuggle it through edges; measured over its first 1,000 steps (batch 16, lr 1e-3) the mean
# error per pixel fell to 0.032 with 8 groups, 0.072 with 32 (docs/default-models.md).
_add(
    "shapes", None, "StableDiffusionXLPipeline",
    {"unet": {**_SDXL_UNET, "attention_head_dim": [2, 4], "block_out_channels": [64, 96],
              "addition_time_embed_dim": 8, "projection_class_embeddings_input_dim": 32 + 6 * 8,
              "cross_attention_dim": 16 + 32, "down_block_types": ["CrossAttnDownBlock2D"] * 2,
              "up_block_types": ["CrossAttnUpBlock2D"] * 2, "transformer_layers_per_block": [1, 1],
              "sample_size": 16},
     "vae": _vae(block_out_channels=[32, 64, 64], layers_per_block=1, norm_num_groups=8, sample_size=64,
                 force_upcast=False),
     "text_encoder": {**_tiny_text(hidden_act="quick_gelu"), "hidden_size": 16, "intermediate_size": 32,
                      "num_attention_heads": 2, "projection_dim": 16},
     "text_encoder_2": {**_tiny_text("CLIPTextModelWithProjection", hidden_act="gelu")},
     "scheduler": {**_SDXL_SCHEDULER, "timestep_spacing": "trailing", "rescale_betas_zero_snr": True,
                   "prediction_type": "v_prediction"}},
    extra={"force_zeros_for_empty_prompt": True},
    tokenizers={"tokenizer": _OPENAI_TOKENIZER, "tokenizer_2": _OPEN_CLIP_TOKENIZER},
)

NAMES: tuple[str, ...] = tuple(_PRESETS)


def get(name: str) -> Preset:
    """The preset `name`, as a fresh deep copy (callers may edit its dicts)."""
    if name not in _PRESETS:
        raise SdxError(f"unknown preset {name!r}; choose one of {', '.join(NAMES)}")
    return copy.deepcopy(_PRESETS[name])
