"""Weighted prompts: the A1111 rules (sdx.prompt_syntax.a1111, checked against the web UI's own documented
examples and its chunking rules), compel's reading (against compel's parser on a corpus), the conditioning
tensors against compel's for SD (`Compel`, `CompelForSD`) and SDXL (`CompelForSDXL`) on tiny text encoders,
the text encoder's attention mask against transformers', and that a new weight compiles nothing."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from pipelines import text
from pipelines.family import family_of
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from sdx import clip, prompt_syntax, weights
from sdx import mesh as meshlib
from sdx.errors import SdxError
from sdx.prompt_syntax import Piece
from sdx.tokenizer import EOS, CLIPTokenizer, write_builtin_folder
from tests.helpers_text import perturbed_clip

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import compel
    from compel.prompt_parser import PromptParser

# --------------------------------------------------------------------------------------------------
# A1111


@pytest.mark.parametrize("prompt,expected", [
    # the web UI's parse_prompt_attention docstring examples
    ("normal text", [("normal text", 1.0)]),
    ("an (important) word", [("an ", 1.0), ("important", 1.1), (" word", 1.0)]),
    ("(unbalanced", [("unbalanced", 1.1)]),
    ("\\(literal\\]", [("(literal]", 1.0)]),
    ("(unnecessary)(parens)", [("unnecessaryparens", 1.1)]),
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     [("a ", 1.0), ("house", 1.1 * 1.1 * 1.3), (" ", 1.1), ("on", 1.0), (" a ", 1.1), ("hill", 0.55),
      (", sun, ", 1.1), ("sky", 1.1**4), (".", 1.1)]),
    # the lenient reading of what is not balanced or not a weight
    ("[a", [("a", 1 / 1.1)]),
    ("a)b]", [("a)b]", 1.0)]),
    ("x:1.2) y", [("x:1.2) y", 1.0)]),
    ("a:b", [("a:b", 1.0)]),
    ("(a:0.5) and [[b]]", [("a", 0.5), (" and ", 1.0), ("b", 1 / 1.21)]),
    ("\\\\ and \\", [("\\ and ", 1.0)]),  # an escaped backslash stays, a lone one is dropped
    ("a BREAK b BREAK", [("a", 1.0), (prompt_syntax.BREAK, None), ("b", 1.0), (prompt_syntax.BREAK, None), ("", 1.0)]),
    ("", [("", 1.0)]),
])
def test_a1111_reading(prompt, expected):
    got = prompt_syntax.a1111(prompt)
    assert [p.text for p in got] == [t for t, _ in expected]
    np.testing.assert_allclose([p.weight or -1 for p in got], [w or -1 for _, w in expected], rtol=1e-12)


@pytest.mark.parametrize("prompt,match", [("(a:1.2.3)", "1.2.3"), ("a [cat:dog:0.5]", "prompt editing"),
                                          ("[cat:0.4] hat", "prompt editing"), ("[cat|dog]", "alternation"),
                                          ("a cat AND a dog", "composable")])
def test_a1111_what_sdx_does_not_read_is_an_error(prompt, match):
    with pytest.raises(SdxError, match=match):
        prompt_syntax.a1111(prompt)


@pytest.fixture(scope="module")
def tok():
    return CLIPTokenizer.builtin()


def test_a1111_chunks_break_and_comma_backtrack(tok):
    """BREAK ends a chunk; a full chunk hands what follows its last comma (within 20 tokens) to the next."""
    out = text._a1111(tok, "a red cat BREAK (a dog:1.5)", truncate=False)
    assert len(out.ids) == 2
    assert tok.decode(out.ids[1]).startswith("a dog") and out.weights[1][1:3] == [1.5, 1.5]
    cats = " ".join(["cat"] * 70)  # one token each
    assert len(text._a1111(tok, cats + ", dog dog dog dog", truncate=False).ids) == 1  # 75 tokens: one chunk
    out = text._a1111(tok, cats + ", dog dog dog dog dog dog", truncate=False)
    assert out.ids[0][1:73] == [tok.content_ids(["cat"])[0][0]] * 70 + tok.content_ids([","])[0] + [tok.eos_id]
    assert tok.decode(out.ids[1]) == "dog dog dog dog dog dog"  # what followed the comma starts the next chunk
    far = text._a1111(tok, " ".join(["cat"] * 40) + ", " + " ".join(["dog"] * 40), truncate=False)
    assert len(far.ids) == 2 and tok.decode(far.ids[1]).count("dog") == 6  # the comma 35 back: a plain cut
    cut = text._a1111(tok, cats + " " + cats, truncate=True)
    assert len(cut.ids) == 1 and cut.cut


# --------------------------------------------------------------------------------------------------
# compel's reading

COMPEL_CORPUS = [
    "a cat", "a cat++ on a mat", "a (red cat)1.3 sat", "(a (red cat)1.2 sat)0.5 down", "cat-- dog+", "(cat)++",
    "a \\(cat\\) sat", "well-known word", "a, b,c", "((a cat)) sat", "(a cat", "a cat)", "a (cat, dog)1.1.",
    '"a cat"1.2 sat', '("a cat", "a dog").and()', '("a cat", "a dog").and(1, 0.5)', "(cat)1.2++", "(cat)-1",
    "(cat)0", "cat.attend(1.5)", "a ( red ) cat", "x-y z+1", "a - b", "(a)(b)1.1", "(cat) 1.2", "(a - b) c",
    '"a, b"1.5', "a (b (c)1.5)0.5 d", "cat+dog", "(cat).5", "(a.b)", "(x=y)1.2", "(cat:1.2)", "[cat]",
    '("(a cat)1.2 sat", dog).and()', "a cat, (dog)-, bird", "", "(((very nested)1.1)1.1)1.1",
    "café (crème)1.2", "emoji 🐱++ ok",
]


@pytest.mark.parametrize("prompt", COMPEL_CORPUS)
def test_compel_reading_matches_compel(prompt, tok):
    """The same pieces (as the tokens they make) with the same weights, part by part."""
    ref = PromptParser().parse_conjunction(prompt)
    as_tokens = lambda pieces: [(tuple(tok.content_ids([p.text])[0]), round(p.weight, 9)) for p in pieces]
    expected = [(round(w, 9), as_tokens([Piece(f.text, f.weight) for f in p.children]))
                for p, w in zip(ref.prompts, ref.weights)]
    assert [(round(c.weight, 9), as_tokens(c.pieces)) for c in prompt_syntax.compel(prompt)] == expected


@pytest.mark.parametrize("prompt,match", [("(a, b).blend(0.5, 0.5)", "blend"), ("a cat.swap(dog)", "swap"),
                                          ("withLora(x, 0.5) a cat", "withLora"),
                                          ('("a", "b").and(0.5)', "2 parts but 1 weights")])
def test_compel_unsupported_is_an_error(prompt, match):
    with pytest.raises(SdxError, match=match):
        prompt_syntax.compel(prompt)


# --------------------------------------------------------------------------------------------------
# Conditioning against compel, on tiny text encoders


def _encoder(hidden: int, projection: bool, seed: int):
    config = transformers.CLIPTextConfig(
        vocab_size=49408, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=77, hidden_act="gelu", projection_dim=24, eos_token_id=2,
        bos_token_id=49406, pad_token_id=1)
    model, state = perturbed_clip(config, with_projection=projection, seed=seed)
    cfg = clip.TextEncoderConfig.from_diffusers_config(config.to_dict() | {"architectures": [type(model).__name__]})
    ours = weights.load_torch_state(weights.abstract(lambda rngs: clip.CLIPTextModel(cfg, rngs=rngs)),
                                    clip.transformers_state(state, where="test"), where="test")
    return model, ours


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny SD-like and SDXL-like text stacks: transformers' for compel, sdx's with the same weights."""
    root = tmp_path_factory.mktemp("tokenizers")
    folders = {"eos": write_builtin_folder(root / "eos", EOS), "bang": write_builtin_folder(root / "bang", "!")}
    hf_tok = {k: transformers.CLIPTokenizer.from_pretrained(str(f)) for k, f in folders.items()}
    tok = {k: CLIPTokenizer.from_folder(f) for k, f in folders.items()}
    one, one_ours = _encoder(32, False, 1)
    two, two_ours = _encoder(48, True, 2)
    sd = (SimpleNamespace(tokenizer=hf_tok["eos"], text_encoder=one),
          family_of("StableDiffusionPipeline", {"text_encoder"}, {}), {"tokenizer": tok["eos"]},
          {"text_encoder": one_ours})
    xl = (SimpleNamespace(tokenizer=hf_tok["eos"], text_encoder=one, tokenizer_2=hf_tok["bang"], text_encoder_2=two),
          family_of("StableDiffusionXLPipeline", {"text_encoder", "text_encoder_2"}, {}),
          {"tokenizer": tok["eos"], "tokenizer_2": tok["bang"]}, {"text_encoder": one_ours, "text_encoder_2": two_ours})
    return {"sd": sd, "sdxl": xl}


