"""Files on disk: safetensors (memory-mapped reads, streamed atomic writes) and JSON.

The safetensors reader memory-maps the file and hands out numpy views: a tensor's bytes are read
only when it is cast, sliced for a device shard or written elsewhere, so a 10 GB UNet never sits in
host memory twice. Loading a model uses an aligned view's file pages in place on a CPU (`in_place`,
`read_ahead`; `unmap` takes them out of the process again once used) and reads any other tensor from
the file itself (`host_copy`), several at once. The reader checks the header strictly (a truncated or
corrupt file names its first bad tensor). Every writer goes through `atomic_write`: a temporary file
next to the target, fsynced and renamed into place, so a reader never sees half a file and an
interrupted run leaves the old one.

Errors a user can fix (a missing, truncated or malformed file) are one SdxError naming the file.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from numpy.lib.array_utils import byte_bounds

from sdx.config import is_int
from sdx.errors import SdxError

# --------------------------------------------------------------------------------------------------
# Permissions and durability


_UMASK_LOCK = threading.Lock()


def umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux ≥ 4.7 reports it in
    /proc/self/status). Elsewhere it is set and restored at once, under a lock; it is read at write
    time, never at import, so importing sdx changes nothing process-wide."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def default_mode(*, folder: bool = False) -> int:
    """The mode `open()` / `mkdir()` would give a new file / folder (mkstemp and mkdtemp give 0600 / 0700)."""
    return (0o777 if folder else 0o666) & ~umask()


def fsync_dir(folder: str | os.PathLike) -> None:
    """Make a rename inside `folder` durable (best effort: some file systems refuse to fsync folders)."""
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


def write_error(path: str | os.PathLike, e: OSError) -> SdxError:
    """The error for a write that failed (a full disk, a read-only or vanished folder), naming the file."""
    hint = "; free some space or write elsewhere" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
    return SdxError(f"cannot write {path}: {e.strerror or e}{hint}")


def atomic_write(path: str | os.PathLike, write: Callable[[object], None]) -> None:
    """Call `write(binary_file)` on a temporary file next to `path`, fsync it, rename it to `path`. A failed
    write (a full disk included) removes the temporary file, leaves `path` as it was and is `write_error`."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, default_mode())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise write_error(path, e) from None
        raise
    fsync_dir(path.parent)


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """Refuse an output location that cannot be written, before the work that would fill it: the nearest
    existing folder on the way to `path` must take a new file (probed with an unnamed temporary file, so
    nothing is left behind). `flag` names the location in the error (e.g. "--output")."""
    path = Path(path)
    folder = path
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise SdxError(f"{flag} {path}: {folder} is a file, not a folder; choose another {flag}")
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        where = f"cannot write in {folder}" if folder == path else f"it does not exist and cannot be made in {folder}"
        raise SdxError(f"{flag} {path}: {where}: {_why_not_writable(folder, e)}; choose another {flag}") from None


def _why_not_writable(folder: Path, e: OSError) -> str:
    """The reason a new file cannot be made in the existing folder `folder`, from the error that said so."""
    kind = file_system(folder)
    if e.errno == errno.EROFS:
        return f"it is on a read-only file system{f' ({kind})' if kind else ''}"
    if kind in SPECIAL_FILE_SYSTEMS:  # /proc says "no such file", /sys "permission denied" (even to root)
        return f"it is on {kind}, a file system the kernel makes of its own state, which takes no files"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "this user may not write there (permission denied)"
    return e.strerror or str(e)


# file systems the kernel makes up from its own state, where no user file can be written
SPECIAL_FILE_SYSTEMS = {"proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
                        "configfs", "pstore", "bpf", "efivarfs", "fusectl", "binfmt_misc"}


