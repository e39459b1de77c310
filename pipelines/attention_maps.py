"""Cross-attention maps per prompt token, aggregated as DAAM does (Tang et al. 2023, "What the DAAM:
Interpreting Stable Diffusion Using Cross Attention", ACL): each chosen cross-attention's probabilities of a
token, at each chosen model call, summed over heads, upscaled (bicubic) and summed over layers and calls.

    pipe = Pipeline.load("default")
    out = pipe.generate(Request(prompts=["a red circle on a blue background"], interventions=(AttentionMaps(),)))
    words, maps = token_maps(pipe, out.readouts[0], ["a red circle on a blue background"], out.images.shape[1:3])[0]

`AttentionMaps` records the prompt branch's maps of the chosen cross-attentions (`layers`, a pattern of
`sdx.interventions.select` over their paths; all by default) at the model calls in the share [start, end) of
the schedule (traced: new values compile nothing), and sums them at the latents' size in a buffer the sampler
carries (`readout`, `accumulate`): (images, h, w, tokens) float32. `token_maps` takes them to the image's
size (bicubic, as DAAM's last step) for the prompt's own tokens; `write` saves PNG heatmaps and one .npy per
image. The probabilities are formed in full where they are read (the `xla` path): an attention's output is
computed from them, or, when more processors follow it (an IP-Adapter's, the blank rows' shortcut), by them.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.family import TOKENIZER_OF
from sdx import interventions
from sdx.interventions import AttentionCall, Intervention, Interventions, Processor, Readout
from sdx.unet import token_grid

@dataclasses.dataclass(frozen=True)
class MapProbe(Processor):
    """Records an attention's probabilities summed over heads, (rows, T, S), under `prefix` + its path."""

    prefix: str
    per_row: ClassVar[bool] = False

    def __call__(self, call: AttentionCall) -> jax.Array:
        p = call.probabilities(call.query(), call.k)  # (rows, heads, T, S) float32
        interventions.record(self.prefix + call.path, p.sum(axis=1))
        return call.proceed() if call.rest else call.output(call.mix(p, call.v))


@dataclasses.dataclass(frozen=True)
class AttentionMaps(Intervention):
    """DAAM's maps of the cross-attentions `layers` selects, over the model calls in [start, end) of the
    schedule (shares of it). name: what its records are called (`sdx.interventions.record`), one per
    AttentionMaps of a request."""

    layers: str = "**"
    start: float = 0.0
    end: float = 1.0
    name: str = "attention_maps"
    traced: ClassVar[tuple[str, ...]] = ("start", "end")
    per_row: ClassVar[bool] = False

    def install(self, unet) -> Interventions:
        paths = interventions.select(interventions.attention_paths(unet, "cross"), self.layers,
                                     "--attention-maps-layers", kind="cross-attention")
        return Interventions(attention={path: (MapProbe(self.prefix),) for path in paths})

    @property
    def prefix(self) -> str:
        return f"{self.name}:"

    def readout(self, at: Readout) -> jax.Array:
        return jnp.zeros((at.images, *at.latent, at.tokens), jnp.float32)

    def accumulate(self, buffer: jax.Array, records, at: Readout) -> jax.Array:
        share = at.index.astype(jnp.float32) / at.calls
        weight = ((share >= self.start) & (share < self.end)).astype(jnp.float32)
        h, w = at.latent
        for name, maps in sorted(records.items()):
            if not name.startswith(self.prefix):
                continue
            mine = maps.reshape(at.images, at.branches, *maps.shape[1:])[:, at.text_branch]  # (B, T, S)
            gh, gw = token_grid(mine.shape[1], h, w)
            grid = mine.reshape(at.images, gh, gw, mine.shape[-1])  # (B, gh, gw, S)
            buffer = buffer + weight * jax.image.resize(grid, (at.images, h, w, grid.shape[-1]), "bicubic")
        return buffer


def token_positions(tokenizer, prompt: str) -> tuple[list[str], list[int]]:
    """(the prompt's tokens as words, their positions in the text context): the context is 77-token chunks of
    [start, 75 tokens, end], so token k sits at 77 * (k // 75) + 1 + k % 75 (`pipelines.text`)."""
    ids = tokenizer.content_ids([prompt])[0]
    body = tokenizer.max_length - 2
    words = [tokenizer.decode([i]) for i in ids]
    return words, [tokenizer.max_length * (k // body) + 1 + k % body for k in range(len(ids))]


def token_maps(pipe, buffer: np.ndarray, prompts: list[str],
               size: tuple[int, int]) -> list[tuple[list[str], np.ndarray]]:
    """Per image: (the prompt's tokens as words, their maps (tokens, H, W) float32 at the image's `size`) from
    `AttentionMaps`' readout (images, h, w, S); `prompts`: each image's prompt."""
    tokenizer = pipe.tokenizers[TOKENIZER_OF[pipe.family.encoders[0]]]
    out = []
    for image, prompt in zip(buffer, prompts):
        words, positions = token_positions(tokenizer, prompt)
        picked = np.asarray(image)[..., positions]  # (h, w, tokens)
        full = jax.image.resize(jnp.asarray(picked), (*size, len(positions)), "bicubic")
        out.append((words, np.asarray(full).transpose(2, 0, 1)))
    return out


def heatmap(values: np.ndarray, picture: np.ndarray | None = None) -> np.ndarray:
    """(H, W) values -> (H, W, 3) uint8: scaled to [0, 1] by their largest, coloured black-red-yellow-white
    and laid at half strength over `picture` (H, W, 3) uint8 when given."""
    v = np.clip(values / max(float(values.max()), 1e-12), 0.0, 1.0)[..., None]
    hot = np.concatenate([np.clip(3 * v, 0, 1), np.clip(3 * v - 1, 0, 1), np.clip(3 * v - 2, 0, 1)], axis=-1) * 255
    return (hot if picture is None else 0.5 * hot + 0.5 * picture).round().astype(np.uint8)


def write(folder: Path, stem: str, words: list[str], maps: np.ndarray, picture: np.ndarray) -> list[Path]:
    """`folder`/`stem`.npy with `maps` (tokens, H, W), and a heatmap over `picture` per token,
    `folder`/`stem`-<k>-<word>.png; returns the paths written."""
    from PIL import Image

    from sdx import io

    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / f"{stem}.npy"]
    io.atomic_write(written[0], lambda f: np.save(f, maps.astype(np.float32)))
    for k, (word, values) in enumerate(zip(words, maps)):
        path = folder / f"{stem}-{k:02d}-{re.sub(r'[^A-Za-z0-9]+', '_', word).strip('_') or 'token'}.png"
        io.atomic_write(path, lambda f, v=values: Image.fromarray(heatmap(v, picture)).save(f, format="PNG"))
        written.append(path)
    return written
