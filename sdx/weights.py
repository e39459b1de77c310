"""Parameters without random initialisation: abstract models, the torch-key mapping, materialising.

A model is first built abstractly (`abstract(...)`: shapes only, via `nnx.eval_shape`); its parameter
paths joined by dots are the diffusers/transformers keys with the last part renamed. `from_torch_keys`
maps a flat `{torch_key: array}` onto those paths strictly (every source tensor used once, every
parameter filled, every shape checked), `to_torch_keys` is its inverse (for exporting), and
`materialize` puts the arrays on the device(s) and returns the live module.

The safetensors reader here memory-maps the file and hands out numpy views: a tensor's bytes are read
only when it is cast, sliced for a device shard or written elsewhere, so a 10 GB UNet never sits in host
memory at once. It checks the header strictly (a truncated or corrupt file names its first bad tensor).
The writer streams one tensor at a time to a temporary name and renames it into place.
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from sdx.errors import SdxError

# torch's `weight` is a kernel (Linear/Conv), a scale (norms) or an embedding table in Flax.
_WEIGHT_NAMES = ("kernel", "scale", "embedding")

Sharding = Callable[[str, tuple[int, ...]], jax.sharding.Sharding] | jax.sharding.Sharding | None


class _ShapeOnlyRngs(nnx.Rngs):
    """An `nnx.Rngs` whose every stream gives one constant key and counts nothing, for `abstract`.

    Under `nnx.eval_shape` each draw from a real Rngs updates a traced counter, and flax 0.12's
    Variable update then asks the tracer for its `sharding`, whose error message walks the whole
    jaxpr traced so far: quadratic in the number of parameters (the SDXL UNet took 155 s to build
    abstractly, the tiny test UNet 7 s). The values drawn are thrown away, so a constant key is enough.
    """

    def __init__(self):
        super().__init__()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return self

    def __call__(self) -> jax.Array:
        return jax.random.key(0)


def abstract(build: Callable[[nnx.Rngs], nnx.Module]) -> nnx.Module:
    """The module `build(rngs)` would make, with ShapeDtypeStructs in place of arrays."""
    return nnx.eval_shape(lambda: build(_ShapeOnlyRngs()))


def param_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """{'down_blocks.0.resnets.0.conv1.kernel': shape, ...} for every parameter of `model`."""
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, path)): tuple(v.get_value().shape) for path, v in nnx.to_flat_state(state)}


# --------------------------------------------------------------------------------------------------
# torch <-> sdx, one rule each way
#
# A torch kernel is (out, in, *spatial) (Linear: (out, in); Conv2d: OIHW); a Flax kernel is
# (*spatial, in, out) (Linear: (in, out); Conv: HWIO). `weight` becomes kernel/scale/embedding, every
# other name (`bias`) is kept. The two functions below are exact inverses except for the one lossy
# case `_to_flax` accepts: a Linear stored as a 1x1 conv (old VAE attention), exported back as a Linear.


def _to_flax(name: str, array: np.ndarray, target_ndim: int) -> np.ndarray:
    if name != "kernel":
        return array
    if array.ndim == 4 and target_ndim == 2:  # a Linear stored as a 1x1 conv (old VAE attention)
        array = array[:, :, 0, 0]
    if array.ndim >= 2:
        return array.transpose(*range(2, array.ndim), 1, 0)  # (out, in, *k) -> (*k, in, out)
    return array


def _to_torch(name: str, array: np.ndarray) -> np.ndarray:
    if name != "kernel" or array.ndim < 2:
        return array
    n = array.ndim
    return array.transpose(n - 1, n - 2, *range(n - 2))  # (*k, in, out) -> (out, in, *k)


def torch_key(path: str) -> str:
    """The torch key of an sdx parameter path: `...to_q.kernel` -> `...to_q.weight`."""
    prefix, _, last = path.rpartition(".")
    return f"{prefix}.weight" if last in _WEIGHT_NAMES else path


def from_torch_keys(
    targets: Mapping[str, tuple[int, ...]], source: Mapping[str, np.ndarray], *, where: str
) -> dict[str, np.ndarray]:
    """Map torch-keyed tensors onto sdx parameter paths; `where` names the file in errors.

    The results are (possibly transposed) views of the sources, not copies.
    """
    out: dict[str, np.ndarray] = {}
    for key, array in source.items():
        prefix, _, last = key.rpartition(".")
        names = _WEIGHT_NAMES if last == "weight" else (last,)
        found = [n for n in names if f"{prefix}.{n}" in targets]
        if not found:
            raise SdxError(f"{where}: tensor {key!r} has no place in the model (unexpected key)")
        path = f"{prefix}.{found[0]}"
        if path in out:
            raise SdxError(f"{where}: tensor {key!r} fills {path}, which another tensor already filled")
        converted = _to_flax(found[0], np.asarray(array), len(targets[path]))
        if tuple(converted.shape) != tuple(targets[path]):
            raise SdxError(
                f"{where}: tensor {key!r} has shape {tuple(np.shape(array))}, the model expects "
                f"{tuple(targets[path])} (as {path}); the checkpoint and the config disagree"
            )
        out[path] = converted
    missing = sorted(set(targets) - set(out))
    if missing:
        names = [torch_key(p) if torch_key(p) == p else f"{torch_key(p)} (as {p})" for p in missing[:5]]
        shown = ", ".join(names) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise SdxError(f"{where}: {len(missing)} parameter(s) missing from the checkpoint: {shown}")
    return out


def to_torch_keys(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `from_torch_keys`: {sdx path: Flax-layout array} -> {torch key: torch-layout array} (views)."""
    out: dict[str, np.ndarray] = {}
    for path, array in arrays.items():
        key = torch_key(path)
        if key in out:
            raise SdxError(f"parameters {path} and another both export as torch key {key!r}")
        out[key] = _to_torch(path.rpartition(".")[2], np.asarray(array))
    return out


