"""The CLIP vision transformer with its projection: the image encoder IP-Adapter reads.

h94/IP-Adapter ships two, both transformers `CLIPVisionModelWithProjection` folders: models/image_encoder
(OpenCLIP ViT-H/14, for the SD 1.5 adapters and the SDXL `_vit-h` ones) and sdxl_models/image_encoder
(OpenCLIP ViT-bigG/14, for the other SDXL ones). What an adapter reads (diffusers' `encode_image`):
`image_embeds` for the plain adapters, `hidden_states[-2]` (the next-to-last layer's output, no norm
applied) for the "plus" ones.

The math is transformers' `CLIPVisionModelWithProjection` (models/clip/modeling_clip.py): the image cut
into patch_size x patch_size patches by one convolution, a learned class token in front, learned position
embeddings, a layer norm (`pre_layrnorm`, transformers' spelling), the pre-norm layers of `sdx.clip` with
attention that is not causal, then `post_layernorm` of the class token and `visual_projection`.
Attribute names are transformers' key paths, so a checkpoint maps onto the model mechanically
(`load_image_encoder`). Pixels are NHWC, as everywhere in sdx; `image_encoder_inputs` makes them from
pictures the way the image processor diffusers pairs with the encoder does.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from sdx import diffusers_config, io, weights
from sdx.clip import ACTIVATIONS, CLIPEncoder
from sdx.config import COUNT, DEPTH, NAME, POSITIVE, JsonConfig, Kind
from sdx.errors import SdxError
from sdx.layers import F32, Compute, LayerNorm, conv, linear


# Keys of a CLIPVisionConfig that change nothing sdx computes: dropout is off at inference, the initialisers
# are overwritten by the weights, the token ids of transformers 4's generic config name no token an image
# encoder has, and `architectures` is checked by the weights themselves (the strict loader names a missing
# `visual_projection` or a stray `text_model` tensor).
INERT = ("attention_dropout", "dropout", "initializer_factor", "initializer_range", "architectures",
         "bos_token_id", "eos_token_id", "pad_token_id")
FIXED: dict[str, tuple[Any, ...]] = {
    "model_type": ("clip_vision_model",),
    "pruned_heads": ({},),  # transformers 4's head pruning would remove heads from the weights
}


@dataclasses.dataclass(frozen=True)
class VisionEncoderConfig(JsonConfig):
    """Architecture of a CLIP image encoder; field names and defaults are transformers' `CLIPVisionConfig`'s
    (5.23). The image is image_size x image_size pixels of num_channels, cut into (image_size //
    patch_size)² patches; `visual_projection` maps the pooled class token to projection_dim."""

    label: ClassVar[str] = "image encoder config"
    kinds: ClassVar[Mapping[str, Kind]] = {
        **{k: COUNT for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_channels",
                              "image_size", "patch_size", "projection_dim")},
        "num_hidden_layers": DEPTH, "hidden_act": NAME, "layer_norm_eps": POSITIVE,
    }
    causal: ClassVar[bool] = False  # `sdx.clip.CLIPAttention`: every patch attends to every other

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 32
    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    projection_dim: int = 512

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise SdxError(f"{self.label}: hidden_act={self.hidden_act!r} is not implemented; "
                           f"sdx has {', '.join(ACTIVATIONS)}")
        if self.num_channels != 3:
            raise SdxError(f"{self.label}: num_channels={self.num_channels} is not implemented; "
                           "sdx encodes RGB images (3)")
        if self.num_attention_heads <= 0 or self.hidden_size % self.num_attention_heads:
            raise SdxError(f"{self.label}: hidden_size={self.hidden_size} is not a multiple of "
                           f"num_attention_heads={self.num_attention_heads}")
        if self.patch_size > self.image_size:
            raise SdxError(f"{self.label}: patch_size={self.patch_size} is larger than image_size={self.image_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_positions(self) -> int:
        """The class token and the patches: (image_size // patch_size)² + 1."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @classmethod
    def from_transformers_config(cls, d: Mapping[str, Any]) -> VisionEncoderConfig:
        """From the config.json of a transformers CLIPVisionModelWithProjection folder: a CLIPVisionConfig, or
        a full CLIPConfig whose `vision_config` transformers reads (as `CLIPVisionConfig.from_pretrained`
        does). Missing fields take transformers' defaults; keys are treated as `sdx.diffusers_config`
        says (honoured, fixed, inert or the library's bookkeeping; anything else is an error)."""
        if "vision_config" in d:
            d = d["vision_config"]
            if not isinstance(d, Mapping):
                raise SdxError(f"{cls.label}: vision_config must be a JSON object")
        fields = [f.name for f in dataclasses.fields(cls)]
        known = {*fields, *INERT, *FIXED, *diffusers_config.TRANSFORMERS_GENERIC}
        diffusers_config.check_known(cls.label, d, known)
        diffusers_config.check_fixed(cls.label, {"model_type": "clip_vision_model", "pruned_heads": {}, **d}, FIXED)
        return cls.from_dict({k: d[k] for k in fields if k in d})


class CLIPVisionOutput(NamedTuple):
    """What the encoder returns (a pytree, so it leaves `jax.jit` as is); transformers' meanings.

    image_embeds: (B, projection_dim) `visual_projection(post_layernorm(class token of last_hidden_state))`.
    last_hidden_state: (B, T, D) the last layer's output, no norm applied; T = (image_size // patch_size)² + 1.
    hidden_states: the encoder's input (embeddings after `pre_layrnorm`) then each layer's output:
        num_hidden_layers + 1 arrays of (B, T, D).
    """

    image_embeds: jax.Array
    last_hidden_state: jax.Array
    hidden_states: tuple[jax.Array, ...]


class CLIPVisionEmbeddings(nnx.Module):
    """Patches by one convolution (kernel = stride = patch_size, no bias), the class token in front, a
    learned position embedding added to each of the T tokens."""

    def __init__(self, cfg: VisionEncoderConfig, cp: Compute, *, rngs: nnx.Rngs):
        d, p = cfg.hidden_size, cfg.patch_size
        self.class_embedding = nnx.Param(jax.random.normal(rngs.params(), (d,), cp.param_dtype))
        self.patch_embedding = conv(cp, cfg.num_channels, d, p, stride=p, padding=((0, 0), (0, 0)), bias=False, rngs=rngs)
        self.position_embedding = nnx.Embed(cfg.num_positions, d, dtype=cp.dtype, param_dtype=cp.param_dtype, rngs=rngs)

    def __call__(self, pixel_values):
        patches = self.patch_embedding(pixel_values)  # (B, H/p, W/p, D)
        b, d = patches.shape[0], patches.shape[-1]
        patches = patches.reshape(b, -1, d)  # (B, N, D), row-major over the patch grid as torch's flatten(2)
        class_token = jnp.broadcast_to(self.class_embedding[...].astype(patches.dtype), (b, 1, d))  # (B, 1, D)
        tokens = jnp.concatenate([class_token, patches], axis=1)  # (B, T, D)
        return tokens + self.position_embedding(jnp.arange(tokens.shape[1]))[None]


class CLIPVisionTransformer(nnx.Module):
    """transformers' `vision_model`: embeddings, pre_layrnorm, encoder, post_layernorm."""

    def __init__(self, cfg: VisionEncoderConfig, cp: Compute, *, rngs: nnx.Rngs):
        self.embeddings = CLIPVisionEmbeddings(cfg, cp, rngs=rngs)
        self.pre_layrnorm = LayerNorm(cp, cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)
        self.encoder = CLIPEncoder(cfg, cp, rngs=rngs)
        self.post_layernorm = LayerNorm(cp, cfg.hidden_size, cfg.layer_norm_eps, rngs=rngs)


class CLIPVisionModelWithProjection(nnx.Module):
    """CLIP image encoder. `model(pixel_values)` with pixel_values (B, image_size, image_size, 3) NHWC,
    normalised (`image_encoder_inputs`), returns a `CLIPVisionOutput`."""

    def __init__(self, config: VisionEncoderConfig, cp: Compute = F32, *, rngs: nnx.Rngs):
        self.config, self.compute = config, cp
        self.vision_model = CLIPVisionTransformer(config, cp, rngs=rngs)
        self.visual_projection = linear(cp, config.hidden_size, config.projection_dim, bias=False, rngs=rngs)

    def __call__(self, pixel_values: jax.Array) -> CLIPVisionOutput:
        c = self.config
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (c.image_size, c.image_size, c.num_channels):
            raise SdxError(f"the image encoder takes pixels of shape (batch, {c.image_size}, {c.image_size}, "
                           f"{c.num_channels}), got {tuple(pixel_values.shape)}")
        vm = self.vision_model
        hidden_states = vm.encoder(vm.pre_layrnorm(vm.embeddings(pixel_values)))
        last = hidden_states[-1]  # (B, T, D)
        image_embeds = self.visual_projection(vm.post_layernorm(last[:, 0]))  # the class token: (B, D) -> (B, P)
        return CLIPVisionOutput(image_embeds, last, hidden_states)


# --------------------------------------------------------------------------------------------------
# Pictures -> pixels

# OpenAI CLIP's per-channel statistics (transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD), RGB.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def image_encoder_inputs(pictures: Sequence[Image.Image], size: int) -> np.ndarray:
    """(N, size, size, 3) float32: `pictures` as the image encoder of that image_size takes them.

    What transformers' `CLIPImageProcessor(size=size, crop_size=size)` gives (diffusers' `load_ip_adapter`
    builds that one), to float32 rounding; without torchvision transformers 5 makes that class its PIL
    backend, `CLIPImageProcessorPil`, which this follows step by step (with torchvision it resizes with
    torch's own bicubic, which differs by about a grey level here and there):

    - RGB, any transparency composited onto white (transformers' `convert_to_rgb`);
    - resized, PIL bicubic, so the shorter side is `size` and the longer int(size * long / short),
      truncated (`get_resize_output_image_size` with default_to_square=False);
    - the centre size x size cropped, an odd leftover row or column cut from the bottom or the right
      (`center_crop`: top = (height - size) // 2);
    - times 1/255 in float64, then float32; minus OPENAI_CLIP_MEAN, divided by OPENAI_CLIP_STD.
    """
    if not pictures:
        raise SdxError("no pictures for the image encoder")
    return np.stack([_pixels(picture, size) for picture in pictures])


def _rgb(picture: Image.Image) -> Image.Image:
    if "A" in picture.getbands() or picture.info.get("transparency") is not None:
        rgba = picture.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return picture.convert("RGB")


def _pixels(picture: Image.Image, size: int) -> np.ndarray:
    """One picture as `image_encoder_inputs` prepares it: (size, size, 3) float32."""
    rgb = _rgb(picture)
    w, h = rgb.size
    long = int(size * max(w, h) / min(w, h))
    resized = np.asarray(rgb.resize((size, long) if w <= h else (long, size), Image.Resampling.BICUBIC))  # (H', W', 3)
    top, left = (resized.shape[0] - size) // 2, (resized.shape[1] - size) // 2
    crop = resized[top:top + size, left:left + size]  # (size, size, 3) uint8
    scaled = (crop.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (scaled - np.asarray(OPENAI_CLIP_MEAN, np.float32)) / np.asarray(OPENAI_CLIP_STD, np.float32)


# --------------------------------------------------------------------------------------------------
# Loading

CONFIG, WEIGHTS, WEIGHTS_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
# transformers < 4.31 saved this non-parameter buffer (an arange over the positions); it is recomputed, so
# it is the one key dropped before the strict check.
POSITION_IDS = "vision_model.embeddings.position_ids"


def load_image_encoder(
    folder: str | os.PathLike,
    *,
    dtype: str = "float32",
    compute: Compute | None = None,
    sharding: weights.Sharding = None,
) -> CLIPVisionModelWithProjection:
    """The live image encoder of a transformers CLIPVisionModelWithProjection `folder` (config.json and
    model.safetensors, or a sharded model.safetensors.index.json with its shards), built abstractly and
    filled straight from the memory-mapped file(s); every tensor used once, every shape checked.

    dtype: parameter dtype ("float32", "bfloat16", "float16").
    compute: how the model runs (activation dtype, attention backend, remat); its param_dtype is replaced
      by `dtype`. Default: Compute(dtype=dtype, param_dtype=dtype).
    sharding: one `jax.sharding.Sharding` for every parameter, or a function (path, shape) -> Sharding.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise SdxError(f"image encoder {folder}: no such folder (a transformers CLIPVisionModelWithProjection "
                       f"folder with {CONFIG} and {WEIGHTS}, as h94/IP-Adapter's models/image_encoder)")
    if not (folder / CONFIG).is_file():
        raise SdxError(f"image encoder {folder}: no {CONFIG} (not a transformers CLIPVisionModelWithProjection folder)")
    try:
        config = VisionEncoderConfig.from_transformers_config(io.read_json(folder / CONFIG, obj=True))
    except SdxError as e:
        raise SdxError(f"{folder / CONFIG}: {e}") from None
    tensors, where = _tensors(folder)
    param_dtype = jnp.dtype(weights.dtype_of(dtype))
    cp = (Compute(dtype=param_dtype, param_dtype=param_dtype) if compute is None
          else dataclasses.replace(compute, param_dtype=param_dtype))
    model = weights.abstract(lambda rngs: CLIPVisionModelWithProjection(config, cp, rngs=rngs))
    tensors = {k: v for k, v in tensors.items() if k != POSITION_IDS}
    return weights.load_torch_state(model, tensors, where=where, dtype=param_dtype, sharding=sharding)


def _tensors(folder: Path) -> tuple[dict[str, np.ndarray], str]:
    """The folder's tensors, memory-mapped, and the file that errors name."""
    if (folder / WEIGHTS).is_file():
        return io.read_safetensors(folder / WEIGHTS), str(folder / WEIGHTS)
    if (folder / WEIGHTS_INDEX).is_file():
        return _sharded(folder / WEIGHTS_INDEX), str(folder / WEIGHTS_INDEX)
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    if pickled:
        raise SdxError(
            f"image encoder {folder}: only pickled weights ({', '.join(pickled)}); sdx reads safetensors only. "
            f"Convert them once: CLIPVisionModelWithProjection.from_pretrained(folder).save_pretrained(folder) "
            f"(transformers writes {WEIGHTS})"
        )
    raise SdxError(f"image encoder {folder}: no weights (expected {WEIGHTS} or {WEIGHTS_INDEX})")


def _sharded(index: Path) -> dict[str, np.ndarray]:
    """The tensors of a sharded checkpoint, each from the shard its index lists it in."""
    weight_map = io.read_json(index, obj=True).get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map
            and all(isinstance(s, str) and Path(s).name == s for s in weight_map.values())):
        raise SdxError(f"{index}: not a shard index (\"weight_map\" must map tensor names to shard files beside it)")
    tensors: dict[str, np.ndarray] = {}
    for shard in sorted(set(weight_map.values())):
        for key, array in io.read_safetensors(index.parent / shard).items():
            if weight_map.get(key) != shard:
                raise SdxError(f"{index.parent / shard}: tensor {key!r} is not listed for this shard in {index.name}")
            tensors[key] = array
    return tensors
