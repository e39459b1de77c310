"""ControlNet-Union in the sampler, as diffusers' StableDiffusionXLControlNetUnion(Img2Img/Inpaint)Pipeline use it.

    python -m sdx.sample --model M --controlnet UNION --control-image pose.png --control-mode openpose \\
        --control-image edges.png --control-mode canny --prompt "..."

A ControlNet-Union (`sdx.controlnet_union.ControlNetUnionModel`, SDXL's) is a ControlNet that takes one or
several control images at once, each with its control type. Everything else is a ControlNet's
(`pipelines.control`): the latents, timestep and text it reads, its residuals at the UNet's skip connections
and mid block, the guidance window, guess mode. `UnionControl` is its request part, `UnionPlugin` its program
part (`pipelines.plugin`), `pipelines.conditioning_cli.UnionFlags` its command-line part (`pipelines.method`).

- One ControlNet-Union takes every image with its type (diffusers' `control_mode`, one per image); several take
  one image each and their residuals add up (diffusers' MultiControlNetUnionModel). A plain ControlNet goes with
  none of them: diffusers has no such pipeline.
- Each image has its scale and window (diffusers' per-image `controlnet_keep`): with one image the scale
  multiplies the residuals, with several it weighs each image inside the model (`sdx.controlnet_union`).
- The condition transformer attends across each image's own rows (its guidance branches; one row in guess
  mode), not across the batch as diffusers' does, so an image is the same at any batch size; for one image at a
  time that is diffusers' result.
- The images, the per-call scales and the control types (a multi-hot `control_type` and the indices) are
  per-row program inputs: a new image, scale, window or type compiles nothing.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from pipelines.control import Control, ControlNetPlugin, scales_per_call
from pipelines.plugin import Batch, Input
from sdx.controlnet_union import ControlNetUnionModel
from sdx.errors import SdxError

# xinsir's control types by the names its model card gives them (github.com/xinsir6/ControlNetPlus, "Control
# Mode": 0 openpose, 1 depth, 2 thick line (scribble/hed/softedge/ted-512), 3 thin line (canny/mlsd/lineart/
# animelineart/ted-1280), 4 normal, 5 segment); its ProMax model adds 6 tile and 7 repaint (inpainting and
# outpainting: ComfyUI's comfy/cldm/control_types.py, diffusers' union inpainting example's control_mode=[7]).
MODES: dict[str, int] = {
    "openpose": 0, "depth": 1,
    "scribble": 2, "hed": 2, "softedge": 2, "pidi": 2, "ted": 2,
    "canny": 3, "lineart": 3, "anime_lineart": 3, "animelineart": 3, "mlsd": 3,
    "normal": 4, "segment": 5, "tile": 6, "repaint": 7, "inpaint": 7, "outpaint": 7,
}


def mode_index(mode: int | str, types: int | None = None) -> int:
    """diffusers' index of a control type given as that index or as a name of `MODES`; with `types`, the
    ControlNet-Union's count of types, one it has."""
    text = str(mode).strip().lower()
    if text.isdigit():
        index = int(text)
    elif text in MODES:
        index = MODES[text]
    else:
        raise SdxError(f"--control-mode {mode!r} is not a control type: give diffusers' index or one of "
                       f"{', '.join(MODES)}")
    if types is not None and index >= types:
        raise SdxError(f"--control-mode {mode} (type {index}): this ControlNet-Union knows {types} types, "
                       f"0 to {types - 1}")
    return index


