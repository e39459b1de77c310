"""The shapes world the default models learn: one shape of one colour on a plain background of another.

    python -m train.shapes captions OUT --count 10000 --seed 0 [--size 64] [--format parquet|imagefolder]
        [--look outline]
    python -m train.shapes edits OUT --count 10000 --seed 0 [--size 64]
    python -m train.shapes draw "a red circle on a blue background" OUT.png [--size 64] [--scale 0.25]

`captions` writes a text-to-image dataset ("a red circle on a blue background"), `edits` InstructPix2Pix
pairs ("make the circle green", "make the background white", "turn the circle into a square"; the rest
of the picture unchanged), `draw` one centred picture. `--look outline` draws the shapes as outlines, a look
the default models never saw (the README's LoRA learns it). Example i is drawn from
`np.random.default_rng([seed, i])` alone, so a dataset is reproducible and the same whatever the number of
shards. Bad input ends with one `error:` line and exit status 2.

Geometry (fractions of the image side, y down): every shape has the same area for the same `scale`
(its area over the image's), so a shape change keeps the area and the centre. The square has side
sqrt(scale), the circle radius sqrt(scale/pi), the triangle points up with base = height = sqrt(2 scale),
centred on its bounding box. Random scenes take scale in [0.20, 0.30] and move the centre by up to 8% of
the side, keeping every shape at least 6% of the side away from the border. Shapes are not rotated: the
bounding-box analysis in `train.shapes_eval` stays exact. Edges are anti-aliased by 4x4 supersampling.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import io
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from sdx.errors import ArgumentParser, SdxError, run_command

# The palette: saturated, far-apart sRGB values (the closest pair, yellow/orange, is 104 apart).
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (215, 25, 25),
    "green": (30, 165, 50),
    "blue": (25, 60, 235),
    "yellow": (250, 235, 30),
    "purple": (150, 35, 190),
    "orange": (250, 135, 0),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
COLOURS = tuple(PALETTE)
SHAPES = ("circle", "square", "triangle")
EDIT_KINDS = ("colour", "background", "shape")  # what an edit changes

SCALE_RANGE = (0.20, 0.30)  # random scenes: shape area / image area
CENTRE_JITTER = 0.08  # random scenes: the centre moves up to this fraction of the side
MARGIN = 0.06  # every shape keeps this fraction of the side clear of the border
SUPERSAMPLE = 4
DEFAULT_SIZE = 64
LOOKS = ("filled", "outline")  # how a picture draws its shape: all of it, or its rim around a hole
OUTLINE_HOLE = 0.6  # an outline's hole: the same shape about the same centre, this fraction of its width


def half_extent(shape: str, scale: float) -> float:
    """Half the side of `shape`'s (square) bounding box, as a fraction of the image side."""
    if shape == "square":
        return math.sqrt(scale) / 2
    if shape == "circle":
        return math.sqrt(scale / math.pi)
    if shape == "triangle":
        return math.sqrt(2 * scale) / 2
    raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


