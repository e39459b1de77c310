"""An image prompt through an IP-Adapter, as diffusers' pipelines take `ip_adapter_image` after `load_ip_adapter`.

    python -m sdx.sample --model M --ip-adapter ip-adapter_sd15.safetensors --ip-adapter-image style.png \
        --prompt "..."

- The picture is prepared as the adapter's CLIP image encoder expects (`sdx.clip_vision.image_encoder_inputs`:
  shortest side to its size, bicubic, centre crop, CLIP's mean and std), once, on the host.
- In the sampler's prepare program the encoder embeds it: `image_embeds` for a plain adapter, the
  next-to-last hidden state for a plus one; the adapter's projection turns that into image tokens, and the
  UNet's cross-attentions attend to them (`sdx.ip_adapter`).
- With guidance, the negative branches read the tokens of no image: a plain adapter projects zeros in place
  of the embedding, a plus one encodes an all-zero image (diffusers' `encode_image`); InstructPix2Pix's two
  negative branches both do, as diffusers' pipeline has it.
- The scale multiplies the image attention in every cross-attention (diffusers' `set_ip_adapter_scale`; 0
  leaves the text alone), or per block (`sdx.ip_adapter.attention_scales`, InstantStyle); one per
  cross-attention and image is an input of the compiled programs, so a new scale compiles nothing.
- Several adapters at once (diffusers' list form of `load_ip_adapter` and `ip_adapter_image`): each has its own
  image, encoder and scale, and each adds its image attention to every cross-attention.

`ImagePrompt` is an adapter's request part, `IPAdapterPlugin` its program part (`pipelines.plugin`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.plugin import PREPARE, Batch, Input, ModelCall, Plugin, Ready, model_name
from sdx import weights
from sdx.clip_vision import CLIPVisionModelWithProjection, image_encoder_inputs, load_image_encoder
from sdx.errors import SdxError
from sdx.interventions import Interventions
from sdx.ip_adapter import IPAdapter, Scale, attention_scales, image_attention, load_ip_adapter
from sdx.layers import Compute

if TYPE_CHECKING:
    import PIL.Image

KIND = "ip_adapter"


def encoder_name(k: int) -> str:
    """The `Sampler.models` key of the k-th IP-Adapter's image encoder (the adapter's is `model_name(KIND, k)`)."""
    return f"image_encoder_{k}"


@dataclasses.dataclass(frozen=True)
class ImagePrompt(Input):
    """One IP-Adapter's part of a request: pixels (N, S, S, 3) float32, its image encoder's input (`of`,
    `prepare`), N = 1 or one per prompt; scale: the image attention's weight, one number or site patterns to
    numbers (`sdx.ip_adapter.attention_scales`; diffusers' per-block dicts: `sdx.ip_adapter.diffusers_scales`)."""

    pixels: np.ndarray
    scale: Scale = 1.0
    kind: ClassVar[str] = KIND
    flag: ClassVar[str] = "--ip-adapter"
    image_flag: ClassVar[str] = "--ip-adapter-image"

    @classmethod
    def of(cls, pictures: list[PIL.Image.Image], pipe, k: int = 0, scale: Scale = 1.0) -> ImagePrompt:
        """The image prompt of `pictures` (one, or one per prompt) for `pipe`'s k-th IP-Adapter."""
        return cls(prepare(pictures, pipe.sampler.models[encoder_name(k)]), scale)

    def check(self, r, pipe, model: str) -> None:
        size = pipe.sampler.models[encoder_name(_index(model))].config.image_size
        if self.pixels.ndim != 4 or self.pixels.shape[0] not in (1, len(r.prompts)) or self.pixels.shape[1:] != (size, size, 3):
            raise SdxError(f"the --ip-adapter-image pixels' shape {self.pixels.shape} does not fit {len(r.prompts)} "
                           f"prompt(s) read at {size}x{size} (`ImagePrompt.of` prepares them)")
        attention_scales(self.scale, pipe.sampler.models["unet"])  # a per-block spec that does not fit fails here

    def plugin(self, batch: Batch, model: str, pipe) -> IPAdapterPlugin:
        scales = attention_scales(self.scale, pipe.sampler.models["unet"])  # (cross-attentions,)
        return IPAdapterPlugin(model, encoder_name(_index(model)), batch.take(self.pixels).astype(np.float32),
                               np.repeat(scales[None], batch.rows, axis=0))


def _index(model: str) -> int:
    """k of the k-th IP-Adapter's model name."""
    return int(model.rsplit("_", 1)[1])


@dataclasses.dataclass(frozen=True)
class IPAdapterPlugin(Plugin):
    """An IP-Adapter in the sampler: model and encoder, the adapter's and its image encoder's names in the sampler;
    pixels (B, S, S, 3) and scales (B, cross-attentions) (traced). Prepare embeds the image and projects its tokens
    for every cross-attention once; each model call attends to them there (`sdx.layers.ImagePrompt`)."""

    model: str
    encoder: str
    pixels: jax.Array
    scales: jax.Array
    traced: ClassVar[tuple[str, ...]] = ("pixels", "scales")
    reads: ClassVar[tuple[str, ...]] = (PREPARE,)

    def models(self, program: str) -> tuple[str, ...]:
        return (self.model, self.encoder) if program == PREPARE else ()

    def prepare(self, models, ready: Ready) -> tuple:
        """The image tokens' keys and values for the UNet batch's rows, for each cross-attention in
        `sdx.ip_adapter.cross_attentions`' order (a tuple: a dict comes out of a program in its keys' order):
        the branches that read the negative prompt read no image (diffusers' negative image embeddings)."""
        adapter, guide = models[self.model], ready.guide
        positive, negative = tokens(adapter, models[self.encoder], self.pixels, guide.branches > 1)
        rows = positive if negative is None else guide.by_branch(positive, negative)  # (B * branches, N, D)
        return tuple(adapter.keys_values(ready.unet, rows))

    def contribute(self, models, kv: tuple, call: ModelCall) -> Interventions:
        return image_attention(call.unet, kv, jnp.repeat(self.scales, call.branches, axis=0))  # (B * branches, ...)


def load(adapter: str | os.PathLike, encoder: str | os.PathLike | None, unet, k: int, *, dtype: str,
         compute: Compute, sharding: weights.Sharding = None) -> dict:
    """{the k-th adapter's name: the IP-Adapter, `encoder_name(k)`: its image encoder} for `unet`, from the
    adapter's .safetensors file and the image encoder's transformers folder (default: `image_encoder` beside the
    file, where h94/IP-Adapter keeps it), parameters in `dtype`; each checked before the next is read."""
    ip = load_ip_adapter(adapter, unet, dtype=dtype, compute=compute, sharding=sharding)
    folder = Path(encoder) if encoder is not None else Path(adapter).parent / "image_encoder"
    vision = load_image_encoder(folder, dtype=dtype, compute=compute, sharding=sharding)
    check_compatible(ip, vision, f"--ip-adapter {adapter}")
    return {model_name(KIND, k): ip, encoder_name(k): vision}


def prepare(pictures: list[PIL.Image.Image], encoder: CLIPVisionModelWithProjection) -> np.ndarray:
    """(N, S, S, 3) float32: `pictures` as `encoder` reads them (S its image_size)."""
    return image_encoder_inputs(pictures, encoder.config.image_size)


def check_compatible(adapter: IPAdapter, encoder: CLIPVisionModelWithProjection, where: str) -> None:
    """Refuse an image encoder whose output is not what the adapter reads, before compiling."""
    c = encoder.config
    width, what = ((c.hidden_size, "hidden states") if adapter.config.reads_hidden_states
                   else (c.projection_dim, "image embeddings"))
    if width != adapter.config.image_embed_dim:
        raise SdxError(
            f"{where}: the adapter reads {adapter.config.image_embed_dim}-wide {what}, its image encoder gives "
            f"{width}-wide ones; pass the encoder it was trained with (--ip-adapter-image-encoder: SD 1.5 and the "
            "_vit-h SDXL adapters take models/image_encoder, ViT-H; the other SDXL ones sdxl_models/image_encoder, "
            "ViT-bigG)"
        )


def tokens(adapter: IPAdapter, encoder: CLIPVisionModelWithProjection, pixels: jax.Array,
           negative: bool) -> tuple[jax.Array, jax.Array | None]:
    """The image tokens (B, N, D) of `pixels` (B, S, S, 3), and with `negative` those of no image (B, N, D)."""
    plus = adapter.config.reads_hidden_states
    read = (lambda out: out.hidden_states[-2]) if plus else (lambda out: out.image_embeds)
    positive = adapter.tokens(read(encoder(pixels.astype(encoder.compute.dtype))))
    if not negative:
        return positive, None
    none = jnp.zeros_like(pixels[:1])  # an all-zero image (plus) or embedding (plain), the same for every row
    none = read(encoder(none.astype(encoder.compute.dtype))) if plus else jnp.zeros((1, adapter.config.image_embed_dim))
    return positive, jnp.broadcast_to(adapter.tokens(none), positive.shape)
