"""Training data: decode, resize, crop and flip each sample as diffusers' scripts do, and batch it with
grain, per host, resumable.

    source = open_source(spec, Columns.pix2pix(), max_samples=None, seed=0, cache_dir=None)  # train.sources
    transform = Transform(resolution=256, center_crop=False, random_flip=True, seed=0, tokenize=None)
    loader = make_loader(source, transform, batch_size=16, seed=0, num_epochs=None,
                         shard_index=None, shard_count=None, workers=0)
    for batch in loader: ...          # numpy dicts, below
    loader.state() -> dict            # JSON-able position; loader.restore(state) before iter() resumes
    loader.skipped                    # unreadable samples skipped so far (saved in state())
    loader.steps_per_epoch            # batches per host per pass over the data
    load_image(path, resolution)      # (res, res, 3) float32 in [-1, 1]: a validation input image

Batch (B = the per-host batch size; one key per image column, named by `Columns.names`):

    "pixels"                      f32[B, res, res, 3] in [-1, 1]  (pix2pix: "original_pixels", "edited_pixels")
    "text"                        object[B] of str (when the columns have text)
    "ids"                         {name: int32[B, ...]} what `tokenize(text)` returned, stacked (with tokenize)
    "original_size"               i32[B, 2] (height, width) before resizing
    "crop_top_left"               i32[B, 2] (top, left) of the crop in the resized, flipped image
    "index"                       i64[B] the sample's global stream index (below)
    "row"                         i64[B] its row in the dataset

Per sample, as diffusers' train_text_to_image_sdxl.py / train_instruct_pix2pix.py: decode and convert
to RGB (`sdx.images.decode`: EXIF orientation applied; alpha dropped, as PIL's convert("RGB"); 16-bit
samples keep their high byte, as PIL does for 16-bit RGB); resize the shorter side to `resolution` with PIL's
filter of `interpolation` (default bilinear, as train_text_to_image.py; the SDXL scripts'
--image_interpolation_mode defaults to lanczos), antialiased: what torchvision's Resize does to a PIL image,
longer side int(res * long / short);
flip horizontally with probability 1/2 (`random_flip`); crop `resolution` square at the center
(torchvision's CenterCrop rounding) or at a uniformly random place. The flip comes before the crop, so
`crop_top_left` is in the flipped image (diffusers PR #6547), what SDXL's time ids take. InstructPix2Pix:
both images are resized to the first one's resized size and get the same flip and crop (diffusers
squashes both to a square; sdx keeps the aspect ratio). Pixels are (x / 255 - 0.5) / 0.5 in float32,
as ToTensor + Normalize([0.5], [0.5]). A caption cell holding a list gives one of them, drawn by the
sample's generator (diffusers: random.choice).

Randomness: the stream is an endless sequence of epochs; global stream index p = epoch * N + k (N
samples) is dataset row order_epoch[k], order_epoch a permutation drawn by grain's index_shuffle with
a 32-bit seed from SeedSequence([seed, epoch]). Host h of H reads p = h, h + H, h + 2H, ... Each sample's
flip, crop and caption come from np.random.default_rng([transform.seed, p]) (four uniforms, in that
order), so a sample is the same whatever the batch size, number of workers or hosts, and a resumed run
draws what an uninterrupted one would. `index` (p) is unique within a run: the training step folds it
into its keys.

Unreadable samples (not an image, truncated, empty, a missing file, a format PIL cannot convert) are
skipped: the next sample of the host's stream takes the place, so batches stay full and the result is
deterministic. The loader counts them (`skipped`, kept across resume) and logs the first ten and every
hundredth. Skipping happens in the main process, after grain's workers: a batch is the next B readable
samples whatever the number of workers. A text cell that is not text (null, a number, an empty list)
is an SdxError naming the column: a dataset error, not a bad image. When 10,000 samples in a row (or
twice the dataset) cannot be read, the loader stops with an SdxError.

Workers: `workers=0` decodes in threads of this process (grain's to_iter_dataset), `workers=n` in n
processes (grain's mp_prefetch, each with its threads). The position saved by `state()` counts stream
samples consumed by the batches returned so far, so resuming needs neither the same worker count nor
grain's iterator state, only the same dataset, seed and host count.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from PIL import Image

from sdx.errors import SdxError
from sdx.images import UnreadableImage, decode as decode_image
from train.sources import Columns, Example, Source, open_source

__all__ = ["Columns", "Example", "Source", "open_source", "Transform", "Geometry", "Loader", "make_loader",
           "load_image"]

STATE_FORMAT = "sdx.train.data/1"
# torchvision's InterpolationMode names -> the PIL filter its Resize applies to a PIL image
INTERPOLATIONS = {"nearest": Image.Resampling.NEAREST, "nearest_exact": Image.Resampling.NEAREST,
                  "bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
                  "box": Image.Resampling.BOX, "hamming": Image.Resampling.HAMMING,
                  "lanczos": Image.Resampling.LANCZOS}
MAX_CONSECUTIVE_UNREADABLE = 10_000
LOG_FIRST_SKIPS = 10
LOG_SKIPS_EVERY = 100


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Where a sample's pixels come from: original (h, w); resized (h, w) after the shorter-side resize;
    flip; (top, left) of the square crop in the resized, flipped image."""

    original_size: tuple[int, int]
    resized: tuple[int, int]
    flip: bool
    top: int
    left: int


