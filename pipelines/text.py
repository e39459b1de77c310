"""Prompts to UNet conditioning: tokenising on the host, encoding inside the sampler's prepare program.

Token ids are traced inputs, so a new prompt never recompiles; only the number of 77-token chunks
(`--long-prompt chunk`) is a shape.

- SD 1.x/2.x: the encoder's last hidden state (after the final layer norm); `clip_skip` c takes the
  output c layers earlier, still through the final layer norm (diffusers' `clip_skip`).
- SDXL: each encoder's penultimate hidden state (no final layer norm; c more layers back with
  `clip_skip`), concatenated on channels (768 + 1280 = 2048); pooled: the last encoder's projected EOS
  token (`text_embeds`).

Weighted prompts (`tokenize_weighted`, syntax from `sdx.prompt_syntax`): every token gets a weight, an input
of the programs like its id, so a new weight compiles nothing (the syntax, and for compel the number of
weighted pieces, are static: `Weighting`).

- "a1111", the web UI's rules: pieces tokenized one by one into chunks of 75 tokens, a chunk ended by
  `BREAK` or when full (what follows the chunk's last comma, if it is at most 20 tokens back, moves to the
  next chunk); each chunk's embeddings multiplied by its tokens' weights, then rescaled to the mean they had
  before (the web UI's "Original" emphasis; its mean is over the whole batch of prompts, sdx's over each
  prompt's chunk, so that an image does not depend on the others in its batch). The pooled embedding is the
  first chunk's, unweighted.
- "compel", the compel package's (`Compel` with its defaults; `CompelForSD` / `CompelForSDXL` with
  `--long-prompt chunk`): pieces tokenized one by one, long prompts cut into chunks at a sentence end (else
  a phrase end, else a word end) within each 75 tokens; each token's embedding moved from the empty prompt's
  by its weight, empty + (z - empty) * w; a piece of weight w < 1 is also masked out of the encoder's
  attention in a copy of the prompt, and the two blended with weights 1 and tan((1 - w) pi / 2);
  `.and()` parts are encoded on their own and concatenated, each weighted the same way. SDXL's pooled
  embedding is the second encoder's of the prompt's raw text (syntax and all, truncated), as compel gives it.
- "none": the text as it is (diffusers' behaviour: brackets and all go to the tokenizer).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.family import TOKENIZER_OF, Family
from sdx import prompt_syntax
from sdx.errors import SdxError

SYNTAXES = ("a1111", "compel", "none")
_COMMA_BACKTRACK = 20  # A1111's comma_padding_backtrack
_SENTENCE_ENDS = (".</w>",)  # compel's SplitLongTextMode.SENTENCES, then PHRASES, then WORDS
_PHRASE_ENDS = (".</w>", ",</w>", ";</w>", ":</w>")


def tokenize(
    family: Family, tokenizers: Mapping, prompts: Sequence[Sequence[str]], *, chunks: int | None, warn=None
) -> dict[str, np.ndarray]:
    """{encoder: (B, chunks, 77) int32}. prompts[i] feeds encoder i of `family.encoders`.

    chunks=None truncates each prompt to one chunk of 77 tokens (diffusers' behaviour) and warns with
    the text that was cut; an int pads every prompt to that many 75-token chunks.
    """
    warn = warn or _warn
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


def _warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# Weighted prompts: the host half


@dataclasses.dataclass(frozen=True)
class Weighting:
    """What of prompt weighting fixes the programs (part of their plan): the syntax, and for compel how
    many masked copies of each prompt its down-weighting encodes (one per weighted piece)."""

    syntax: str = "none"
    variants: int = 0


PLAIN = Weighting()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenWeights:
    """One encoder's weights for its ids (B, n, 77), n chunks, V = `Weighting.variants`:
    weights (B, n, 77) float32, each token's; masks (B, V, n, 77) float32, 1 where copy v of the prompt lets
    the encoder attend to a token (compel); blend (B, V, n) float32, copy v's share in each chunk (0: an
    unused copy); empty (B, 77) int32, the empty prompt's ids (compel's reference point); pooled_ids (B, 77)
    int32, the text compel's pooled embedding reads ((B, 0) for the other syntaxes)."""

    weights: jax.Array
    masks: jax.Array
    blend: jax.Array
    empty: jax.Array
    pooled_ids: jax.Array


