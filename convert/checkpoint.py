"""A pipeline in diffusers terms, whatever file layout it came from.

Every reader (diffusers folder, hub id, single file) produces a `Checkpoint`; every writer consumes
one. Tensors keep the diffusers/transformers key names of their component (`unet`, `vae`,
`text_encoder`, `text_encoder_2`) so the readers, LoRA merging and writers share one vocabulary.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np


@dataclasses.dataclass
class Checkpoint:
    """pipeline_class: model_index.json's `_class_name` (e.g. "StableDiffusionXLPipeline").
    configs: component -> its diffusers/transformers config.json as a dict (scheduler included).
    tensors: component -> {diffusers key: numpy array}.
    tokenizers: component ("tokenizer", "tokenizer_2") -> folder holding that tokenizer's files.
    extra: model_index.json entries that are not components (e.g. force_zeros_for_empty_prompt).
    """

    pipeline_class: str
    configs: dict[str, dict]
    tensors: dict[str, dict[str, np.ndarray]]
    tokenizers: dict[str, Path] = dataclasses.field(default_factory=dict)
    extra: dict = dataclasses.field(default_factory=dict)