@dataclasses.dataclass(frozen=True)
class Transform:
    """What happens to each sample (see the module docstring). tokenize: text -> {name: int array}, run
    per sample in the loading workers; its arrays are stacked under batch["ids"]."""

    resolution: int
    center_crop: bool = False
    random_flip: bool = False
    seed: int = 0
    tokenize: Callable[[str], Mapping[str, np.ndarray]] | None = None
    interpolation: str = "bilinear"

    def __post_init__(self):
        if self.resolution < 1:
            raise SdxError(f"resolution must be at least 1, got {self.resolution}")
        if self.interpolation not in INTERPOLATIONS:
            raise SdxError(f"unknown interpolation {self.interpolation!r} (choose from {', '.join(INTERPOLATIONS)})")

    def draws(self, index: int) -> np.ndarray:
        """The sample's four uniforms in [0, 1): flip, crop top, crop left, caption choice."""
        return np.random.default_rng([int(self.seed) % 2**64, int(index)]).random(4)

    def flip(self, index: int) -> bool:
        """Whether sample `index` is flipped."""
        return bool(self.random_flip and self.draws(index)[0] < 0.5)

    def geometry(self, height: int, width: int, index: int, flip: bool | None = None) -> Geometry:
        """flip: None draws it (`flip(index)`); True/False imposes it (the latent cache encodes both)."""
        res = self.resolution
        short, long = (height, width) if height <= width else (width, height)
        new_long = int(res * long / short)  # torchvision's _compute_resized_output_size
        rh, rw = (res, new_long) if height <= width else (new_long, res)
        u = self.draws(index)
        flip = self.flip(index) if flip is None else bool(flip)
        if self.center_crop:
            top, left = int(round((rh - res) / 2.0)), int(round((rw - res) / 2.0))
        else:
            top, left = int(u[1] * (rh - res + 1)), int(u[2] * (rw - res + 1))
        return Geometry((height, width), (rh, rw), flip, top, left)

    def images(self, pictures: Sequence[Image.Image], index: int, flip: bool | None = None) -> tuple[list[np.ndarray], Geometry]:
        """RGB pictures -> uint8 (res, res, 3) arrays, all resized to the first one's resized size and
        flipped and cropped alike; and that geometry (flip: as in `geometry`)."""
        first = pictures[0]
        geo = self.geometry(first.height, first.width, index, flip)
        rh, rw = geo.resized
        res = self.resolution
        out = []
        for pic in pictures:
            if pic.size != (rw, rh):
                pic = pic.resize((rw, rh), INTERPOLATIONS[self.interpolation])
            a = np.asarray(pic)
            if geo.flip:
                a = a[:, ::-1]
            out.append(np.ascontiguousarray(a[geo.top: geo.top + res, geo.left: geo.left + res]))
        return out, geo

    def caption(self, value: Any, index: int) -> str:
        """A text cell -> one caption (a list: one drawn by the sample's generator). ValueError when the
        cell is not text."""
        if isinstance(value, str):
            return value
        if isinstance(value, (list, tuple, np.ndarray)) and len(value) and all(isinstance(v, str) for v in value):
            return value[min(int(self.draws(index)[3] * len(value)), len(value) - 1)]
        raise ValueError(_describe(value))