@dataclasses.dataclass
class _Prompt:
    """One prompt for one encoder, on the host: chunks of ids and weights (77 each), compel's masked copies
    (the first chunk of the part they mask, the mask over the part's chunks, their share), what truncation
    cut, and compel's pooled ids."""

    ids: list[list[int]]
    weights: list[list[float]]
    copies: list[tuple[int, np.ndarray, float]]
    cut: list[int]
    pooled_ids: list[int] | None = None


def _chunk(tok, content: list[int], weights: list[float]) -> tuple[list[int], list[float]]:
    """One 77-token row: BOS, content, EOS, pad; weight 1 but for the content."""
    row = tok.wrap(content)
    return row, [1.0, *weights, *[1.0] * (len(row) - 1 - len(weights))]


def _a1111(tok, text: str, truncate: bool) -> _Prompt:
    comma = tok.content_ids([","])[0][0]
    body = tok.max_length - 2
    chunks: list[tuple[list[int], list[float]]] = []
    ids: list[int] = []
    weights: list[float] = []
    last_comma = -1

    def close() -> None:
        nonlocal ids, weights, last_comma
        chunks.append((ids, weights))
        ids, weights, last_comma = [], [], -1

    pieces = prompt_syntax.a1111(text)
    tokens = tok.content_ids([p.text for p in pieces])
    for piece, piece_ids in zip(pieces, tokens):
        if piece.is_break:
            close()
            continue
        for t in piece_ids:
            if t == comma:
                last_comma = len(ids)
            elif len(ids) == body and last_comma != -1 and len(ids) - last_comma <= _COMMA_BACKTRACK:
                moved = ids[last_comma + 1:], weights[last_comma + 1:]  # what follows the comma starts the next
                ids, weights = ids[:last_comma + 1], weights[:last_comma + 1]
                close()
                ids, weights = list(moved[0]), list(moved[1])
            if len(ids) == body:
                close()
            ids.append(t)
            weights.append(piece.weight)
    if ids or not chunks:
        close()
    cut = [t for c, _ in chunks[1:] for t in c] if truncate else []
    rows = [_chunk(tok, c, w) for c, w in (chunks[:1] if truncate else chunks)]
    return _Prompt([r for r, _ in rows], [w for _, w in rows], [], cut)


def _split_point(tok, ids: list[int], body: int) -> int:
    """compel's `_find_next_best_split_point` (SENTENCES): after the last sentence end within `body` tokens,
    else the last phrase end, else the last word end, else `body`."""
    if len(ids) <= body:
        return body
    texts = [tok.token(t) for t in ids[:body]]
    for found in (lambda t: t in _SENTENCE_ENDS, lambda t: t in _PHRASE_ENDS, lambda t: t.endswith("</w>")):
        for k in range(body - 1, -1, -1):
            if found(texts[k]):
                return k + 1
    return body


def _compel(tok, text: str, truncate: bool, pooled: bool) -> _Prompt:
    body, width = tok.max_length - 2, tok.max_length
    out = _Prompt([], [], [], [], tok.wrap(tok.content_ids([text])[0]) if pooled else None)
    for part in prompt_syntax.compel(text):
        frag_ids = tok.content_ids([p.text for p in part.pieces])
        if truncate:  # compel tokenizes each piece with truncation
            frag_ids = [f[:body] for f in frag_ids]
        content = [t for f in frag_ids for t in f]
        weights = [p.weight for p, f in zip(part.pieces, frag_ids) for _ in f]
        starts = np.cumsum([0] + [len(f) for f in frag_ids])
        # chunk the content, recording where each content token lands in the part's rows
        place, first, k = np.zeros(len(content), np.int64), len(out.ids), 0
        while True:
            split = body if truncate else _split_point(tok, content[k:], body)
            take = content[k:k + split]
            place[k:k + len(take)] = (len(out.ids) - first) * width + 1 + np.arange(len(take))
            row, w = _chunk(tok, take, weights[k:k + split])
            out.ids.append(row)
            out.weights.append([x * part.weight for x in w])
            k += len(take)
            if truncate or k >= len(content):
                break
        out.cut += content[k:]
        rows = len(out.ids) - first
        for p, a, b in zip(part.pieces, starts[:-1], starts[1:]):
            if p.weight == 1.0 or a == b:
                continue  # compel's copies are for its down-weighted pieces; every weighted one gets a slot
            if truncate and a >= body:
                break  # compel stops at a piece that starts beyond the chunk
            lo, hi = int(place[a]), int(place[min(b, len(content)) - 1]) if b <= k else rows * width - 1
            mask = np.ones(rows * width, np.float32)
            mask[lo:hi + 1] = 0.0
            if not truncate:  # compel keeps every chunk's first and last position
                mask[0::width] = 1.0
                mask[width - 1::width] = 1.0
            share = math.tan((1.0 - max(1e-5, p.weight)) * math.pi / 2) if p.weight < 1.0 else 0.0
            out.copies.append((first, mask, share))
    return out


