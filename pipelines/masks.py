"""Inpainting masks, prepared as diffusers' inpainting pipelines prepare them (white = repaint).

    picture = read_mask("mask.png")                  # before any model loads
    mask = fit_mask(picture, (512, 512), blur=4)     # (1, 512, 512, 1) float32 of 0.0 and 1.0

diffusers' mask processor (a VaeImageProcessor with do_binarize and do_convert_grayscale, no
normalisation) resizes the picture to the generation size with Lanczos, converts it to greyscale ("L")
and binarises it at 0.5; `blur` is its `blur(mask, blur_factor)` (a Gaussian blur of the picture), which
diffusers leaves to the caller before the pipeline and sdx applies first. The latent-size mask is the
pixel mask sampled every `factor` pixels, as torch's nearest `interpolate` does (`latent_mask`).

--padding-mask-crop PAD, as diffusers' `padding_mask_crop`: the generation runs on a crop of the image around
the mask (`crop_region`: the mask's bounding box grown by PAD pixels, then to the generation's aspect
ratio), resized to the generation size keeping its aspect ratio with the edges stretched into any margin
(`resize_fill`); the result is scaled back into the box and the unmasked pixels of the original image are
put over it (`overlay`), so the output has the input's size. --apply-overlay puts the unmasked pixels over a
whole generation the same way (`overlaid`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from sdx import images
from sdx.errors import SdxError

if TYPE_CHECKING:
    import PIL.Image


def read_mask(path: str) -> PIL.Image.Image:
    """The --mask file, decoded in full (an RGB PIL image: greyscale is taken at `fit_mask`)."""
    try:
        return images.decode(path)
    except images.UnreadableImage as e:
        raise SdxError(f"--mask {path}: cannot read the image ({e})") from None


def fit_mask(picture: PIL.Image.Image, size: tuple[int, int], blur: float = 0.0) -> np.ndarray:
    """(1, H, W, 1) float32, 1.0 where the picture is repainted: `picture` blurred by `blur` >= 0 pixels (0: not),
    resized to `size` = (H, W) with Lanczos, greyscale, binarised at 0.5."""
    from PIL import Image

    picture = blurred(picture, blur).resize((size[1], size[0]), Image.LANCZOS)  # a copy when the size is right
    grey = np.asarray(picture.convert("L"), np.float32) / 255.0
    return (grey >= 0.5).astype(np.float32)[None, :, :, None]


def blurred(picture: PIL.Image.Image, blur: float) -> PIL.Image.Image:
    """`picture` under a Gaussian blur of radius `blur` pixels (0: as it is), diffusers' mask_processor.blur."""
    from PIL import ImageFilter

    return picture.filter(ImageFilter.GaussianBlur(blur)) if blur else picture


def latent_mask(mask, factor: int):
    """(B, H, W, 1) pixel mask -> (B, H/f, W/f, 1): every `factor`-th pixel, torch's nearest downsampling."""
    return mask[:, ::factor, ::factor]