def file_system(path: Path) -> str:
    """The type of the file system `path` is on (Linux: /proc/self/mounts, the longest mount point above it), or ""
    where that cannot be read."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) > 2]
    except OSError:
        return ""
    target = os.path.realpath(path)
    above = [(point, kind) for point, kind in mounts
             if target == point or target.startswith(point.rstrip("/") + "/")]
    return max(above, key=lambda m: len(m[0]))[1] if above else ""


# --------------------------------------------------------------------------------------------------
# JSON


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


# --------------------------------------------------------------------------------------------------
# safetensors
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
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SdxError(f"{path}: corrupt safetensors header entry for tensor {key!r}") from None
        if not (isinstance(dtype, str) and all(is_int(d) and d >= 0 for d in (*shape, begin, end))):
            raise SdxError(f"{path}: corrupt safetensors header entry for tensor {key!r} (shape and offsets must be "
                           "integers >= 0)")
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
    mm = None
    if cursor:
        with open(path, "rb") as f:
            mm = np.frombuffer(_FileMap.of(path, f), np.uint8, cursor, start)
    out: dict[str, np.ndarray] = {}
    for begin, end, key, dtype, shape in sorted(entries, key=lambda e: e[2]):
        if end == begin:
            out[key] = np.zeros(shape, _ST_DTYPES[dtype])
        else:
            out[key] = mm[begin:end].view(_ST_DTYPES[dtype]).reshape(shape)
    return out


class _FileMap(mmap.mmap):
    """A read-only memory map of a whole file that remembers which file it maps (`host_copy` reads the file)
    and where it lies in this process's memory (`unmap`)."""

    path: Path
    identity: tuple[int, ...]  # device, inode, size, modification time: the file the map was made from
    address: int  # of its first byte

    @classmethod
    def of(cls, path: Path, f) -> _FileMap:
        mapped = cls(f.fileno(), 0, access=mmap.ACCESS_READ)
        mapped.path, mapped.identity = path, _identity(os.fstat(f.fileno()))
        mapped.address = np.frombuffer(mapped, np.uint8).ctypes.data
        _FILE_MAPS.add(mapped)
        return mapped


_FILE_MAPS: weakref.WeakSet[_FileMap] = weakref.WeakSet()  # every `_FileMap` still alive, for `unmap`


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _mapping(array: np.ndarray) -> tuple[mmap.mmap, int] | None:
    """(the open memory map under `array`, the offset there of the element `array.ctypes.data` points to), or
    None if it has none."""
    base = array.base
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if base is None or base.closed:
        return None
    return base, array.ctypes.data - np.frombuffer(base, np.uint8).ctypes.data


def unmap(address: int, nbytes: int) -> bool:
    """Unmap from this process the pages of the `nbytes` at `address` (memory of a device buffer a CPU uses in
    place, say) if they lie in one of `read_safetensors`' maps: the data stays in the OS page cache and the
    next read maps it again (a minor fault; from the disk only if the kernel dropped it meanwhile), but it
    stops counting in the process's memory. Whether they did; memory outside those maps is left alone."""
    for mapped in list(_FILE_MAPS):
        offset = address - mapped.address
        if not mapped.closed and offset >= 0 and offset + nbytes <= len(mapped):
            if nbytes:
                first = offset - offset % mmap.PAGESIZE
                mapped.madvise(mmap.MADV_DONTNEED, first, offset + nbytes - first)
            return True
    return False


def drop_pages(array: np.ndarray) -> None:
    """`unmap` the file pages under `array`, a view into `read_safetensors`' memory map, once it has been
    copied (`host_copy` of a view it cannot read from the file, a transposed or strided one: a load would
    otherwise hold those pages and their copies at once). Arrays not backed by a memory map are left alone."""
    low, high = byte_bounds(array)  # the bytes a strided or transposed view spans
    unmap(low, high - low)


ALIGNMENT = 64  # bytes: from this alignment, `jax.device_put` on a CPU keeps a host array as the device's buffer


def host_copy(array, dtype=None) -> np.ndarray:
    """A C-contiguous copy of `array` cast to `dtype` (default: its own), in memory aligned to `ALIGNMENT`
    bytes, so that `jax.device_put` on a CPU uses it in place instead of copying it again.

    A contiguous view into `read_safetensors`' map is read from its file with `os.preadv`, not through the
    map: no page faults, nothing left mapped in this process, and reads from several threads overlap (SDXL's
    10 GB UNet read from disk by 4 threads: 7.9 s, against 36 s copied through the map; from the page
    cache 3.3 s against 11.9 s, on the 2-core VM). Anything else is copied, and its mapped pages dropped."""
    array = np.asarray(array)
    dtype = array.dtype if dtype is None else np.dtype(dtype)
    out = _aligned_empty(array.shape, dtype)
    base, offset = _mapping(array) or (None, 0)
    if isinstance(base, _FileMap) and array.flags.c_contiguous:
        raw = out if dtype == array.dtype else _aligned_empty(array.shape, array.dtype)
        _read_into(base, offset, raw)
        if raw is not out:
            np.copyto(out, raw, casting="unsafe")
    else:
        np.copyto(out, array, casting="unsafe")
        drop_pages(array)
    return out


