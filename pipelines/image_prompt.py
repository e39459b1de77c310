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
  cross-attention is an input of the compiled programs, so a new scale compiles nothing.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from sdx import weights
from sdx.clip_vision import CLIPVisionModelWithProjection, image_encoder_inputs, load_image_encoder
from sdx.errors import SdxError
from sdx.ip_adapter import IPAdapter, Scale, attention_scales, load_ip_adapter
from sdx.layers import Compute

if TYPE_CHECKING:
    import PIL.Image

ENCODER, ADAPTER = "image_encoder", "ip_adapter"  # the two models' names in a sampler


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
    """The image part of a request: pixels (N, S, S, 3) float32, the encoder's input (`prepare`), N = 1 or
    one per prompt; scale: the image attention's weight, one number or a per-block spec
    (`sdx.ip_adapter.attention_scales`)."""

    pixels: np.ndarray
    scale: Scale = 1.0

    def per_attention(self, unet) -> np.ndarray:
        """(cross-attentions,) float32: the scale of each of `unet`'s cross-attentions."""
        return attention_scales(self.scale, unet)


def load(adapter: str | os.PathLike, encoder: str | os.PathLike | None, unet, *, dtype: str, compute: Compute,
         sharding: weights.Sharding = None) -> dict:
    """{ENCODER: the image encoder, ADAPTER: the IP-Adapter} for `unet`, from the adapter's .safetensors file
    and the image encoder's transformers folder (default: `image_encoder` beside the file, where
    h94/IP-Adapter keeps it), parameters in `dtype`; each checked before the next is read."""
    ip = load_ip_adapter(adapter, unet, dtype=dtype, compute=compute, sharding=sharding)
    folder = Path(encoder) if encoder is not None else Path(adapter).parent / "image_encoder"
    vision = load_image_encoder(folder, dtype=dtype, compute=compute, sharding=sharding)
    check_compatible(ip, vision, f"--ip-adapter {adapter}")
    return {ENCODER: vision, ADAPTER: ip}


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
