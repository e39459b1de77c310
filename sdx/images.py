"""Reading the images a user hands to sdx (the sampler's --image, training datasets) into RGB.

    decode(b"...png bytes") or decode("photo.jpg") -> an RGB PIL image, or UnreadableImage(reason)

As diffusers' load_image: EXIF orientation applied, then PIL's convert("RGB") (alpha dropped; CMYK and
palettes converted), except that 16- and 32-bit integer greyscale keeps the high byte of 16-bit values
instead of being clipped at 255. Pictures whose header claims more than PIL's decompression-bomb limit
(twice `Image.MAX_IMAGE_PIXELS`, about 179 megapixels) are refused before their pixels are allocated.
"""

from __future__ import annotations

import io
import os
import warnings
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps


class UnreadableImage(Exception):
    """Bytes or a file that do not decode to a picture; the message says why."""


def decode(src: bytes | bytearray | memoryview | str | os.PathLike | None) -> Image.Image:
    """Encoded bytes or a file path -> an RGB PIL image, decoded in full; UnreadableImage otherwise."""
    if src is None:
        raise UnreadableImage("empty cell")
    try:
        # in memory: PIL reads a chunk by the length its header claims, which a file object would allocate
        raw = src if isinstance(src, (bytes, bytearray, memoryview)) else Path(src).read_bytes()
        if len(raw) == 0:
            raise UnreadableImage("zero bytes")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # palette transparency, EXIF and bomb-size warnings
            with Image.open(io.BytesIO(raw)) as im:
                if im.width == 0 or im.height == 0:
                    raise UnreadableImage(f"{im.width}x{im.height} pixels")
                im.load()
                return to_rgb(_upright(im))
    except UnreadableImage:
        raise
    except FileNotFoundError:
        raise UnreadableImage(f"no such file {src}") from None
    except Exception as e:  # PIL raises many types for corrupt data; any of them means "unreadable"
        raise UnreadableImage(f"{type(e).__name__}: {e}") from None


def _upright(im: Image.Image) -> Image.Image:
    """`im` turned as its EXIF orientation says (a broken EXIF block: as stored)."""
    try:
        if im.getexif().get(0x0112, 1) != 1:
            return ImageOps.exif_transpose(im)
    except Exception:
        pass
    return im


def to_rgb(im: Image.Image) -> Image.Image:
    """PIL's convert("RGB"), except that 16- and 32-bit integer greyscale keeps the high byte of 16-bit
    values instead of being clipped at 255."""
    if im.mode == "RGB":
        return im
    if im.mode.startswith("I;16") or im.mode == "I":
        a = np.asarray(im).astype(np.int64)
        if im.mode.startswith("I;16") or a.max(initial=0) > 255:
            a = a >> 8
        im = Image.fromarray(np.clip(a, 0, 255).astype(np.uint8), "L")
    return im.convert("RGB")
