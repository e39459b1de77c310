"""Where a model comes from, and what changes it on the way in.

A source is, in this order: an sdx model folder (sdx.json), a diffusers-layout folder
(model_index.json), a single-file checkpoint (SGM/LDM keys, `convert.single_file`), or a hub id
`org/name` (a local path always wins over a hub id). `read_source` makes it a `Checkpoint`;
`ModelOptions` (the `--config`, `--preset`, `--lora`, `--vae` and `--unet` flags of `python -m convert` and
`python -m sdx.sample`) change it: `resolved` finds (or downloads) the files, `apply_options` swaps the UNet
(`convert.unet_source`) and the VAE and merges the LoRAs.

Errors a user can fix are SdxErrors naming the flag and the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from convert import builtin_models, diffusers_folder, hub, sdx_folder
from convert.checkpoint import Checkpoint
from sdx import model_folder, presets
from sdx.errors import SdxError

Log = Callable[[str], None]

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
    unet: a UNet to use instead of the model's (`--unet`, `convert.unet_source`): a diffusers UNet folder, a
      pipeline folder (its unet/), an sdx folder, a weights file (diffusers or original keys), or a hub id.
    embeddings: (file or hub path, token or None) pairs, textual inversion embeddings added in order
      (`--embedding FILE[:TOKEN]`, `convert.textual_inversion`).
    """

    config: str | None = None
    preset: str | None = None
    loras: tuple[tuple[str, float], ...] = ()
    vae: str | None = None
    embeddings: tuple[tuple[str, str | None], ...] = ()
    unet: str | None = None

    @classmethod
    def from_args(cls, *, config=None, preset=None, lora: Sequence[str] | None = None, vae=None,
                  embedding: Sequence[str] | None = None, unet=None) -> ModelOptions:
        from convert.lora import parse_lora_arg

        loras = []
        for arg in lora or ():
            _, scale = parse_lora_arg(arg)  # checks the scale
            head, sep, tail = arg.rpartition(":")
            loras.append((head if sep and head and _is_number(tail) else arg, scale))  # the path as typed
        return cls(config=config, preset=preset, loras=tuple(loras), vae=vae,
                   embeddings=tuple(map(parse_embedding_arg, embedding or ())), unet=unet)

    @property
    def single_file_only(self) -> bool:
        return self.config is not None or self.preset is not None

    @property
    def changes_weights(self) -> bool:
        return bool(self.loras) or self.vae is not None or bool(self.embeddings) or self.unet is not None

    @property
    def empty(self) -> bool:
        return not (self.single_file_only or self.changes_weights)


def parse_embedding_arg(arg: str) -> tuple[str, str | None]:
    """`--embedding FILE[:TOKEN]` -> (FILE, TOKEN or None): the text after the last colon is the token unless
    the whole argument names a file (or the text before the colon would be empty)."""
    head, sep, tail = arg.rpartition(":")
    if not sep or not head or not tail or Path(arg).exists():
        return arg, None
    return head, tail


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
    check_source(src, config=config, preset=preset)
    path = Path(src)
    if path.is_file():
        return _read_single_file(path, log, config=config, preset=preset)
    if path.is_dir():
        if model_folder.is_model_folder(path):
            log(f"reading sdx folder {path}")
            return sdx_folder.read_sdx_folder(path)
        log(f"reading diffusers folder {path}")
        return diffusers_folder.read_diffusers_folder(path, variant=variant, log=log)
    folder = hub.fetch(str(src), variant=variant, revision=revision, cache_dir=cache_dir, log=log)
    return diffusers_folder.read_diffusers_folder(folder, variant=variant, log=log)


def check_source(src: str | os.PathLike, *, config: str | os.PathLike | None = None, preset: str | None = None) -> None:
    """What `read_source` can refuse without reading: a source that is neither a file, a folder, a built-in
    model's name nor a hub id; --config or --preset for anything but a single file; a --config that is not a
    folder; an unknown --preset."""
    path = Path(src)
    if not path.is_file():
        if config is not None or preset is not None:
            flag = "--config" if config is not None else "--preset"
            raise SdxError(f"{flag} applies to single-file checkpoints; {src} is not one (its configs are its own)")
        if not path.is_dir() and str(src) not in builtin_models.NAMES:
            if path.exists() or path.is_symlink():
                raise SdxError(f"{src}: neither a folder nor a file")
            if looks_local(str(src)) or not hub.looks_like_repo_id(str(src)):
                raise builtin_models.unknown(str(src))
    if config is not None and not Path(config).is_dir():
        raise SdxError(f"--config {config}: not a folder (a diffusers-layout folder with the config.json files)")
    if preset is not None:
        presets.get(preset)