@dataclasses.dataclass(frozen=True)
class Scene:
    """One picture of the world. centre: (x, y) of the shape's bounding-box centre, fractions of the
    width and height; scale: the shape's area over the image's."""

    shape: str
    colour: str
    background: str
    centre: tuple[float, float] = (0.5, 0.5)
    scale: float = 0.25

    def __post_init__(self):
        object.__setattr__(self, "centre", tuple(float(c) for c in self.centre))
        object.__setattr__(self, "scale", float(self.scale))
        if len(self.centre) != 2:
            raise ValueError(f"centre {self.centre}: give (x, y)")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; choose one of {', '.join(SHAPES)}")
        for name in (self.colour, self.background):
            if name not in PALETTE:
                raise ValueError(f"unknown colour {name!r}; choose one of {', '.join(COLOURS)}")
        if self.colour == self.background:
            raise ValueError(f"a {self.colour} shape on a {self.background} background would be invisible")
        half = half_extent(self.shape, self.scale)
        if not 0 < self.scale or any(c - half < 0 or c + half > 1 for c in self.centre):
            raise ValueError(f"a {self.shape} of scale {self.scale} at {self.centre} does not fit in the image")

    @classmethod
    def random(cls, rng: np.random.Generator, *, shape: str | None = None, colour: str | None = None,
               background: str | None = None) -> Scene:
        """A random scene (the given attributes fixed), with the size and position jitter."""
        shape = shape or SHAPES[rng.integers(len(SHAPES))]
        colour = colour or str(rng.choice([c for c in COLOURS if c != background]))
        background = background or str(rng.choice([c for c in COLOURS if c != colour]))
        scale = float(rng.uniform(*SCALE_RANGE))
        # the jitter every shape of this scale can take, so a shape change keeps the centre
        room = 0.5 - max(half_extent(s, scale) for s in SHAPES) - MARGIN
        jitter = min(CENTRE_JITTER, room)
        cx, cy = (float(0.5 + v) for v in rng.uniform(-jitter, jitter, size=2))
        return cls(shape, colour, background, (cx, cy), scale)

    def coverage(self, size: int, look: str = "filled") -> np.ndarray:
        """(size, size) float64 in [0, 1]: how much of each pixel the shape (drawn in `look`) covers (4x4 samples)."""
        if look == "outline":
            return self.coverage(size) - dataclasses.replace(self, scale=self.scale * OUTLINE_HOLE**2).coverage(size)
        if look != "filled":
            raise ValueError(f"unknown look {look!r}; choose one of {', '.join(LOOKS)}")
        n = size * SUPERSAMPLE
        t = (np.arange(n) + 0.5) / n  # sample centres, fractions of the side
        x, y = t[None, :], t[:, None]
        cx, cy = self.centre
        half = half_extent(self.shape, self.scale)
        if self.shape == "square":
            inside = (np.abs(x - cx) <= half) & (np.abs(y - cy) <= half)
        elif self.shape == "circle":
            inside = (x - cx) ** 2 + (y - cy) ** 2 <= half**2
        else:  # apex at the top centre; at depth d below it the triangle is d/2 wide either side
            depth = y - (cy - half)
            inside = (depth >= 0) & (depth <= 2 * half) & (np.abs(x - cx) <= depth / 2)
        return inside.reshape(size, SUPERSAMPLE, size, SUPERSAMPLE).mean(axis=(1, 3))

    def render(self, size: int = DEFAULT_SIZE, look: str = "filled") -> np.ndarray:
        """(size, size, 3) uint8."""
        if size < 8:
            raise ValueError(f"size {size}: images must be at least 8 pixels")
        a = self.coverage(size, look)[..., None]
        fg, bg = np.asarray(PALETTE[self.colour], np.float64), np.asarray(PALETTE[self.background], np.float64)
        return np.round(bg + (fg - bg) * a).astype(np.uint8)

    def prompt(self) -> str:
        return f"{article(self.colour)} {self.colour} {self.shape} on {article(self.background)} {self.background} background"

    def attributes(self) -> tuple[str, str, str]:
        return self.shape, self.colour, self.background

    def with_colour(self, colour: str) -> Scene:
        return dataclasses.replace(self, colour=colour)

    def with_background(self, background: str) -> Scene:
        return dataclasses.replace(self, background=background)

    def with_shape(self, shape: str) -> Scene:
        """The same centre and area, another shape."""
        return dataclasses.replace(self, shape=shape)

    def edit(self, kind: str, target: str) -> tuple[str, Scene]:
        """(instruction, edited scene) for an edit of `kind` ("colour", "background", "shape") to `target`."""
        if kind == "colour":
            if target == self.colour:
                raise ValueError(f"the {self.shape} is {target} already")
            return f"make the {self.shape} {target}", self.with_colour(target)
        if kind == "background":
            if target == self.background:
                raise ValueError(f"the background is {target} already")
            return f"make the background {target}", self.with_background(target)
        if kind == "shape":
            if target == self.shape:
                raise ValueError(f"the shape is a {target} already")
            return f"turn the {self.shape} into {article(target)} {target}", self.with_shape(target)
        raise ValueError(f"unknown edit {kind!r}; choose one of {', '.join(EDIT_KINDS)}")

    def edit_targets(self, kind: str) -> list[str]:
        """Every target an edit of `kind` can take this scene to (never making the shape invisible)."""
        if kind == "colour":
            return [c for c in COLOURS if c not in (self.colour, self.background)]
        if kind == "background":
            return [c for c in COLOURS if c not in (self.colour, self.background)]
        if kind == "shape":
            return [s for s in SHAPES if s != self.shape]
        raise ValueError(f"unknown edit {kind!r}; choose one of {', '.join(EDIT_KINDS)}")

    def random_edit(self, rng: np.random.Generator, kind: str | None = None) -> tuple[str, str, Scene]:
        """(kind, instruction, edited scene) for a random edit (of `kind` when given)."""
        kind = kind or EDIT_KINDS[rng.integers(len(EDIT_KINDS))]
        targets = self.edit_targets(kind)
        return (kind, *self.edit(kind, targets[rng.integers(len(targets))]))