def _prompt(syntax: str, tok, text: str, truncate: bool, pooled: bool) -> _Prompt:
    if syntax == "a1111":
        return _a1111(tok, text, truncate)
    if syntax == "compel":
        return _compel(tok, text, truncate, pooled)
    content = tok.content_ids([text])[0]
    body = tok.max_length - 2
    pieces = [content[i:i + body] for i in range(0, len(content), body)] or [[]]
    rows = [_chunk(tok, c, [1.0] * len(c)) for c in (pieces[:1] if truncate else pieces)]
    return _Prompt([r for r, _ in rows], [w for _, w in rows], [], content[body:] if truncate else [])


def check_syntax(syntax: str, texts: Sequence[str]) -> None:
    """Refuse, before anything runs, a prompt the syntax cannot read (a bad weight, compel's .blend())."""
    read = {"a1111": prompt_syntax.a1111, "compel": prompt_syntax.compel}.get(syntax)
    for t in texts if read else ():
        read(t)


def tokenize_weighted(
    family: Family, tokenizers: Mapping, groups: Sequence[Sequence[Sequence[str]]], *, syntax: str, chunk: bool,
    warn=None,
) -> tuple[list[tuple[dict[str, np.ndarray], dict[str, TokenWeights]]], Weighting]:
    """For each group of prompts (the prompts, the negative prompts; group[i] feeds encoder i of
    `family.encoders`): ({encoder: ids (B, n, 77) int32}, {encoder: `TokenWeights`}), with one chunk count n
    and one copy count for all groups and encoders, and the `Weighting` they make. chunk=False keeps one chunk
    per prompt (per compel part), warning with the text that was cut."""
    if syntax not in SYNTAXES:
        raise SdxError(f"prompt syntax {syntax!r}: choose from {', '.join(SYNTAXES)}")
    warn = warn or _warn
    cuts = {}  # the text truncation cut, each once
    made = []  # per group: {encoder: [_Prompt]}
    for group in groups:
        per = {}
        for encoder, texts in zip(family.encoders, group):
            tok = tokenizers[TOKENIZER_OF[encoder]]
            pooled = syntax == "compel" and family.xl and encoder == family.encoders[-1]
            per[encoder] = [_prompt(syntax, tok, t, not chunk, pooled) for t in texts]
            cuts |= {tok.decode(p.cut, skip_special_tokens=False): tok.max_length for p in per[encoder] if p.cut}
        made.append(per)
    for cut, length in cuts.items():
        warn(f"this part of the prompt was cut (CLIP takes {length} tokens; --long-prompt chunk keeps it): {cut!r}")
    every = [p for per in made for prompts in per.values() for p in prompts]
    n = max(len(p.ids) for p in every)
    variants = max(len(p.copies) for p in every) if syntax == "compel" else 0
    out = []
    for per in made:
        ids, weights = {}, {}
        for encoder, prompts in per.items():
            tok = tokenizers[TOKENIZER_OF[encoder]]
            ids[encoder], weights[encoder] = _pack(tok, prompts, n, variants)
        out.append((ids, weights))
    return out, Weighting(syntax, variants)


