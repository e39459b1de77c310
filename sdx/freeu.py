"""FreeU (Si et al. 2024, "FreeU: Free Lunch in Diffusion U-Net", arXiv:2309.11497): the first two up blocks
(the lowest resolutions) amplify half of their backbone features and damp the low frequencies of the skip
features they concatenate, at no cost in parameters.

At up block i < 2, before each resnet: the first half of the hidden states' channels times b_{i+1}, and
the skip connection's spectrum (a 2-D FFT over height and width, centred) times s_{i+1} in the (2 x 2)
lowest frequencies, then back (the real part). Equal to diffusers' `UNet2DConditionModel.enable_freeu(s1,
s2, b1, b2)` (its `apply_freeu` and `fourier_filter`): the filter in float32 whatever the compute dtype, and
FreeU off altogether when any of the four is 0, as diffusers' truthiness test of its scales leaves it. The
four are traced: a new value compiles nothing.

Values the FreeU authors give: SD 1.4/1.5 b1 1.5, b2 1.6, s1 0.9, s2 0.2; SD 2.1 b1 1.4, b2 1.6, s1 0.9,
s2 0.2; SDXL b1 1.3, b2 1.4, s1 0.9, s2 0.2.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sdx.interventions import Hook, Intervention, Interventions

THRESHOLD = 1  # diffusers' fourier_filter(threshold=1): a (2 x 2) block of the centred spectrum


def low_frequencies(height: int, width: int, threshold: int = THRESHOLD) -> np.ndarray:
    """(height, width) bool: the centred spectrum's block [h//2 - t, h//2 + t) x [w//2 - t, w//2 + t), with
    numpy's (and torch's) slice rules for a start below 0."""
    mask = np.zeros((height, width), bool)
    ch, cw = height // 2, width // 2
    mask[ch - threshold:ch + threshold, cw - threshold:cw + threshold] = True
    return mask


def fourier_filter(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x (B, H, W, C) with the low frequencies of each channel's 2-D spectrum times `scale` (), in float32,
    returned in x's dtype."""
    h, w = x.shape[1:3]
    spectrum = jnp.fft.fftshift(jnp.fft.fft2(x.astype(jnp.float32), axes=(1, 2)), axes=(1, 2))
    gain = jnp.where(jnp.asarray(low_frequencies(h, w))[None, :, :, None], scale.astype(jnp.float32), 1.0)
    back = jnp.fft.ifft2(jnp.fft.ifftshift(spectrum * gain, axes=(1, 2)), axes=(1, 2)).real
    return back.astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class FreeU(Intervention, Hook):
    """FreeU at the skip concatenations of up blocks 0 and 1 (`up_blocks.<i>.resnets.<j>.skip`)."""

    b1: float
    b2: float
    s1: float
    s2: float
    traced: ClassVar[tuple[str, ...]] = ("b1", "b2", "s1", "s2")
    per_row: ClassVar[bool] = False

    def install(self, model) -> Interventions:
        stages = ("up_blocks.0.", "up_blocks.1.")
        return Interventions(sites={name: (self,) for name, kind in model.sites().items()
                                    if kind == "skip" and name.startswith(stages)})

    def __call__(self, site: str, x: jax.Array, skip: jax.Array) -> tuple[jax.Array, jax.Array]:
        on = (self.b1 != 0) & (self.b2 != 0) & (self.s1 != 0) & (self.s2 != 0)  # diffusers' `s1 and s2 and b1 and b2`
        b, s = (self.b1, self.s1) if site.startswith("up_blocks.0.") else (self.b2, self.s2)
        b, s = (jnp.where(on, jnp.asarray(v, jnp.float32), 1.0) for v in (b, s))
        half = x.shape[-1] // 2
        x = jnp.concatenate([x[..., :half] * b.astype(x.dtype), x[..., half:]], axis=-1)
        return x, jnp.where(on, fourier_filter(skip, s), skip)
