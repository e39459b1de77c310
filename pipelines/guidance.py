"""Guidance: how the model outputs of one batched UNet call become one prediction.

Batch layouts (along axis 0, each part the generation batch B):
- classifier-free guidance (Ho & Salimans 2022): [negative, text];
- InstructPix2Pix (Brooks et al. 2023): [text+image, negative+image, negative+no image].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def classifier_free(uncond: jax.Array, text: jax.Array, scale: jax.Array) -> jax.Array:
    """uncond + scale * (text - uncond)."""
    return uncond + scale * (text - uncond)


def pix2pix(text: jax.Array, image: jax.Array, uncond: jax.Array, scale: jax.Array, image_scale: jax.Array) -> jax.Array:
    """uncond + scale * (text - image) + image_scale * (image - uncond) (the InstructPix2Pix paper, eq. 3)."""
    return uncond + scale * (text - image) + image_scale * (image - uncond)


def rescale(guided: jax.Array, text: jax.Array, phi: jax.Array) -> jax.Array:
    """Lin et al. 2023 ("Common Diffusion Noise Schedules and Sample Steps are Flawed"), section 3.4:
    rescale the guided prediction to the per-sample standard deviation of the text prediction, mixed
    by phi. phi = 0 returns `guided` unchanged. Standard deviations are unbiased (as torch.std)."""
    axes = tuple(range(1, guided.ndim))
    std_text = jnp.std(text, axis=axes, keepdims=True, ddof=1)
    std_guided = jnp.std(guided, axis=axes, keepdims=True, ddof=1)
    return phi * (guided * (std_text / std_guided)) + (1.0 - phi) * guided
