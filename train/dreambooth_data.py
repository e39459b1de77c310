"""DreamBooth's data: the subject's images under one prompt and, with prior preservation, as many images of
its class under the class prompt in every batch (diffusers' train_dreambooth.py).

    data = open_data(cfg)                            # checked before any model is loaded
    sample_class_images(data, pipeline, cfg, log)    # the missing class images, sampled into --class_data_dir
    loader = DreamBoothLoader(instance_loader, class_loader, ids)

The instance images are every image file of `--instance_data_dir` (sorted by path; a metadata.jsonl there
is read as an image folder's), or the rows of `--dataset_name` (the SDXL DreamBooth LoRA script's), each
with its own prompt from `--caption_column` when given (else `--instance_prompt`); `--repeats` reads each
one that many times per epoch. The class images are the first `--num_class_images` image files of
`--class_data_dir` in path order (diffusers takes them in directory order); when there are fewer, the
missing ones are sampled first with `--class_prompt`, `--sample_batch_size` at a time, and written as
`{number}-{sha1 of the pixels}.jpg` as diffusers names them. An epoch is diffusers' dataset length:
the instance images, or with prior preservation max(instance images, --num_class_images).

Each part is read by its own `data.Loader` (its own shuffle, flips and crops: the class part's seed is
offset by `CLASS_STREAM`), so a class image is resized and cropped by its own size. A batch is the
instance batch followed by the class batch; an instance sample's stream index p becomes 2p and a class
sample's 2p + 1 (every sample of a step draws from its own key); "prior" flags the class rows and "ids"
holds each row's prompt tokens.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from sdx import io
from sdx.errors import SdxError
from train import data, sources
from train.config import TrainConfig

CLASS_STREAM = 0x436C6173  # the class loader's seed: --seed plus this, apart from the instance loader's


@dataclasses.dataclass
class DreamBoothData:
    """The run's images. instance: the subject's; class_dir: the class images' folder (prior preservation),
    else None. `len` counts diffusers' dataset rows (one instance image, and one class image, each)."""

    instance: sources.Source
    class_dir: Path | None
    num_class_images: int

    @property
    def description(self) -> str:
        prior = f", class images from {self.class_dir}" if self.class_dir is not None else ""
        return f"{self.instance.description}{prior}"

    def __len__(self) -> int:
        if self.class_dir is None:
            return len(self.instance)
        return max(len(self.instance), self.num_class_images)

    def classes(self) -> sources.Source:
        """The class images used: the first --num_class_images of the folder (once there are that many)."""
        found = sources.image_files(self.class_dir)
        if len(found) < self.num_class_images:
            raise SdxError(f"--class_data_dir {self.class_dir} holds {len(found)} images, fewer than "
                           f"--num_class_images {self.num_class_images}")
        folder = sources.FolderSource(self.class_dir, sources.Columns.images_only(), name="--class_data_dir")
        return sources.Subset(folder, range(self.num_class_images))


def open_data(cfg: TrainConfig) -> DreamBoothData:
    """The instance images, checked; the class folder checked to be writable when images must be sampled."""
    if cfg.dataset_name:
        columns = sources.Columns(images=(cfg.image_column,), text=cfg.caption_column, names=("pixels",))
        instance = sources.open_source(cfg.dataset_name, columns, max_samples=None, seed=cfg.seed,
                                       cache_dir=cfg.cache_dir)
    else:
        instance = sources.image_folder(cfg.instance_data_dir, "--instance_data_dir")
    instance = sources.repeated(instance, cfg.repeats)
    class_dir = None
    if cfg.with_prior_preservation:
        class_dir = Path(cfg.class_data_dir)
        if class_dir.exists() and not class_dir.is_dir():
            raise SdxError(f"--class_data_dir {class_dir} is a file, not a folder")
        if len(sources.image_files(class_dir)) < cfg.num_class_images:
            io.check_writable(class_dir, "--class_data_dir")
    return DreamBoothData(instance, class_dir, cfg.num_class_images)


def sample_class_images(source: DreamBoothData, generate, cfg: TrainConfig, log=print) -> None:
    """Sample the class images `source.class_dir` lacks. generate(count, seed) -> uint8 images (count, H,
    W, 3) of --class_prompt (image j from seed's key j, `pipelines.request`); seed = --seed + the number of
    images already there. Each is written whole (atomically) as `{number}-{sha1}.jpg`."""
    have = len(sources.image_files(source.class_dir))
    missing = source.num_class_images - have
    if missing <= 0:
        return
    log(f"sampling {missing} class images of {cfg.class_prompt!r} into {source.class_dir}")
    images = generate(missing, cfg.seed + have)
    source.class_dir.mkdir(parents=True, exist_ok=True)
    for j, pixels in enumerate(images):
        picture = Image.fromarray(pixels)
        name = f"{have + j}-{hashlib.sha1(picture.tobytes()).hexdigest()}.jpg"
        io.atomic_write(source.class_dir / name, lambda f, picture=picture: picture.save(f, format="JPEG"))


class DreamBoothLoader:
    """One host's batches (see the module docstring), with `data.Loader`'s interface: iter, state, restore,
    skipped, close. ids: {"instance": {encoder: (1, 77)}, "class": ...}, each prompt's tokens, for the rows
    whose batch has no "ids" of its own (captions)."""

    def __init__(self, instance: data.Loader, classes: data.Loader | None, ids: Mapping[str, Mapping[str, np.ndarray]]):
        self.parts = {"instance": instance} | ({"class": classes} if classes is not None else {})
        self.ids = ids

    @property
    def skipped(self) -> int:
        return sum(loader.skipped for loader in self.parts.values())

    def state(self) -> dict[str, Any]:
        return {name: loader.state() for name, loader in self.parts.items()}

    def restore(self, state: Mapping[str, Any]) -> None:
        if set(state) != set(self.parts):
            raise SdxError(f"the saved data position holds {sorted(state)}, this run reads {sorted(self.parts)}; "
                           "resume with the same --with_prior_preservation")
        for name, loader in self.parts.items():
            loader.restore(state[name])

    def close(self) -> None:
        for loader in self.parts.values():
            loader.close()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        streams = [iter(loader) for loader in self.parts.values()]
        for batches in zip(*streams):
            yield self._merge(batches)

    def _merge(self, batches) -> dict[str, Any]:
        """The parts' batches -> one: rows stacked in part order, each with its prompt's ids."""
        out: dict[str, Any] = {}
        for k in ("pixels", "original_size", "crop_top_left", "row"):
            out[k] = np.concatenate([b[k] for b in batches])
        out["index"] = np.concatenate([2 * b["index"] + part for part, b in enumerate(batches)])
        out["prior"] = np.concatenate([np.full(len(b["index"]), part == 1) for part, b in enumerate(batches)])
        out["ids"] = {e: np.concatenate([b["ids"][e] if "ids" in b  # the rows' own captions, else the part's prompt
                                         else np.repeat(self.ids[name][e][None], len(b["index"]), 0)
                                         for name, b in zip(self.parts, batches)])  # (B, 1, 77)
                      for e in self.ids["instance"]}
        return out