def looks_local(text: str) -> bool:
    return text.startswith((".", "/", "~")) or os.sep + os.sep in text or text.endswith(os.sep)


def _read_single_file(path: Path, log: Log, *, config=None, preset=None) -> Checkpoint:
    from convert import single_file

    log(f"reading single-file checkpoint {path}" + (f" with the configs of {config}" if config else ""))
    return single_file.read_single_file(path, config, preset=preset)


# --------------------------------------------------------------------------------------------------
# --lora, --vae, --unet: where the files are


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
    """The local file of a `--lora` argument: a path; a folder or a hub `org/name` holding
    pytorch_lora_weights.safetensors or exactly one .safetensors file (what diffusers' load_lora_weights
    takes, and what `python -m train.text_to_image_lora` writes); or a hub `org/name/file.safetensors`,
    downloaded."""
    if Path(spec).is_file():
        return Path(spec)
    if Path(spec).is_dir():
        listing = sorted(p.name for p in Path(spec).iterdir() if p.is_file())
        return Path(spec) / _lora_file(listing, f"--lora {spec}: the folder", f"{Path(spec) / 'FILE'}")[0]
    repo, file = _hub_or_error(spec, "--lora")

    def choose(listing: list[str]) -> list[str]:
        where = f"--lora {spec}: hub repo {repo!r}"
        if file is not None:
            if file not in listing:
                raise SdxError(f"{where} has no file {file}")
            return [file]
        return _lora_file(listing, where, f"{repo}/FILE")

    chosen = _recording(choose)
    folder = hub.fetch_files(repo, chosen, cache_dir=cache_dir, log=log)
    return folder / chosen.picked[0]


def _lora_file(listing: list[str], where: str, name_one: str) -> list[str]:
    """[the LoRA file among `listing`]: pytorch_lora_weights.safetensors, else the only .safetensors file."""
    if "pytorch_lora_weights.safetensors" in listing:
        return ["pytorch_lora_weights.safetensors"]
    found = [f for f in listing if f.endswith(".safetensors")]
    if len(found) == 1:
        return found
    if not found:
        raise SdxError(f"{where} has no .safetensors file (LoRAs are read from safetensors only)")
    raise SdxError(f"{where} has several .safetensors files ({', '.join(found[:6])}); name one: "
                   f"--lora {name_one}[:SCALE]")


def resolve_vae(spec: str, *, variant: str | None = None, cache_dir: str | Path | None = None,
                log: Log | None = None) -> Path:
    """The local folder or file of a `--vae` argument (a hub id is downloaded: only the VAE's config and
    weights, from a VAE repo or from a pipeline repo's vae/ folder; `org/name/FILE` for a single file)."""
    return resolve_model_part(spec, "vae", "VAE", "a single VAE file", variant=variant, cache_dir=cache_dir, log=log)


def resolve_model_part(spec: str, part: str, name: str, file_kind: str, *, variant: str | None,
                       cache_dir: str | Path | None, log: Log | None) -> Path:
    """The local folder or file of a `--{part}` argument: a local path, or from the hub a model repo's root,
    a pipeline repo's `{part}/` folder (only its config and weights), or `org/name/FILE`."""
    if Path(spec).exists():
        return Path(spec)
    repo, file = _hub_or_error(spec, f"--{part}")
    where = f"--{part} {spec}: hub repo {repo!r}"

    def choose(listing: list[str]) -> list[str]:
        if file is not None:
            if file not in listing:
                raise SdxError(f"{where} has no file {file}")
            return [file]
        found = diffusers_folder.model_files(listing, ("", f"{part}/"), variant, where=where)
        if found is not None:
            return found
        raise SdxError(f"{where} is neither a {name} repo (config.json) nor a pipeline repo ({part}/config.json); "
                       f"for {file_kind} give --{part} {repo}/FILE.safetensors")

    chosen = _recording(choose)
    folder = hub.fetch_files(repo, chosen, cache_dir=cache_dir, log=log)
    if file is not None:
        return folder / file
    return folder / part if chosen.picked[0].startswith(f"{part}/") else folder


# --------------------------------------------------------------------------------------------------
# --ip-adapter: the adapter file and its image encoder's folder

ENCODER_FOLDER = "image_encoder"  # beside the adapter file, as h94/IP-Adapter lays them out


def _encoder_files(listing: list[str], folder: str, where: str) -> list[str]:
    """The image encoder's config and safetensors weights among `listing`, under `folder` ('' for the root)."""
    prefix = f"{folder}/" if folder else ""
    found = [f for f in listing if f.startswith(prefix) and "/" not in f[len(prefix):]
             and (f.endswith((".safetensors", ".safetensors.index.json")) or f == f"{prefix}config.json")]
    if f"{prefix}config.json" not in found or not any(f.endswith(".safetensors") for f in found):
        raise SdxError(f"{where} has no image encoder in {folder or 'its root'}/ (config.json and model.safetensors); "
                       "name it with --ip-adapter-image-encoder")
    return found


