"""CLIP's tokenizer on the `tokenizers` library, giving the ids transformers 5's `CLIPTokenizer` gives.

The pipeline is transformers' (models/clip/tokenization_clip.py): NFC, every run of whitespace to one
space, lowercase (no ftfy, no HTML unescaping), a split on CLIP's regex, byte-level BPE with `</w>`
ending each word, then `<|startoftext|>` ... `<|endoftext|>` and padding to 77 with the folder's pad
token (`<|endoftext|>` for SD 1.x and SDXL's first tokenizer, `!` for SDXL's second and SD 2.x).
Special tokens are "added tokens" matched in the raw text before BPE, with the flags transformers
gives them; a quirk worth knowing: where the pad token is `!`, every `!` in a prompt becomes id 0
instead of BPE's `!</w>` (256), exactly as in diffusers.

Folders are read as the hub ships them: vocab.json + merges.txt (+ tokenizer_config.json,
special_tokens_map.json), the layout of the SD/SDXL repos, or tokenizer.json (+ tokenizer_config.json),
the layout transformers 5 saves. `CLIPTokenizer.builtin()` needs no folder: it builds CLIP's
vocabulary from `sdx/assets/bpe_simple_vocab_16e6.txt.gz` as OpenAI CLIP's SimpleTokenizer does (that
file is OpenAI CLIP's, MIT license; see sdx/assets/README.md).
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import types
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from sdx import io
from sdx.errors import SdxError

BOS, EOS = "<|startoftext|>", "<|endoftext|>"
MAX_LENGTH = 77  # CLIP's context (max_position_embeddings); used when tokenizer_config.json gives none
# transformers 5 CLIPTokenizer's split pattern (its special tokens first, then OpenAI CLIP's regex).
_SPLIT = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TOKEN_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _bytes_to_unicode() -> dict[int, str]:
    """OpenAI CLIP's (and GPT-2's) reversible byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@functools.lru_cache(maxsize=1)
def builtin_vocab() -> tuple[Mapping[str, int], tuple[tuple[str, str], ...]]:
    """CLIP's vocabulary (49408 entries) and BPE merges, built like OpenAI CLIP's SimpleTokenizer.

    The 256 byte characters, the same with `</w>`, one entry per merge for the first 49152-256-2
    merges of bpe_simple_vocab_16e6.txt.gz (its first line is a header), then BOS and EOS. This is
    the vocab.json / merges.txt that openai/clip-vit-large-patch14 and the SD repos ship. Both are
    read-only (a mapping proxy and tuples): the cached values are shared by every caller.
    """
    data = resources.files("sdx").joinpath("assets/bpe_simple_vocab_16e6.txt.gz").read_bytes()
    lines = gzip.decompress(data).decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : 49152 - 256 - 2 + 1]]
    chars = list(_bytes_to_unicode().values())
    tokens = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + [BOS, EOS]
    return types.MappingProxyType({t: i for i, t in enumerate(tokens)}), tuple(merges)


