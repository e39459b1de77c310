"""New words for a CLIP text encoder, learned (Gal et al. 2022, "An Image is Worth One Word"):
`python -m train.textual_inversion` trains their vectors, nothing else.

The words' vectors are a `WordParam` (n, C) on the encoder's embeddings (`add_words`), read for the ids
after the token embedding's (`sdx.clip.CLIPTextEmbeddings`), so the encoder's own table stays as loaded
and the optimizer sees the n rows alone (diffusers' script optimises the whole table and puts every other
row back after each step: the same update for the new rows).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from sdx.clip import CLIPTextModel


class WordParam(nnx.Param):
    """The vectors of words being learned: what a textual inversion run trains (`nnx.split(model, WordParam, ...)`)."""


def add_words(encoder: CLIPTextModel, vectors: jax.Array) -> None:
    """Give `encoder` words with these first vectors (n, C), float32: ids vocab_size ... vocab_size + n - 1."""
    encoder.text_model.embeddings.words = WordParam(vectors)


def word_vectors(encoder: CLIPTextModel) -> np.ndarray:
    """(n, C) float32: the learned words' vectors of `encoder`."""
    return np.asarray(jax.device_get(encoder.text_model.embeddings.words[...]), np.float32)