def _each(value, k: int, flag: str) -> tuple:
    """A value given once or once per image, as one per image."""
    if not isinstance(value, (tuple, list)):
        return (value,) * k
    if len(value) not in (1, k):
        raise SdxError(f"{flag}: give one value or one per image ({k}), not {len(value)}")
    return tuple(value) * (k // len(value))


@dataclasses.dataclass(frozen=True)
class UnionControl(Input):
    """One ControlNet-Union's part of a request: images, each (N, H, W, C) float32 in [0, 1] at the generation
    size (N = 1 or one per prompt); modes, each image's control type (diffusers' index, or a name of `MODES`);
    scale (diffusers' controlnet_conditioning_scale), start and end (control_guidance_start/_end), each one for
    every image or one per image; guess_mode: diffusers' (a pipeline whose first ControlNet pools its residuals
    turns it on, as diffusers)."""

    images: tuple[np.ndarray, ...]
    modes: tuple[int | str, ...]
    scale: float | tuple[float, ...] = 1.0
    start: float | tuple[float, ...] = 0.0
    end: float | tuple[float, ...] = 1.0
    guess_mode: bool = False
    kind: ClassVar[str] = Control.kind
    flag: ClassVar[str] = Control.flag
    image_flag: ClassVar[str] = Control.image_flag

    def parts(self) -> list[Control]:
        """Each image as the `Control` it would be for a plain ControlNet: its image, scale and window."""
        k = len(self.images)
        values = (_each(self.scale, k, "--controlnet-conditioning-scale"),
                  _each(self.start, k, "--control-guidance-start"), _each(self.end, k, "--control-guidance-end"))
        return [Control(image, *each, self.guess_mode) for image, *each in zip(self.images, *values)]

    def size(self) -> tuple[int, int]:
        return tuple(self.images[0].shape[1:3])

    def check(self, r, pipe, model: str) -> None:
        nets = pipe.conditioning_models(self.kind)
        if not all(isinstance(net, ControlNetUnionModel) for net in nets):
            raise SdxError("a UnionControl (--control-mode) goes to ControlNet-Unions, and they go with no plain "
                           "ControlNet (diffusers has no such pipeline)")
        if not self.images:
            raise SdxError("a UnionControl takes at least one image")
        if len(self.modes) != len(self.images):
            raise SdxError(f"give one --control-mode per --control-image ({len(self.images)}), not {len(self.modes)}")
        if len(nets) > 1 and len(self.images) > 1:
            raise SdxError(f"several ControlNet-Unions take one image each (diffusers' MultiControlNetUnionModel), "
                           f"not {len(self.images)}")
        for mode in self.modes:
            mode_index(mode, pipe.sampler.models[model].config.num_control_type)
        for part in self.parts():
            part.check_image(r, pipe)

    def plugin(self, batch: Batch, model: str, pipe) -> UnionPlugin:
        types = pipe.sampler.models[model].config.num_control_type
        guess = self.guess_mode or pipe.conditioning_models(self.kind)[0].config.global_pool_conditions
        parts = self.parts()
        index = np.array([mode_index(mode, types) for mode in self.modes], np.int32)  # (K,)
        control_type = np.zeros((types,), np.float32)
        control_type[index] = 1.0  # every type in use (diffusers' scatter of control_mode)
        per_row = lambda a: np.repeat(a[None], batch.rows, axis=0)  # (...) -> (rows, ...)
        images = np.stack([batch.take(part.image) for part in parts], axis=1)  # (rows, K, H, W, C)
        scales = scales_per_call(parts, batch.calls, batch.begin, batch.end)  # (K, calls that run)
        return UnionPlugin(model, guess, images.astype(np.float32), per_row(scales), per_row(control_type),
                           per_row(index))


@dataclasses.dataclass(frozen=True)
class UnionPlugin(ControlNetPlugin):
    """A ControlNet-Union in the sampler: a ControlNet's plug-in (`ControlNetPlugin`: its model, guess mode, and
    how its residuals enter the UNet) whose image is K images (B, K, H, W, C) and scales (B, K, calls) one per image,
    with the control types: control_type (B, num_control_type), 1 at every type in use, and index (B, K), each
    image's type (all traced)."""

    control_type: np.ndarray
    index: np.ndarray
    traced: ClassVar[tuple[str, ...]] = ("image", "scales", "control_type", "index")

    def residuals(self, net, x, t, text, rows, scale, added) -> tuple:
        """The union's two outputs, its condition transformer attending across each image's rows of x."""
        return net(x, t, text, rows(self.image), rows(self.control_type), rows(self.index), scale, added,
                   self.guess_mode, rows_per_image=x.shape[0] // self.image.shape[0])
