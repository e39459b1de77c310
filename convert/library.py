"""The library form of `python -m convert`, and the conversion cache `python -m sdx.sample` uses.

`convert(src, out, fmt=...)` reads any source (`convert.sources`), applies the `ModelOptions` and
writes one of the formats in `WRITERS`. A ControlNet source (`convert.controlnet.read_if_controlnet`: a
diffusers or sdx ControlNet folder, a hub repo holding one, an original single file) is written in the
same formats by `convert.controlnet_folder.WRITERS`. `ensure_sdx_folder(src)` gives an sdx model folder for any
source, converting it once into a cache keyed by the source's identity, the dtype and the options.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from convert import builtin_models, controlnet, controlnet_folder, export, hub, sdx_folder
from convert.sources import (
    Log,
    ModelOptions,
    apply_options,
    resolve_embedding,
    tokenizer_folders,
    check_source,
    default_variant,
    looks_local,
    read_source,
    resolved,
)
from sdx import io, model_folder, weights
from sdx.errors import SdxError

# --format NAME -> writer(checkpoint, out, *, dtype, overwrite, log). Adding a format is one line here.
WRITERS: dict[str, Callable[..., Path]] = {
    "sdx": sdx_folder.write_sdx_folder,
    "diffusers": export.write_diffusers_folder,
    "single-file": export.write_single_file_checkpoint,
}


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
    options: ModelOptions | None = None,
    log: Log | None = None,
) -> Path:
    """Read `src`, change it as `options` say, write it to `out` in format `fmt`; the library form of
    `python -m convert`."""
    log = log or (lambda _msg: None)
    options = options or ModelOptions()
    weights.dtype_of(dtype)
    if fmt not in WRITERS:
        raise SdxError(f"unknown --format {fmt!r}; choose one of {', '.join(WRITERS)}")
    if Path(src).exists() and Path(out).resolve() == Path(src).resolve():
        raise SdxError(f"{out}: the output must differ from the source")
    check_source(src, config=options.config, preset=options.preset)
    check_output(Path(out), fmt, overwrite=overwrite)
    src = builtin_models.folder(str(src), default_cache_dir() / "models", log) or src
    if variant is None:
        variant = default_variant(dtype)
    changes = resolved(options, variant=variant, cache_dir=cache_dir, log=log)
    embeddings = [(resolve_embedding(spec, cache_dir=cache_dir, log=log), token) for spec, token in options.embeddings]
    part = controlnet.read_if_controlnet(src, config=options.config, preset=options.preset, variant=variant,
                                         revision=revision, cache_dir=cache_dir, log=log)
    if part is not None:
        if options.changes_weights:
            raise SdxError(f"{src}: a ControlNet; --lora, --vae, --unet and --embedding apply to pipelines")
        return controlnet_folder.WRITERS[fmt](part, out, dtype=dtype, overwrite=overwrite, log=log)
    if fmt == "sdx" and model_folder.is_model_folder(src) and options.empty:
        return model_folder.resave(src, out, dtype=dtype, overwrite=overwrite, log=log)
    ckpt = read_source(src, variant=variant, revision=revision, cache_dir=cache_dir, config=options.config,
                       preset=options.preset, log=log)
    if not ckpt.pipeline_class and fmt != "single-file":
        raise SdxError(f"{src}: a standalone VAE file; use it with --vae, or write it with --format single-file")
    apply_options(ckpt, changes, variant=variant, log=log)
    if not ckpt.pipeline_class:
        if embeddings:
            raise SdxError(f"{src}: a standalone VAE; --embedding adds words to a pipeline's text encoders")
        return WRITERS[fmt](ckpt, out, dtype=dtype, overwrite=overwrite, log=log)
    with tokenizer_folders(ckpt, embeddings, log):
        return WRITERS[fmt](ckpt, out, dtype=dtype, overwrite=overwrite, log=log)


def check_output(out: Path, fmt: str, *, overwrite: bool = False) -> None:
    """Refuse an output `fmt` cannot be written to, before any source is read: an existing one without
    `overwrite`, a single file not named *.safetensors, a folder named like a file, a place that cannot
    be written."""
    if fmt == "single-file":
        export.check_single_file_output(out, overwrite=overwrite)
        io.check_writable(out.parent if out.exists() else out, "OUT")  # (an existing file: --overwrite)
        return
    if out.suffix.lower() in (".safetensors", ".ckpt") and not out.is_dir():
        raise SdxError(f"{out}: --format {fmt} writes a folder; for one .safetensors file pass --format single-file")
    model_folder.check_output_folder(out, overwrite=overwrite)
    io.check_writable(out, "OUT")


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


def identity(path: Path) -> str:
    """A folder's or file's identity for cache keys: its resolved path and its files' sizes and mtimes."""
    path = Path(path)
    if path.is_dir():
        return f"{path.resolve()}\0{_fingerprint(path)}"
    st = path.stat()
    return f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"