def render(shape: str, colour: str, background: str, *, size: int = DEFAULT_SIZE,
           rng: np.random.Generator | None = None) -> np.ndarray:
    """(size, size, 3) uint8: `shape` in `colour` on `background`, jittered by `rng` (centred, scale 0.25
    without one)."""
    scene = Scene(shape, colour, background) if rng is None else Scene.random(
        rng, shape=shape, colour=colour, background=background)
    return scene.render(size)


def parse_prompt(prompt: str) -> tuple[str, str, str]:
    """(shape, colour, background) of a `Scene.prompt()` sentence."""
    words = prompt.strip().lower().split()
    if (len(words) != 7 or words[0] not in ("a", "an") or words[3] != "on" or words[4] not in ("a", "an")
            or words[6] != "background" or words[2] not in SHAPES or words[1] not in PALETTE or words[5] not in PALETTE):
        raise ValueError(f"{prompt!r} is not 'a COLOUR SHAPE on a COLOUR background'")
    return words[2], words[1], words[5]


def parse_instruction(instruction: str) -> tuple[str, str]:
    """(kind, target) of a `Scene.edit` instruction."""
    words = instruction.strip().lower().split()
    if len(words) == 4 and words[:2] == ["make", "the"] and words[2] == "background" and words[3] in PALETTE:
        return "background", words[3]
    if len(words) == 4 and words[:2] == ["make", "the"] and words[2] in SHAPES and words[3] in PALETTE:
        return "colour", words[3]
    if (len(words) == 6 and words[:2] == ["turn", "the"] and words[2] in SHAPES and words[3] == "into"
            and words[4] in ("a", "an") and words[5] in SHAPES):
        return "shape", words[5]
    raise ValueError(f"{instruction!r} is not a shapes-world edit instruction")


# ---------------------------------------------------------------------------------------------- datasets


def caption_example(seed: int, index: int, size: int = DEFAULT_SIZE, look: str = "filled") -> tuple[Scene, np.ndarray]:
    """Example `index` of the text-to-image dataset of `seed`: its scene and image (the scene is the same in
    every look)."""
    scene = Scene.random(np.random.default_rng([seed, index]))
    return scene, scene.render(size, look)


def edit_example(seed: int, index: int, size: int = DEFAULT_SIZE) -> tuple[str, str, Scene, Scene]:
    """Example `index` of the edit dataset of `seed`: (kind, instruction, input scene, edited scene)."""
    rng = np.random.default_rng([seed, index])
    scene = Scene.random(rng)
    kind, instruction, edited = scene.random_edit(rng)
    return kind, instruction, scene, edited


