"""Reading a shapes-world picture back, and how often a model draws what it was asked for.

    python -m train.shapes_eval --model FOLDER [--edit-model FOLDER] [--vae-model FOLDER] [--seeds 2] [--steps 30]

`read(image)` is a fixed, deterministic reader (no learning): the background is the palette colour
nearest the median of the border pixels; the foreground is the largest 4-connected region of pixels
nearer the shape's median colour than the background's (so an anti-aliased edge counts where it is
more than half covered); its colour is the palette colour nearest its median; its shape is the
template (square = the bounding box, circle = the inscribed disc, triangle = the upright inscribed
triangle) that overlaps it best (intersection over union), a bounding box far from square or an overlap
under `MIN_IOU` leaving it unread. The nearest template takes a rounded diamond for a circle, so the reports
also judge strictly (`Reading.strict_shape`): a circle must fill its circumscribed circle (`roundness` >=
`MIN_ROUNDNESS`), a square or triangle fit its own template with IoU >= `STRICT_IOU`.

`evaluate_text_to_image(generate)` asks for every shape x colour x other background (168 prompts) per
seed and reads each picture; `evaluate_edits(edit)` edits generated pictures (each combination once per
edit kind and seed) and checks the edited attribute changed as asked and the other two did not;
`evaluate_reconstruction(reconstruct)` reads a VAE's encode-decode of a picture of every combination, the
ceiling that VAE sets for any diffusion model drawing through it. All take plain callables, so any model
(or the generator itself) can be measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from sdx import io
from sdx.errors import ArgumentParser, SdxError, run_command
from train.shapes import COLOURS, EDIT_KINDS, PALETTE, SHAPES, Scene

ROUGH_DISTANCE = 48.0  # RGB distance from the background that surely is foreground (a first guess)
MIN_AREA = 0.01  # a foreground under this fraction of the image is no shape
MIN_IOU = 0.6  # the best template must overlap the foreground this well
MAX_ASPECT = 1.5  # every shape of the world has a square bounding box
# The strict judgement (`Reading.strict_shape`), calibrated at 64x64 on 3,000 random scenes of each shape and on
# drawn wrong shapes (tests/test_shapes.py draws both). A circle needs `roundness` >= MIN_ROUNDNESS: the world's
# discs score 0.978-1.014 (median 0.998), a rounded diamond 0.79-0.91, the superellipse |x|^1.5 + |y|^1.5 <= 1
# 0.92. A square or a triangle needs its own template's IoU >= STRICT_IOU: the world's squares 0.996-1.0, a square
# whose sides bow in by 5 % of its half side 0.94, by 10 % 0.90 (corners rounded to a quarter of the side pass,
# 0.953); the world's triangles 0.930-1.0 (median 0.977), one with its corners rounded by 2.6 pixels 0.88, its
# apex cut at a fifth of its height 0.85, its sides bowed in by a fifth 0.89 (at the line: corners rounded by 1.3
# pixels 0.90). The pixel grid costs a small triangle more (the world's own go down to 0.915 at 48x48, 0.875 at
# 32x32): the judgement is meant for 64x64 pictures and larger.
MIN_ROUNDNESS = 0.95
STRICT_IOU = {"square": 0.95, "triangle": 0.90}

_PALETTE = np.asarray([PALETTE[c] for c in COLOURS], np.float64)
_ATTRIBUTES = ("shape", "colour", "background")


def nearest_colour(rgb) -> str:
    """The palette colour nearest `rgb` (Euclidean in sRGB)."""
    return COLOURS[int(np.argmin(np.linalg.norm(_PALETTE - np.asarray(rgb, np.float64), axis=-1)))]


@dataclasses.dataclass(frozen=True)
class Reading:
    """What `read` saw. None for what it could not read; centre (x, y) of the shape's bounding box and
    area, as fractions of the image; iou: how well the chosen template fits (0 when unread); roundness: the
    foreground's `roundness` (0 when there is none)."""

    shape: str | None
    colour: str | None
    background: str | None
    centre: tuple[float, float] | None = None
    area: float = 0.0
    iou: float = 0.0
    roundness: float = 0.0

    def attributes(self) -> tuple[str | None, str | None, str | None]:
        return self.shape, self.colour, self.background

    @property
    def strict_shape(self) -> str | None:
        """The shape if it is drawn well, else None: a circle with `roundness` >= MIN_ROUNDNESS, a square or a
        triangle whose template fits with IoU >= STRICT_IOU[shape] (nearest-template reading alone lets a rounded
        diamond pass for a circle)."""
        if self.shape == "circle":
            return self.shape if self.roundness >= MIN_ROUNDNESS else None
        return self.shape if self.shape is not None and self.iou >= STRICT_IOU[self.shape] else None

    def strict_attributes(self) -> tuple[str | None, str | None, str | None]:
        """`attributes()` with `strict_shape` for the shape."""
        return self.strict_shape, self.colour, self.background

    def scene(self) -> Scene | None:
        """The scene this reading describes (None if it is incomplete or does not fit the world)."""
        try:
            return Scene(self.shape, self.colour, self.background, self.centre, self.area)
        except (ValueError, TypeError):
            return None


