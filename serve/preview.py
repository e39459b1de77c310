"""A cheap picture of latents mid-generation: A1111's "approx" live preview, a fixed linear map from the latent
channels to RGB, with no VAE call.

For the 4-channel latents of SD 1.x/2.x and SDXL the maps are the ones A1111's `cheap_approximation` uses: for
SD 1.x/2.x, the 4x3 least-squares fit of the VAE's decoded colours on its latents that Keturn published on the
Hugging Face forum ("Decoding latents to RGB without upscaling", 2022); for SDXL, A1111's refit for the SDXL VAE.
Each gives RGB in about [-1, 1]. Latents of any other channel count (a 16-channel VAE, say) have no published map:
channel c adds to colour c % 3, the three sums are averaged, and each picture is stretched to its own range,
which shows the layout of the picture, not its colours.
"""

from __future__ import annotations

import numpy as np

# rows: latent channels; columns: R, G, B
SD_RGB = np.array([[0.298, 0.207, 0.208],
                   [0.187, 0.286, 0.173],
                   [-0.158, 0.189, 0.264],
                   [-0.184, -0.271, -0.473]], np.float32)
SDXL_RGB = np.array([[0.3448, 0.4168, 0.4395],
                     [-0.1953, -0.0290, 0.0250],
                     [0.1074, 0.0886, -0.0163],
                     [-0.3730, -0.2499, -0.2088]], np.float32)


def approx_rgb(latents: np.ndarray, xl: bool) -> np.ndarray:
    """(N, h, w, C) latents as the sampler holds them (NHWC, scaled by the VAE's scaling factor) -> (N, h, w, 3)
    uint8 pictures at the latents' size. xl: the latents are an SDXL VAE's (else SD 1.x/2.x's, for 4 channels)."""
    latents = np.asarray(latents, np.float32)
    channels = latents.shape[-1]
    if channels == 4:
        rgb = (latents @ (SDXL_RGB if xl else SD_RGB) + 1.0) / 2.0
    else:
        spread = np.zeros((channels, 3), np.float32)
        spread[np.arange(channels), np.arange(channels) % 3] = 1.0
        rgb = latents @ (spread / spread.sum(axis=0).clip(min=1.0))
        low = rgb.min(axis=(1, 2, 3), keepdims=True)
        span = rgb.max(axis=(1, 2, 3), keepdims=True) - low
        rgb = np.where(span > 0, (rgb - low) / np.where(span > 0, span, 1.0), 0.5)
    return (np.clip(rgb, 0.0, 1.0) * 255.0).round().astype(np.uint8)