def png_bytes(image: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _image_struct(image: np.ndarray) -> dict:
    return {"bytes": png_bytes(image), "path": None}  # the hub's Image feature


def _caption_rows(seed: int, indices, size: int, look: str = "filled") -> dict[str, list]:
    cols = {"image": [], "text": [], "shape": [], "colour": [], "background": []}
    for i in indices:
        scene, image = caption_example(seed, i, size, look)
        cols["image"].append(_image_struct(image))
        cols["text"].append(scene.prompt())
        for key, value in zip(("shape", "colour", "background"), scene.attributes()):
            cols[key].append(value)
    return cols


def _edit_rows(seed: int, indices, size: int) -> dict[str, list]:
    cols = {k: [] for k in ("input_image", "edit_prompt", "edited_image", "edit", "shape", "colour", "background",
                             "edited_shape", "edited_colour", "edited_background")}
    for i in indices:
        kind, instruction, scene, edited = edit_example(seed, i, size)
        cols["input_image"].append(_image_struct(scene.render(size)))
        cols["edit_prompt"].append(instruction)
        cols["edited_image"].append(_image_struct(edited.render(size)))
        cols["edit"].append(kind)
        for key, a, b in zip(("shape", "colour", "background"), scene.attributes(), edited.attributes()):
            cols[key].append(a)
            cols[f"edited_{key}"].append(b)
    return cols


def _parquet_table(cols: dict[str, list], info: dict):
    import pyarrow as pa

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    fields = [pa.field(k, image if isinstance(v[0], dict) else pa.string()) for k, v in cols.items()]
    features = {k: {"_type": "Image"} if isinstance(v[0], dict) else {"dtype": "string", "_type": "Value"}
                for k, v in cols.items()}
    schema = pa.schema(fields, metadata={
        "huggingface": json.dumps({"info": {"features": features}}),  # how `datasets` knows the Image columns
        "sdx_shapes": json.dumps(info),
    })
    return pa.table({k: pa.array(v, type=f.type) for (k, v), f in zip(cols.items(), fields)}, schema=schema)


def shard_ranges(count: int, shards: int) -> list[range]:
    """Contiguous, near-equal index ranges, one per shard."""
    bounds = [count * k // shards for k in range(shards + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def default_shards(count: int) -> int:
    return max(1, min(count, math.ceil(count / 1000)))


def _write_parquet(out: Path, rows, seed: int, count: int, size: int, shards: int, kind: str, look: str) -> None:
    import pyarrow.parquet as pq

    (out / "data").mkdir()
    info = {"dataset": kind, "seed": seed, "count": count, "size": size, "look": look, "palette": PALETTE}
    for k, indices in enumerate(shard_ranges(count, shards)):
        table = _parquet_table(rows(seed, indices, size), {**info, "shard": k, "first_index": indices.start})
        pq.write_table(table, out / "data" / f"train-{k:05d}-of-{shards:05d}.parquet")


def _write_imagefolder(out: Path, seed: int, count: int, size: int, look: str) -> None:
    folder = out / "train"
    folder.mkdir()
    digits = max(6, len(str(count - 1)))
    with open(folder / "metadata.jsonl", "w") as meta:
        for i in range(count):
            scene, image = caption_example(seed, i, size, look)
            name = f"{i:0{digits}d}.png"
            (folder / name).write_bytes(png_bytes(image))
            shape, colour, background = scene.attributes()
            meta.write(json.dumps({"file_name": name, "text": scene.prompt(), "shape": shape, "colour": colour,
                                   "background": background}) + "\n")


def write_dataset(out: str | os.PathLike, kind: str, *, count: int, seed: int = 0, size: int = DEFAULT_SIZE,
                  format: str = "parquet", shards: int | None = None, overwrite: bool = False,
                  look: str = "filled") -> Path:
    """Write the `kind` ("captions" or "edits") dataset to the folder `out`, atomically: it is built under a
    temporary name beside `out` and renamed into place once complete.

    parquet: out/data/train-0000k-of-0000n.parquet; captions have columns image (the hub's Image struct,
    {bytes: PNG, path: None}), text, shape, colour, background; edits have input_image, edit_prompt,
    edited_image (InstructPix2Pix's names), edit (the kind), shape, colour, background and edited_shape,
    edited_colour, edited_background. imagefolder (captions only): out/train/NNNNNN.png and
    out/train/metadata.jsonl with file_name, text, shape, colour, background. look (captions only): how the
    pictures draw their shapes (`LOOKS`); the scenes and captions are the same in every look.
    """
    out = Path(out)
    if kind not in ("captions", "edits"):
        raise SdxError(f"unknown dataset {kind!r}; choose captions or edits")
    if format not in ("parquet", "imagefolder"):
        raise SdxError(f"--format {format}: choose parquet or imagefolder")
    if kind == "edits" and format != "parquet":
        raise SdxError("edit pairs are written as parquet only (two images per example)")
    if look not in LOOKS or (kind == "edits" and look != "filled"):
        raise SdxError(f"--look {look}: captions take one of {', '.join(LOOKS)}; edits are filled")
    if count < 1:
        raise SdxError(f"--count {count} must be at least 1")
    if seed < 0:
        raise SdxError(f"--seed {seed} must be a non-negative integer")
    if size < 8:
        raise SdxError(f"--size {size} must be at least 8 pixels")
    shards = default_shards(count) if shards is None else shards
    if not 1 <= shards <= count:
        raise SdxError(f"--shards {shards}: give between 1 and --count ({count}) shards")
    if out.exists() and not overwrite:
        raise SdxError(f"{out} exists; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if format == "imagefolder":
            _write_imagefolder(tmp, seed, count, size, look)
        else:
            rows = functools.partial(_caption_rows, look=look) if kind == "captions" else _edit_rows
            _write_parquet(tmp, rows, seed, count, size, shards, kind, look)
        os.chmod(tmp, 0o777 & ~_umask())
        if out.exists():  # --overwrite: the old folder goes only once the new one is complete
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ------------------------------------------------------------------------------------------------- CLI



def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m train.shapes", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="kind", required=True, metavar="{captions,edits,draw}", parser_class=ArgumentParser)
    for kind, help in (("captions", "text-to-image examples: image, text"),
                       ("edits", "InstructPix2Pix pairs: input_image, edit_prompt, edited_image")):
        s = sub.add_parser(kind, help=help, description=help)
        s.add_argument("out", metavar="OUT", help="the dataset folder to write")
        s.add_argument("--count", type=int, required=True, help="number of examples")
        s.add_argument("--seed", type=int, default=0, help="example i comes from np.random.default_rng([seed, i])")
        s.add_argument("--size", type=int, default=DEFAULT_SIZE, help=f"image side in pixels (default {DEFAULT_SIZE})")
        s.add_argument("--shards", type=int, help="parquet files (default: one per 1000 examples)")
        s.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
        if kind == "captions":
            s.add_argument("--format", choices=("parquet", "imagefolder"), default="parquet",
                           help="parquet shards under OUT/data, or OUT/train/*.png with metadata.jsonl")
            s.add_argument("--look", choices=LOOKS, default="filled",
                           help="how the pictures draw their shapes: filled, or as outlines (a look the default "
                                "models never saw)")
    s = sub.add_parser("draw", help="one picture of the world, centred, as a PNG file",
                       description="one picture of the world, centred, as a PNG file")
    s.add_argument("prompt", metavar="PROMPT", help="what to draw: 'a COLOUR SHAPE on a COLOUR background'")
    s.add_argument("out", metavar="OUT.png", help="the PNG file to write")
    s.add_argument("--size", type=int, default=DEFAULT_SIZE, help="image side in pixels")
    s.add_argument("--scale", type=float, default=0.25, help="the shape's area over the picture's")
    s.add_argument("--look", choices=LOOKS, default="filled", help="how to draw the shape")
    return p


def draw(prompt: str, out: str | os.PathLike, *, size: int = DEFAULT_SIZE, scale: float = 0.25,
         look: str = "filled") -> Path:
    """Write the centred picture of `prompt` (`parse_prompt`'s sentence), its shape covering `scale` of it, as a
    PNG file at `out`."""
    from sdx import io as sdx_io

    if not 0 < scale < 1:
        raise SdxError(f"--scale {scale}: the shape's share of the picture is between 0 and 1")
    try:
        scene = Scene(*parse_prompt(prompt), scale=scale)
        image = scene.render(size, look)
    except ValueError as e:
        raise SdxError(str(e)) from None
    out = Path(out)
    sdx_io.check_writable(out.parent, "OUT")
    out.parent.mkdir(parents=True, exist_ok=True)
    sdx_io.atomic_write(out, lambda f: f.write(png_bytes(image)))
    return out


def main(argv: list[str] | None = None) -> int:
    def body():
        args = parser().parse_args(argv)
        if args.kind == "draw":
            print(f"wrote {draw(args.prompt, args.out, size=args.size, scale=args.scale, look=args.look)}",
                  file=sys.stderr)
            return
        out = write_dataset(args.out, args.kind, count=args.count, seed=args.seed, size=args.size,
                            format=getattr(args, "format", "parquet"), shards=args.shards, overwrite=args.overwrite,
                            look=getattr(args, "look", "filled"))
        print(f"wrote {args.count} {args.kind} examples to {out}", file=sys.stderr)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
