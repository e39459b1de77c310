"""ControlNet through `alwayson_scripts`, as sd-webui-controlnet's API takes it: `{"controlnet": {"args": [unit,
...]}}`, each unit with its fields `enabled`, `model`, `weight`, `image` (base64, a data URI, or `{"image": ...}`),
`guidance_start`, `guidance_end`, `control_mode`, `module`, `resize_mode`, ...

A unit names one of the ControlNets the server was started with (`--controlnet`, listed by GET
/controlnet/model_list). sdx runs no preprocessor: the image is the control map itself (`module` none). What sdx
cannot honour is refused naming the unit's field: another module, a control mode other than Balanced, a resize
mode other than Just Resize for an image not already at the generation size, a unit mask.
"""

from __future__ import annotations

import dataclasses

from serve import images
from sdx.errors import SdxError

NO_MODULE = ("none", "None", "", None)
BALANCED = (0, "Balanced")
JUST_RESIZE = (0, "Just Resize")
RESIZE_MODES = (*JUST_RESIZE, 1, "Crop and Resize", 2, "Resize and Fill", "Inner Fit (Scale to Fit)",
                "Envelope (Outer Fit)")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One enabled unit: the index of its ControlNet in the server's list, its picture, scale and window."""

    net: int
    picture: object
    weight: float
    start: float
    end: float

    def infotext(self, name: str) -> tuple[str, str]:
        return (f"ControlNet {self.net}",
                f"Module: none, Model: {name}, Weight: {self.weight}, Guidance Start: {self.start}, "
                f"Guidance End: {self.end}")


def units(scripts: dict, served_nets: tuple[str, ...], size: tuple[int, int], max_pixels: int) -> list[Unit]:
    """The enabled units of a request's `alwayson_scripts`, checked; an unknown script is A1111's 422."""
    found = {}
    for name, value in scripts.items():
        if name.lower() != "controlnet" or not served_nets:
            raise SdxError(f"alwayson_scripts: always on script {name} not found")
        found = value if isinstance(value, dict) else {}
    args = found.get("args", [])
    if not isinstance(args, list):
        raise SdxError("alwayson_scripts.controlnet.args: a list of units")
    out = []
    for i, unit in enumerate(args):
        if not isinstance(unit, dict):
            raise SdxError(f"alwayson_scripts.controlnet.args[{i}]: a unit is an object of fields")
        if unit.get("enabled", True):
            out.append(_unit(unit, f"alwayson_scripts.controlnet.args[{i}]", served_nets, size, max_pixels))
    nets = [u.net for u in out]
    if len(set(nets)) < len(nets):
        raise SdxError("alwayson_scripts.controlnet: each ControlNet may be used by one unit")
    return out


def _unit(unit: dict, where: str, served_nets: tuple[str, ...], size: tuple[int, int], max_pixels: int) -> Unit:
    model = str(unit.get("model") or "None").split(" [")[0]
    if model not in served_nets:
        raise SdxError(f"{where}.model {unit.get('model')!r}: this server has the ControlNets "
                       f"{', '.join(served_nets)} (GET /controlnet/model_list)")
    if unit.get("module", "none") not in NO_MODULE:
        raise SdxError(f"{where}.module {unit['module']!r}: sdx runs no preprocessor; send the control map itself "
                       "with module none")
    if unit.get("control_mode", 0) not in BALANCED:
        raise SdxError(f"{where}.control_mode {unit['control_mode']!r}: sdx weighs a ControlNet as Balanced (0) does")
    if unit.get("mask") or unit.get("mask_image") or unit.get("effective_region_mask"):
        raise SdxError(f"{where}: sdx applies a ControlNet to the whole picture (no mask)")
    image = unit.get("image", unit.get("input_image"))
    if isinstance(image, dict):
        if image.get("mask"):
            raise SdxError(f"{where}.image.mask: sdx applies a ControlNet to the whole picture (no mask)")
        image = image.get("image")
    if not isinstance(image, str) or not image:
        raise SdxError(f"{where}.image: give the control map, as base64 or a data URI")
    picture = images.decode(image, f"{where}.image", max_pixels)
    resize = unit.get("resize_mode", "Crop and Resize")
    if resize not in RESIZE_MODES:
        raise SdxError(f"{where}.resize_mode {resize!r}: one of Just Resize, Crop and Resize, Resize and Fill")
    if resize not in JUST_RESIZE and (picture.height, picture.width) != size:
        raise SdxError(f"{where}.resize_mode {resize!r}: sdx resizes a control map to the generation size (Just "
                       f"Resize); send it at {size[1]}x{size[0]} or with resize_mode Just Resize")
    try:
        weight, start, end = (float(unit.get(k, d)) for k, d in (("weight", 1.0), ("guidance_start", 0.0),
                                                                   ("guidance_end", 1.0)))
    except (TypeError, ValueError):
        raise SdxError(f"{where}: weight, guidance_start and guidance_end are numbers") from None
    return Unit(served_nets.index(model), picture, weight, start, end)