def check_arrays(targets: Mapping[str, tuple[int, ...]], arrays: Mapping[str, np.ndarray], *, where: str) -> None:
    """Strict check of sdx-keyed arrays against a model's parameter shapes: none missing, none extra, same shapes."""
    extra = sorted(set(arrays) - set(targets))
    if extra:
        raise SdxError(f"{where}: tensor {extra[0]!r} has no place in the model (unexpected key)"
                       + (f", and {len(extra) - 1} more" if len(extra) > 1 else ""))
    missing = sorted(set(targets) - set(arrays))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise SdxError(f"{where}: {len(missing)} parameter(s) missing: {shown}")
    for key, shape in targets.items():
        if tuple(arrays[key].shape) != tuple(shape):
            raise SdxError(
                f"{where}: tensor {key!r} has shape {tuple(arrays[key].shape)}, the model expects {tuple(shape)}"
            )


class SourceTensors(dict):
    """{key: array}, plus `where`: the file (or index file) they came from, for error messages."""

    def __init__(self, arrays: Mapping[str, np.ndarray] = (), *, where: str):
        super().__init__(arrays)
        self.where = where


def where_of(tensors: Mapping[str, np.ndarray], default: str) -> str:
    return getattr(tensors, "where", None) or default


# --------------------------------------------------------------------------------------------------
# Materialising


def _put(value: np.ndarray, dtype, target: jax.sharding.Sharding | None) -> jax.Array:
    if target is None:
        return jnp.asarray(np.asarray(value).astype(dtype, copy=False))
    # Each device reads (and casts) only its own slice: a memory-mapped tensor is never fully copied
    # on the host when it is sharded.
    return jax.make_array_from_callback(
        tuple(value.shape), target, lambda index: np.asarray(value[index]).astype(dtype, copy=False)
    )


