"""`--unet`: another UNet in a pipeline, as the authors of few-step models ship theirs.

SDXL-Lightning ships `sdxl_lightning_4step_unet.safetensors`, a UNet's weights alone in diffusers keys, to load
into SDXL base's UNet; its ComfyUI form has the original keys (`model.diffusion_model.*`). LCM ships
`latent-consistency/lcm-sdxl`, a diffusers UNet folder whose config adds the guidance embedding
(`time_cond_proj_dim`). `--unet` takes any of these, or a pipeline folder (its unet/), an sdx folder, or a hub id
(`org/name`, `org/name/FILE`):

- a file takes the model's UNet config, and must hold exactly the model's UNet tensors, shapes included;
- a folder brings its own config, whose interface with the rest of the pipeline (latent channels, text
  embedding width, the added SDXL conditioning) must be the model's.

Each mismatch is one error naming the file and what differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from convert.checkpoint import Checkpoint
from convert.sources import Log, read_part_folder, resolve_model_part
from sdx.errors import SdxError

# config fields (diffusers' defaults) that fix how the UNet meets the text encoders, the VAE and the sampler
INTERFACE = {"in_channels": 4, "out_channels": 4, "cross_attention_dim": 1280, "addition_embed_type": None,
             "addition_time_embed_dim": None, "projection_class_embeddings_input_dim": None,
             "class_embed_type": None, "encoder_hid_dim": None}


def resolve_unet(spec: str, *, variant: str | None = None, cache_dir: str | Path | None = None,
                 log: Log | None = None) -> Path:
    """The local folder or file of a `--unet` argument (a hub id is downloaded: only the UNet's config and
    weights, from a UNet repo or a pipeline repo's unet/ folder; `org/name/FILE` for a weights file)."""
    return resolve_model_part(spec, "unet", "UNet", "a weights file", variant=variant, cache_dir=cache_dir, log=log)


def _file_tensors(path: Path, config: Mapping[str, Any], model: Mapping[str, Any]) -> dict[str, Any]:
    """The diffusers-keyed tensors of a UNet weights file, which must be exactly the model's UNet's, shapes
    included (`single_file.read_part`)."""
    from convert import single_file

    where = f"--unet {path}"
    tensors = single_file.read_part(path, "unet", config, where=where)
    shapes = [f"{k} {list(tensors[k].shape)} (the model's: {list(model[k].shape)})" for k in sorted(tensors)
              if tuple(tensors[k].shape) != tuple(model[k].shape)]
    if shapes:
        raise SdxError(f"{where}: {len(shapes)} tensor(s) differ in shape from the model's UNet: "
                       f"{', '.join(shapes[:5])}; a UNet of another architecture comes as a folder with its config.json")
    return tensors


def read_unet_source(path: Path, model_config: dict, model_tensors: Mapping[str, Any], *,
                     variant: str | None = None) -> tuple[dict, Mapping[str, Any]]:
    """(config.json dict, diffusers-keyed tensors) of the UNet at `path` (see `resolve_unet`)."""
    if path.is_file():
        return dict(model_config), _file_tensors(path, model_config, model_tensors)
    return read_part_folder(path, "unet", "UNet", "UNet2DConditionModel", file_kind="a weights file",
                            variant=variant)


def swap_unet(ckpt: Checkpoint, path: Path, *, variant: str | None = None, log: Log | None = None) -> None:
    """Replace `ckpt`'s UNet (config and weights) by the one at `path`, whose interface must be the model's."""
    log = log or (lambda _msg: None)
    if "unet" not in ckpt.configs:
        raise SdxError(f"--unet {path}: the model has no UNet to replace")
    old = ckpt.configs["unet"]
    config, tensors = read_unet_source(path, old, ckpt.tensors["unet"], variant=variant)
    diff = [f"{k} {config.get(k, d)} (the model's: {old.get(k, d)})" for k, d in INTERFACE.items()
            if config.get(k, d) != old.get(k, d)]
    if diff:
        raise SdxError(f"--unet {path}: does not fit the model: {'; '.join(diff)}")
    ckpt.configs["unet"], ckpt.tensors["unet"] = config, tensors
    extra = f" (guidance embedding of {config['time_cond_proj_dim']})" if config.get("time_cond_proj_dim") else ""
    log(f"unet: {path}{extra}")