def ensure_sdx_folder(
    src: str | os.PathLike,
    *,
    dtype: str = "float32",
    variant: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    options: ModelOptions | None = None,
    log: Log | None = None,
) -> Path:
    """An sdx model folder for `src`: `src` itself when it is one (and `options` change nothing), else a
    conversion cached once under `cache_dir` (default `default_cache_dir()/models`), keyed by the
    source's identity, `dtype` and the options (the LoRA files' identities and scales, the VAE's and the
    UNet's, the embeddings' with their tokens).

    A folder or single file is keyed by its resolved path and file stats; a hub id by the snapshot it
    resolves to (so a new commit converts again). This is what `python -m sdx.sample --model` calls.
    """
    log = log or (lambda _msg: None)
    options = options or ModelOptions()
    weights.dtype_of(dtype)
    if model_folder.is_model_folder(src) and options.empty:
        return Path(src)
    variant = variant if variant is not None else default_variant(dtype)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models"
    path = Path(src)
    if path.is_dir() or path.is_file():
        source, key = path, identity(path)
        name = path.resolve().stem if path.is_file() else path.resolve().name
        if options.config is not None and Path(options.config).exists():
            key += f"\0config\0{identity(Path(options.config))}"
        if options.preset is not None:
            key += f"\0preset\0{options.preset}"
    elif path.exists():
        raise SdxError(f"{src}: not an sdx folder, diffusers folder or single-file checkpoint, nor a hub id")
    elif looks_local(str(src)) or not hub.looks_like_repo_id(str(src)):
        raise builtin_models.unknown(str(src))
    else:
        if options.single_file_only:
            raise SdxError(f"--config/--preset apply to single-file checkpoints; {src} is a hub repo")
        source = hub.fetch(str(src), variant=variant, revision=revision, cache_dir=None, log=log)
        key, name = f"hub\0{src}\0{source.name}", str(src).replace("/", "--")
    changes = resolved(options, variant=variant, cache_dir=None, log=log)
    for lora, scale in changes.loras:
        key += f"\0lora\0{identity(lora)}\0{scale!r}"
    for what, path in (("vae", changes.vae), ("unet", changes.unet)):
        if path is not None:
            key += f"\0{what}\0{identity(path)}"
    embeddings = [(resolve_embedding(spec, log=log), token) for spec, token in options.embeddings]
    for embedding, token in embeddings:
        key += f"\0embedding\0{identity(embedding)}\0{token!r}"
    digest = hashlib.sha256(f"{key}\0{variant}".encode()).hexdigest()[:12]
    out = root / f"{name}-{dtype}-{digest}"
    if model_folder.is_model_folder(out):
        return out
    log(f"converting {src} into {out} (once)")
    ckpt = read_source(source, variant=variant, config=options.config, preset=options.preset, log=log)
    if not ckpt.pipeline_class:
        raise SdxError(f"{src}: a standalone VAE file, not a model; pass it with --vae")
    apply_options(ckpt, changes, variant=variant, log=log)
    try:
        with tokenizer_folders(ckpt, embeddings, log):
            return sdx_folder.write_sdx_folder(ckpt, out, dtype=dtype, overwrite=True, log=log)
    except SdxError:
        if model_folder.is_model_folder(out):  # another process finished the same conversion first
            return out
        raise