def materialize(
    model: nnx.Module,
    arrays: Mapping[str, np.ndarray],
    *,
    dtype: jnp.dtype | None = None,
    sharding: Sharding = None,
) -> nnx.Module:
    """Fill the abstract `model` with `arrays` (keyed by parameter path), cast to `dtype`, placed by `sharding`.

    `sharding` is one Sharding for every parameter, or a function of (path, shape) giving one.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    for path, var in nnx.to_flat_state(rest):
        if isinstance(var.get_value(), jax.ShapeDtypeStruct):
            key = ".".join(map(str, path))
            raise SdxError(f"model state {key} is not a parameter and has no value; it cannot be materialised")
    flat = []
    for path, var in nnx.to_flat_state(params):
        key = ".".join(map(str, path))
        if key not in arrays:
            raise SdxError(f"parameter {key} was not provided")
        value = arrays[key]
        target = sharding(key, tuple(value.shape)) if callable(sharding) else sharding
        flat.append((path, var.replace(_put(value, dtype or var.get_value().dtype, target))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)


def load_torch_state(model: nnx.Module, source: Mapping[str, np.ndarray], *, where: str, dtype=None, sharding=None):
    """Strictly map a torch state dict onto an abstract model and materialise it."""
    return materialize(model, from_torch_keys(param_shapes(model), source, where=where), dtype=dtype, sharding=sharding)


# --------------------------------------------------------------------------------------------------
# dtypes

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def dtype_of(name: str) -> np.dtype:
    """'float32' | 'bfloat16' | 'float16' -> numpy dtype (bfloat16 from ml_dtypes, as jax uses)."""
    if name not in DTYPES:
        raise SdxError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def is_float(dtype) -> bool:
    """numpy floating types and the ml_dtypes ones (bfloat16, float8), which numpy does not call floating."""
    dtype = np.dtype(dtype)
    return np.issubdtype(dtype, np.floating) or dtype in _ML_FLOATS


_ML_FLOATS = {np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)}


def dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise SdxError(f"dtype {dtype} is not one sdx stores weights in ({', '.join(DTYPES)})")


# --------------------------------------------------------------------------------------------------
# safetensors, memory-mapped
#
# Format: 8 bytes little-endian header length N, N bytes of JSON {key: {dtype, shape, data_offsets:
# [begin, end]}, "__metadata__": {str: str}}, then the data; offsets are relative to the end of the
# header, tensors are C-contiguous little-endian and together cover the data exactly.

_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


def _read_header(path: Path) -> tuple[dict, int, int]:
    """(header dict, data start, file size), checked against the file size."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SdxError(f"{path}: not a safetensors file ({size} bytes, too short for a header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise SdxError(
                    f"{path}: truncated or not a safetensors file (header of {n} bytes, file of {size} bytes)"
                )
            raw = f.read(n)
    except OSError as e:
        raise SdxError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise SdxError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise SdxError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, 8 + n, size


def read_safetensors_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The `__metadata__` string map of a safetensors file (empty if none)."""
    header, _, _ = _read_header(Path(path))
    meta = header.get("__metadata__") or {}
    return dict(meta) if isinstance(meta, dict) else {}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """{key: read-only numpy view into a memory map of `path`}, every entry checked against the file.

    A truncated file, a tensor whose byte range does not match its dtype and shape, overlapping or
    missing data, or an unknown dtype is an SdxError naming the file and the key.
    """
    path = Path(path)
    header, start, size = _read_header(path)
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SdxError(f"{path}: corrupt safetensors header entry for tensor {key!r}") from None
        if dtype not in _ST_DTYPES:
            raise SdxError(f"{path}: tensor {key!r} has dtype {dtype}, which sdx does not read")
        nbytes = math.prod(shape) * _ST_DTYPES[dtype].itemsize
        if end - begin != nbytes or begin < 0:
            raise SdxError(
                f"{path}: tensor {key!r} ({dtype} {list(shape)}) needs {nbytes} bytes but its header gives {end - begin}"
            )
        if start + end > size:
            raise SdxError(
                f"{path}: truncated file: tensor {key!r} ends at byte {start + end} but the file has {size} bytes"
            )
        entries.append((begin, end, key, dtype, shape))
    entries.sort()
    cursor = 0
    for begin, end, key, _, _ in entries:
        if begin != cursor:
            raise SdxError(f"{path}: corrupt safetensors file: tensor {key!r} starts at {begin}, expected {cursor}")
        cursor = end
    if start + cursor != size:
        raise SdxError(f"{path}: corrupt safetensors file: {size - start - cursor} trailing bytes after the last tensor")
    if not entries:
        return {}
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(cursor,)) if cursor else None
    out: dict[str, np.ndarray] = {}
    for begin, end, key, dtype, shape in sorted(entries, key=lambda e: e[2]):
        if end == begin:
            out[key] = np.zeros(shape, _ST_DTYPES[dtype])
        else:
            out[key] = mm[begin:end].view(_ST_DTYPES[dtype]).reshape(shape)
    return out


_UMASK = os.umask(0o022)
os.umask(_UMASK)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[object], None]) -> None:
    """Call `write(binary_file)` on a temporary file next to `path`, fsync it, rename it to `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the mode open() would
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` as safetensors, atomically, streaming one tensor at a time (each made contiguous
    little-endian only while it is written). Readable by the safetensors library, torch and diffusers."""
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for key, array in items:
        if key in header:
            raise SdxError(f"{path}: tensor {key!r} given twice")
        dtype = np.dtype(array.dtype).newbyteorder("<") if np.dtype(array.dtype).byteorder == ">" else np.dtype(array.dtype)
        if dtype not in _ST_NAMES:
            raise SdxError(f"{path}: tensor {key!r} has dtype {array.dtype}, which safetensors cannot store")
        nbytes = math.prod(array.shape) * dtype.itemsize
        header[key] = {"dtype": _ST_NAMES[dtype], "shape": list(array.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it

    def write(f):
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, array in items:
            a = np.ascontiguousarray(array)
            if a.dtype.byteorder == ">":
                a = a.astype(a.dtype.newbyteorder("<"))
            f.write(memoryview(a.reshape(-1).view(np.uint8)))

    atomic_write(path, write)


def read_json(path: str | os.PathLike, *, optional: bool = False, obj: bool = False) -> Any:
    """The JSON at `path`. optional: None when there is no such file (else an error); obj: it must be a
    JSON object. Every failure is one SdxError naming the file."""
    path = Path(path)
    if optional and not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SdxError(f"{path}: missing") from None
    except json.JSONDecodeError as e:
        raise SdxError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SdxError(f"{path}: cannot read ({e})") from None
    if obj and not isinstance(data, dict):
        raise SdxError(f"{path}: not a JSON object")
    return data


def atomic_write_json(path: str | os.PathLike, data: Any, *, sort_keys: bool = False) -> None:
    """`data` as indented JSON at `path`, atomically (numpy scalars as numbers, tuples and sets as lists)."""
    text = json.dumps(data, indent=2, sort_keys=sort_keys, default=_json_default) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def _json_default(value):
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, (tuple, set)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


class _LazyCast:
    """An array-like cast to `dtype` only when written (keeps peak memory at one tensor)."""

    def __init__(self, array, dtype: np.dtype):
        self.array, self.dtype, self.shape = array, np.dtype(dtype), tuple(array.shape)

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.array).astype(self.dtype, copy=False)
        return a if dtype is None else a.astype(dtype, copy=False)


def lazy_cast(array, dtype: np.dtype):
    """`array` as `dtype` for `write_safetensors`, converted when written; integer tensors stay as they are."""
    if not is_float(array.dtype) or np.dtype(array.dtype) == np.dtype(dtype):
        return array
    return _LazyCast(array, dtype)