def _describe(value) -> str:
    if value is None:
        return "nothing (null)"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def pixels_to_float(a: np.ndarray) -> np.ndarray:
    """uint8 -> float32 in [-1, 1], as torchvision's ToTensor then Normalize([0.5], [0.5])."""
    return (a.astype(np.float32) / np.float32(255.0) - np.float32(0.5)) / np.float32(0.5)


def load_image(path: str | os.PathLike, resolution: int) -> np.ndarray:
    """An image file -> (resolution, resolution, 3) float32 in [-1, 1]: shorter side resized, center crop."""
    try:
        pic = decode_image(str(path))
    except UnreadableImage as e:
        raise SdxError(f"{path}: cannot read the image ({e})") from None
    arrays, _ = Transform(resolution, center_crop=True).images([pic], 0)
    return pixels_to_float(arrays[0])


# ------------------------------------------------------------------------------------------------ stream


class _Stream:
    """Host position q -> the element of global stream index p = q * shard_count + shard_index: a dict
    with the sample's uint8 images, text or token ids and geometry; or {"skip": reason} for an
    unreadable sample; or {"error": message} for a dataset error. Picklable (grain's workers).

    element: (source position, p) -> element, instead of reading and decoding the row (the latent
    cache's elements, see train/cache.py); it must skip the samples decoding would skip."""

    def __init__(self, source: Source, transform: Transform, seed: int, shuffle: bool, shard_index: int,
                 shard_count: int, element: Callable[[int, int], dict] | None = None):
        self.element = element
        self.source, self.transform = source, transform
        self.seed, self.shuffle = int(seed), shuffle
        self.shard_index, self.shard_count = shard_index, shard_count
        self.size = len(source)
        self.names = source.columns.names
        self.text_column = source.columns.text

    def global_index(self, q: int) -> int:
        return q * self.shard_count + self.shard_index

    def position(self, p: int) -> int:
        """Stream index -> position in the source (the epoch's permutation)."""
        epoch, k = divmod(p, self.size)
        if not self.shuffle or self.size == 1:
            return k
        from grain.experimental import index_shuffle

        epoch_seed = int(np.random.SeedSequence([self.seed % 2**64, epoch]).generate_state(1)[0])
        return int(index_shuffle(k, max_index=self.size - 1, seed=epoch_seed, rounds=4))

    def __call__(self, q: int) -> dict:
        p = self.global_index(int(q))
        if self.element is not None:
            return self.element(self.position(p), p)
        return self.read(self.source[self.position(p)], p)

    def read(self, example: Example, p: int, flip: bool | None = None) -> dict:
        """A row -> its stream element as sample p (flip: imposed, else drawn)."""
        head = {"index": np.int64(p), "row": np.int64(example.row), "where": example.where}
        out = dict(head)
        if self.text_column is not None:
            try:
                text = self.transform.caption(example.text, p)
            except ValueError as e:
                return {**head, "error": f"{example.where}: column {self.text_column!r} holds {e}, not text "
                                         "(a string or a non-empty list of strings)"}
            out["text"] = text
            if self.transform.tokenize is not None:
                out["ids"] = {k: np.asarray(v) for k, v in self.transform.tokenize(text).items()}
        try:
            pictures = []
            for column, cell in zip(self.source.columns.images, example.images):
                try:
                    pictures.append(decode_image(cell))
                except UnreadableImage as e:
                    raise UnreadableImage(f"column {column!r}: {e}") from None
        except UnreadableImage as e:
            return {**head, "skip": str(e)}
        arrays, geo = self.transform.images(pictures, p, flip)
        out["images"] = dict(zip(self.names, arrays))
        out["original_size"] = np.asarray(geo.original_size, np.int32)
        out["crop_top_left"] = np.asarray((geo.top, geo.left), np.int32)
        return out


def read_example(source: Source, transform: Transform, example: Example, p: int = 0,
                 flip: bool | None = None) -> dict:
    """One row, read and decoded as the loader reads sample p (flip: imposed, else drawn): its stream
    element (see `_Stream`)."""
    return _Stream(source, transform, 0, False, 0, 1).read(example, p, flip)