def resolve_ip_adapter(spec: str, encoder: str | None = None, *, cache_dir: str | Path | None = None,
                       log: Log | None = None) -> tuple[Path, Path]:
    """(the adapter file, its image encoder's folder) of `--ip-adapter` and `--ip-adapter-image-encoder`.

    spec: a local file, whose encoder defaults to the `image_encoder` folder beside it; or a hub
    `org/name/sub/file.safetensors` (h94/IP-Adapter/models/ip-adapter_sd15.safetensors), downloaded with
    `sub/image_encoder/`'s config and safetensors weights unless the encoder is given. encoder: a local
    folder or a hub `org/name/sub/folder`."""
    if Path(spec).exists():
        adapter = Path(spec)
    else:
        repo, file = _hub_or_error(spec, "--ip-adapter")
        if file is None:
            raise SdxError(f"--ip-adapter {spec}: name the adapter's file in the repo, e.g. "
                           "h94/IP-Adapter/models/ip-adapter_sd15.safetensors")
        where = f"--ip-adapter {spec}: hub repo {repo!r}"
        beside = str(Path(file).parent / ENCODER_FOLDER).removeprefix("./")

        def choose(listing: list[str]) -> list[str]:
            if file not in listing:
                raise SdxError(f"{where} has no file {file}")
            return [file] + ([] if encoder is not None else _encoder_files(listing, beside, where))

        folder = hub.fetch_files(repo, choose, cache_dir=cache_dir, log=log)
        adapter = folder / file
        if encoder is None:
            return adapter, folder / beside
    if encoder is None:
        return adapter, adapter.parent / ENCODER_FOLDER
    if Path(encoder).exists():
        return adapter, Path(encoder)
    repo, sub = _hub_or_error(encoder, "--ip-adapter-image-encoder")
    where = f"--ip-adapter-image-encoder {encoder}: hub repo {repo!r}"
    folder = hub.fetch_files(repo, lambda listing: _encoder_files(listing, sub or "", where), cache_dir=cache_dir,
                             log=log)
    return adapter, folder / (sub or "")


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
    config, tensors = read_part_folder(path, "vae", "VAE", "AutoencoderKL", file_kind="a VAE file", variant=variant)
    return config, diffusers_folder.normalize_vae(tensors)


def read_part_folder(path: Path, part: str, name: str, class_name: str, *, file_kind: str,
                     variant: str | None) -> tuple[dict, Mapping[str, Any]]:
    """(config.json dict, diffusers-keyed tensors) of the `--{part}` folder at `path`: an sdx folder's
    `part`, a pipeline folder's `part/`, or a diffusers model folder of `class_name`."""
    where = f"--{part} {path}"
    if model_folder.is_model_folder(path):
        ckpt = sdx_folder.read_sdx_folder(path)
        if part not in ckpt.tensors:
            raise SdxError(f"{where}: this sdx folder has no {part}")
        return ckpt.configs[part], ckpt.tensors[part]
    if not (path / "config.json").is_file() and (path / part / "config.json").is_file():
        path = path / part  # a pipeline folder: its model
    if not (path / "config.json").is_file():
        raise SdxError(f"{where}: not a {name} folder (no config.json), a pipeline folder (no {part}/config.json), "
                       f"an sdx folder or {file_kind}")
    config, tensors = diffusers_folder.read_model_folder(path, "diffusers", variant)
    found = config.get("_class_name", class_name)
    if found != class_name:
        raise SdxError(f"{where}: its config.json describes {found}, not {class_name}")
    return config, tensors


def check_vae_architecture(config: dict, wanted: dict, *, where: str):
    """The VAEConfig of diffusers config `config`, checked to have the architecture of `wanted`'s (its
    latent scaling may differ); one error naming every field that differs."""
    from sdx.vae import VAEConfig

    try:
        new = VAEConfig.from_diffusers_config(config)
    except SdxError as e:
        raise SdxError(f"{where}: {e}") from None
    old = VAEConfig.from_diffusers_config(wanted)
    diff = [f"{k} {getattr(new, k)} (the model's: {getattr(old, k)})" for k in _VAE_ARCHITECTURE
            if getattr(new, k) != getattr(old, k)]
    if diff:
        raise SdxError(f"{where}: its architecture differs from the model's VAE: {'; '.join(diff)}")
    return new