def _pack(tok, prompts: list[_Prompt], n: int, variants: int) -> tuple[np.ndarray, TokenWeights]:
    """The arrays of a batch of prompts, each completed to n chunks with empty ones (weight 1)."""
    width, b = tok.max_length, len(prompts)
    empty = tok.wrap([])
    ids = np.tile(np.asarray(empty, np.int32), (b, n, 1))
    weights = np.ones((b, n, width), np.float32)
    masks = np.ones((b, variants, n * width), np.float32)
    blend = np.zeros((b, variants, n), np.float32)
    for i, p in enumerate(prompts):
        ids[i, :len(p.ids)] = p.ids
        weights[i, :len(p.weights)] = p.weights
        for v, (first, mask, share) in enumerate(p.copies):
            masks[i, v, first * width:first * width + len(mask)] = mask
            blend[i, v, first:first + len(mask) // width] = share
    pooled = (np.asarray([p.pooled_ids for p in prompts], np.int32) if prompts[0].pooled_ids is not None
              else np.zeros((b, 0), np.int32))
    return ids, TokenWeights(weights, masks.reshape(b, variants, n, width), blend,
                             np.tile(np.asarray(empty, np.int32), (b, 1)), pooled)


# --------------------------------------------------------------------------------------------------
# The device half


def encode(
    family: Family, encoders: Mapping, ids: Mapping[str, jax.Array], clip_skip: int | None, dtype,
    weighting: Weighting = PLAIN, weights: Mapping[str, TokenWeights] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """(context (B, chunks*77, C), pooled (B, P) or None) from ids {encoder: (B, chunks, 77)}, with each
    encoder's `TokenWeights` applied as `weighting.syntax` says (see the module docstring)."""
    contexts, pooled = [], None
    skip = clip_skip or 0
    for name in family.encoders:
        model, tokens = encoders[name], ids[name]
        w = None if weighting.syntax == "none" else weights[name]
        b, n, t = tokens.shape
        hidden = lambda out: (model.hidden_state(out, skip=skip + 1, final_layer_norm=False) if family.xl
                              else model.hidden_state(out, skip=skip, final_layer_norm=True))
        rows = tokens.reshape(b * n, t)  # (B*chunks, 77) ids
        if weighting.variants:  # the masked copies ride in the same call: (B*chunks + B*V*chunks, 77)
            copies = jnp.broadcast_to(tokens[:, None], (b, weighting.variants, n, t)).reshape(-1, t)
            out = model(jnp.concatenate([rows, copies]),
                        jnp.concatenate([jnp.ones_like(rows), w.masks.reshape(-1, t).astype(jnp.int32)]))
        else:
            out = model(rows)
        h = hidden(out)
        z = h[: b * n].reshape(b, n, t, h.shape[-1])  # (B, chunks, 77, C)
        if weighting.syntax == "a1111":
            z = _a1111_emphasis(z, w.weights)
        elif weighting.syntax == "compel":
            if weighting.variants:
                copies = h[b * n:].reshape(b, weighting.variants, n, t, h.shape[-1])
                share = w.blend.astype(z.dtype)  # (B, V, chunks)
                z = (z + jnp.einsum("bvn,bvntc->bntc", share, copies)) / (1 + share.sum(1))[..., None, None]
            empty = hidden(model(w.empty[:1]))[:, None]  # (1, 1, 77, C)
            scale = w.weights[..., None].astype(z.dtype)
            z = jnp.where(scale == 1, z, empty + (z - empty) * scale)
        contexts.append(z.reshape(b, n * t, h.shape[-1]))  # (B, chunks*77, C)
        if out.text_embeds is not None:
            if weighting.syntax == "compel" and w.pooled_ids.shape[-1]:
                pooled = model(w.pooled_ids).text_embeds  # the raw text's, (B, P)
            else:
                pooled = out.text_embeds[: b * n].reshape(b, n, -1)[:, 0]  # the first chunk's, (B, P)
    return jnp.concatenate(contexts, axis=-1).astype(dtype), pooled


def _a1111_emphasis(z: jax.Array, weights: jax.Array) -> jax.Array:
    """z (B, chunks, 77, C) times each token's weight, each chunk rescaled to its mean before (unchanged
    where every weight of the chunk is 1)."""
    w = weights[..., None].astype(z.dtype)
    weighted = z * w
    ratio = z.mean(axis=(2, 3), keepdims=True) / weighted.mean(axis=(2, 3), keepdims=True)
    plain = (weights == 1).all(axis=-1)[..., None, None]  # (B, chunks, 1, 1)
    return jnp.where(plain, z, weighted * ratio)
