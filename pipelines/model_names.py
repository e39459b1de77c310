"""What `--model` (and `Pipeline.load`, and the trainers' `--pretrained_model_name_or_path`) takes, as an sdx
folder: a built-in model's name (`convert.builtin_models`: the shipped default models `default`, `default-edit`,
the random-weight demo models `tiny`, `tiny_xl`), an sdx folder, a diffusers folder, a single-file checkpoint or
a hub id. Anything but an sdx folder, and anything with LoRAs, a VAE or embeddings, is converted once into the
cache.

    folder = resolve_model("default", dtype="float32", cache=default_cache_dir(), log=print)
"""

from __future__ import annotations

from pathlib import Path


def resolve_model(spec: str, *, dtype: str, cache: Path, log, options=None, variant=None, revision=None) -> Path:
    """An sdx folder for `spec`, with `options` (a `convert.sources.ModelOptions`: LoRAs, VAE, embeddings,
    config folder) applied in a cached conversion under `cache`/models (`variant`, `revision`: of a hub id).
    A name is a built-in model unless a file or folder of that name exists."""
    from convert import builtin_models
    from convert.library import ensure_sdx_folder
    from convert.sources import ModelOptions

    options = options or ModelOptions()
    named = builtin_models.folder(spec, cache / "models", log)
    if named is not None:
        if options.empty:
            return named
        spec = str(named)
    return ensure_sdx_folder(spec, dtype=dtype, variant=variant, revision=revision, cache_dir=cache / "models",
                             options=options, log=log)