def in_place(array: np.ndarray) -> bool:
    """Whether `array` is a C-contiguous view into `read_safetensors`' map at an `ALIGNMENT`-byte address:
    `jax.device_put` on a CPU then uses its file pages as the device buffer, with no copy at all
    (`write_safetensors` aligns every tensor it can). Such weights live in the OS page cache, shared with
    other processes reading the file; a file rewritten in place (not replaced, as every sdx writer does)
    would change them."""
    base, _ = _mapping(array) or (None, 0)
    return isinstance(base, _FileMap) and array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0


READ_AHEAD_BYTES = 128 * 1024
"""Bytes per `read_ahead` request: Linux reads at most a device's read-ahead window (`read_ahead_kb`, 128 KiB
by default) of one MADV_WILLNEED, so a larger range is asked for in pieces of this size."""


def read_ahead(array: np.ndarray) -> None:
    """Have the OS read `array`'s file pages into its page cache now, without mapping them into this process:
    called from several threads, the reads overlap, so the first use does not wait for the disk a page at a
    time (SDXL's 10 GB UNet: 4.3 s from disk with 4 threads, 0.2 s when already cached, on the 2-core VM of
    benchmarks/LOG.md), and the pages count in the process's memory only once a computation maps them
    (a minor fault each)."""
    base, offset = _mapping(array) or (None, 0)
    if base is None:
        return
    first = offset - offset % mmap.PAGESIZE
    for start in range(first, offset + array.nbytes, READ_AHEAD_BYTES):
        base.madvise(mmap.MADV_WILLNEED, start, min(READ_AHEAD_BYTES, offset + array.nbytes - start))


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    first = -raw.ctypes.data % ALIGNMENT
    return raw[first:first + nbytes].view(dtype).reshape(shape)


def _read_into(mapped: _FileMap, offset: int, out: np.ndarray) -> None:
    """Fill `out` with the file bytes `mapped` maps from `offset` on."""
    buffer = memoryview(out.reshape(-1).view(np.uint8))
    try:
        fd = os.open(mapped.path, os.O_RDONLY)
    except OSError as e:
        raise SdxError(f"{mapped.path}: cannot read ({e.strerror or e})") from None
    try:
        if _identity(os.fstat(fd)) != mapped.identity:
            raise SdxError(f"{mapped.path}: the file changed while it was being loaded; load it again")
        done = 0
        while done < len(buffer):  # a read may stop short (Linux moves at most 2 GiB per call)
            n = os.preadv(fd, [buffer[done:]], offset + done)
            if n == 0:
                raise SdxError(f"{mapped.path}: the file ended while it was being loaded; load it again")
            done += n
    except OSError as e:
        raise SdxError(f"{mapped.path}: cannot read ({e.strerror or e})") from None
    finally:
        os.close(fd)


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `tensors` as safetensors, atomically, streaming one tensor at a time (each made contiguous
    little-endian only while it is written). Readable by the safetensors library, torch and diffusers.
    The data starts `ALIGNMENT`-byte aligned and the tensors whose size is a multiple of it come first, so
    that each of those can be used in place once mapped (`in_place`)."""
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    items.sort(key=lambda item: math.prod(item[1].shape) * np.dtype(item[1].dtype).itemsize % ALIGNMENT != 0)  # stable
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
    raw += b" " * (-(8 + len(raw)) % ALIGNMENT)  # header padding (safetensors pads to 8 bytes; 64 is a multiple)

    def write(f):
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, array in items:
            a = np.ascontiguousarray(array)
            if a.dtype.byteorder == ">":
                a = a.astype(a.dtype.newbyteorder("<"))
            f.write(memoryview(a.reshape(-1).view(np.uint8)))

    atomic_write(path, write)
