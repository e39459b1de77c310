"""`--cache_latents`: the frozen VAE and text encoders run once over the dataset; training reads what they
produced from disk instead of decoding images and running the encoders at every step.

    cache = LatentCache.open_or_build(folder, source, transform, encode=..., batch_size=B, key={...}, log=print)
    loader = data.make_loader(source, transform, ..., element=cache.element, collate_fn=cache.collate)
    arrays = cache.gather(host_batch)        # the arrays `train.denoise.encode_batch` would have returned

What is stored is exactly what the uncached step computes before its loss (`encode_batch`): the VAE
posterior's moments (mean and log-variance, not a sample), the InstructPix2Pix input image's latents,
the text embeddings (context; SDXL's pooled embedding; under `--train_text_encoder`, whose encoders run
in the step, the token ids instead) and SDXL's time ids. The posterior is sampled in
the step from the cached moments with each sample's own key, as without the cache, so a cached run draws
what an uncached one draws and trains on the same numbers (up to the float rounding of encoding in other
batches). The data stream (shuffling, per-host shards, skipped unreadable rows, the saved position) is
the loader's own; only reading and decoding a row is replaced by looking it up.

Exactness decides what may be cached. A row's encoding must not depend on the sample it is drawn as:

- `--random_flip`: each row is encoded twice, unflipped and flipped, and a sample reads the variant its
  own flip draw picks (the uncached loader's draw);
- a random crop is drawn per sample: refused (one `error:` line, exit 2) unless the row's image is
  already `resolution` square after resizing, where every crop is the whole image; `--center_crop` is
  always fine;
- a caption cell holding several captions (one drawn per sample): refused.

Layout, `folder` (`--output_dir/cache`, one per process): `manifest.json` (what the cache was built from:
dataset, model, transform, dtype; a cache whose manifest differs from this run's is rebuilt, one that
matches is reused, so a resumed run encodes nothing), `valid.npy` / `rows.npy` (whether each dataset
position could be read, and its row), and one `.npy` file per stored array, memory-mapped: per image
variant `[positions * variants, ...]` (moments, image_latents, time_ids), per row `[positions, ...]`
(context, pooled, ids). A step reads only its samples' rows; the dataset is never held in memory. The folder
is written under a temporary name and renamed into place when complete.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from tqdm import tqdm

from convert.library import identity
from sdx import io, model_folder
from sdx.errors import SdxError
from train import data

FORMAT = "sdx.train.cache/1"
MANIFEST = "manifest.json"
PER_ROW = ("context", "pooled", "ids")  # text: the same for both flips of a row
UNREADABLE_LOGGED = 10


def data_key(cfg, source: data.Source, model: Path) -> dict:
    """What a cache of `source`, read as the TrainConfig `cfg` reads it and encoded by the model in folder
    `model`, depends on; a task adds what its own encoding depends on. A cache built under another key is
    built again."""
    spec = cfg.dataset_name or cfg.train_data_dir
    return {"task": cfg.task, "dataset": spec, "dataset_identity": identity(Path(spec)) if Path(spec).exists() else None,
            "description": source.description, "samples": len(source), "columns": list(source.columns.images),
            "text_column": source.columns.text, "max_train_samples": cfg.max_train_samples, "seed": cfg.seed,
            "model": identity(model), "resolution": cfg.resolution, "center_crop": cfg.center_crop,
            "random_flip": cfg.random_flip, "interpolation": cfg.image_interpolation_mode}


def _host_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in order."""
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = {s.index[0].start or 0: s for s in x.addressable_shards}
    return np.concatenate([np.asarray(shards[k].data) for k in sorted(shards)])


def _storable(a: np.ndarray) -> np.ndarray:
    """.npy has no bfloat16: stored as its uint16 bits (the manifest keeps the dtype)."""
    return a.view(np.uint16) if a.dtype == ml_dtypes.bfloat16 else a


@dataclasses.dataclass(frozen=True)
class _Element:
    """The loader's element for source position `pos` drawn as sample p (picklable: grain's workers)."""

    valid: np.ndarray
    rows: np.ndarray
    skipped: Mapping[int, str]
    transform: data.Transform

    def __call__(self, pos: int, p: int) -> dict:
        head = {"index": np.int64(p), "row": np.int64(self.rows[pos]), "where": f"cached position {pos}"}
        if not self.valid[pos]:
            return {**head, "skip": self.skipped.get(pos, "unreadable when the cache was built")}
        return {**head, "pos": np.int64(pos), "flip": self.transform.flip(p)}


def collate(elements: Sequence[dict]) -> dict[str, np.ndarray]:
    return {"index": np.asarray([e["index"] for e in elements], np.int64),
            "row": np.asarray([e["row"] for e in elements], np.int64),
            "pos": np.asarray([e["pos"] for e in elements], np.int64),
            "flip": np.asarray([e["flip"] for e in elements], bool)}


