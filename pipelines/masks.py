"""Inpainting masks, prepared as diffusers' inpainting pipelines prepare them (white = repaint).

    picture = read_mask("mask.png")                  # before any model loads
    mask = fit_mask(picture, (512, 512), blur=4)     # (1, 512, 512, 1) float32 of 0.0 and 1.0

diffusers' mask processor (a VaeImageProcessor with do_binarize and do_convert_grayscale, no
normalisation) resizes the picture to the generation size with Lanczos, converts it to greyscale ("L")
and binarises it at 0.5; `blur` is its `blur(mask, blur_factor)` (a Gaussian blur of the picture), which
diffusers leaves to the caller before the pipeline and sdx applies first. The latent-size mask is the
pixel mask sampled every `factor` pixels, as torch's nearest `interpolate` does (`latent_mask`).
"""

from __future__ import annotations

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
    from PIL import Image, ImageFilter

    if blur:
        picture = picture.filter(ImageFilter.GaussianBlur(blur))
    picture = picture.resize((size[1], size[0]), Image.LANCZOS)  # PIL returns a copy when the size is already right
    grey = np.asarray(picture.convert("L"), np.float32) / 255.0
    return (grey >= 0.5).astype(np.float32)[None, :, :, None]


def latent_mask(mask, factor: int):
    """(B, H, W, 1) pixel mask -> (B, H/f, W/f, 1): every `factor`-th pixel, torch's nearest downsampling."""
    return mask[:, ::factor, ::factor]
