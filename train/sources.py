"""Training datasets, read lazily row by row: parquet files and image folders.

    open_source(spec, columns, *, max_samples=None, seed=0, cache_dir=None, revision=None) -> Source
    Columns(images=("image",), text="text", names=None)       which columns a task reads
    Source: len(source), source[i] -> Example(row, images, text, where); source.found (its columns)

`spec` is what diffusers' `--dataset_name` / `--train_data_dir` take:

- a local `.parquet` file, a list of them, or a folder holding `*.parquet` (searched recursively, in
  sorted path order);
- a hub dataset id (`org/name`): only its parquet files are fetched, through huggingface_hub's
  `snapshot_download(repo_type="dataset")` and its cache (HF_HUB_OFFLINE, HF_HUB_CACHE, the token and
  `revision` apply; `revision="refs/convert/parquet"` reads the hub's parquet conversion of a dataset
  stored in another format);
- an image folder in the hub's imagefolder layout: `metadata.jsonl` (or `metadata.csv`) next to the
  images, one row per line. Its `file_name` column becomes the image column `image`, and any
  `X_file_name` column becomes the image column `X` (so an InstructPix2Pix pair is
  `{"input_image_file_name": "a.png", "edited_image_file_name": "b.png", "edit_prompt": "..."}`); file
  names are relative to the metadata file. A folder without metadata is read as images only (column
  `image`, for VAE training).

Splits, as the hub names them: when file or folder names mark splits (`train-0000-of-0002.parquet`,
`train/metadata.jsonl`, `data/validation-*.parquet`), only the train split is read.

Image cells may be raw encoded bytes (a binary column), the hub's Image feature (a struct
`{bytes, path}`: `bytes` when embedded, else `path`, relative to the parquet file's folder, then to the
dataset's root), or a path string. Nothing is decoded here; `train.data` decodes (and skips what
cannot be decoded).

Parquet is read by row group (pyarrow keeps the row groups' offsets, a small per-process cache holds
the last few row groups read): a shuffled read costs one row group per sample unless row groups are
small, as the hub's image datasets' are (about 100 rows).

Columns are checked when the source is opened: a missing column is one SdxError naming it and listing
the columns found; a text column that is not text (strings, or lists of strings) likewise.

`max_samples` keeps what diffusers' `dataset.shuffle(seed).select(range(max_samples))` keeps: the first
`max_samples` rows of `np.random.default_rng(seed).permutation(len(dataset))` (the permutation
`datasets` draws), so the same rows as diffusers for the same seed and file order.
"""

from __future__ import annotations

import abc
import collections
import csv
import dataclasses
import json
import os
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sdx.errors import SdxError

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
METADATA_FILES = ("metadata.jsonl", "metadata.csv")
# The hub's split keywords (datasets.data_files): a file belongs to a split when one of these is a
# word of its path (words split at / - . _ space and digits).
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
# batch key -> the flag that names its column, for error messages
_IMAGE_FLAGS = {"pixels": "--image_column", "original_pixels": "--original_image_column",
                "edited_pixels": "--edited_image_column"}


@dataclasses.dataclass(frozen=True)
class Columns:
    """The columns a task reads. images: image column names; text: the caption / edit-prompt column, or
    None (VAE training); names: the batch key of each image column (default ("pixels",) for one image).
    Defaults follow diffusers' scripts (see the constructors)."""

    images: tuple[str, ...] = ("image",)
    text: str | None = "text"
    names: tuple[str, ...] | None = None

    def __post_init__(self):
        images = (self.images,) if isinstance(self.images, str) else tuple(self.images)
        object.__setattr__(self, "images", images)
        if not images:
            raise ValueError("Columns needs at least one image column")
        names = self.names
        if names is None:
            if len(images) != 1:
                raise ValueError("Columns with several image columns needs their batch names")
            names = ("pixels",)
        names = (names,) if isinstance(names, str) else tuple(names)
        if len(names) != len(images) or len(set(names)) != len(names):
            raise ValueError(f"Columns: {len(images)} image columns need as many distinct names, got {names}")
        object.__setattr__(self, "names", names)

    @classmethod
    def text_to_image(cls, image: str = "image", caption: str = "text") -> Columns:
        return cls(images=(image,), text=caption, names=("pixels",))

    @classmethod
    def pix2pix(cls, original: str = "input_image", edit_prompt: str = "edit_prompt",
                edited: str = "edited_image") -> Columns:
        return cls(images=(original, edited), text=edit_prompt, names=("original_pixels", "edited_pixels"))

    @classmethod
    def images_only(cls, image: str = "image") -> Columns:
        return cls(images=(image,), text=None, names=("pixels",))

    @property
    def wanted(self) -> tuple[str, ...]:
        """Every column read, images first, without repeats."""
        return tuple(dict.fromkeys(self.images + ((self.text,) if self.text else ())))

    def flag(self, column: str) -> str:
        """The training flag that names `column` (for messages)."""
        if column == self.text:
            return "--edit_prompt_column" if "edited_pixels" in self.names else "--caption_column"
        return _IMAGE_FLAGS.get(self.names[self.images.index(column)], "the image column")

    def check(self, found: Sequence[str], where: str) -> None:
        """One SdxError naming every wanted column missing from `found`, and listing `found`."""
        missing = [c for c in self.wanted if c not in found]
        if missing:
            named = ", ".join(f"{c!r} ({self.flag(c)})" for c in missing)
            listing = ", ".join(found) if found else "none"
            raise SdxError(f"{where} has no column {named}; its columns are: {listing}")