def ours(family, tokenizers, encoders, groups, chunk: bool):
    """[(context, pooled)] of each group of prompts (each group: one list per encoder)."""
    packed, weighting = text.tokenize_weighted(family, tokenizers, groups, syntax="compel", chunk=chunk,
                                               warn=lambda _msg: None)
    run = nnx.jit(lambda enc, ids, w: text.encode(family, enc, ids, None, jnp.float32, weighting, w))
    return [run(encoders, ids, w) for ids, w in packed]


LONG = ("a lighthouse on a cliff at dusk. waves crash below it, and gulls circle its lamp. " * 7
        + "(the sky)1.3 is orange and purple, with long thin clouds.")
PROMPTS = ["a photo of a (red cat)1.3 on a (wooden)0.7 mat", "a cat++ and a dog--, (a (deep)0.5 nest)1.2",
           "a \\(literal\\) bracket and (unbalanced", '("a (red)0.5 cat", "a blue dog").and(1, 0.6)',
           "plain words only"]
NEGATIVES = ["blurry, (ugly)1.4", "(low quality)0.5", "", "watermark--", "(text)0"]


def _close(name, got, ref):
    ref = ref.detach().numpy()
    got = np.asarray(got)
    assert got.shape == ref.shape, (name, got.shape, ref.shape)
    err, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    assert err <= 2e-6 * scale, f"{name}: max abs error {err:.2e} at scale {scale:.2f}"


