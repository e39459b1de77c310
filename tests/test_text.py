"""Prompt handling: truncation warnings, 75-token chunks, clip skip, and batch sizes that leave a remainder."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipelines import text
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import mesh as meshlib

LONG = "a very detailed painting of " + ", ".join(f"tower number {i}" for i in range(40))


@pytest.fixture(scope="module")
def pipe(tmp_path_factory, demo_build) -> Pipeline:
    folder = demo_build("tiny_xl", tmp_path_factory.mktemp("demo"))
    return Pipeline.load(folder, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))


def encoders(pipe: Pipeline) -> dict:
    return {name: pipe.sampler.models[name] for name in pipe.family.encoders}


def test_truncation_warns_with_the_cut_text(pipe):
    warnings = []
    ids = text.tokenize(pipe.family, pipe.tokenizers, [[LONG], [LONG]], chunks=None, warn=warnings.append)
    assert all(v.shape == (1, 1, 77) for v in ids.values())
    # digits are single tokens, so the cut text decodes as "3 9" (transformers' decode does the same)
    assert warnings and warnings[0].endswith("tower number 3 9'") and "--long-prompt chunk" in warnings[0]


def test_chunks_are_encoded_separately_and_concatenated(pipe):
    prompts = [[LONG, "short"], [LONG, "short"]]
    n = text.chunks_needed(pipe.family, pipe.tokenizers, prompts)
    assert n >= 2
    ids = text.tokenize(pipe.family, pipe.tokenizers, prompts, chunks=n)
    enc = encoders(pipe)
    context, pooled = text.encode(pipe.family, enc, {k: jnp.asarray(v) for k, v in ids.items()}, None, jnp.float32)
    assert context.shape[:2] == (2, 77 * n)
    for j in range(n):  # chunk j alone gives the same embeddings as its slice of the whole
        one = {k: jnp.asarray(v[:, j : j + 1]) for k, v in ids.items()}
        part, part_pooled = text.encode(pipe.family, enc, one, None, jnp.float32)
        np.testing.assert_allclose(context[:, 77 * j : 77 * (j + 1)], part, atol=1e-6)
        if j == 0:
            np.testing.assert_allclose(pooled, part_pooled, atol=1e-6)
    # the short prompt's later chunks are chunks of the empty prompt
    empty = text.tokenize(pipe.family, pipe.tokenizers, [[""], [""]], chunks=1)
    for k in ids:
        np.testing.assert_array_equal(ids[k][1, 1], empty[k][0, 0])


def test_long_prompt_modes_through_the_pipeline(pipe):
    base = dict(prompts=[LONG], height=32, width=32, steps=2)
    truncated = pipe(Request(**base))
    chunked = pipe(Request(**base, long_prompt="chunk"))
    assert truncated.shape == chunked.shape and not np.allclose(truncated, chunked)
    short = dict(prompts=["a tower"], height=32, width=32, steps=2)
    np.testing.assert_allclose(pipe(Request(**short)), pipe(Request(**short, long_prompt="chunk")), atol=1e-6)


def test_clip_skip_takes_an_earlier_layer(pipe):
    ids = text.tokenize(pipe.family, pipe.tokenizers, [["a tower"], ["a tower"]], chunks=None)
    ids = {k: jnp.asarray(v) for k, v in ids.items()}
    enc = encoders(pipe)
    skipped, _ = text.encode(pipe.family, enc, ids, 1, jnp.float32)
    expected = []
    for name in pipe.family.encoders:
        out = enc[name](ids[name][:, 0])
        expected.append(out.hidden_states[-3])  # SDXL: penultimate by default, one more back with clip skip 1
    np.testing.assert_allclose(skipped, jnp.concatenate(expected, -1), atol=1e-6)


def test_batch_size_with_a_remainder_gives_the_same_images(pipe):
    request = dict(prompts=["a red fox", "a boat"], num_images_per_prompt=2, height=32, width=32, steps=2, seed=5)
    whole = pipe(Request(**request))
    in_threes = pipe(Request(**request, batch_size=3))  # batches of 3: the second one is padded
    np.testing.assert_allclose(whole, in_threes, atol=1e-5)