@dataclasses.dataclass(frozen=True)
class Example:
    """One dataset row, undecoded. row: its index in the whole dataset (before max_samples); images: per
    image column, encoded bytes, a file path, or None (an empty cell); text: the text cell as stored
    (None without a text column); where: file and row, for messages."""

    row: int
    images: tuple[bytes | str | None, ...]
    text: Any
    where: str


class Source(abc.ABC):
    """Random access to a dataset's rows. Sources are picklable (data-loading workers get a copy) and
    safe to read from several threads."""

    columns: Columns
    found: tuple[str, ...]  # every column the dataset has
    description: str  # one line: what was opened

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def __getitem__(self, i: int) -> Example: ...


# ----------------------------------------------------------------------------------------------- parquet


def _image_kind(t, column: str, where: str) -> str:
    import pyarrow as pa

    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) or \
            _is(pa.types, "is_binary_view", t):
        return "bytes"
    if pa.types.is_struct(t) and {"bytes", "path"} & {t.field(k).name for k in range(t.num_fields)}:
        return "struct"
    if _is_string(t):
        return "path"
    raise SdxError(f"{where}: column {column!r} has type {t}, not an image (encoded bytes, the hub's Image "
                   "feature {bytes, path}, or a file path)")


def _is(types, name: str, t) -> bool:
    fn = getattr(types, name, None)
    return bool(fn and fn(t))