def _added_token(value: Any, *, special: bool | None = None) -> AddedToken | str:
    """A token as transformers reads it: a str stays a str, a dict becomes an AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and "content" in value:
        flags = {k: value[k] for k in _TOKEN_FLAGS if k in value}
        if special is not None:
            flags["special"] = special
        return AddedToken(**flags)
    raise SdxError(f"a special token must be a string or a {{'content': ...}} object, got {value!r}")


def _tokens_to_add(
    config: Mapping[str, Any], special_map: Mapping[str, Any] | None, json_added: list | None
) -> tuple[list[AddedToken], dict[str, str]]:
    """The added tokens, in the order transformers 5 adds them (later duplicates win in `tokenizers`).

    tokenizer_config.json's `added_tokens_decoder` when present (then special_tokens_map.json is not
    read, as in transformers); otherwise the legacy route: special_tokens_map.json overrides the
    config's named tokens and tokenizer.json's `added_tokens` are the added tokens. Then every named
    special token (bos, eos, unk, pad, ...) and extra special token not among them is appended.
    """
    named: dict[str, Any] = {"bos_token": BOS, "eos_token": EOS, "unk_token": EOS, "pad_token": EOS}
    named.update({k: _added_token(config[k]) for k in _NAMED if config.get(k) is not None})
    extra = list(config.get("extra_special_tokens") or config.get("additional_special_tokens") or [])
    decoder: dict[int, AddedToken] = {}
    if "added_tokens_decoder" in config:
        decoder = {int(i): _added_token(t) for i, t in config["added_tokens_decoder"].items()}
    else:
        for key, value in (special_map or {}).items():
            if key in _NAMED and value is not None:
                named[key] = _added_token(value, special=True)
            elif key in ("additional_special_tokens", "extra_special_tokens") and isinstance(value, list):
                extra += [t for t in (_added_token(v, special=True) for v in value) if t not in extra]
        for t in json_added or []:
            decoder[int(t["id"])] = _added_token(t)
    by_content = {str(t): t for t in decoder.values()}
    named = {k: by_content.get(str(v), v) for k, v in named.items()}

    tokens = [t for _, t in sorted(decoder.items())]
    present = [str(t) for t in tokens]
    for value in [named[k] for k in _NAMED if k in named] + [_added_token(t) for t in extra]:
        if str(value) not in present and value not in tokens:
            tokens.append(value)
    named_contents = {str(v) for v in named.values()}
    out = []
    for t in tokens:
        if isinstance(t, str):
            t = AddedToken(t, special=True)
        elif not t.special and str(t) in named_contents:
            t.special = True
        out.append(t)
    return out, {k: str(v) for k, v in named.items()}


@dataclasses.dataclass(frozen=True)
class Tokenized:
    """A batch of prompts as the text encoders take them.

    ids: (B, max_length) int32, BOS + up to max_length-2 tokens + EOS, then pad ids.
    truncated: per prompt, the text that did not fit (decoded, as diffusers prints it), or None.
    """

    ids: np.ndarray
    truncated: list[str | None]


class CLIPTokenizer:
    """CLIP BPE tokenizer. Build with `from_folder(path)` or `builtin(pad_token=...)`.

    `tok(texts)` -> (B, 77) int32 ids, padded and truncated like transformers' `CLIPTokenizer(texts,
    padding="max_length", max_length=77, truncation=True)`. `encode(texts)` adds which prompts were
    truncated; `content_ids(texts)` gives the untruncated ids without BOS/EOS, and `chunked(texts)`
    the 75-token chunks of the long-prompt mode.
    """

    def __init__(
        self,
        vocab: Mapping[str, int],
        merges: Sequence[tuple[str, str]],
        *,
        config: Mapping[str, Any] | None = None,
        special_tokens_map: Mapping[str, Any] | None = None,
        json_added_tokens: list | None = None,
        source: str = "built-in vocabulary",
    ):
        config = dict(config or {})
        self.source = source
        self.max_length = int(config.get("model_max_length") or MAX_LENGTH)
        if self.max_length > 10**6:  # transformers' "no limit" placeholder; CLIP has 77 positions
            self.max_length = MAX_LENGTH
        added, named = _tokens_to_add(config, special_tokens_map, json_added_tokens)
        tok = Tokenizer(
            BPE(
                vocab=dict(vocab), merges=list(merges), dropout=None, continuing_subword_prefix="",
                end_of_word_suffix="</w>", fuse_unk=False, unk_token=named["unk_token"],
            )
        )
        tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()])
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT), behavior="removed", invert=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ])
        tok.decoder = decoders.ByteLevel()
        tok.add_tokens(added)
        self._tok = tok
        ids = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            i = tok.token_to_id(named[key])
            if i is None:
                raise SdxError(f"{source}: the {key} {named[key]!r} is not in the vocabulary")
            ids[key] = i
        self.bos_id, self.eos_id, self.pad_id = ids["bos_token"], ids["eos_token"], ids["pad_token"]
        self.pad_token = named["pad_token"]
        self.named = named
        contents = {str(t) for t in tok.get_added_tokens_decoder().values()}
        self._multi = {}  # textual inversion: token T with vectors T_1, ... -> "T T_1 ..." (`expand`)
        for t in contents:
            n = 1
            while f"{t}_{n}" in contents:
                n += 1
            if n > 1:
                self._multi[t] = " ".join([t] + [f"{t}_{i}" for i in range(1, n)])

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def builtin(cls, pad_token: str = EOS) -> CLIPTokenizer:
        """CLIP's own vocabulary with BOS/EOS and `pad_token` ("<|endoftext|>" for SD 1.x and SDXL's
        first encoder, "!" for SDXL's second and SD 2.x): what the hub folders of those models hold,
        for single-file checkpoints and the demo model, which come without one."""
        vocab, merges = builtin_vocab()
        return cls(vocab, merges, config=builtin_tokenizer_config(pad_token), source=f"built-in vocabulary (pad {pad_token!r})")

    @classmethod
    def from_folder(cls, path: str | Path) -> CLIPTokenizer:
        """A hub tokenizer folder: tokenizer.json, or vocab.json + merges.txt; tokenizer_config.json and
        special_tokens_map.json when present. tokenizer.json wins when both kinds are there (as in
        transformers)."""
        p = Path(path)
        if not p.is_dir():
            raise SdxError(f"tokenizer folder {p} does not exist or is not a folder")
        config = io.read_json(p / "tokenizer_config.json", optional=True) or {}
        if (p / "added_tokens.json").exists():
            raise SdxError(f"{p / 'added_tokens.json'}: added_tokens.json is not supported; save the tokenizer with transformers >= 4.34")
        special_map = io.read_json(p / "special_tokens_map.json", optional=True)
        tj = io.read_json(p / "tokenizer.json", optional=True)
        if tj is not None:
            model = tj.get("model") or {}
            if model.get("type", "BPE") != "BPE" or not isinstance(model.get("vocab"), dict):
                raise SdxError(f"{p / 'tokenizer.json'}: not a BPE tokenizer (model.type={model.get('type')!r})")
            vocab = model["vocab"]
            merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]
            json_added = tj.get("added_tokens") or []
        elif (p / "vocab.json").is_file() and (p / "merges.txt").is_file():
            vocab = io.read_json(p / "vocab.json", optional=True)
            merges = _read_merges(p / "merges.txt")
            json_added = None
        else:
            raise SdxError(f"tokenizer folder {p} has neither tokenizer.json nor vocab.json + merges.txt")
        bad = [m for m in merges if len(m) != 2]
        if bad:
            raise SdxError(f"tokenizer folder {p}: malformed merge {' '.join(bad[0])!r}")
        try:
            return cls(vocab, merges, config=config, special_tokens_map=special_map, json_added_tokens=json_added, source=str(p))
        except Exception as e:  # the tokenizers library rejects inconsistent vocab/merges
            if isinstance(e, SdxError):
                raise
            raise SdxError(f"tokenizer folder {p} could not be read: {e}") from e

    # -- encoding -----------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def added_tokens(self) -> dict[int, AddedToken]:
        """{id: token} of the added tokens (the special ones, and a textual inversion's words)."""
        return self._tok.get_added_tokens_decoder()

    def expand(self, text: str) -> str:
        """`text` with each multi-vector textual-inversion token T (the added tokens T, T_1, ..., T_{n-1})
        replaced by "T T_1 ... T_{n-1}", as diffusers' `maybe_convert_prompt` does to every prompt (a plain
        string replacement, as there); any other text as it is."""
        if not self._multi:
            return text
        for token in dict.fromkeys(self._tok.encode(text, add_special_tokens=False).tokens):
            if token in self._multi:
                text = text.replace(token, self._multi[token])
        return text

    def content_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each prompt's ids without BOS/EOS and without truncation (multi-vector tokens `expand`ed)."""
        if isinstance(texts, str):
            raise TypeError("pass a list of prompts, not a single string")
        return [e.ids for e in self._tok.encode_batch([self.expand(t) for t in texts], add_special_tokens=False)]

    def _wrap(self, ids: Sequence[int]) -> list[int]:
        body = self.max_length - 2
        row = [self.bos_id, *ids[:body], self.eos_id]
        return row + [self.pad_id] * (self.max_length - len(row))

    def wrap(self, ids: Sequence[int]) -> list[int]:
        """One encoder input row of content ids: BOS, the first max_length-2 of them, EOS, pad ids."""
        return self._wrap(ids)

    def token(self, i: int) -> str:
        """The vocabulary entry of id `i`: its BPE text, `</w>` ending a word."""
        return self._tok.id_to_token(int(i))

    def encode(self, texts: Sequence[str]) -> Tokenized:
        """Padded/truncated ids and, per prompt, the truncated-away text (None when it all fit)."""
        content = self.content_ids(texts)
        ids = np.asarray([self._wrap(c) for c in content], dtype=np.int32).reshape(len(content), self.max_length)
        body = self.max_length - 2
        # Decoded as diffusers prints it (special tokens kept: with pad "!", a "!" in the prompt is one).
        truncated = [self.decode(c[body:], skip_special_tokens=False) if len(c) > body else None for c in content]
        return Tokenized(ids, truncated)

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        """(B, max_length) int32: BOS, at most max_length-2 tokens, EOS, pad ids."""
        return self.encode(texts).ids

    def chunked(self, texts: Sequence[str], num_chunks: int | None = None) -> np.ndarray:
        """(B, num_chunks, max_length) int32 for the long-prompt "chunk" mode.

        Each prompt's ids are cut into pieces of max_length-2 (75) tokens, each wrapped with BOS/EOS
        and padded like a prompt of its own; the encoder runs on each chunk and the pipeline
        concatenates the embeddings along the token axis. A prompt with fewer chunks than
        `num_chunks` (default: the most any prompt in the batch needs, at least 1) is completed with
        chunks of the empty prompt; more chunks than `num_chunks` is an SdxError.
        """
        body = self.max_length - 2
        content = self.content_ids(texts)
        pieces = [[c[i : i + body] for i in range(0, len(c), body)] or [[]] for c in content]
        n = num_chunks if num_chunks is not None else max([len(p) for p in pieces] or [1])
        out = np.empty((len(pieces), n, self.max_length), dtype=np.int32)
        for b, p in enumerate(pieces):
            if len(p) > n:
                raise SdxError(f"prompt {b} needs {len(p)} chunks of {body} tokens; at most {n} allowed")
            for j in range(n):
                out[b, j] = self._wrap(p[j] if j < len(p) else [])
        return out

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (transformers' CLIP decode: `</w>` becomes a space, ends stripped)."""
        text = self._tok.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)
        return text.replace("</w>", " ").strip()


def builtin_tokenizer_config(pad_token: str = EOS) -> dict[str, Any]:
    """tokenizer_config.json as stabilityai/stable-diffusion-xl-base-1.0 ships it (tokenizer/ for pad
    "<|endoftext|>", tokenizer_2/ for pad "!"; the `added_tokens_decoder` flags are those files')."""
    flags = dict(lstrip=False, rstrip=False, single_word=False)
    added = {
        "49406": {"content": BOS, **flags, "normalized": True, "special": False},
        "49407": {"content": EOS, **flags, "normalized": False, "special": False},
    }
    vocab, _ = builtin_vocab()
    if pad_token not in (BOS, EOS):
        if pad_token not in vocab:
            raise SdxError(f"pad token {pad_token!r} is not in CLIP's vocabulary")
        added = {str(vocab[pad_token]): {"content": pad_token, **flags, "normalized": False, "special": True}, **added}
    return {
        "add_prefix_space": False, "added_tokens_decoder": added, "additional_special_tokens": [],
        "bos_token": BOS, "clean_up_tokenization_spaces": True, "do_lower_case": True, "eos_token": EOS,
        "errors": "replace", "model_max_length": MAX_LENGTH, "pad_token": pad_token,
        "tokenizer_class": "CLIPTokenizer", "unk_token": EOS,
    }


def write_builtin_folder(path: str | Path, pad_token: str = EOS) -> Path:
    """Write the built-in tokenizer in the hub layout of the SD/SDXL repos (vocab.json, merges.txt,
    tokenizer_config.json, special_tokens_map.json), e.g. when writing a diffusers folder for a
    single-file checkpoint. Returns the folder."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    vocab, merges = builtin_vocab()
    (p / "vocab.json").write_text(json.dumps(dict(vocab), ensure_ascii=False), encoding="utf-8")
    (p / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n", encoding="utf-8")
    (p / "tokenizer_config.json").write_text(json.dumps(builtin_tokenizer_config(pad_token), indent=2) + "\n", encoding="utf-8")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": pad_token, "unk_token": EOS}
    (p / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n", encoding="utf-8")
    return p




def write_with_tokens(src: str | Path, dst: str | Path, tokens: Sequence[str]) -> tuple[Path, int]:
    """(`dst`, the first new id): a copy of the tokenizer folder `src` at `dst` with `tokens` added after
    every id it has, as
    transformers' `add_tokens` adds words (not special, normalized, nothing stripped): its
    tokenizer_config.json then lists every added token in `added_tokens_decoder`, with the named ones
    (bos, eos, unk, pad), the form transformers 5 saves. A token the tokenizer already has is an SdxError."""
    import shutil

    old = CLIPTokenizer.from_folder(src)
    known = old._tok.get_vocab()
    taken = [t for t in tokens if t in known]
    if taken:
        raise SdxError(f"the token {taken[0]!r} is already in the tokenizer's vocabulary; choose another word")
    flags = lambda t: {"content": str(t), "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                       "single_word": t.single_word, "special": t.special}
    decoder = {str(i): flags(t) for i, t in sorted(old.added_tokens().items())}
    for k, t in enumerate(tokens):
        decoder[str(old.vocab_size + k)] = flags(AddedToken(t, special=False, normalized=True))
    dst = Path(dst)
    shutil.copytree(src, dst)
    config = io.read_json(dst / "tokenizer_config.json", optional=True) or {}
    config.update(old.named, added_tokens_decoder=decoder)
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return dst, old.vocab_size


def _read_merges(path: Path) -> list[tuple[str, ...]]:
    """merges.txt: an optional `#version` header line, then one "a b" pair per line."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, UnicodeDecodeError) as e:
        raise SdxError(f"{path}: cannot read ({e})") from e
    if lines and lines[0].startswith("#version"):
        lines = lines[1:]
    return [tuple(line.split()) for line in lines if line.strip()]
