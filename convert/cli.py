"""`python -m convert SRC OUT`: read any supported source, write the asked format.

SRC is, in this order: an sdx model folder (sdx.json), a diffusers-layout folder (model_index.json),
a single-file checkpoint (when `convert.single_file` is present), or a hub id `org/name` (a local
path always wins over a hub id). Readers produce a `Checkpoint`; writers consume one (`WRITERS`).

Errors a user can fix are SdxErrors: printed as one line `error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from convert import diffusers_folder, hub, sdx_folder
from convert.checkpoint import Checkpoint
from sdx import model_folder, weights
from sdx.errors import SdxError

Log = Callable[[str], None]

# --format NAME -> writer(checkpoint, out, *, dtype, overwrite, log). Adding a format is one line here.
WRITERS: dict[str, Callable[..., Path]] = {
    "sdx": sdx_folder.write_sdx_folder,
}

SIXTEEN_BIT = ("bfloat16", "float16")


def default_variant(dtype: str | None) -> str | None:
    """The weights variant worth reading for `dtype`: fp16 halves the download when 16 bits are kept anyway."""
    return "fp16" if dtype in SIXTEEN_BIT else None


def read_source(
    src: str | os.PathLike,
    *,
    variant: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    log: Log | None = None,
) -> Checkpoint:
    """Any supported source as a Checkpoint (tensors memory-mapped where the format allows)."""
    log = log or (lambda _msg: None)
    path = Path(src)
    if path.is_dir():
        if model_folder.is_model_folder(path):
            log(f"reading sdx folder {path}")
            return sdx_folder.read_sdx_folder(path)
        log(f"reading diffusers folder {path}")
        return diffusers_folder.read_diffusers_folder(path, variant=variant, log=log)
    if path.is_file():
        return _read_single_file(path, log)
    if path.exists() or path.is_symlink():
        raise SdxError(f"{src}: neither a folder nor a file")
    text = str(src)
    if looks_local(text) or not hub.looks_like_repo_id(text):
        raise SdxError(f"{src}: no such file or folder (and not a hub id of the form org/name)")
    folder = hub.fetch(text, variant=variant, revision=revision, cache_dir=cache_dir, log=log)
    return diffusers_folder.read_diffusers_folder(folder, variant=variant, log=log)


def looks_local(text: str) -> bool:
    return text.startswith((".", "/", "~")) or os.sep + os.sep in text or text.endswith(os.sep)


def _read_single_file(path: Path, log: Log) -> Checkpoint:
    if importlib.util.find_spec("convert.single_file") is None:
        raise SdxError(f"{path}: single-file checkpoints are not supported by this build; give a diffusers folder")
    from convert import single_file

    log(f"reading single-file checkpoint {path}")
    return single_file.read_single_file(path, None)


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    fmt: str = "sdx",
    dtype: str = "float32",
    variant: str | None = None,
    revision: str | None = None,
    overwrite: bool = False,
    cache_dir: str | Path | None = None,
    log: Log | None = None,
) -> Path:
    """Read `src`, write it to `out` in format `fmt`; the library form of `python -m convert`."""
    weights.dtype_of(dtype)
    if fmt not in WRITERS:
        raise SdxError(f"unknown --format {fmt!r}; choose one of {', '.join(WRITERS)}")
    if Path(src).exists() and Path(out).resolve() == Path(src).resolve():
        raise SdxError(f"{out}: the output must differ from the source")
    if variant is None:
        variant = default_variant(dtype)
    if fmt == "sdx" and model_folder.is_model_folder(src):
        return model_folder.resave(src, out, dtype=dtype, overwrite=overwrite, log=log)
    ckpt = read_source(src, variant=variant, revision=revision, cache_dir=cache_dir, log=log)
    return WRITERS[fmt](ckpt, out, dtype=dtype, overwrite=overwrite, log=log)


def default_cache_dir() -> Path:
    """$SDX_CACHE, else $XDG_CACHE_HOME/sdx, else ~/.cache/sdx."""
    if os.environ.get("SDX_CACHE"):
        return Path(os.environ["SDX_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sdx"


def _fingerprint(folder: Path) -> str:
    """Paths, sizes and mtimes of every file under `folder`: changes when the folder's content does."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.relative_to(folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def ensure_sdx_folder(
    src: str | os.PathLike,
    *,
    dtype: str = "float32",
    variant: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    log: Log | None = None,
) -> Path:
    """An sdx model folder for `src`: `src` itself when it is one, else a conversion cached once under
    `cache_dir` (default `default_cache_dir()/models`), keyed by the source's identity and `dtype`.

    A diffusers folder is keyed by its resolved path and file stats; a hub id by the snapshot it resolves
    to (so a new commit converts again). This is what `python -m sdx.sample --model` calls.
    """
    log = log or (lambda _msg: None)
    weights.dtype_of(dtype)
    if model_folder.is_model_folder(src):
        return Path(src)
    variant = variant if variant is not None else default_variant(dtype)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models"
    path = Path(src)
    if path.is_dir():
        source, key = path, f"{path.resolve()}\0{_fingerprint(path)}"
        name = path.resolve().name
    elif path.exists() or looks_local(str(src)) or not hub.looks_like_repo_id(str(src)):
        raise SdxError(f"{src}: not an sdx or diffusers folder, nor a hub id (single files: convert with python -m convert)")
    else:
        source = hub.fetch(str(src), variant=variant, revision=revision, cache_dir=None, log=log)
        key, name = f"hub\0{src}\0{source.name}", str(src).replace("/", "--")
    digest = hashlib.sha256(f"{key}\0{variant}".encode()).hexdigest()[:12]
    out = root / f"{name}-{dtype}-{digest}"
    if model_folder.is_model_folder(out):
        return out
    log(f"converting {src} into {out} (once)")
    ckpt = diffusers_folder.read_diffusers_folder(source, variant=variant, log=log)
    try:
        return sdx_folder.write_sdx_folder(ckpt, out, dtype=dtype, overwrite=True, log=log)
    except SdxError:
        if model_folder.is_model_folder(out):  # another process finished the same conversion first
            return out
        raise


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m convert",
        description="Convert a diffusers folder, a hub id or an sdx folder into an sdx model folder.",
    )
    p.add_argument("src", metavar="SRC", help="diffusers-layout folder, hub id (org/name) or sdx folder")
    p.add_argument("out", metavar="OUT", help="output folder (must not exist or be empty, unless --overwrite)")
    p.add_argument("--format", dest="fmt", default="sdx", choices=list(WRITERS), help="output layout (default: sdx)")
    p.add_argument("--dtype", default="float32", choices=list(weights.DTYPES),
                   help="dtype of the written weights (default: float32)")
    p.add_argument("--variant", default=None,
                   help="weights variant to read, e.g. fp16 (default: fp16 for a 16-bit --dtype when it exists)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) for a hub id")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    p.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    return p


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as every sdx CLI error
        print(f"error: {message} (see python -m convert --help)", file=sys.stderr)
        raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    log = (lambda _msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    try:
        convert(
            args.src, args.out, fmt=args.fmt, dtype=args.dtype, variant=args.variant, revision=args.revision,
            overwrite=args.overwrite, log=log,
        )
    except SdxError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0