class LatentCache:
    """An opened cache folder (see the module docstring)."""

    def __init__(self, folder: Path, transform: data.Transform):
        self.folder, self.transform = folder, transform
        self.manifest = io.read_json(folder / MANIFEST, obj=True)
        self.variants = int(self.manifest["variants"])
        self.dtypes = dict(self.manifest["arrays"])
        self.arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r") for name in self.dtypes}
        valid, rows = np.load(folder / "valid.npy"), np.load(folder / "rows.npy")
        skipped = {int(k): v for k, v in self.manifest["skipped"].items()}
        self.element = _Element(valid, rows, skipped, transform)
        self.collate = collate

    def gather(self, host: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A host batch of the cached loader -> the step's arrays (only these rows are read from disk)."""
        pos = np.asarray(host["pos"], np.int64)
        item = pos * self.variants + (np.asarray(host["flip"], np.int64) if self.variants == 2 else 0)
        out = {"index": np.asarray(host["index"])}
        for name, array in self.arrays.items():
            rows = np.asarray(array[pos if name in PER_ROW else item])
            dtype = np.dtype(getattr(ml_dtypes, self.dtypes[name], None) or self.dtypes[name])
            out[name] = rows.view(dtype) if rows.dtype != dtype else rows
        return out

    @classmethod
    def open_or_build(cls, folder: Path, source: data.Source, transform: data.Transform, *,
                      encode: Callable[[dict], Mapping[str, jax.Array]], batch_size: int, key: Mapping[str, Any],
                      log=print, flag: str = "--cache_latents") -> LatentCache:
        """The cache in `folder` when its manifest says it was built with `key`; else built anew.
        encode: a host batch of the loader (decoded images, token ids, geometry) -> the encoded global
        batch (`encode_batch`'s output, batch-sharded over the mesh); batch_size: host samples per call;
        flag: the command-line flag that asked for the cache, which its errors name."""
        key = json.loads(json.dumps(dict(key)))
        if (folder / MANIFEST).is_file():
            old = io.read_json(folder / MANIFEST, obj=True)
            if old.get("key") == key:
                log(f"latent cache: reusing {folder}")
                return cls(folder, transform)
            log(f"latent cache: {folder} was built from another dataset, model or transform; building it again")
        _build(folder, source, transform, encode, batch_size, key, log, flag)
        return cls(folder, transform)


def _read(source: data.Source, transform: data.Transform, pos: int, flip: bool, flag: str = "--cache_latents") -> dict:
    """Position `pos` decoded with this flip, checked to be the same whatever sample it is drawn as."""
    example = source[pos]
    if isinstance(example.text, (list, tuple, np.ndarray)) and len(example.text) > 1:
        raise SdxError(f"{flag}: {example.where} holds {len(example.text)} captions, one of which is drawn "
                       "per sample; a cache stores one encoding per image, so use one caption per row or drop "
                       f"{flag}")
    element = data.read_example(source, transform, example, flip=flip)
    if "error" in element:
        raise SdxError(element["error"])
    if "skip" not in element and not transform.center_crop:
        h, w = (int(v) for v in element["original_size"])
        resized = transform.geometry(h, w, 0).resized
        if resized != (transform.resolution, transform.resolution):
            raise SdxError(f"{flag} with a random crop: {example.where} is {w}x{h} (resized to "
                           f"{resized[1]}x{resized[0]}), so its crop is drawn per sample and cannot be cached; "
                           f"add --center_crop or drop {flag}")
    return element


def _build(folder: Path, source, transform, encode, batch_size: int, key, log, flag: str) -> None:
    variants = 2 if transform.random_flip else 1
    n = len(source)
    log(f"latent cache: encoding {n} samples{' (unflipped and flipped)' if variants == 2 else ''} into {folder}")
    with model_folder.building_folder(folder, overwrite=True) as tmp:
        valid = np.zeros(n, bool)
        rows = np.zeros(n, np.int64)
        skipped: dict[int, str] = {}
        arrays: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        pending: list[tuple[int, int, dict]] = []  # (position, variant, element)

        def flush():
            if not pending:
                return
            elements = [e for _, _, e in pending]
            elements += [elements[-1]] * (batch_size - len(elements))  # a full batch: one compiled shape
            host = data.collate(elements, source.columns.names)
            encoded = {k: _host_rows(v) for k, v in encode(host).items() if k != "index"}
            for name, value in encoded.items():
                if name not in arrays:
                    count = n if name in PER_ROW else n * variants
                    dtypes[name] = str(value.dtype)
                    arrays[name] = np.lib.format.open_memmap(tmp / f"{name}.npy", mode="w+", shape=(count, *value.shape[1:]),
                                                             dtype=_storable(value).dtype)
                for j, (pos, v, _) in enumerate(pending):
                    if name not in PER_ROW:
                        arrays[name][pos * variants + v] = _storable(value[j])
                    elif v == 0:
                        arrays[name][pos] = _storable(value[j])
            pending.clear()

        for pos in tqdm(range(n), desc="latent cache", unit="sample", disable=jax.process_index() != 0,
                        dynamic_ncols=True):
            for v in range(variants):
                element = _read(source, transform, pos, flip=bool(v), flag=flag)
                rows[pos] = element["row"]
                if "skip" in element:  # the image cannot be decoded: unflipped or flipped alike
                    skipped[pos] = element["skip"]
                    if len(skipped) <= UNREADABLE_LOGGED:
                        log(f"latent cache: unreadable sample {element['where']}: {element['skip']}")
                    break
                pending.append((pos, v, element))
                if len(pending) == batch_size:
                    flush()
            else:
                valid[pos] = True
        flush()
        if not valid.any():
            raise SdxError(f"{flag}: no sample of the dataset could be read")
        for a in arrays.values():
            a.flush()
        np.save(tmp / "valid.npy", valid)
        np.save(tmp / "rows.npy", rows)
        io.atomic_write_json(tmp / MANIFEST, {"format": FORMAT, "key": key, "variants": variants, "arrays": dtypes,
                                               "skipped": {str(k): v for k, v in skipped.items()}})
