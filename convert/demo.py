"""The embedded demo models: small random-weight pipelines that need no download.

`--model tiny` (SD 1.x-like) or `--model tiny_xl` (SDXL-like) builds the preset's architecture with
seeded random weights and the built-in CLIP vocabulary, and writes it once as an sdx folder in the
cache. It shows the whole path (tokenizer, text encoders, sampler loop, VAE, PNG) end to end on any
machine; its pictures are noise-like, since nothing was trained. (The trained default models are
`convert.default_models`.) Unlike a model at its initialisation, every norm scale and bias of a demo
model is drawn too (`varied`), so that the tests which run them see a scale or bias that a conversion,
a loader or a module drops.

`random_parts` and `write_pipeline` are also how `python -m train.init` starts a model from scratch (at
the standard initialisation: scales 1, biases 0).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from flax import nnx

from sdx import model_folder, presets
from sdx.layers import F32
from sdx.tokenizer import write_builtin_folder

DEMO_MODELS = ("tiny", "tiny_xl")


def random_parts(preset: presets.Preset, seed: int, components=None) -> dict[str, model_folder.ModelPart]:
    """The preset's model components (all, or `components`) with random weights drawn from `seed`."""
    parts = {}
    rngs = nnx.Rngs(seed)
    for comp in components or ("unet", "vae", *preset.text_encoders):
        kind = model_folder.MODEL_KINDS[comp]
        config = kind.config_from_diffusers(preset.configs[comp])
        model = kind.build(config, F32, rngs)
        cls = preset.configs[comp].get("_class_name") or preset.configs[comp]["architectures"][0]
        parts[comp] = model_folder.ModelPart(cls, config, model_folder.module_arrays(model), preset.configs[comp])
    return parts


def write_pipeline(out: Path, preset: presets.Preset, parts: Mapping[str, model_folder.ModelPart], *,
                   overwrite: bool = False, log=None) -> Path:
    """An sdx folder of the preset's pipeline from `parts`, with the built-in tokenizers and its scheduler."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizers = {
            t: write_builtin_folder(Path(tmp) / t, pad_token=facts["pad_token"]) for t, facts in preset.tokenizers.items()
        }
        return model_folder.write_model_folder(
            out, pipeline_class=preset.pipeline_class, models=parts, tokenizers=tokenizers,
            scheduler=preset.configs["scheduler"], extra=preset.extra, overwrite=overwrite, log=log,
        )


def varied(part: model_folder.ModelPart, rng: np.random.Generator) -> model_folder.ModelPart:
    """`part` with every norm scale drawn as 1 + N(0, 0.1²) and every bias as N(0, 0.1²) (the standard
    initialisation sets them to 1 and 0, which hides a dropped scale or bias); kernels and embeddings kept."""
    def draw(path: str, array: np.ndarray) -> np.ndarray:
        leaf = path.rpartition(".")[2]
        if leaf not in ("scale", "bias"):
            return array
        mean = 1.0 if leaf == "scale" else 0.0
        return (mean + 0.1 * rng.standard_normal(array.shape)).astype(array.dtype)

    return dataclasses.replace(part, arrays={path: draw(path, a) for path, a in sorted(part.arrays.items())})


# part of a demo folder's name: bump it when the weights a seed gives change, so that a folder an earlier
# version built in the cache is not taken for the new one
REVISION = 2


def demo_folder(name: str, cache: Path, seed: int = 0) -> Path:
    """The sdx folder of demo model `name`, built on first use under `cache`: `random_parts` of the preset,
    `varied` (from the same seed)."""
    out = cache / f"demo-{name}-seed{seed}-r{REVISION}"
    if model_folder.is_model_folder(out):
        return out
    preset = presets.get(name)
    rng = np.random.default_rng(seed)
    parts = {comp: varied(part, rng) for comp, part in random_parts(preset, seed).items()}
    return write_pipeline(out, preset, parts, overwrite=True)
