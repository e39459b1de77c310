"""A generation method's part of `python -m sdx.sample`: its flags, their checks, what it asks of `Pipeline.load`
and of the `Request`, its PNG parameters and what it writes besides the images.

The command (`pipelines.cli`) loops over a table of them, `METHODS`: the conditioning plug-ins'
(`pipelines.control`, `pipelines.t2i_adapter`, `pipelines.image_prompt`) and the research methods'
(`pipelines.research_cli`); a new method is one more entry, as a new sampler is one more line of
`sdx.schedulers.names`.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from sdx import images
from sdx.errors import SdxError


@dataclasses.dataclass(frozen=True)
class Context:
    """What a method's request part reads besides its flags: pipe, the loaded pipeline; size, the generation's
    (height, width); image and mask: whether --image and --mask are given; crop: --padding-mask-crop's
    `pipelines.masks.Crop`, or None."""

    pipe: Any
    size: tuple[int, int]
    image: bool = False
    mask: bool = False
    crop: Any = None

    def cut(self, picture):
        """`picture` as the generation sees it: its crop around the mask with --padding-mask-crop, else itself."""
        return picture if self.crop is None else self.crop.cut(picture, self.size)


class Method:
    """One method's command-line part; every step does nothing by default. `title`: its group in --help."""

    title: ClassVar[str]

    def add_flags(self, group: argparse._ArgumentGroup) -> None:
        """Put its flags on the parser's group."""

    def check(self, args: argparse.Namespace) -> Any:
        """Refuse bad values of its flags before anything loads; returns what it read (its pictures), which
        `request` gets back (None when nothing)."""
        return None

    def load(self, args: argparse.Namespace, cache: Path, log) -> dict:
        """`Pipeline.load` keywords for the models it needs (ControlNets, adapters)."""
        return {}

    def pictures(self, read) -> list:
        """Of what `check` read, the pictures whose size text-to-image takes when no size is given (the first)."""
        return []

    def request(self, args: argparse.Namespace, read, at: Context) -> dict:
        """`Request` fields: "conditioning" inputs, "interventions" (each a list the command joins), a "guidance"."""
        return {}

    def png(self, args: argparse.Namespace, request) -> dict:
        """What it sets, for the PNG's metadata."""
        return {}

    def write(self, args: argparse.Namespace, pipe, request, generated, pixels, paths: list[Path], log) -> list[Path]:
        """Files besides the images (what interventions read out); returns their paths."""
        return []


def read_picture(path: str, flag: str):
    """The picture at `path`, or an SdxError naming `flag`."""
    try:
        return images.decode(path)
    except images.UnreadableImage as e:
        raise SdxError(f"{flag} {path}: cannot read the image ({e})") from None


def per_model(values: list | None, n: int, flag: str, models: str) -> list | None:
    """A flag's values given once or once per model of the `models` flag, as one per model (None stays None)."""
    if values is None or len(values) == n:
        return values
    if len(values) == 1:
        return values * n
    raise SdxError(f"{flag}: give one value or one per {models} ({n}), not {len(values)}")


def pictures_per_model(args: argparse.Namespace, models: str, pictures: str, refiner: str) -> list:
    """The pictures of flag `pictures` (an argparse destination, e.g. "control_image"), one per model of flag
    `models` ("controlnet"), read; refused with --refiner (`refiner`: why, in the user's words)."""
    n, given = len(getattr(args, models)), getattr(args, pictures)
    flag, picture_flag = "--" + models.replace("_", "-"), "--" + pictures.replace("_", "-")
    if len(given) != n:
        raise SdxError(f"give one {picture_flag} per {flag} ({n}), not {len(given)}")
    if n and args.refiner:
        raise SdxError(f"{flag} and --refiner do not go together: {refiner}")
    return [read_picture(path, picture_flag) for path in given]