def collate(elements: Sequence[dict], names: Sequence[str]) -> dict[str, Any]:
    """Readable stream elements -> one batch (see the module docstring)."""
    batch: dict[str, Any] = {n: pixels_to_float(np.stack([e["images"][n] for e in elements])) for n in names}
    if "text" in elements[0]:
        batch["text"] = np.array([e["text"] for e in elements], dtype=object)
    if "ids" in elements[0]:
        batch["ids"] = {k: np.stack([e["ids"][k] for e in elements]) for k in elements[0]["ids"]}
    batch["original_size"] = np.stack([e["original_size"] for e in elements]).astype(np.int32)
    batch["crop_top_left"] = np.stack([e["crop_top_left"] for e in elements]).astype(np.int32)
    batch["index"] = np.asarray([e["index"] for e in elements], np.int64)
    batch["row"] = np.asarray([e["row"] for e in elements], np.int64)
    return batch


# ------------------------------------------------------------------------------------------------ loader


def _stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


class Loader:
    """Batches of one host's share of the stream; see `make_loader` and the module docstring. One
    iterator at a time: `iter()` starts from the current position (closing an earlier iterator)."""

    def __init__(self, source: Source, transform: Transform, *, batch_size: int, seed: int, num_epochs: int | None,
                 shard_index: int, shard_count: int, workers: int, threads: int, shuffle: bool,
                 log: Callable[[str], None], element: Callable[[int, int], dict] | None = None,
                 collate_fn: Callable[[Sequence[dict]], dict] | None = None):
        if batch_size < 1:
            raise SdxError(f"batch size must be at least 1, got {batch_size}")
        if not 0 <= shard_index < shard_count:
            raise SdxError(f"shard {shard_index} of {shard_count} does not exist")
        if num_epochs is not None and num_epochs < 1:
            raise SdxError(f"num_epochs must be at least 1 (or None: endless), got {num_epochs}")
        if workers < 0:
            raise SdxError(f"workers must not be negative, got {workers}")
        self.source, self.transform = source, transform
        self.batch_size, self.seed, self.num_epochs = batch_size, int(seed), num_epochs
        self.shard_index, self.shard_count = shard_index, shard_count
        self.workers, self.threads, self.shuffle = workers, max(1, threads), shuffle
        self.log = log
        self._stream = _Stream(source, transform, self.seed, shuffle, shard_index, shard_count, element)
        self._collate = collate_fn or functools.partial(collate, names=source.columns.names)
        # every host reads the same number of stream samples: floor(epochs * N / hosts)
        self._end = sys.maxsize if num_epochs is None else num_epochs * len(source) // shard_count
        self._position = 0  # host stream samples consumed by the batches returned
        self._skipped = 0
        self._active: Iterator | None = None

    @property
    def skipped(self) -> int:
        """Unreadable samples skipped by the batches returned so far (this run and the ones it resumes)."""
        return self._skipped

    @property
    def position(self) -> int:
        """Host stream samples consumed by the batches returned so far."""
        return self._position

    @property
    def epoch(self) -> int:
        """The epoch of the next sample."""
        return self._stream.global_index(self._position) // len(self.source)

    @property
    def steps_per_epoch(self) -> int:
        """Batches per host in one pass over the data (all hosts together read each sample once)."""
        return len(self.source) // (self.batch_size * self.shard_count)

    def state(self) -> dict[str, Any]:
        """The position after the batches returned so far, JSON-able (restore() takes it back)."""
        return {"format": STATE_FORMAT, "position": self._position, "skipped": self._skipped, "seed": self.seed,
                "samples": len(self.source), "shuffle": self.shuffle, "shard_index": self.shard_index,
                "shard_count": self.shard_count}

    def restore(self, state: Mapping[str, Any] | str | bytes) -> None:
        """Continue from `state` (from state(), or its JSON): the next iter() starts there."""
        if isinstance(state, (str, bytes)):
            state = json.loads(state)
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise SdxError(f"not a data-loader state saved by this version of sdx: {str(state)[:120]}")
        mine = self.state()
        for key, what in (("samples", "a dataset of"), ("seed", "seed"), ("shuffle", "shuffle"),
                          ("shard_count", "hosts:"), ("shard_index", "host")):
            if state.get(key) != mine[key]:
                raise SdxError(f"the saved data position belongs to {what} {state.get(key)} where this run has "
                               f"{mine[key]} ({key}); resume with the same dataset, --max_train_samples, --seed "
                               "and number of hosts")
        self.close()
        self._position, self._skipped = int(state["position"]), int(state["skipped"])

    def close(self) -> None:
        """Stop the current iterator (its worker processes and threads)."""
        if self._active is not None:
            self._active.close()
            self._active = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.close()
        self._active = self._batches()
        return self._active

    def _elements(self, start: int):
        import grain

        ds = grain.MapDataset.range(start, self._end).map(self._stream)
        buffer = max(4, 2 * self.batch_size)
        it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=buffer))
        if self.workers:
            _grain_flags_usable()
            it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers,
                                                                   per_worker_buffer_size=buffer))
        return iter(it_ds)

    def _batches(self) -> Iterator[dict[str, Any]]:
        start = self._position
        if start >= self._end:
            return
        it = self._elements(start)
        limit = min(MAX_CONSECUTIVE_UNREADABLE, 2 * len(self.source))
        consumed, skipped, in_a_row = 0, 0, 0
        pending: list[dict] = []
        try:
            for element in it:
                consumed += 1
                if "error" in element:
                    raise SdxError(element["error"])
                if "skip" in element:
                    skipped += 1
                    in_a_row += 1
                    self._log_skip(self._skipped + skipped, element)
                    if in_a_row >= limit:
                        raise SdxError(f"{in_a_row} samples in a row could not be read (the last: "
                                       f"{element['where']}: {element['skip']}); check the dataset")
                    continue
                in_a_row = 0
                pending.append(element)
                if len(pending) == self.batch_size:
                    batch = self._collate(pending)
                    pending = []
                    self._position = start + consumed
                    self._skipped += skipped
                    skipped = 0
                    yield batch
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _log_skip(self, count: int, element: dict) -> None:
        if count <= LOG_FIRST_SKIPS:
            self.log(f"skipped unreadable sample {element['where']}: {element['skip']}")
        elif count % LOG_SKIPS_EVERY == 0:
            self.log(f"{count} unreadable samples skipped so far")


