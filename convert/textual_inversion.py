"""Textual inversion embeddings (Gal et al. 2022, "An Image is Worth One Word"): new words for a pipeline's
text encoders, added on its way in (`--embedding FILE[:TOKEN]`), as diffusers' `load_textual_inversion` adds them.

A file holds one embedding, n vectors of each text encoder's width, in one of the layouts people share:

- diffusers' `learned_embeds.safetensors`: {token: (D,) or (n, D)}; the token is the key;
- A1111 / ComfyUI: {"emb_params": (n, D)};
- SDXL: {"clip_l": (n, 768), "clip_g": (n, 1280)}, for the first and second text encoder.

Without TOKEN, the A1111 and SDXL layouts take the word in the file's metadata ("token", which
`python -m train.textual_inversion` writes), else the file's name (`easynegative.safetensors` -> easynegative).
n vectors become n tokens, T, T_1, ..., T_{n-1}, added to each tokenizer after its last id
(`sdx.tokenizer.write_with_tokens`) with their vectors appended to the text encoder's token embedding at
those ids; a prompt's T reads all n (`sdx.tokenizer.CLIPTokenizer.expand`). Pickled `.pt`/`.bin` files are
not read: safetensors only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from convert.checkpoint import Checkpoint
from sdx import io
from sdx.errors import SdxError
from sdx.tokenizer import write_with_tokens

Log = Callable[[str], None]
A1111, SDXL_L, SDXL_G = "emb_params", "clip_l", "clip_g"
EMBEDDING_KEY = "embeddings.token_embedding.weight"  # the end of a text encoder's token-embedding key


def read_embedding(path: Path, token: str | None) -> tuple[str, dict[str, np.ndarray]]:
    """(the token, {SDXL_L / SDXL_G / "": (n, D) vectors}) of the embedding file `path`; "" is a one-matrix
    embedding (SD 1.x/2.x)."""
    where = f"--embedding {path}"
    if path.suffix in (".pt", ".bin", ".ckpt"):
        raise SdxError(f"{where}: a pickled file; sdx reads embeddings from .safetensors (most are published in "
                       "both forms)")
    if not path.is_file():
        raise SdxError(f"{where}: no such file")
    tensors = io.read_safetensors(path)
    token = token or io.read_safetensors_metadata(path).get("token")
    if set(tensors) == {SDXL_L, SDXL_G}:
        vectors = {k: np.asarray(v, np.float32) for k, v in tensors.items()}
    elif len(tensors) == 1:
        (key, value), = tensors.items()
        vectors = {"": np.asarray(value, np.float32)}
        if key != A1111:
            token = token or key
    else:
        raise SdxError(f"{where}: not an embedding sdx knows (keys {sorted(tensors)[:4]}); it reads diffusers' "
                       f"{{token: vectors}}, A1111's {{'{A1111}': vectors}} and SDXL's {{'{SDXL_L}', '{SDXL_G}'}}")
    vectors = {k: v[None] if v.ndim == 1 else v for k, v in vectors.items()}  # (D,) -> (1, D)
    if any(v.ndim != 2 or not v.shape[0] for v in vectors.values()) or len({v.shape[0] for v in vectors.values()}) > 1:
        raise SdxError(f"{where}: the vectors' shapes {[v.shape for v in vectors.values()]} are not (n, width), the "
                       "same n for every encoder")
    return token or path.stem, vectors


def _per_encoder(ckpt: Checkpoint, vectors: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """{text encoder: (n, D)} of the pipeline's encoders, or an SdxError when the file is for another model."""
    encoders = sorted(c for c in ckpt.tensors if c.startswith("text_encoder"))
    if "" in vectors:
        if encoders != ["text_encoder"]:
            raise SdxError(f"{where}: an SD 1.x/2.x embedding (one matrix); this model has {len(encoders)} text "
                           f"encoders, whose embeddings hold {SDXL_L} and {SDXL_G}")
        return {"text_encoder": vectors[""]}
    if "text_encoder_2" not in encoders:
        raise SdxError(f"{where}: an SDXL embedding ({SDXL_L}, {SDXL_G}); this model has one text encoder")
    named = {"text_encoder": SDXL_L, "text_encoder_2": SDXL_G}
    return {name: vectors[named[name]] for name in encoders}


def add_embeddings(ckpt: Checkpoint, embeddings: Sequence[tuple[Path, str | None]], tmp: Path, log: Log) -> None:
    """Add each (file, token or None) to `ckpt` in place: its tokens to the tokenizers (new folders under
    `tmp`, which must live until `ckpt` is written), its vectors to the text encoders."""
    if embeddings and not ckpt.pipeline_class:
        raise SdxError("--embedding adds words to a pipeline's text encoders; this source is a standalone VAE")
    for n, (path, token) in enumerate(embeddings):
        where = f"--embedding {path}"
        token, vectors = read_embedding(path, token)
        for encoder, rows in _per_encoder(ckpt, vectors, where).items():
            tensors, config = ckpt.tensors[encoder], ckpt.configs[encoder]
            key = next(k for k in tensors if k.endswith(EMBEDDING_KEY))
            table = np.asarray(tensors[key])  # (vocab, D)
            if rows.shape[1] != table.shape[1]:
                raise SdxError(f"{where}: {rows.shape[1]}-wide vectors for {encoder}, whose embeddings are "
                               f"{table.shape[1]} wide (an embedding made for another model)")
            tokens = [token] + [f"{token}_{i}" for i in range(1, rows.shape[0])]
            name = "tokenizer" + encoder[len("text_encoder"):]
            try:
                folder, first = write_with_tokens(ckpt.tokenizers[name], tmp / f"{name}-{n}", tokens)
            except SdxError as e:
                raise SdxError(f"{where}: {e} (FILE:TOKEN)") from None
            if first != table.shape[0]:
                raise SdxError(f"{where}: {encoder} has {table.shape[0]} token embeddings and its tokenizer {first} "
                               "ids; sdx adds words where the two line up, as in every released model")
            tensors[key] = np.concatenate([table, rows.astype(table.dtype)])  # (vocab + n, D): the new ids' rows
            config["vocab_size"] = first + len(tokens)
            ckpt.tokenizers[name] = folder
        log(f"added embedding {path} as {token!r} ({rows.shape[0]} vector(s))")