def largest_component(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected region of a boolean (H, W) mask (all False if the mask is empty)."""
    h, w = mask.shape
    if not mask.any():
        return mask.copy()
    empty = h * w
    lab = np.where(mask, np.arange(h * w).reshape(h, w), empty)
    while True:  # each pixel takes the smallest index in its region: neighbour minima, then pointer jumps
        m = lab.copy()
        np.minimum(m[1:], lab[:-1], out=m[1:])
        np.minimum(m[:-1], lab[1:], out=m[:-1])
        np.minimum(m[:, 1:], lab[:, :-1], out=m[:, 1:])
        np.minimum(m[:, :-1], lab[:, 1:], out=m[:, :-1])
        m = np.where(mask, m, empty)
        m = np.append(m.ravel(), empty)[m]  # a label is a pixel of the same region: take that pixel's label
        if np.array_equal(m, lab):
            break
        lab = m
    counts = np.bincount(lab[mask])
    return lab == int(np.argmax(counts))


def templates(h: int, w: int) -> dict[str, np.ndarray]:
    """Each shape drawn into an (h, w) bounding box, sampled at pixel centres."""
    u = (np.arange(w) + 0.5)[None, :] / w  # 0..1 across
    v = (np.arange(h) + 0.5)[:, None] / h  # 0..1 down
    return {
        "circle": (2 * u - 1) ** 2 + (2 * v - 1) ** 2 <= 1,
        "square": np.ones((h, w), bool),
        "triangle": np.abs(u - 0.5) <= v / 2,
    }


def _border(x: np.ndarray) -> np.ndarray:
    b = max(1, min(x.shape[:2]) // 32)
    return np.concatenate([x[:b].reshape(-1, 3), x[-b:].reshape(-1, 3), x[b:-b, :b].reshape(-1, 3),
                           x[b:-b, -b:].reshape(-1, 3)])


def roundness(mask: np.ndarray) -> float:
    """How much of its circumscribed circle a foreground fills: the number of pixels in `mask` (H, W) bool over
    the area of the circle centred on their centroid through the farthest pixel centre of them (0 for fewer
    than two pixels). A disc drawn by the world scores about 1 (0.978-1.014 at 64x64), a square 2/pi = 0.64 (the
    world's, whose farthest pixel centres lie half a pixel inside the corners, 0.67-0.73), the world's triangle
    0.37-0.41; a rounded diamond (a square turned 45 degrees, its corners rounded) about 0.8."""
    ys, xs = np.nonzero(mask)
    if len(ys) < 2:
        return 0.0
    r2 = float(((ys - ys.mean()) ** 2 + (xs - xs.mean()) ** 2).max())
    return float(len(ys) / (np.pi * r2))


def analyse(image) -> tuple[Reading, np.ndarray]:
    """(reading, foreground mask (H, W) bool) of a uint8 (H, W, 3) image."""
    img = np.asarray(image)
    if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8 or min(img.shape[:2]) < 8:
        raise ValueError(f"read takes one uint8 (H, W, 3) image of at least 8x8 pixels, not {img.dtype} {img.shape}")
    x = img.astype(np.float64)
    h, w = img.shape[:2]
    bg = np.median(_border(x), axis=0)
    background = nearest_colour(bg)
    d_bg = np.linalg.norm(x - bg, axis=-1)
    rough = d_bg > ROUGH_DISTANCE
    nothing = Reading(None, None, background)
    if rough.sum() < MIN_AREA * h * w:
        return nothing, np.zeros((h, w), bool)
    fg = np.median(x[rough], axis=0)
    mask = largest_component(np.linalg.norm(x - fg, axis=-1) < d_bg)
    area = float(mask.sum()) / (h * w)
    if area < MIN_AREA:
        return nothing, np.zeros((h, w), bool)
    colour = nearest_colour(np.median(x[mask], axis=0))
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    y0, y1, x0, x1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    centre = (float(x0 + x1) / 2 / w, float(y0 + y1) / 2 / h)
    box = mask[y0:y1, x0:x1]
    bh, bw = box.shape
    ious = {}
    for name, t in templates(bh, bw).items():
        ious[name] = float((box & t).sum() / (box | t).sum())
    best = max(SHAPES, key=lambda s: ious[s])
    shape = best if ious[best] >= MIN_IOU and max(bh, bw) <= MAX_ASPECT * min(bh, bw) else None
    return Reading(shape, colour, background, centre, area, ious[best], roundness(mask)), mask


def read(image) -> Reading:
    """Shape, colour and background of a uint8 (H, W, 3) picture; see the module's docstring."""
    return analyse(image)[0]


# ----------------------------------------------------------------------------------------------- harness


@dataclasses.dataclass(frozen=True)
class Item:
    """One judged picture: what was asked (prompt or instruction, seed, expected attributes) and what was
    read; iou: edits only, the overlap of the read foreground with the expected picture's shape."""

    text: str
    seed: int
    expected: tuple[str, str, str]
    read: Reading
    iou: float | None = None


@dataclasses.dataclass(frozen=True)
class Report:
    """Accuracies (fractions in [0, 1]) over `items`. Text-to-image: shape, colour, background, all (the
    three at once). Edits of one kind: edited (the changed attribute as asked), kept (the other two as
    before), all, and iou (the mean overlap of the foreground with where the shape should be). strict: the
    same accuracies (iou aside) with every shape judged by `Reading.strict_shape`."""

    name: str
    items: tuple[Item, ...]
    accuracy: dict[str, float]
    strict: dict[str, float]

    @property
    def count(self) -> int:
        return len(self.items)

    def circle_roundness(self) -> list[float]:
        """The `roundness` of every picture meant to show a circle."""
        return [i.read.roundness for i in self.items if i.expected[0] == "circle"]

    def strict_by_shape(self) -> dict[str, float]:
        """{shape: the fraction of the pictures meant to show it that are right in all three attributes, strictly}."""
        return {shape: _fraction(i.read.strict_attributes() == i.expected for i in self.items if i.expected[0] == shape)
                for shape in SHAPES}

    def failures(self, strict: bool = False) -> list[Item]:
        """The items read wrong (strict: under the strict judgement)."""
        judge = Reading.strict_attributes if strict else Reading.attributes
        return [i for i in self.items if judge(i.read) != i.expected]


def combinations() -> list[tuple[str, str, str]]:
    """Every (shape, colour, background) of the world: 3 x 8 x 7 = 168."""
    return [(s, c, b) for s, c, b in itertools.product(SHAPES, COLOURS, COLOURS) if c != b]


def _images(out, n: int, what: str) -> np.ndarray:
    arr = np.asarray(out)
    if arr.ndim != 4 or arr.shape[0] != n or arr.shape[3] != 3 or arr.dtype != np.uint8:
        raise ValueError(f"{what} must return {n} uint8 (H, W, 3) images, not {arr.dtype} {arr.shape}")
    return arr


def _fraction(flags) -> float:
    flags = list(flags)
    return float(np.mean(flags)) if flags else float("nan")


def evaluate_text_to_image(generate: Callable[[list[str], list[int]], np.ndarray], *,
                           seeds: Sequence[int] = (0, 1)) -> Report:
    """Ask `generate(prompts, seeds)` (-> uint8 (N, H, W, 3), image i for prompts[i] with seeds[i]) for
    every combination of the world once per seed, in one call, and read every picture."""
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("give at least one seed")
    asked = [(Scene(*c).prompt(), s, c) for s in seeds for c in combinations()]
    images = _images(generate([a[0] for a in asked], [a[1] for a in asked]), len(asked), "generate")
    return _attribute_report("text-to-image", [Item(text, seed, expected, read(img))
                                               for (text, seed, expected), img in zip(asked, images)])


def evaluate_reconstruction(reconstruct: Callable[[np.ndarray], np.ndarray], *, seeds: Sequence[int] = (0,),
                            size: int = 64) -> Report:
    """`reconstruct(images)` (uint8 (N, H, W, 3) in and out; a VAE's encode then decode) applied, in one call,
    to a picture of every combination per seed (positions and sizes drawn from the seed), each result read."""
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("give at least one seed")
    scenes = [(s, Scene.random(np.random.default_rng([0x5EED, s, len(EDIT_KINDS), c]), shape=shape, colour=colour,
                               background=background))
              for s in seeds for c, (shape, colour, background) in enumerate(combinations())]
    images = np.stack([scene.render(size) for _, scene in scenes])
    out = _images(reconstruct(images), len(scenes), "reconstruct")
    return _attribute_report("VAE", [Item(scene.prompt(), s, scene.attributes(), read(img))
                                     for (s, scene), img in zip(scenes, out)])


def _attribute_report(name: str, items: list[Item]) -> Report:
    """Each attribute's accuracy, and all three at once, over pictures each meant to show `expected`, as read and
    under the strict judgement."""
    def accuracy(judge):
        acc = {a: _fraction(judge(i.read)[k] == i.expected[k] for i in items) for k, a in enumerate(_ATTRIBUTES)}
        acc["all"] = _fraction(judge(i.read) == i.expected for i in items)
        return acc

    return Report(name, tuple(items), accuracy(Reading.attributes), accuracy(Reading.strict_attributes))


def edit_cases(seed: int, kind: str) -> list[tuple[str, Scene, Scene]]:
    """[(instruction, input scene, expected scene)]: one edit of `kind` of every combination of the world,
    positions and targets drawn from `seed` (a stream apart from the training datasets')."""
    kind_index = EDIT_KINDS.index(kind)
    cases = []
    for c, (shape, colour, background) in enumerate(combinations()):
        rng = np.random.default_rng([0x5EED, seed, kind_index, c])
        scene = Scene.random(rng, shape=shape, colour=colour, background=background)
        _, instruction, edited = scene.random_edit(rng, kind)
        cases.append((instruction, scene, edited))
    return cases


def evaluate_edits(edit: Callable[[np.ndarray, list[str], list[int]], np.ndarray], *, seeds: Sequence[int] = (0, 1),
                   size: int = 64, kinds: Sequence[str] = EDIT_KINDS) -> dict[str, Report]:
    """{kind: Report}: `edit(images, instructions, seeds)` (uint8 (N, H, W, 3) in and out) applied to every
    combination of the world once per edit kind and seed, in one call, each result read and compared."""
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("give at least one seed")
    for kind in kinds:
        if kind not in EDIT_KINDS:
            raise ValueError(f"unknown edit {kind!r}; choose from {', '.join(EDIT_KINDS)}")
    asked = [(kind, s, *case) for kind in kinds for s in seeds for case in edit_cases(s, kind)]
    inputs = np.stack([a[3].render(size) for a in asked])
    out = _images(edit(inputs, [a[2] for a in asked], [a[1] for a in asked]), len(asked), "edit")
    if out.shape[1:3] != (size, size):
        raise ValueError(f"edit returned {out.shape[1]}x{out.shape[2]} images for {size}x{size} inputs")
    reports = {}
    for kind in kinds:
        k = _ATTRIBUTES.index(kind)
        items = []
        for (kd, seed, text, _, expected), img in zip(asked, out):
            if kd != kind:
                continue
            reading, mask = analyse(img)
            want = expected.coverage(size) >= 0.5
            items.append(Item(text, seed, expected.attributes(), reading, float((mask & want).sum() / (mask | want).sum())))
        reports[kind] = Report(f"edit: {kind}", tuple(items),
                               {**_edit_accuracy(items, k, Reading.attributes), "iou": _fraction(i.iou for i in items)},
                               _edit_accuracy(items, k, Reading.strict_attributes))
    return reports


def _edit_accuracy(items: list[Item], k: int, judge) -> dict[str, float]:
    """edited (attribute k as asked), kept (the other two as before) and all, over edits of one kind, each
    picture's attributes given by `judge(reading)`."""
    got = [judge(i.read) for i in items]
    edited = [g[k] == i.expected[k] for g, i in zip(got, items)]
    kept = [all(g[j] == i.expected[j] for j in range(3) if j != k) for g, i in zip(got, items)]
    return {"edited": _fraction(edited), "kept": _fraction(kept), "all": _fraction(e and p for e, p in zip(edited, kept))}


def roundness_summary(reports: Sequence[Report]) -> dict[str, float] | None:
    """{count, median, min, passed (the fraction >= MIN_ROUNDNESS)} of the pictures meant to show a circle in
    `reports` (None if there are none)."""
    values = np.asarray([v for r in reports for v in r.circle_roundness()])
    if not len(values):
        return None
    return {"count": len(values), "median": float(np.median(values)), "min": float(values.min()),
            "passed": float(np.mean(values >= MIN_ROUNDNESS))}


def _roundness_lines(reports: Sequence[Report]) -> list[str]:
    r = roundness_summary(reports)
    return [] if r is None else [f"{'':14}circles' roundness: median {r['median']:.3f}, min {r['min']:.3f}; "
                                 f"{r['passed']:.3f} of {r['count']} at least {MIN_ROUNDNESS}"]


def format_reports(text: Report | None, edits: dict[str, Report] | None, vae: Report | None = None) -> str:
    """The accuracy table the CLI prints: each report as read, then under the strict judgement ("strict")."""
    lines = []
    for r in (text, vae):
        if r is None:
            continue
        a, s = r.accuracy, r.strict
        if lines:
            lines.append("")
        lines.append(f"{r.name:14}{'images':>7}  {'shape':>6}  {'colour':>6}  {'background':>10}  {'all':>6}")
        lines.append(f"{'':14}{r.count:7d}  {a['shape']:6.3f}  {a['colour']:6.3f}  {a['background']:10.3f}  {a['all']:6.3f}")
        lines.append(f"{'  strict':14}{'':7}  {s['shape']:6.3f}  {s['colour']:6.3f}  {s['background']:10.3f}  {s['all']:6.3f}")
        lines += _roundness_lines([r])
    if edits:
        if lines:
            lines.append("")
        lines.append(f"{'edit':14}{'pairs':>7}  {'edited':>6}  {'kept':>6}  {'all':>6}  {'mask IoU':>8}")
        for kind, r in edits.items():
            a, s = r.accuracy, r.strict
            lines.append(f"{kind:14}{r.count:7d}  {a['edited']:6.3f}  {a['kept']:6.3f}  {a['all']:6.3f}  {a['iou']:8.3f}")
            lines.append(f"{'  strict':14}{'':7}  {s['edited']:6.3f}  {s['kept']:6.3f}  {s['all']:6.3f}")
        lines += _roundness_lines(list(edits.values()))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- CLI



def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m train.shapes_eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="text-to-image model (sdx folder, or anything `python -m sdx.sample --model` takes)")
    p.add_argument("--edit-model", help="InstructPix2Pix model to measure on the three edit kinds")
    p.add_argument("--vae-model", help="a model whose VAE to measure: the world's pictures encoded (posterior "
                                       "mode), decoded and read back")
    p.add_argument("--seeds", type=int, default=2,
                   help="how many seeds for every prompt and edit, from --first-seed on (default 2)")
    p.add_argument("--first-seed", type=int, default=0,
                   help="start the seeds here: --first-seed 2 --seeds 2 measures seeds 2 and 3, the same pictures "
                        "as in a --seeds 4 run (default 0)")
    p.add_argument("--steps", type=int, default=30, help="inference steps (default 30)")
    p.add_argument("--guidance-scale", type=float,
                   help="classifier-free guidance (default: the model's own, else 7.5, SDXL 5.0)")
    p.add_argument("--guidance-rescale", type=float, default=0.0,
                   help="rescale of the guided prediction, as `python -m sdx.sample --guidance-rescale` (default 0)")
    p.add_argument("--image-guidance-scale", type=float, default=1.5, help="InstructPix2Pix image guidance (1.5)")
    p.add_argument("--size", type=int, help="image side in pixels (default: the model's training size)")
    p.add_argument("--scheduler", help="a `python -m sdx.sample --scheduler` name (default: the model's own)")
    p.add_argument("--batch-size", type=int, help="images per compiled call (default all)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--cache", help="converted models and compiled programs (default ~/.cache/sdx)")
    p.add_argument("--json", metavar="PATH", help="also write the accuracies to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not (args.model or args.edit_model or args.vae_model):
        p.error("give --model, --edit-model, --vae-model or several of them")
    if args.seeds < 1:
        p.error(f"--seeds {args.seeds} must be at least 1")
    if args.first_seed < 0:
        p.error(f"--first-seed {args.first_seed} must be at least 0")
    if args.steps < 1:
        p.error(f"--steps {args.steps} must be at least 1")
    if args.size is not None and args.size < 8:
        p.error(f"--size {args.size} must be at least 8 pixels")
    if args.batch_size is not None and args.batch_size < 1:
        p.error(f"--batch-size {args.batch_size} must be at least 1")


def _load(spec: str, args, cache: Path, log, *, edit: bool):
    from pipelines.pipeline import Pipeline
    from pipelines.model_names import resolve_model

    flag = "--edit-model" if edit else "--model"
    folder = resolve_model(spec, dtype=args.dtype, cache=cache, log=log)
    pipe = Pipeline.load(folder, dtype=args.dtype, scheduler=args.scheduler, name=spec)
    if pipe.family.pix2pix != edit:
        raise SdxError(f"{flag} {spec}: " + ("not an InstructPix2Pix model" if edit else
                                             "an InstructPix2Pix model edits images; pass it as --edit-model"))
    pipe.sampler.compile_log = lambda plan, s: log(f"compiled in {s:.1f} s")
    return pipe


def _by_seed(pipe, request_for, n: int, seeds: list[int], size: int, bar) -> np.ndarray:
    """Run the pipeline once per distinct seed (image j of that call gets fold_in(PRNGKey(seed), j))."""
    from pipelines.pipeline import to_uint8

    out = np.zeros((n, size, size, 3), np.uint8)
    for s in sorted(set(seeds)):
        idx = [i for i in range(n) if seeds[i] == s]
        out[idx] = to_uint8(pipe(request_for(idx, s), bar))
    return out


def _load_vae(spec: str, cache: Path, log):
    from pipelines.model_names import resolve_model
    from sdx import model_folder

    folder = resolve_model(spec, dtype="float32", cache=cache, log=log)
    if "vae" not in model_folder.read_spec(folder)["components"]:
        raise SdxError(f"--vae-model {spec}: the model has no VAE")
    return model_folder.load_component(folder, "vae")


def _pixels(images: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W, 3) -> float32 in [-1, 1], what the models take."""
    return images.astype(np.float32) / 127.5 - 1.0


def reconstructor(vae, batch_size: int | None):
    """uint8 (N, H, W, 3) -> uint8: encode, posterior mode, decode, `batch_size` pictures per call."""
    import jax

    call = jax.jit(lambda v, x: v(x))

    def reconstruct(images):
        from pipelines.pipeline import to_uint8

        x = _pixels(images)
        step = batch_size or len(x)
        out = np.concatenate([np.asarray(call(vae, x[i:i + step])) for i in range(0, len(x), step)])
        return to_uint8(np.clip((out + 1) / 2, 0, 1))

    return reconstruct


def run(args: argparse.Namespace) -> tuple[Report | None, dict[str, Report] | None, Report | None]:
    from convert.library import default_cache_dir
    from pipelines.request import Request
    from pipelines.sampler import enable_compilation_cache

    log = (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    cache = Path(args.cache) if args.cache else default_cache_dir()
    enable_compilation_cache(cache / "jax")
    bar = None
    if not args.quiet:
        from tqdm import tqdm

        bar = tqdm(desc="denoising", unit="step", total=0, file=sys.stderr)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    text = edits = vae_report = None
    try:
        if args.model:
            pipe = _load(args.model, args, cache, log, edit=False)
            size = args.size or pipe.default_size
            cfg = args.guidance_scale if args.guidance_scale is not None else pipe.family.guidance_scale

            def generate(prompts, image_seeds):
                request = lambda idx, s: Request(prompts=[prompts[i] for i in idx], height=size, width=size,
                                                 steps=args.steps, seed=s, guidance_scale=cfg,
                                                 guidance_rescale=args.guidance_rescale, batch_size=args.batch_size)
                return _by_seed(pipe, request, len(prompts), image_seeds, size, bar)

            text = evaluate_text_to_image(generate, seeds=seeds)
            del pipe
        if args.edit_model:
            pipe = _load(args.edit_model, args, cache, log, edit=True)
            size = args.size or pipe.default_size
            cfg = args.guidance_scale if args.guidance_scale is not None else pipe.family.guidance_scale

            def edit(images, instructions, image_seeds):
                pixels = _pixels(images)
                request = lambda idx, s: Request(
                    prompts=[instructions[i] for i in idx], image=pixels[idx], height=size, width=size,
                    steps=args.steps, seed=s, guidance_scale=cfg, guidance_rescale=args.guidance_rescale,
                    image_guidance_scale=args.image_guidance_scale,
                    batch_size=args.batch_size)
                return _by_seed(pipe, request, len(instructions), image_seeds, size, bar)

            edits = evaluate_edits(edit, seeds=seeds, size=size)
            del pipe
        if args.vae_model:
            vae = _load_vae(args.vae_model, cache, log)
            trained = vae.config.sample_size
            size = args.size or (trained if isinstance(trained, int) else trained[0])
            vae_report = evaluate_reconstruction(reconstructor(vae, args.batch_size), seeds=seeds, size=size)
    finally:
        if bar is not None:
            bar.close()
    return text, edits, vae_report


def to_json(text: Report | None, edits: dict[str, Report] | None, vae: Report | None = None) -> dict:
    out = {}
    if text is not None:
        out["text_to_image"] = _json_report(text)
    if vae is not None:
        out["vae_reconstruction"] = _json_report(vae)
    if edits:
        out["edits"] = {k: _json_report(r) for k, r in edits.items()}
    return out


def _json_report(r: Report) -> dict:
    return {"count": r.count, **r.accuracy, "strict": r.strict, "strict_by_shape": r.strict_by_shape(),
            "circle_roundness": roundness_summary([r])}


def main(argv: list[str] | None = None) -> int:
    def body():
        p = parser()
        args = p.parse_args(argv)
        _check_args(p, args)
        text, edits, vae = run(args)
        print(format_reports(text, edits, vae))
        if args.json:
            try:
                io.atomic_write_json(args.json, to_json(text, edits, vae))
            except OSError as e:
                raise SdxError(f"--json {args.json}: {e.strerror or e}") from None

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