def crop_region(mask: PIL.Image.Image, size: tuple[int, int], pad: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the box holding every non-black pixel of `mask`, grown by `pad` on each
    side (within the picture), then grown along one axis, centred, to the aspect ratio of `size` = (H, W),
    shifted back inside the picture where it overhangs (diffusers' `get_crop_region`)."""
    grey = np.asarray(mask.convert("L"))
    h, w = grey.shape
    rows, cols = np.flatnonzero(grey.any(axis=1)), np.flatnonzero(grey.any(axis=0))
    if not len(rows):
        raise SdxError("--padding-mask-crop: the mask is black everywhere (nothing to repaint)")
    left, top = max(int(cols[0]) - pad, 0), max(int(rows[0]) - pad, 0)
    right, bottom = min(int(cols[-1]) + 1 + pad, w), min(int(rows[-1]) + 1 + pad, h)
    aspect = size[1] / size[0]
    if (right - left) / (bottom - top) > aspect:
        top, bottom = _grow(top, bottom, int((right - left) / aspect - (bottom - top)), h)
    else:
        left, right = _grow(left, right, int((bottom - top) * aspect - (right - left)), w)
    return left, top, right, bottom


def _grow(lo: int, hi: int, by: int, limit: int) -> tuple[int, int]:
    """[lo, hi) grown by `by` (half before, the rest after), moved back within [0, limit)."""
    lo, hi = lo - by // 2, hi + by - by // 2
    if hi >= limit:
        lo, hi = lo - (hi - limit), limit
    if lo < 0:
        lo, hi = 0, hi - lo
    return lo, min(hi, limit)


def _scaled(picture: PIL.Image.Image, size: tuple[int, int], cover: bool) -> tuple[PIL.Image.Image, int, int]:
    """`picture` resized (Lanczos), aspect kept, to cover (True) or fit inside (False) `size` = (H, W), and the
    (left, top) that centres it there (diffusers' resize modes "crop" and "fill", their rounding included)."""
    from PIL import Image

    h, w = size
    ratio, own = w / h, picture.width / picture.height
    full_width = ratio > own if cover else ratio < own
    pw = w if full_width else picture.width * h // picture.height
    ph = picture.height * w // picture.width if full_width else h
    return picture.resize((pw, ph), Image.LANCZOS), w // 2 - pw // 2, h // 2 - ph // 2


def resize_fill(picture: PIL.Image.Image, size: tuple[int, int]) -> PIL.Image.Image:
    """`picture` fitted inside `size` = (H, W), aspect kept, centred on an RGB canvas, with its first and last
    rows (or columns) stretched over the margins (diffusers' resize_mode="fill")."""
    from PIL import Image

    h, w = size
    ratio, own = w / h, picture.width / picture.height
    fitted, x, y = _scaled(picture, size, cover=False)
    canvas = Image.new("RGB", (w, h))
    canvas.paste(fitted, box=(x, y))
    if ratio < own and y > 0:  # margins above and below
        canvas.paste(fitted.resize((w, y), box=(0, 0, w, 0)), box=(0, 0))
        canvas.paste(fitted.resize((w, y), box=(0, fitted.height, w, fitted.height)), box=(0, y + fitted.height))
    elif ratio > own and x > 0:  # margins left and right
        canvas.paste(fitted.resize((x, h), box=(0, 0, 0, h)), box=(0, 0))
        canvas.paste(fitted.resize((x, h), box=(fitted.width, 0, fitted.width, h)), box=(x + fitted.width, 0))
    return canvas


def overlay(mask: PIL.Image.Image, original: PIL.Image.Image, generated: np.ndarray,
            box: tuple[int, int, int, int]) -> np.ndarray:
    """(H, W, 3) uint8 at the original's size: `generated` (h, w, 3) uint8 scaled to cover `box` and centred
    there (black elsewhere), with `original` put over it where `mask` is not white, weighted by how dark the
    mask is (diffusers' `apply_overlay`)."""
    from PIL import Image, ImageOps

    left, top, right, bottom = box
    scaled, x, y = _scaled(Image.fromarray(generated), (bottom - top, right - left), cover=True)
    inside = Image.new("RGB", (right - left, bottom - top))
    inside.paste(scaled, box=(x, y))
    base = Image.new("RGBA", original.size)
    base.paste(inside, (left, top))
    keep = Image.new("RGBa", original.size)
    keep.paste(original.convert("RGBA").convert("RGBa"), mask=ImageOps.invert(mask.convert("L")))
    out = base.convert("RGB").convert("RGBA")
    out.alpha_composite(keep.convert("RGBA"))
    return np.asarray(out.convert("RGB"))


def overlaid(generated: np.ndarray, original: PIL.Image.Image, mask: PIL.Image.Image, blur: float = 0.0) -> np.ndarray:
    """`generated` (H, W, 3) uint8 with `original`'s pixels put back where `mask` (blurred by `blur` pixels,
    not binarised) keeps them, both resized to its size (Lanczos): `overlay` over the whole picture, what
    --apply-overlay does. Where the mask is black the result is the original exactly."""
    from PIL import Image

    size = (generated.shape[1], generated.shape[0])
    fitted = lambda picture: picture if picture.size == size else picture.resize(size, Image.LANCZOS)
    return overlay(fitted(blurred(mask, blur)), fitted(original), generated, (0, 0, *size))


@dataclasses.dataclass(frozen=True)
class Crop:
    """A --padding-mask-crop generation: the box it ran on, the original picture and its mask (blurred, at the
    picture's size), to put the generated pixels back with `overlay`."""

    box: tuple[int, int, int, int]
    original: PIL.Image.Image
    mask: PIL.Image.Image

    @classmethod
    def around(cls, original: PIL.Image.Image, mask: PIL.Image.Image, blur: float, size: tuple[int, int],
               pad: int) -> Crop:
        """The crop of `original` around `mask` (resized to the original's size, blurred by `blur` pixels) for
        a generation of `size` = (H, W)."""
        from PIL import Image

        mask = blurred(mask, blur)
        if mask.size != original.size:
            mask = mask.resize(original.size, Image.LANCZOS)
        return cls(crop_region(mask, size, pad), original, mask)

    def cut(self, picture: PIL.Image.Image, size: tuple[int, int]) -> PIL.Image.Image:
        """`picture` (at the original's size, else resized to it) cropped to the box and filled into `size`."""
        from PIL import Image

        if picture.size != self.original.size:
            picture = picture.resize(self.original.size, Image.LANCZOS)
        return resize_fill(picture.crop(self.box), size)

    def paste(self, generated: np.ndarray) -> np.ndarray:
        """The generated (h, w, 3) uint8 crop put back into the original (`overlay`)."""
        return overlay(self.mask, self.original, generated, self.box)