def _grain_flags_usable() -> None:
    """grain's multiprocessing reads its absl flags, which only an absl program parses: outside one,
    let grain's own flags read their defaults (what grain does itself in its workers)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        for name in list(flags.FLAGS):
            if name.startswith("grain_"):
                flags.FLAGS[name].present = True


def make_loader(source: Source, transform: Transform, *, batch_size: int, seed: int | None = None,
                num_epochs: int | None = None, shard_index: int | None = None, shard_count: int | None = None,
                workers: int = 0, threads: int | None = None, shuffle: bool = True,
                log: Callable[[str], None] | None = None, element: Callable[[int, int], dict] | None = None,
                collate_fn: Callable[[Sequence[dict]], dict] | None = None) -> Loader:
    """Batches of `batch_size` samples of this host's share of `source`.

    seed: the epochs' shuffle (default transform.seed); num_epochs: None for an endless stream, else
    the stream ends after num_epochs passes (the last partial batch dropped); shard_index/shard_count:
    this host and the number of hosts (default jax.process_index() / jax.process_count()); workers:
    decoding processes (0: threads of this process); threads: decoding threads per process (default
    min(8, CPUs)); shuffle: False reads rows in order (evaluation); log: where skip messages go;
    element, collate_fn: (source position, p) -> element and elements -> batch in place of reading and
    decoding rows (the latent cache, train/cache.py): same order, shuffling, sharding, skips and state.
    """
    if shard_index is None or shard_count is None:
        import jax

        shard_index = jax.process_index() if shard_index is None else shard_index
        shard_count = jax.process_count() if shard_count is None else shard_count
    return Loader(source, transform, batch_size=batch_size, seed=transform.seed if seed is None else seed,
                  num_epochs=num_epochs, shard_index=shard_index, shard_count=shard_count, workers=workers,
                  threads=threads if threads is not None else min(8, os.cpu_count() or 1), shuffle=shuffle,
                  log=log or _stderr, element=element, collate_fn=collate_fn)