def test_sd_conditioning_matches_compel(models):
    """`Compel` (one chunk per part, truncation) for the prompts, `CompelForSD` (chunks at sentence ends) with
    the negative prompts, a long prompt among them."""
    pipe, family, tokenizers, encoders = models["sd"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = compel.Compel(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder)(PROMPTS)
        labelled = compel.CompelForSD(pipe)(PROMPTS + [LONG], negative_prompt=NEGATIVES + ["lowres"])
    (got, _), = ours(family, tokenizers, encoders, [[PROMPTS]], chunk=False)
    _close("Compel, truncated", got, ref)
    (pos, _), (neg, _) = ours(family, tokenizers, encoders, [[PROMPTS + [LONG]], [NEGATIVES + ["lowres"]]], chunk=True)
    assert pos.shape[1] > 77 * 2  # the long prompt's sentences: three chunks at least
    _close("CompelForSD embeds", pos, labelled.embeds)
    _close("CompelForSD negative_embeds", neg, labelled.negative_embeds)


def test_sdxl_conditioning_matches_compel(models):
    """`CompelForSDXL`: both encoders' penultimate states side by side, the second's pooled embedding of the
    raw text, a second (style) prompt, and the negatives."""
    pipe, family, tokenizers, encoders = models["sdxl"]
    style = ["oil painting", "(watercolor)0.8", "ink", "pencil++", "(charcoal)1.2"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = compel.CompelForSDXL(pipe)(main_prompt=PROMPTS, style_prompt=style, negative_prompt=NEGATIVES)
    (pos, pooled), (neg, neg_pooled) = ours(family, tokenizers, encoders, [[PROMPTS, style], [NEGATIVES, NEGATIVES]],
                                            chunk=True)
    _close("CompelForSDXL embeds", pos, ref.embeds)
    _close("CompelForSDXL pooled_embeds", pooled, ref.pooled_embeds)
    _close("CompelForSDXL negative_embeds", neg, ref.negative_embeds)
    _close("CompelForSDXL negative_pooled_embeds", neg_pooled, ref.negative_pooled_embeds)


def test_attention_mask_matches_transformers(models):
    pipe, _, _, encoders = models["sd"]
    ids = np.asarray(pipe.tokenizer(["a red cat on a mat", "x"], padding="max_length", max_length=77).input_ids)
    mask = np.ones_like(ids)
    mask[0, 2:4] = 0
    mask[1, 5:40] = 0
    with torch.no_grad():
        ref = pipe.text_encoder(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).last_hidden_state
    got = nnx.jit(lambda m, i, a: m(i, a).last_hidden_state)(encoders["text_encoder"], jnp.asarray(ids), jnp.asarray(mask))
    _close("masked last_hidden_state", got, ref)


def test_a1111_weights_scale_and_keep_each_chunks_mean(models):
    """A1111's emphasis: unweighted chunks as plain prompts give them, weighted ones the embeddings times the
    weights, rescaled to the chunk's mean before."""
    _, family, tokenizers, encoders = models["sd"]
    packed, weighting = text.tokenize_weighted(family, tokenizers, [[["a red cat BREAK a (blue:1.4) [dog]"]]],
                                               syntax="a1111", chunk=True)
    (ids, w), = packed
    got, _ = text.encode(family, encoders, ids, None, jnp.float32, weighting, w)
    plain, _ = text.encode(family, encoders, ids, None, jnp.float32)
    chunks = np.asarray(plain).reshape(1, 2, 77, -1)
    np.testing.assert_array_equal(np.asarray(got)[:, :77], chunks[:, 0])  # "a red cat": no weight, untouched
    weighted = chunks[:, 1] * np.asarray(w["text_encoder"].weights)[:, 1, :, None]
    expected = weighted * chunks[:, 1].mean() / weighted.mean()
    np.testing.assert_allclose(np.asarray(got)[:, 77:], expected, rtol=1e-5, atol=1e-6)
    assert sorted(set(np.round(np.asarray(w["text_encoder"].weights)[0, 1], 4))) == [round(1 / 1.1, 4), 1.0, 1.4]


# --------------------------------------------------------------------------------------------------
# Through the pipeline: weights are inputs


@pytest.fixture(scope="module")
def pipe(tmp_path_factory, demo_build) -> Pipeline:
    folder = demo_build("tiny_xl", tmp_path_factory.mktemp("demo"))
    return Pipeline.load(folder, mesh=meshlib.make_mesh(devices=jax.devices()[:1]))


@pytest.mark.parametrize("syntax,first,second", [("a1111", "a (red:1.3) fox, [snow]", "a (red:0.6) fox, [[snow]]"),
                                                 ("compel", "a (red)1.3 fox, snow-", "a (red)0.6 fox, snow--")])
def test_a_new_weight_compiles_nothing(pipe, jax_events, syntax, first, second):
    run = lambda prompt: pipe(Request(prompts=[prompt], negative_prompts=["(blurry)1.2"], height=32, width=32,
                                      steps=2, prompt_syntax=syntax))
    a = run(first)
    compiles, plans = jax_events("backend_compile"), pipe.sampler.compilations
    b = run(second)
    assert compiles == [] and pipe.sampler.compilations == plans, compiles  # no program made, none compiled
    assert not np.allclose(a, b, atol=1e-3)  # the weights reached the images


@pytest.mark.parametrize("args,match", [(["--prompt", "(a, b).blend(1, 1)", "--prompt-syntax", "compel"], "blend"),
                                        (["--prompt", "x", "--negative-prompt", "(a:1.2.3)"], "1.2.3")])
def test_an_unreadable_prompt_is_one_error_line_before_loading(capsys, args, match):
    from sdx.sample import main

    assert main(["--model", "tiny", "--quiet", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and match in err[-1] and "Traceback" not in "\n".join(err)
