"""Prompts to UNet conditioning: tokenising on the host, encoding inside the sampler's prepare program.

Token ids are traced inputs, so a new prompt never recompiles; only the number of 75-token chunks
(`--long-prompt chunk`) is a shape.

- SD 1.x/2.x: the encoder's last hidden state (after the final layer norm); `clip_skip` c takes the
  output c layers earlier, still through the final layer norm (diffusers' `clip_skip`).
- SDXL: each encoder's penultimate hidden state (no final layer norm; c more layers back with
  `clip_skip`), concatenated on channels (768 + 1280 = 2048); pooled: the last encoder's projected EOS
  token (`text_embeds`).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.family import TOKENIZER_OF, Family


def tokenize(
    family: Family, tokenizers: Mapping, prompts: Sequence[Sequence[str]], *, chunks: int | None, warn=None
) -> dict[str, np.ndarray]:
    """{encoder: (B, chunks, 77) int32}. prompts[i] feeds encoder i of `family.encoders`.

    chunks=None truncates each prompt to one chunk of 77 tokens (diffusers' behaviour) and warns with
    the text that was cut; an int pads every prompt to that many 75-token chunks.
    """
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr))
    out = {}
    for encoder, texts in zip(family.encoders, prompts):
        tok = tokenizers[TOKENIZER_OF[encoder]]
        if chunks is None:
            enc = tok.encode(list(texts))
            for cut in {c for c in enc.truncated if c}:
                warn(f"this part of the prompt was cut (CLIP takes {tok.max_length} tokens; "
                     f"--long-prompt chunk keeps it): {cut!r}")
            out[encoder] = enc.ids[:, None, :]
        else:
            out[encoder] = tok.chunked(list(texts), num_chunks=chunks)
    return out


def chunks_needed(family: Family, tokenizers: Mapping, prompts: Sequence[Sequence[str]]) -> int:
    """The most 75-token chunks any prompt needs, over every encoder's prompts."""
    n = 1
    for encoder, texts in zip(family.encoders, prompts):
        tok = tokenizers[TOKENIZER_OF[encoder]]
        body = tok.max_length - 2
        n = max([n] + [-(-len(ids) // body) for ids in tok.content_ids(list(texts))])
    return n


def encode(
    family: Family, encoders: Mapping, ids: Mapping[str, jax.Array], clip_skip: int | None, dtype
) -> tuple[jax.Array, jax.Array | None]:
    """(context (B, chunks*77, C), pooled (B, P) or None) from ids {encoder: (B, chunks, 77)}."""
    contexts, pooled = [], None
    skip = clip_skip or 0
    for name in family.encoders:
        model, tokens = encoders[name], ids[name]
        b, n, t = tokens.shape
        out = model(tokens.reshape(b * n, t))  # (B*chunks, 77) ids
        if family.xl:
            h = model.hidden_state(out, skip=skip + 1, final_layer_norm=False)
        else:
            h = model.hidden_state(out, skip=skip, final_layer_norm=True)
        contexts.append(h.reshape(b, n * t, h.shape[-1]))  # (B, chunks*77, C)
        if out.text_embeds is not None:
            pooled = out.text_embeds.reshape(b, n, -1)[:, 0]  # the first chunk's, (B, P)
    return jnp.concatenate(contexts, axis=-1).astype(dtype), pooled