def _is_string(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or _is(pa.types, "is_string_view", t)


def _check_text_type(t, column: str, where: str) -> None:
    import pyarrow as pa

    if _is_string(t):
        return
    if (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_string(t.value_type):
        return
    raise SdxError(f"{where}: column {column!r} has type {t}, not text (strings or lists of strings)")


class ParquetSource(Source):
    """Rows of parquet files, in file order then row order, read a row group at a time."""

    def __init__(self, files: Sequence[str | os.PathLike], columns: Columns, *, root: str | os.PathLike | None = None,
                 name: str | None = None, cache_row_groups: int = 4):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.files = [Path(f) for f in files]
        if not self.files:
            raise SdxError(f"{name or 'the dataset'}: no parquet files")
        self.root = Path(root) if root is not None else self.files[0].parent
        self.columns = columns
        self.cache_row_groups = max(1, cache_row_groups)
        name = name or (str(self.files[0]) if len(self.files) == 1 else str(self.root))
        starts, groups, kinds, found = [], [], [], None
        total = 0
        for fi, path in enumerate(self.files):
            label = self._label(fi)
            try:
                with pq.ParquetFile(path) as pf:
                    meta, schema = pf.metadata, pf.schema_arrow
            except (OSError, pa.ArrowException) as e:
                raise SdxError(f"{label}: not a readable parquet file ({e})") from None
            names = tuple(schema.names)
            columns.check(names, f"dataset {name}" if fi == 0 else f"{label} (of dataset {name})")
            found = found or names
            kinds.append(tuple(_image_kind(schema.field(c).type, c, label) for c in columns.images))
            if columns.text:
                _check_text_type(schema.field(columns.text).type, columns.text, label)
                _check_no_nulls(meta, schema, columns.text, label)
            in_file = 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                if rows:
                    starts.append(total)
                    groups.append((fi, g, in_file))
                    total += rows
                    in_file += rows
        self.found = found
        self._starts = np.asarray(starts, np.int64)
        self._groups = groups
        self._kinds = kinds
        self._len = total
        self.description = f"{name}: {total} rows in {len(self.files)} parquet file(s)"
        self._init_transient()

    def _init_transient(self) -> None:
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._local = threading.local()

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_lock", "_cache", "_local"):
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_transient()

    def _label(self, fi: int) -> str:
        path = self.files[fi]
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)

    def __len__(self) -> int:
        return self._len

    def _row_group(self, fi: int, g: int):
        key = (fi, g)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        import pyarrow.parquet as pq

        handles = self._local.__dict__.setdefault("files", {})
        if fi not in handles:
            handles[fi] = pq.ParquetFile(self.files[fi])
        table = handles[fi].read_row_group(g, columns=list(self.columns.wanted))
        with self._lock:
            self._cache[key] = table
            while len(self._cache) > self.cache_row_groups:
                self._cache.popitem(last=False)
        return table

    def __getitem__(self, i: int) -> Example:
        i = int(i)
        if not 0 <= i < self._len:
            raise IndexError(f"row {i} of {self._len}")
        k = int(np.searchsorted(self._starts, i, side="right")) - 1
        fi, g, in_file = self._groups[k]
        table = self._row_group(fi, g)
        local = i - int(self._starts[k])
        record = table.slice(local, 1).to_pylist()[0]
        base = self.files[fi].parent
        images = tuple(self._cell(record[c], kind, base) for c, kind in zip(self.columns.images, self._kinds[fi]))
        text = record[self.columns.text] if self.columns.text else None
        return Example(row=i, images=images, text=text, where=f"{self._label(fi)} row {in_file + local}")

    def _cell(self, value, kind: str, base: Path) -> bytes | str | None:
        if value is None:
            return None
        if kind == "bytes":
            return value
        if kind == "struct":
            if value.get("bytes") is not None:
                return value["bytes"]
            value = value.get("path")
            if value is None:
                return None
        return _resolve(value, (base, self.root))


def _resolve(path: str, bases: Sequence[Path]) -> str:
    """An image path as stored: absolute, or relative to the first of `bases` where it exists."""
    p = Path(path)
    if p.is_absolute():
        return str(p)
    for base in bases:
        if (base / p).exists():
            return str(base / p)
    return str(bases[0] / p)


def _check_no_nulls(meta, schema, column: str, label: str) -> None:
    """Empty (null) cells of a string column, counted from the row groups' statistics when the file has
    them (otherwise the loader reports the first it meets)."""
    if not _is_string(schema.field(column).type):
        return
    leaves = [meta.schema.column(k).path for k in range(meta.num_columns)]
    if column not in leaves:
        return
    leaf = leaves.index(column)
    nulls = 0
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(leaf).statistics
        if stats is not None and stats.has_null_count:
            nulls += stats.null_count
    if nulls:
        raise SdxError(f"{label}: column {column!r} has {nulls} empty (null) cells; every sample needs its text")


# ---------------------------------------------------------------------------------------------- folders


class FolderSource(Source):
    """An image folder: rows of metadata.jsonl / metadata.csv (image paths and text), or, without
    metadata, every image file (column `image` only)."""

    def __init__(self, root: str | os.PathLike, columns: Columns, *, name: str | None = None):
        self.root = Path(root)
        self.columns = columns
        name = name or str(root)
        metas = _train_split([p for p in sorted(self.root.rglob("*")) if p.name in METADATA_FILES and p.is_file()],
                             self.root, name)
        images_col, text_col = columns.images, columns.text
        self._images: list[tuple[str | None, ...]] = []
        self._texts: list[Any] = []
        self._where: list[tuple[int, int]] = []  # (metadata file, line)
        self._metas = metas
        if metas:
            found: dict[str, None] = {}
            first = True
            for mi, meta in enumerate(metas):
                for line, record in _read_metadata(meta, self.root):
                    record = _image_columns(record)
                    if first:
                        found.update(dict.fromkeys(record))
                        columns.check(tuple(found), f"dataset {name} ({meta.relative_to(self.root).as_posix()})")
                        first = False
                    else:
                        found.update(dict.fromkeys(record))
                    where = f"{meta.relative_to(self.root).as_posix()} line {line}"
                    paths = []
                    for c in images_col:
                        value = record.get(c)
                        if value is not None and not isinstance(value, str):
                            raise SdxError(f"{where}: image column {c!r} holds {value!r}, not a file name")
                        paths.append(None if not value else _resolve(value, (meta.parent, self.root)))
                    self._images.append(tuple(paths))
                    if text_col:
                        if text_col not in record:
                            raise SdxError(f"{where}: no {text_col!r} ({columns.flag(text_col)}); this row has: "
                                           f"{', '.join(record)}")
                        _check_text_value(record[text_col], text_col, where)
                        self._texts.append(record[text_col])
                    self._where.append((mi, line))
            self.found = tuple(found)
            if first:
                raise SdxError(f"dataset {name}: its metadata files hold no rows")
        else:
            files = _train_split(image_files(self.root), self.root, name)
            self.found = ("image",)
            columns.check(self.found, f"dataset {name} (images without metadata.jsonl)")
            self._images = [(str(p),) * len(images_col) for p in files]
            self._files = [p.relative_to(self.root).as_posix() for p in files]
        self.description = f"{name}: {len(self._images)} rows (image folder)"

    def __len__(self) -> int:
        return len(self._images)

    def __getitem__(self, i: int) -> Example:
        i = int(i)
        if not 0 <= i < len(self._images):
            raise IndexError(f"row {i} of {len(self._images)}")
        if self._metas:
            mi, line = self._where[i]
            where = f"{self._metas[mi].relative_to(self.root).as_posix()} line {line}"
        else:
            where = self._files[i]
        text = self._texts[i] if self.columns.text else None
        return Example(row=i, images=self._images[i], text=text, where=where)


def image_files(folder: Path) -> list[Path]:
    """The image files under `folder` (IMAGE_EXTENSIONS), in path order; none when it does not exist."""
    if not folder.is_dir():
        return []
    return [p for p in sorted(folder.rglob("*")) if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()]


def image_folder(root: str | os.PathLike, flag: str, repeats: int = 1) -> Source:
    """Every image file of the folder `root` (no metadata), each read `repeats` times per epoch; an SdxError
    naming `flag` when `root` is no folder or holds no image."""
    root = Path(root)
    if not root.is_dir():
        raise SdxError(f"{flag} {root} is not a folder")
    if not image_files(root):
        raise SdxError(f"{flag} {root} holds no image files ({', '.join(IMAGE_EXTENSIONS)})")
    return repeated(FolderSource(root, Columns.images_only(), name=f"{flag} {root}"), repeats)


def repeated(source: Source, repeats: int) -> Source:
    """`source` with every row read `repeats` times per epoch (in turn: rows 0..n-1, then again)."""
    return source if repeats == 1 else Subset(source, np.tile(np.arange(len(source)), repeats))


def _read_metadata(path: Path, root: Path):
    """(line number, record) for each row of a metadata.jsonl / metadata.csv."""
    label = path.relative_to(root).as_posix()
    try:
        with open(path, encoding="utf-8", newline="" if path.suffix == ".csv" else None) as f:
            if path.suffix == ".csv":
                for line, record in enumerate(csv.DictReader(f), start=2):
                    yield line, dict(record)
                return
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    record = json.loads(text)
                except json.JSONDecodeError as e:
                    raise SdxError(f"{label} line {line}: not JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise SdxError(f"{label} line {line}: a JSON object per line is expected")
                yield line, record
    except (OSError, UnicodeDecodeError) as e:
        raise SdxError(f"{label}: cannot read it ({e})") from None


def _image_columns(record: dict) -> dict:
    """The hub's imagefolder naming: file_name -> image, X_file_name -> X."""
    out = {}
    for k, v in record.items():
        if k == "file_name":
            k = "image"
        elif k.endswith("_file_name"):
            k = k[: -len("_file_name")]
        out[k] = v
    return out


def _check_text_value(value, column: str, where: str) -> None:
    if isinstance(value, str):
        return
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return
    raise SdxError(f"{where}: column {column!r} holds {_short(value)}, not text (a string or a list of strings)")


def _short(value) -> str:
    if value is None:
        return "nothing (null)"
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


# ------------------------------------------------------------------------------------------------ subset


class Subset(Source):
    """`parent`'s rows `rows`, in that order (max_samples)."""

    def __init__(self, parent: Source, rows: Sequence[int]):
        self.parent = parent
        self.rows = np.asarray(rows, np.int64)
        self.columns, self.found = parent.columns, parent.found
        self.description = f"{parent.description}, {len(self.rows)} of them used"

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Example:
        return self.parent[int(self.rows[i])]


# ---------------------------------------------------------------------------------------------- open


def _words(rel: str) -> set[str]:
    stem = rel.rsplit(".", 1)[0] if "." in rel.rsplit("/", 1)[-1] else rel
    return {w for w in re.split(r"[/\\\-._ 0-9]+", stem.lower()) if w}


def _train_split(paths: list[Path], root: Path, name: str) -> list[Path]:
    """The train split's files when names mark splits (as the hub reads them), else all."""
    marked = []
    for p in paths:
        words = _words(p.relative_to(root).as_posix())
        marked.append({s for s, keys in SPLIT_WORDS.items() if words & set(keys)})
    train = [p for p, s in zip(paths, marked) if "train" in s]
    if train:
        return train
    unmarked = [p for p, s in zip(paths, marked) if not s]
    if paths and not unmarked:
        splits = sorted(set().union(*marked))
        raise SdxError(f"dataset {name}: its files are split into {', '.join(splits)} but there is no train split")
    return unmarked


def parquet_files(folder: Path, name: str) -> list[Path]:
    """The train split's `*.parquet` files under `folder`, sorted by path."""
    files = sorted((p for p in folder.rglob("*.parquet") if p.is_file()), key=lambda p: p.relative_to(folder).as_posix())
    return _train_split(files, folder, name)


def fetch_hub_dataset(repo_id: str, *, revision: str | None = None, cache_dir: str | os.PathLike | None = None) -> Path:
    """The local snapshot of hub dataset `repo_id` with its parquet files (downloaded once, then cached)."""
    from huggingface_hub import snapshot_download

    from convert.hub import hub_errors, reachable

    where = f"hub dataset {repo_id!r}" + (f" (revision {revision})" if revision else "")
    with hub_errors(where, missing="lacks a file it lists"):
        reachable()  # once per process: an unreachable hub leaves the cache alone to answer
        return Path(snapshot_download(repo_id, repo_type="dataset", revision=revision, cache_dir=cache_dir,
                                      allow_patterns=["*.parquet"]))


def open_source(spec: str | os.PathLike | Sequence[str | os.PathLike], columns: Columns, *,
                max_samples: int | None = None, seed: int = 0, cache_dir: str | os.PathLike | None = None,
                revision: str | None = None) -> Source:
    """The dataset `spec` names (see the module docstring), its columns checked; `max_samples`: keep the
    rows diffusers keeps (the first after a permutation seeded with `seed`; all of them when there are
    no more than that); `cache_dir`, `revision`: for a hub dataset."""
    source = _open(spec, columns, cache_dir=cache_dir, revision=revision)
    if len(source) == 0:
        raise SdxError(f"dataset {_name(spec)} has no rows")
    if max_samples is not None:
        if max_samples < 1:
            raise SdxError(f"max_samples must be at least 1, got {max_samples}")
        if max_samples < len(source):
            rows = np.random.default_rng(seed).permutation(len(source))[:max_samples]
            source = Subset(source, rows)
    return source


def _name(spec) -> str:
    return str(spec) if isinstance(spec, (str, os.PathLike)) else f"[{', '.join(map(str, spec))}]"


def _open(spec, columns: Columns, *, cache_dir, revision) -> Source:
    if not isinstance(spec, (str, os.PathLike)):
        files = [Path(f) for f in spec]
        for f in files:
            if not f.is_file():
                raise SdxError(f"{f}: no such parquet file")
        return ParquetSource(files, columns, root=Path(os.path.commonpath([f.parent for f in files])),
                             name=_name(spec))
    path = Path(spec)
    if path.is_file():
        if path.suffix != ".parquet":
            raise SdxError(f"{path}: a dataset file must be .parquet (or give an image folder with metadata.jsonl)")
        return ParquetSource([path], columns, name=str(path))
    if path.is_dir():
        files = parquet_files(path, str(path))
        if files:
            return ParquetSource(files, columns, root=path, name=str(path))
        return FolderSource(path, columns, name=str(path))
    from convert.hub import looks_like_repo_id

    if not looks_like_repo_id(str(spec)):
        raise SdxError(f"dataset {spec}: no such file or folder (nor a hub dataset id org/name)")
    try:
        folder = fetch_hub_dataset(str(spec), revision=revision, cache_dir=cache_dir)
    except SdxError as e:  # `data/captions` reads as a hub id too: say that it is not here either
        raise SdxError(f"dataset {spec}: there is no such local folder or file ({path.absolute()}), and as a hub dataset "
                       f"id: {e}. A dataset is a local folder (parquet files, or images with metadata.jsonl), a "
                       ".parquet file, or a hub dataset id org/name") from None
    files = parquet_files(folder, str(spec))
    if not files:
        raise SdxError(f"hub dataset {spec!r} has no parquet files; read its parquet conversion with revision "
                       "refs/convert/parquet, or download it and pass the folder")
    return ParquetSource(files, columns, root=folder, name=f"hub dataset {spec}")
