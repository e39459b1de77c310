"""`python -m train.textual_inversion`: textual inversion (Gal et al. 2022) with diffusers'
textual_inversion.py flags, SD 1.x/2.x or SDXL: a new word learned from a few images, nothing else trains.

    python -m train.textual_inversion --pretrained_model_name_or_path stable-diffusion-v1-5 \\
        --train_data_dir ./cat-toy --placeholder_token "<cat-toy>" --initializer_token toy \\
        --resolution 512 --train_batch_size 1 --gradient_accumulation_steps 4 --max_train_steps 3000 \\
        --learning_rate 5e-4 --scale_lr --output_dir textual-inversion-cat-toy
    python -m sdx.sample --model stable-diffusion-v1-5 --embedding textual-inversion-cat-toy/learned_embeds.safetensors \\
        --prompt "a <cat-toy> on the moon"

The word (`--placeholder_token`, with `--num_vectors` vectors: tokens T, T_1, ...) is added to each
tokenizer; its vectors start as `--initializer_token`'s (which must be one token) and are the only
parameters that train (`sdx.textual_inversion`), through the frozen text encoders, UNet and VAE. SDXL
learns a word for each of its two encoders, as diffusers' textual_inversion_sdxl.py does. Each image is
read `--repeats` times per epoch under a caption drawn per sample from short templates ("a photo of a T",
... or, with `--learnable_property style`, "a painting in the style of T", ...), flipped half the time,
resized with bicubic by its shorter side and cropped (`--center_crop`: the centre; else at random; diffusers
stretches an image to a square instead, the same for square images). The run writes
`learned_embeds.safetensors`: {T: (n, width)} as diffusers' script writes it, or SDXL's {"clip_l", "clip_g"}
layout, with the word in its metadata; `--embedding` (and diffusers' `load_textual_inversion`) read it.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from pipelines.family import TOKENIZER_OF
from sdx import io
from sdx import mesh as meshlib
from sdx import model_folder
from sdx.errors import SdxError
from sdx.textual_inversion import WordParam, add_words, word_vectors
from sdx.tokenizer import CLIPTokenizer, write_with_tokens
from train import config, diffusion, loop, sources
from train.config import TrainConfig

EMBEDS_FILE = "learned_embeds.safetensors"
# Captions, "{}" the word: what an image of an object, or a picture in a style, might be called.
TEMPLATES = {
    "object": ("a photo of a {}", "a rendering of a {}", "a close-up photo of the {}", "a bright photo of a {}",
               "a dark photo of the {}", "a cropped photo of a {}", "a good photo of the {}", "a photo of one {}",
               "a photo of a small {}", "a photo of a large {}", "an image of the {}", "a picture of my {}"),
    "style": ("a painting in the style of {}", "an artwork in the style of {}", "a picture in the style of {}",
              "a drawing in the style of {}", "a close-up painting in the style of {}", "a small painting in the "
              "style of {}", "a large painting in the style of {}", "a bright painting in the style of {}",
              "a dark painting in the style of {}", "an illustration in the style of {}",
              "a rendering in the style of {}", "a sketch in the style of {}"),
}


def word_tokens(cfg: TrainConfig) -> list[str]:
    """The word's tokens: T, T_1, ..., T_{n-1}."""
    return [cfg.placeholder_token] + [f"{cfg.placeholder_token}_{i}" for i in range(1, cfg.num_vectors)]


class TextualInversionTask(diffusion.DiffusionTask):
    def adapt(self, trained: dict[str, nnx.Module]) -> type[nnx.Variable]:
        """The word's tokens added to each tokenizer and its vectors to each text encoder, starting as
        --initializer_token's; they alone train."""
        cfg, m = self.cfg, self.models
        tokens = word_tokens(cfg)
        for encoder in m.family.encoders:
            name = TOKENIZER_OF[encoder]
            ids = m.tokenizers[name].content_ids([cfg.initializer_token])[0]
            if len(ids) != 1:
                raise SdxError(f"--initializer_token {cfg.initializer_token!r} is {len(ids)} tokens for {name}; "
                               "give one word the tokenizer knows whole (e.g. 'toy')")
            with tempfile.TemporaryDirectory(prefix="sdx-tokenizer-") as tmp:
                source = model_folder.tokenizer_folder(m.folder, name, spec=m.spec)
                try:
                    folder, first = write_with_tokens(source, Path(tmp) / name, tokens)
                except SdxError as e:
                    raise SdxError(f"--placeholder_token: {e}") from None
                m.tokenizers[name] = CLIPTokenizer.from_folder(folder)
            table = trained[encoder].text_model.embeddings.token_embedding.embedding[...]  # (vocab, C)
            if first != table.shape[0]:
                raise SdxError(f"{encoder} has {table.shape[0]} token embeddings and its tokenizer {first} ids; "
                               "new words go where the two line up")
            start = jnp.broadcast_to(table[ids[0]].astype(jnp.float32), (len(tokens), table.shape[1]))  # (n, C)
            add_words(trained[encoder], jax.device_put(start, meshlib.replicated(self.mesh)))
        self.log(f"learning {cfg.placeholder_token!r} ({len(tokens)} vector(s) per text encoder) from "
                 f"{cfg.initializer_token!r}")
        return WordParam

    def export(self, module: nnx.Module, out: Path) -> None:
        """learned_embeds.safetensors: {T: (n, width)} (one text encoder) or {"clip_l", "clip_g"} (SDXL)."""
        if jax.process_index() != 0:
            return
        trained, encoders = self.trained(module), self.models.family.encoders
        vectors = {e: word_vectors(trained[e]) for e in encoders}
        if len(encoders) == 1:
            arrays = {self.cfg.placeholder_token: vectors[encoders[0]]}
        else:
            arrays = {"clip_l": vectors["text_encoder"], "clip_g": vectors["text_encoder_2"]}
        path = out / EMBEDS_FILE
        io.write_safetensors(path, arrays, metadata={"format": "pt", "token": self.cfg.placeholder_token})
        self.log(f"the word {self.cfg.placeholder_token!r} written to {path} (python -m sdx.sample --model "
                 f"{self.cfg.pretrained_model_name_or_path} --embedding {path})")


@dataclasses.dataclass
class Captioned(sources.Source):
    """`images`' rows, each with every caption: the loader draws one per sample (`data.Transform.caption`)."""

    images: sources.Source
    captions: tuple[str, ...]

    def __post_init__(self):
        self.columns = sources.Columns.text_to_image()
        self.found = ("image", "text")
        self.description = f"{self.images.description}, {len(self.captions)} caption templates"

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> sources.Example:
        return dataclasses.replace(self.images[i], text=self.captions)


def open_data(cfg: TrainConfig) -> Captioned:
    """Every image file of --train_data_dir, read --repeats times, with the templates' captions of the word."""
    images = sources.image_folder(cfg.train_data_dir, "--train_data_dir", cfg.repeats)
    return Captioned(images, tuple(t.format(cfg.placeholder_token) for t in TEMPLATES[cfg.learnable_property]))


def train(argv=None) -> int:
    return loop.run(config.parse("textual_inversion", argv), TextualInversionTask, open_data)


if __name__ == "__main__":
    loop.main(train, sys.argv[1:])
