"""Shared pieces of the text-encoder and tokenizer tests: hub tokenizer folders in each layout the
real repos use, a prompt corpus that exercises the tokenizer's edge cases, and small random-weight
transformers CLIP text models with every parameter (layer norms and biases included) perturbed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sdx.tokenizer import BOS, EOS, write_builtin_folder

LAYOUTS = ("sdxl", "legacy", "tokenizer_json")

_LONG = ", ".join(f"word{i} and another thing number {i}" for i in range(20))
CORPUS = [
    "",
    " ",
    "a photo of an astronaut riding a horse on mars",
    "Hello, World!",
    "wow!!! amazing!? !",
    "!!",
    "hello!world!",
    "Crème brûlée à la café, naïve résumé, Ærøskøbing, straße",
    "Cre\u0300me bru\u0302le\u0301e (NFD accents)",
    "emoji 🐱🚀 👩‍👩‍👧 ❤️ 🇯🇵 👍🏽",
    "日本語のテキスト 中文字符 한국어 Ελληνικά Кириллица العربية",
    "price: $3.50, 100% off, 2024-01-01, 3.14159, 1,000,000, ½ ² Ⅻ",
    "&amp; &lt;b&gt;bold&lt;/b&gt; &quot;quoted&quot; &#39;x&#39; &nbsp;",
    "tabs\tand\nnewlines\r\n  multiple   spaces   \t",
    "\u00a0nbsp\u2003em space\u200bzero width\u3000ideographic",
    "MiXeD CaSe TEXT İstanbul ΣΊΣΥΦΟΣ",
    "don't it's we're they've I'm we'll he'd DON'T O'Neil's",
    "<|startoftext|> a <|endoftext|> b <|STARTOFTEXT|> c <|ENDOFTEXT|> d<|endoftext|>e",
    "(masterpiece:1.2), [[best quality]], {foo|bar}, a_b-c.d/e\\f ~@#^*+=`",
    "ﬁ ligature ＡＢＣ fullwidth ｶﾀｶﾅ",
    "control\x00chars\x07bell\x1b[0m",
    _LONG,
    " ".join(["cat"] * 75),
    " ".join(["cat"] * 76),
    "dog " * 200,
]


def make_tokenizer_folder(path: Path, *, pad_token: str, layout: str) -> Path:
    """A tokenizer folder with CLIP's real vocabulary in one of the layouts found on the hub.

    sdxl: vocab.json + merges.txt + tokenizer_config.json (with added_tokens_decoder) +
        special_tokens_map.json, as stabilityai/stable-diffusion-xl-base-1.0 ships tokenizer/ and tokenizer_2/.
    legacy: the pre-4.34 layout of runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-2-1:
        `__type: AddedToken` objects in tokenizer_config.json, no added_tokens_decoder, and the pad token
        given only by special_tokens_map.json (SD 2.x: config says "<|endoftext|>", the map says "!").
    tokenizer_json: what transformers 5's save_pretrained writes (tokenizer.json + tokenizer_config.json).
    """
    path = Path(path)
    if layout == "sdxl":
        return write_builtin_folder(path, pad_token)
    if layout == "legacy":
        write_builtin_folder(path, pad_token)
        tok = lambda c: {"content": c, "lstrip": False, "normalized": True, "rstrip": False, "single_word": False}  # noqa: E731
        cfg = {
            "add_prefix_space": False, "bos_token": {"__type": "AddedToken", **tok(BOS)}, "do_lower_case": True,
            "eos_token": {"__type": "AddedToken", **tok(EOS)}, "errors": "replace", "model_max_length": 77,
            "name_or_path": "openai/clip-vit-large-patch14", "pad_token": EOS,
            "special_tokens_map_file": "./special_tokens_map.json", "tokenizer_class": "CLIPTokenizer",
            "unk_token": {"__type": "AddedToken", **tok(EOS)},
        }
        special = {"bos_token": tok(BOS), "eos_token": tok(EOS), "pad_token": pad_token, "unk_token": tok(EOS)}
        (path / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))
        return path
    if layout == "tokenizer_json":
        from transformers import CLIPTokenizer as HFTokenizer

        src = write_builtin_folder(path.with_name(path.name + "_src"), pad_token)
        HFTokenizer.from_pretrained(str(src)).save_pretrained(str(path))
        assert not (path / "vocab.json").exists() and (path / "tokenizer.json").exists()
        return path
    raise ValueError(layout)


def perturbed_clip(hf_config, *, with_projection: bool, seed: int = 0, scale: float = 0.1):
    """A transformers CLIPTextModel(WithProjection) in eval mode with every parameter moved off its
    initial value (layer norms no longer 1/0, biases nonzero), and its state dict as numpy."""
    import torch
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    model = cls(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model, {k: v.detach().numpy() for k, v in model.state_dict().items()}


def random_ids(batch: int, *, pad_id: int, seed: int = 0, length: int = 77, vocab: int = 49406) -> np.ndarray:
    """(batch, length) BOS + random content of varying length + EOS + padding, as a tokenizer makes."""
    rng = np.random.default_rng(seed)
    ids = np.full((batch, length), pad_id, dtype=np.int32)
    for b in range(batch):
        n = int(rng.integers(0, length - 1))  # content tokens: 0 .. length-2
        ids[b, 0] = 49406
        ids[b, 1 : 1 + n] = rng.integers(0, vocab, n)
        ids[b, 1 + n] = 49407
    return ids