def swap_vae(ckpt: Checkpoint, path: Path, *, variant: str | None = None, log: Log | None = None) -> None:
    """Replace `ckpt`'s VAE (config and weights) by the one at `path`, which must have the same architecture;
    its own latent scaling (scaling_factor, shift_factor) and force_upcast come with it."""
    log = log or (lambda _msg: None)
    if "vae" not in ckpt.configs:
        raise SdxError(f"--vae {path}: the model has no VAE to replace")
    config, tensors = read_vae_source(path, ckpt.configs["vae"], variant=variant)
    new = check_vae_architecture(config, ckpt.configs["vae"], where=f"--vae {path}")
    ckpt.configs["vae"], ckpt.tensors["vae"] = config, tensors
    log(f"vae: {path} (scaling_factor {new.scaling_factor}, force_upcast {new.force_upcast})")


@contextlib.contextmanager
def tokenizer_folders(ckpt: Checkpoint, embeddings: Sequence[tuple[Path, str | None]], log: Log):
    """Give a single file's Checkpoint the tokenizers it lacks, from sdx's built-in CLIP vocabulary with
    the pad token its text encoders were trained with, then add the textual inversion `embeddings` (files
    and tokens) to its tokenizers and text encoders (`convert.textual_inversion`); the new folders live
    until the `with` ends."""
    from convert import single_file
    from convert.textual_inversion import add_embeddings
    from sdx.tokenizer import write_builtin_folder

    wanted = {f"tokenizer{c[len('text_encoder'):]}" for c in ckpt.tensors if c.startswith("text_encoder")}
    missing = sorted(wanted - set(ckpt.tokenizers))
    if not missing and not embeddings:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="sdx-tokenizers-") as tmp:
        specs = single_file.tokenizer_specs(ckpt) if missing else {}
        for name in missing:
            ckpt.tokenizers[name] = write_builtin_folder(Path(tmp) / name, pad_token=specs[name]["pad_token"])
            log(f"{name}: sdx's built-in CLIP vocabulary (pad token {specs[name]['pad_token']!r})")
        add_embeddings(ckpt, embeddings, Path(tmp), log)
        yield


def resolve_embedding(spec: str, *, cache_dir: str | Path | None = None, log: Log | None = None) -> Path:
    """The local file of an `--embedding` argument: a path, or a hub `org/name/file.safetensors`, downloaded."""
    if Path(spec).exists():
        return Path(spec)
    repo, file = _hub_or_error(spec, "--embedding")
    if file is None:
        raise SdxError(f"--embedding {spec}: name the file in the repo, e.g. {spec}/learned_embeds.safetensors")

    def choose(listing: list[str]) -> list[str]:
        if file not in listing:
            raise SdxError(f"--embedding {spec}: hub repo {repo!r} has no file {file}")
        return [file]

    return hub.fetch_files(repo, choose, cache_dir=cache_dir, log=log) / file


@dataclasses.dataclass(frozen=True)
class Changes:
    """The local files of a `ModelOptions`' weight changes, for `apply_options`."""

    loras: tuple[tuple[Path, float], ...] = ()
    vae: Path | None = None
    unet: Path | None = None


def resolved(options: ModelOptions, *, variant, cache_dir, log) -> Changes:
    """The local files of the options' LoRAs, VAE and UNet (downloading hub ones), for `apply_options`."""
    from convert.unet_source import resolve_unet

    loras = tuple((resolve_lora(spec, cache_dir=cache_dir, log=log), scale) for spec, scale in options.loras)
    vae = resolve_vae(options.vae, variant=variant, cache_dir=cache_dir, log=log) if options.vae else None
    unet = resolve_unet(options.unet, variant=variant, cache_dir=cache_dir, log=log) if options.unet else None
    return Changes(loras, vae, unet)


def apply_options(ckpt: Checkpoint, changes: Changes, *, variant: str | None = None,
                  log: Log | None = None) -> Checkpoint:
    """Swap the UNet and the VAE and merge the LoRAs (in order, into the new UNet) in `ckpt`, in place;
    returns it."""
    from convert.lora import merge_lora
    from convert.unet_source import swap_unet

    log = log or (lambda _msg: None)
    if changes != Changes() and not ckpt.pipeline_class:
        raise SdxError("--lora, --vae and --unet apply to a whole pipeline; this source is a standalone VAE")
    if changes.unet is not None:
        swap_unet(ckpt, changes.unet, variant=variant, log=log)
    if changes.vae is not None:
        swap_vae(ckpt, changes.vae, variant=variant, log=log)
    for path, scale in changes.loras:
        try:
            merge_lora(ckpt, path, scale)
        except SdxError as e:
            raise SdxError(str(e) if str(path) in str(e) else f"--lora {path}: {e}") from None
        log(f"merged LoRA {path} at scale {scale:g}")
    return ckpt
