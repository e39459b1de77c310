"""Small training datasets written by tests: parquet (raw bytes or the hub's Image struct), image folders
with metadata.jsonl, a huggingface_hub cache snapshot, and pictures whose pixels say where they came from."""

from __future__ import annotations

import io
import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def coordinates(height: int, width: int, tag: int = 0) -> np.ndarray:
    """uint8 (h, w, 3) with R = x, G = y, B = tag: a crop of it says where it was cut (and a flip, how)."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x, y, np.full_like(x, tag)], axis=-1).astype(np.uint8)


def random_picture(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def encode(array_or_image, fmt: str = "PNG") -> bytes:
    im = array_or_image if isinstance(array_or_image, Image.Image) else Image.fromarray(array_or_image)
    buf = io.BytesIO()
    im.save(buf, fmt)
    return buf.getvalue()


def png16(a: np.ndarray) -> bytes:
    """A 16-bit PNG of uint16 (h, w, c), c = 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA)."""
    h, w, c = a.shape
    colour_type = {1: 0, 2: 4, 3: 2, 4: 6}[c]
    raw = b"".join(b"\x00" + a[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", w, h, 16, colour_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def truncated_png(seed: int = 0) -> bytes:
    data = encode(random_picture(24, 24, seed))
    return data[: len(data) // 2]


GARBAGE = b"this is not an image at all" * 4

IMAGE_STRUCT = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])


def write_parquet(path: Path, columns: dict[str, list], *, image_columns: tuple[str, ...] = (),
                  as_struct: bool = False, row_group_size: int | None = None) -> Path:
    """A parquet file; `image_columns` hold bytes (or, with as_struct, the hub's {bytes, path} dicts)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays, fields = [], []
    for name, values in columns.items():
        if name in image_columns:
            t = IMAGE_STRUCT if as_struct else pa.binary()
        elif values and isinstance(values[0], list):
            t = pa.list_(pa.string())
        elif values and isinstance(values[0], (int, np.integer)):
            t = pa.int64()
        else:
            t = pa.string()
        arrays.append(pa.array(values, type=t))
        fields.append(pa.field(name, t))
    features = {n: {"_type": "Image"} for n in image_columns}
    schema = pa.schema(fields, metadata={"huggingface": json.dumps({"info": {"features": features}})})
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), path, row_group_size=row_group_size)
    return path


def write_imagefolder(root: Path, rows: list[dict], images: dict[str, bytes], *,
                      metadata: str = "metadata.jsonl") -> Path:
    """`images` (file name -> bytes) and a metadata.jsonl of `rows` in `root`."""
    root.mkdir(parents=True, exist_ok=True)
    for name, data in images.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    with open(root / metadata, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return root


def hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = HUB_COMMIT) -> Path:
    """A huggingface_hub cache holding `folder` as the main revision of the dataset `repo_id`."""
    storage = cache / ("datasets--" + repo_id.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    shutil.copytree(folder, storage / "snapshots" / commit)
    return storage / "snapshots" / commit
