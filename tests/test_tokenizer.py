"""The tokenizer gives transformers 5's CLIPTokenizer ids, for both SDXL tokenizers, in every folder layout."""

from __future__ import annotations


import numpy as np
import pytest

from sdx.errors import SdxError
from sdx.tokenizer import EOS, CLIPTokenizer, builtin_vocab
from tests.helpers_text import CORPUS, LAYOUTS, make_tokenizer_folder

transformers = pytest.importorskip("transformers")

PADS = {"pad_eos": EOS, "pad_bang": "!"}


def _reference(folder):
    hf = transformers.CLIPTokenizer.from_pretrained(str(folder))
    ids = np.asarray(hf(CORPUS, padding="max_length", max_length=77, truncation=True)["input_ids"])
    return hf, ids


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        (pad, layout): make_tokenizer_folder(root / f"{pad}-{layout}", pad_token=PADS[pad], layout=layout)
        for pad in PADS
        for layout in LAYOUTS
    }


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pad", PADS)
def test_ids_equal_transformers(folders, pad, layout):
    folder = folders[(pad, layout)]
    hf, expected = _reference(folder)
    tok = CLIPTokenizer.from_folder(folder)
    got = tok(CORPUS)
    assert got.dtype == np.int32 and got.shape == (len(CORPUS), 77)
    for text, g, e in zip(CORPUS, got, expected):
        np.testing.assert_array_equal(g, e, err_msg=repr(text))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert tok.pad_id == (0 if pad == "pad_bang" else 49407)
    # The same special tokens with the same matching flags (normalized, lstrip, ...) as transformers.
    ours = {i: repr(t) for i, t in tok._tok.get_added_tokens_decoder().items()}
    theirs = {i: repr(t) for i, t in hf.backend_tokenizer.get_added_tokens_decoder().items()}
    assert ours == theirs
    # The second tokenizer's quirk is real: "!" in a prompt is the pad token (id 0), not "!</w>" (256).
    bang = tok.content_ids(["wow!"])[0][-1]
    assert bang == (0 if pad == "pad_bang" else 256)


@pytest.mark.parametrize("pad", PADS)
def test_builtin_equals_hub_folder(folders, pad):
    _, expected = _reference(folders[(pad, "sdxl")])
    np.testing.assert_array_equal(CLIPTokenizer.builtin(PADS[pad])(CORPUS), expected)


def test_builtin_vocabulary_is_clips():
    vocab, merges = builtin_vocab()
    assert len(vocab) == 49408 and len(merges) == 48894
    assert vocab["!"] == 0 and vocab["!</w>"] == 256 and vocab["<|startoftext|>"] == 49406 and vocab[EOS] == 49407
    with pytest.raises(TypeError):  # cached and shared: read-only
        vocab["!"] = 1
    # Ids of openai/clip-vit-large-patch14's tokenizer for a well-known prompt.
    ids = CLIPTokenizer.builtin()(["a photo of a cat"])[0]
    assert ids[:7].tolist() == [49406, 320, 1125, 539, 320, 2368, 49407] and (ids[7:] == 49407).all()


def test_truncation_is_reported():
    tok = CLIPTokenizer.builtin()
    exact, over = " ".join(["cat"] * 75), " ".join(["cat"] * 75) + " big dog"
    out = tok.encode(["a cat", exact, over])
    assert out.truncated == [None, None, "big dog"]
    assert out.ids[2, -1] == tok.eos_id and (out.ids[1] == out.ids[2]).all()
    assert [len(c) for c in tok.content_ids([exact, over])] == [75, 77]


def test_chunked_long_prompt():
    tok = CLIPTokenizer.builtin("!")
    long_text = " ".join(f"word{i}" for i in range(100))  # each "wordN" is several tokens
    content = tok.content_ids([long_text])[0]
    chunks = tok.chunked([long_text, "a cat"])
    n = -(-len(content) // 75)
    assert chunks.shape == (2, n, 77) and chunks.dtype == np.int32
    body = []
    for c in chunks[0]:
        assert c[0] == tok.bos_id
        end = int(np.argmax(c == tok.eos_id))
        body += c[1:end].tolist()
        assert (c[end + 1 :] == tok.pad_id).all()
    assert body == content
    np.testing.assert_array_equal(chunks[1, 0], tok(["a cat"])[0])
    np.testing.assert_array_equal(chunks[1, 1:], np.broadcast_to(tok([""])[0], (n - 1, 77)))
    assert tok.chunked(["a cat"], num_chunks=3).shape == (1, 3, 77)
    with pytest.raises(SdxError, match="chunks"):
        tok.chunked([long_text], num_chunks=1)


def test_bad_folders_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(SdxError, match=str(missing)):
        CLIPTokenizer.from_folder(missing)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SdxError, match="neither tokenizer.json nor vocab.json"):
        CLIPTokenizer.from_folder(empty)
    broken = make_tokenizer_folder(tmp_path / "broken", pad_token=EOS, layout="sdxl")
    (broken / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(SdxError, match="tokenizer_config.json"):
        CLIPTokenizer.from_folder(broken)
    bad_merges = make_tokenizer_folder(tmp_path / "bad_merges", pad_token=EOS, layout="sdxl")
    with open(bad_merges / "merges.txt", "a") as f:
        f.write("a b c\n")
    with pytest.raises(SdxError, match="malformed merge"):
        CLIPTokenizer.from_folder(bad_merges)
