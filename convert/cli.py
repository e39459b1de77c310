"""`python -m convert SRC OUT`: read any supported source, write the asked format.

SRC is, in this order: an sdx model folder (sdx.json), a diffusers-layout folder (model_index.json),
a single-file checkpoint (SGM/LDM keys, `convert.single_file`), or a hub id `org/name` (a local
path always wins over a hub id). Readers produce a `Checkpoint`; `ModelOptions` change it on the way
(a swapped VAE, merged LoRAs, the configs of a single file); writers consume it (`WRITERS`).

Errors a user can fix are SdxErrors: printed as one line `error: ...`, exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from convert import diffusers_folder, export, hub, sdx_folder
from convert.checkpoint import Checkpoint
from sdx import io, model_folder, weights
from sdx.errors import SdxError

Log = Callable[[str], None]

# --format NAME -> writer(checkpoint, out, *, dtype, overwrite, log). Adding a format is one line here.
WRITERS: dict[str, Callable[..., Path]] = {
    "sdx": sdx_folder.write_sdx_folder,
    "diffusers": export.write_diffusers_folder,
    "single-file": export.write_single_file_checkpoint,
}

SIXTEEN_BIT = ("bfloat16", "float16")


def default_variant(dtype: str | None) -> str | None:
    """The weights variant worth reading for `dtype`: fp16 halves the download when 16 bits are kept anyway."""
    return "fp16" if dtype in SIXTEEN_BIT else None


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """What changes a source on its way in (`python -m convert` and `python -m sdx.sample` flags).

    config: a diffusers-layout folder (config.json files, tokenizers) for a single-file source, in
      place of the built-in preset its keys point to (`--config`).
    preset: the preset for a single-file source, e.g. "sd21" for an SD 2.x-base epsilon file (`--preset`).
    loras: (file or hub path, scale) pairs, merged in order (`--lora FILE[:SCALE]`).
    vae: a VAE to use instead of the model's (`--vae`): a diffusers VAE folder, a pipeline folder
      (its vae/), an sdx folder, a single VAE file, or a hub id (`org/name`, `org/name/file.safetensors`).
    """

    config: str | None = None
    preset: str | None = None
    loras: tuple[tuple[str, float], ...] = ()
    vae: str | None = None

    @classmethod
    def from_args(cls, *, config=None, preset=None, lora: Sequence[str] | None = None, vae=None) -> ModelOptions:
        from convert.lora import parse_lora_arg

        loras = []
        for arg in lora or ():
            _, scale = parse_lora_arg(arg)  # checks the scale
            head, sep, tail = arg.rpartition(":")
            loras.append((head if sep and head and _is_number(tail) else arg, scale))  # the path as typed
        return cls(config=config, preset=preset, loras=tuple(loras), vae=vae)

    @property
    def single_file_only(self) -> bool:
        return self.config is not None or self.preset is not None

    @property
    def changes_weights(self) -> bool:
        return bool(self.loras) or self.vae is not None

    @property
    def empty(self) -> bool:
        return not (self.single_file_only or self.changes_weights)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def read_source(
    src: str | os.PathLike,
    *,
    variant: str | None = None,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    config: str | os.PathLike | None = None,
    preset: str | None = None,
    log: Log | None = None,
) -> Checkpoint:
    """Any supported source as a Checkpoint (tensors memory-mapped where the format allows).

    config, preset: for a single-file source only (see `ModelOptions`); an error for any other.
    """
    log = log or (lambda _msg: None)
    path = Path(src)
    if path.is_file():
        return _read_single_file(path, log, config=config, preset=preset)
    if config is not None or preset is not None:
        flag = "--config" if config is not None else "--preset"
        raise SdxError(f"{flag} applies to single-file checkpoints; {src} is not one (its configs are its own)")
    if path.is_dir():
        if model_folder.is_model_folder(path):
            log(f"reading sdx folder {path}")
            return sdx_folder.read_sdx_folder(path)
        log(f"reading diffusers folder {path}")
        return diffusers_folder.read_diffusers_folder(path, variant=variant, log=log)
    if path.exists() or path.is_symlink():
        raise SdxError(f"{src}: neither a folder nor a file")
    text = str(src)
    if looks_local(text) or not hub.looks_like_repo_id(text):
        raise SdxError(f"{src}: no such file or folder (and not a hub id of the form org/name)")
    folder = hub.fetch(text, variant=variant, revision=revision, cache_dir=cache_dir, log=log)
    return diffusers_folder.read_diffusers_folder(folder, variant=variant, log=log)


def looks_local(text: str) -> bool:
    return text.startswith((".", "/", "~")) or os.sep + os.sep in text or text.endswith(os.sep)


def _read_single_file(path: Path, log: Log, *, config=None, preset=None) -> Checkpoint:
    from convert import single_file

    log(f"reading single-file checkpoint {path}" + (f" with the configs of {config}" if config else ""))
    return single_file.read_single_file(path, config, preset=preset)


# --------------------------------------------------------------------------------------------------
# --lora, --vae: where the files are


def _hub_or_error(spec: str, flag: str) -> tuple[str, str | None]:
    split = None if looks_local(spec) else hub.split_hub_path(spec)
    if split is None:
        raise SdxError(f"{flag} {spec}: no such file or folder (nor a hub id org/name or org/name/FILE)")
    return split


class _recording:
    """A `choose(listing)` for `hub.fetch_files` that remembers what it picked."""

    def __init__(self, choose: Callable[[list[str]], list[str]]):
        self.choose, self.picked = choose, []

    def __call__(self, listing: list[str]) -> list[str]:
        self.picked = self.choose(listing)
        return self.picked


def resolve_lora(spec: str, *, cache_dir: str | Path | None = None, log: Log | None = None) -> Path:
    """The local file of a `--lora` argument: a path, or a hub `org/name/file.safetensors` (or `org/name`
    holding pytorch_lora_weights.safetensors or exactly one .safetensors file), downloaded."""
    if Path(spec).is_file():
        return Path(spec)
    if Path(spec).is_dir():
        raise SdxError(f"--lora {spec}: is a folder; give the LoRA's .safetensors file")
    repo, file = _hub_or_error(spec, "--lora")

    def choose(listing: list[str]) -> list[str]:
        where = f"--lora {spec}: hub repo {repo!r}"
        if file is not None:
            if file not in listing:
                raise SdxError(f"{where} has no file {file}")
            return [file]
        if "pytorch_lora_weights.safetensors" in listing:
            return ["pytorch_lora_weights.safetensors"]
        found = [f for f in listing if f.endswith(".safetensors")]
        if len(found) == 1:
            return found
        if not found:
            raise SdxError(f"{where} has no .safetensors file (LoRAs are read from safetensors only)")
        raise SdxError(f"{where} has several .safetensors files ({', '.join(found[:6])}); name one: "
                       f"--lora {repo}/FILE[:SCALE]")

    chosen = _recording(choose)
    folder = hub.fetch_files(repo, chosen, cache_dir=cache_dir, log=log)
    return folder / chosen.picked[0]


def resolve_vae(spec: str, *, variant: str | None = None, cache_dir: str | Path | None = None,
                log: Log | None = None) -> Path:
    """The local folder or file of a `--vae` argument (a hub id is downloaded: only the VAE's config and
    weights, from a VAE repo or from a pipeline repo's vae/ folder; `org/name/FILE` for a single file)."""
    if Path(spec).exists():
        return Path(spec)
    repo, file = _hub_or_error(spec, "--vae")
    where = f"--vae {spec}: hub repo {repo!r}"

    def choose(listing: list[str]) -> list[str]:
        if file is not None:
            if file not in listing:
                raise SdxError(f"{where} has no file {file}")
            return [file]
        for sub in ("", "vae/"):
            if f"{sub}config.json" in listing:
                names = [f[len(sub):] for f in listing if f.startswith(sub) and "/" not in f[len(sub):]]
                choice = diffusers_folder.choose_weights(names, "diffusers", variant, where=f"{where}: {sub or '/'}")
                return [f"{sub}config.json", *(sub + f for f in choice.files)]
        raise SdxError(f"{where} is neither a VAE repo (config.json) nor a pipeline repo (vae/config.json); "
                       f"for a single VAE file give --vae {repo}/FILE.safetensors")

    chosen = _recording(choose)
    folder = hub.fetch_files(repo, chosen, cache_dir=cache_dir, log=log)
    if file is not None:
        return folder / file
    return folder / "vae" if chosen.picked[0].startswith("vae/") else folder


_VAE_ARCHITECTURE = ("in_channels", "out_channels", "block_out_channels", "layers_per_block", "latent_channels",
                     "norm_num_groups", "use_quant_conv", "use_post_quant_conv", "mid_block_add_attention")


def read_vae_source(path: Path, pipeline_vae_config: dict, *, variant: str | None = None) -> tuple[dict, dict]:
    """(config.json dict, diffusers-keyed tensors) of the VAE at `path` (see `resolve_vae`). A single
    file has no config: it takes the pipeline's (so the pipeline's scaling factor)."""
    where = f"--vae {path}"
    if path.is_file():
        from convert import single_file

        try:
            return dict(pipeline_vae_config), single_file.read_vae(path, pipeline_vae_config)
        except SdxError as e:
            raise SdxError(f"{where}: does not fit the model's VAE: {e}") from None
    if model_folder.is_model_folder(path):
        ckpt = sdx_folder.read_sdx_folder(path)
        if "vae" not in ckpt.tensors:
            raise SdxError(f"{where}: this sdx folder has no vae")
        return ckpt.configs["vae"], ckpt.tensors["vae"]
    if not (path / "config.json").is_file() and (path / "vae" / "config.json").is_file():
        path = path / "vae"  # a pipeline folder: its VAE
    if not (path / "config.json").is_file():
        raise SdxError(f"{where}: not a VAE folder (no config.json), a pipeline folder (no vae/config.json), "
                       "an sdx folder or a VAE file")
    config = io.read_json(path / "config.json", obj=True)
    cls = config.get("_class_name", "AutoencoderKL")
    if cls != "AutoencoderKL":
        raise SdxError(f"{where}: its config.json describes a {cls}, not an AutoencoderKL")
    names = sorted(p.name for p in path.iterdir() if p.is_file())
    choice = diffusers_folder.choose_weights(names, "diffusers", variant, where=str(path))
    return config, diffusers_folder.normalize_vae(diffusers_folder.read_weights(path, choice))


def swap_vae(ckpt: Checkpoint, path: Path, *, variant: str | None = None, log: Log | None = None) -> None:
    """Replace `ckpt`'s VAE (config and weights) by the one at `path`, which must have the same architecture;
    its own latent scaling (scaling_factor, shift_factor) and force_upcast come with it."""
    from sdx.vae import VAEConfig

    log = log or (lambda _msg: None)
    if "vae" not in ckpt.configs:
        raise SdxError(f"--vae {path}: the model has no VAE to replace")
    config, tensors = read_vae_source(path, ckpt.configs["vae"], variant=variant)
    try:
        new = VAEConfig.from_diffusers_config(config)
    except SdxError as e:
        raise SdxError(f"--vae {path}: {e}") from None
    old = VAEConfig.from_diffusers_config(ckpt.configs["vae"])
    diff = [f"{k} {getattr(new, k)} (the model's: {getattr(old, k)})" for k in _VAE_ARCHITECTURE
            if getattr(new, k) != getattr(old, k)]
    if diff:
        raise SdxError(f"--vae {path}: its architecture differs from the model's VAE: {'; '.join(diff)}")
    ckpt.configs["vae"], ckpt.tensors["vae"] = config, tensors
    log(f"vae: {path} (scaling_factor {new.scaling_factor}, force_upcast {new.force_upcast})")


@contextlib.contextmanager
def _builtin_tokenizers(ckpt: Checkpoint, log: Log):
    """Give a single file's Checkpoint the tokenizers it lacks, from sdx's built-in CLIP vocabulary with
    the pad token its text encoders were trained with (the folders live until the `with` ends)."""
    from convert import single_file
    from sdx.tokenizer import write_builtin_folder

    wanted = {f"tokenizer{c[len('text_encoder'):]}" for c in ckpt.tensors if c.startswith("text_encoder")}
    missing = sorted(wanted - set(ckpt.tokenizers))
    if not missing:
        yield
        return
    specs = single_file.tokenizer_specs(ckpt)
    with tempfile.TemporaryDirectory(prefix="sdx-tokenizers-") as tmp:
        for name in missing:
            ckpt.tokenizers[name] = write_builtin_folder(Path(tmp) / name, pad_token=specs[name]["pad_token"])
            log(f"{name}: sdx's built-in CLIP vocabulary (pad token {specs[name]['pad_token']!r})")
        yield


def _resolved(options: ModelOptions, *, variant, cache_dir, log) -> tuple[list[tuple[Path, float]], Path | None]:
    """The local files of the options' LoRAs and VAE (downloading hub ones)."""
    loras = [(resolve_lora(spec, cache_dir=cache_dir, log=log), scale) for spec, scale in options.loras]
    vae = resolve_vae(options.vae, variant=variant, cache_dir=cache_dir, log=log) if options.vae else None
    return loras, vae


def apply_options(ckpt: Checkpoint, loras: Sequence[tuple[Path, float]], vae: Path | None, *,
                  variant: str | None = None, log: Log | None = None) -> Checkpoint:
    """Swap the VAE and merge the LoRAs (in order) into `ckpt`, in place; returns it."""
    from convert.lora import merge_lora

    log = log or (lambda _msg: None)
    if (loras or vae) and not ckpt.pipeline_class:
        raise SdxError("--lora and --vae apply to a whole pipeline; this source is a standalone VAE")
    if vae is not None:
        swap_vae(ckpt, vae, variant=variant, log=log)
    for path, scale in loras:
        try:
            merge_lora(ckpt, path, scale)
        except SdxError as e:
            raise SdxError(str(e) if str(path) in str(e) else f"--lora {path}: {e}") from None
        log(f"merged LoRA {path} at scale {scale:g}")
    return ckpt


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
    if variant is None:
        variant = default_variant(dtype)
    if fmt == "sdx" and model_folder.is_model_folder(src) and options.empty:
        return model_folder.resave(src, out, dtype=dtype, overwrite=overwrite, log=log)
    loras, vae = _resolved(options, variant=variant, cache_dir=cache_dir, log=log)
    ckpt = read_source(src, variant=variant, revision=revision, cache_dir=cache_dir, config=options.config,
                       preset=options.preset, log=log)
    if not ckpt.pipeline_class and fmt != "single-file":
        raise SdxError(f"{src}: a standalone VAE file; use it with --vae, or write it with --format single-file")
    apply_options(ckpt, loras, vae, variant=variant, log=log)
    if not ckpt.pipeline_class:
        return WRITERS[fmt](ckpt, out, dtype=dtype, overwrite=overwrite, log=log)
    with _builtin_tokenizers(ckpt, log):
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


def _identity(path: Path) -> str:
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
    source's identity, `dtype` and the options (the LoRA files' identities and scales, the VAE's).

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
        source, key = path, _identity(path)
        name = path.resolve().stem if path.is_file() else path.resolve().name
        if options.config is not None and Path(options.config).exists():
            key += f"\0config\0{_identity(Path(options.config))}"
        if options.preset is not None:
            key += f"\0preset\0{options.preset}"
    elif path.exists() or looks_local(str(src)) or not hub.looks_like_repo_id(str(src)):
        raise SdxError(f"{src}: not an sdx folder, diffusers folder or single-file checkpoint, nor a hub id")
    else:
        if options.single_file_only:
            raise SdxError(f"--config/--preset apply to single-file checkpoints; {src} is a hub repo")
        source = hub.fetch(str(src), variant=variant, revision=revision, cache_dir=None, log=log)
        key, name = f"hub\0{src}\0{source.name}", str(src).replace("/", "--")
    loras, vae = _resolved(options, variant=variant, cache_dir=None, log=log)
    for lora, scale in loras:
        key += f"\0lora\0{_identity(lora)}\0{scale!r}"
    if vae is not None:
        key += f"\0vae\0{_identity(vae)}"
    digest = hashlib.sha256(f"{key}\0{variant}".encode()).hexdigest()[:12]
    out = root / f"{name}-{dtype}-{digest}"
    if model_folder.is_model_folder(out):
        return out
    log(f"converting {src} into {out} (once)")
    ckpt = read_source(source, variant=variant, config=options.config, preset=options.preset, log=log)
    if not ckpt.pipeline_class:
        raise SdxError(f"{src}: a standalone VAE file, not a model; pass it with --vae")
    apply_options(ckpt, loras, vae, variant=variant, log=log)
    try:
        with _builtin_tokenizers(ckpt, log):
            return sdx_folder.write_sdx_folder(ckpt, out, dtype=dtype, overwrite=True, log=log)
    except SdxError:
        if model_folder.is_model_folder(out):  # another process finished the same conversion first
            return out
        raise


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m convert",
        description="Convert a model (diffusers folder, hub id, single-file checkpoint or sdx folder) into an sdx "
                    "model folder, a diffusers folder or a single file.",
    )
    p.add_argument("src", metavar="SRC",
                   help="diffusers-layout folder, hub id (org/name), single-file checkpoint (.safetensors, .ckpt) "
                        "or sdx folder")
    p.add_argument("out", metavar="OUT",
                   help="output folder, or .safetensors file for --format single-file (must not exist, or be an "
                        "empty folder, unless --overwrite)")
    p.add_argument("--format", dest="fmt", default="sdx", choices=list(WRITERS),
                   help="output layout: sdx folder, diffusers folder (from_pretrained) or one original-layout "
                        ".safetensors file (from_single_file) (default: sdx)")
    p.add_argument("--dtype", default="float32", choices=list(weights.DTYPES),
                   help="dtype of the written weights (default: float32)")
    p.add_argument("--variant", default=None,
                   help="weights variant to read, e.g. fp16 (default: fp16 for a 16-bit --dtype when it exists)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit) for a hub id")
    p.add_argument("--config", metavar="FOLDER", default=None,
                   help="single-file SRC: a diffusers-layout folder whose config.json files (and tokenizers) "
                        "describe it, instead of the built-in preset")
    p.add_argument("--preset", default=None,
                   help="single-file SRC: the built-in preset to read it as, e.g. sd21 for an SD 2.x-base "
                        "(epsilon) file (default: detected from its keys)")
    p.add_argument("--lora", metavar="FILE[:SCALE]", action="append", default=[],
                   help="merge a LoRA (kohya or diffusers/PEFT .safetensors, or a hub org/name[/FILE]) at SCALE "
                        "(default 1.0); repeatable")
    p.add_argument("--vae", metavar="MODEL", default=None,
                   help="use this VAE instead of the model's: a diffusers VAE folder, a pipeline folder, an sdx "
                        "folder, a single VAE file, or a hub id (org/name or org/name/FILE)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
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
        options = ModelOptions.from_args(config=args.config, preset=args.preset, lora=args.lora, vae=args.vae)
        convert(
            args.src, args.out, fmt=args.fmt, dtype=args.dtype, variant=args.variant, revision=args.revision,
            overwrite=args.overwrite, options=options, log=log,
        )
    except SdxError as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0
