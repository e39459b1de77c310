"""Images in and out of the API: base64 or data-URI pictures decoded within the server's limits, and PNGs with
A1111's `parameters` text.

A picture is refused before its pixels are allocated when its header claims more than --max-image-pixels (a
decompression bomb); a URL is refused (the server fetches nothing); what remains is decoded as the sampling
command decodes a file (`sdx.images.decode`: EXIF orientation, RGB), so the same picture gives the same image.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from sdx import images
from sdx.errors import SdxError


def decode(text: str, field: str, max_pixels: int) -> Image.Image:
    """The RGB picture in `text` (base64, or a data: URI), or an SdxError naming `field`."""
    try:
        return images.decode(_checked(text, field, max_pixels))
    except images.UnreadableImage as e:
        raise SdxError(f"{field}: cannot read the image ({e})") from None


def texts(text: str, field: str, max_pixels: int) -> dict[str, str]:
    """The text chunks of the picture in `text` (a PNG's `parameters`, ...), or an SdxError naming `field`."""
    with Image.open(io.BytesIO(_checked(text, field, max_pixels))) as im:
        return {k: v for k, v in im.info.items() if isinstance(k, str) and isinstance(v, str)}


def _checked(text: str, field: str, max_pixels: int) -> bytes:
    """The encoded picture in `text`, refused unless it is one of at most `max_pixels` pixels, given inline."""
    text = text.strip()
    if text.lower().startswith(("http://", "https://")):
        raise SdxError(f"{field}: the server fetches no URLs; send the image itself, as base64 or a data URI")
    if text.startswith("data:"):
        head, _, text = text.partition(",")
        if not head.endswith(";base64"):
            raise SdxError(f"{field}: a data URI of an image in base64 (data:image/png;base64,...)")
    try:
        raw = base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError) as e:
        raise SdxError(f"{field}: not base64 ({e})") from None
    try:
        with warnings.catch_warnings(), Image.open(io.BytesIO(raw)) as header:
            warnings.simplefilter("ignore")
            size = header.size
    except Image.DecompressionBombError:  # a header past PIL's own limit, far past ours
        raise SdxError(f"{field}: more pixels than this server's --max-image-pixels {max_pixels}") from None
    except Exception as e:  # PIL's many types for what is not a picture
        raise SdxError(f"{field}: cannot read the image ({type(e).__name__}: {e})") from None
    if size[0] * size[1] > max_pixels:
        raise SdxError(f"{field}: {size[0]}x{size[1]} is more than this server's --max-image-pixels {max_pixels}")
    return raw


def png(pixels: np.ndarray, parameters: str) -> bytes:
    """(H, W, 3) uint8 -> PNG bytes with the `parameters` text chunk A1111 writes."""
    info = PngInfo()
    info.add_text("parameters", parameters)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
