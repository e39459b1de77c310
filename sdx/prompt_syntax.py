"""Prompt weighting syntax: text -> pieces of text with weights, the two ways people write them.

A1111 (`a1111`, the Stable Diffusion web UI's `prompt_parser.parse_prompt_attention`, its rules restated):

- `(text)` multiplies the weight of `text` by 1.1, `[text]` divides it by 1.1, `(text:1.3)` multiplies it by
  1.3; brackets nest and multiply. `\\(`, `\\)`, `\\[`, `\\]` and `\\\\` are the characters themselves (a
  lone `\\` is dropped).
- Unbalanced brackets are read leniently, as the web UI reads them: a `(` or `[` never closed weighs
  everything after it; a `)` or `]` with nothing open, and a `:` that is not `:number)`, are text.
- `BREAK` (the word, upper case) ends a 75-token chunk: what follows starts the next one.
- Neighbouring pieces of equal weight are merged.
- The web UI's prompt editing (`[from:to:when]`), alternation (`[a|b]`) and composable prompts (`AND`) change
  the prompt during sampling or run several; sdx does not implement them and says so (rather than weigh their
  text).

compel (`compel`, the `compel` package's prompt language, version 2, as its pyparsing grammar reads it):

- `word+` / `word-` multiply a word by 1.1 / 0.9 per sign (`word++` = 1.21); `(words)1.3`, `(words)++`,
  `"words"0.8` and `target.attend(1.3)` weigh a group; `(words)` alone groups without weighting; groups nest
  and multiply. `\\(`, `\\)`, `\\"` are the characters.
- `("prompt one", "prompt two").and(1, 0.5)` (or `.add`): a conjunction, each part encoded on its own
  (`Conjunct`) and their conditionings concatenated, each weighted.
- What the grammar cannot read (unbalanced brackets among them) is text, as compel takes it.
- `.blend()`, `.swap()` and `useLora()` / `withLora()` are compel's too; sdx does not implement them and says so.

Both return `Piece`s, which `pipelines.text` tokenizes and encodes with their weights.
"""

from __future__ import annotations

import dataclasses
import re

from sdx.errors import SdxError

BREAK = "BREAK"


@dataclasses.dataclass(frozen=True)
class Piece:
    """Text and its weight; `a1111`'s chunk breaks are Piece(BREAK, weight=None)."""

    text: str
    weight: float | None = 1.0

    @property
    def is_break(self) -> bool:
        return self.weight is None


# --------------------------------------------------------------------------------------------------
# A1111

_A1111_TOKEN = re.compile(r"""
\\[()\[\]\\] |          # an escaped bracket or backslash
\\ |                    # a lone backslash
[(\[] |                 # an opening bracket
:([+-]?[.\d]+)\) |      # a weight closing a round bracket
[)\]] |                 # a closing bracket
[^\\()\[\]:]+ |         # text
:                       # a colon that weighs nothing
""", re.X)
_A1111_BREAK = re.compile(r"\s*\bBREAK\b\s*", re.S)
_A1111_UNSUPPORTED = re.compile(r"(?<!\\)\[[^\[\]]*[:|][^\[\]]*(?<!\\)\]|\bAND\b")


def a1111(text: str) -> list[Piece]:
    """The web UI's reading of `text`: pieces with their weights, BREAKs as `Piece(BREAK, None)`."""
    unsupported = _A1111_UNSUPPORTED.search(text)
    if unsupported:
        what = "composable prompts (AND)" if unsupported.group(0) == "AND" else (
            "alternation [a|b]" if "|" in unsupported.group(0) else "prompt editing [from:to:when]")
        raise SdxError(f"prompt {text!r}: sdx does not implement the web UI's {what} ({unsupported.group(0)!r}); "
                       "weights, brackets and BREAK it reads")
    pieces: list[list] = []  # [text, weight] while brackets are open
    round_open: list[int] = []  # where each open bracket's span starts in `pieces`
    square_open: list[int] = []

    def weigh(start: int, factor: float) -> None:
        for piece in pieces[start:]:
            if piece[1] is not None:
                piece[1] *= factor

    for m in _A1111_TOKEN.finditer(text):
        token, weight = m.group(0), m.group(1)
        if token.startswith("\\"):
            pieces.append([token[1:], 1.0])
        elif token == "(":
            round_open.append(len(pieces))
        elif token == "[":
            square_open.append(len(pieces))
        elif weight is not None and round_open:
            try:
                factor = float(weight)
            except ValueError:
                raise SdxError(f"prompt {text!r}: the weight {weight!r} in '{token}' is not a number") from None
            weigh(round_open.pop(), factor)
        elif token == ")" and round_open:
            weigh(round_open.pop(), 1.1)
        elif token == "]" and square_open:
            weigh(square_open.pop(), 1 / 1.1)
        else:  # text, and what closes nothing
            for k, part in enumerate(_A1111_BREAK.split(token)):
                if k:
                    pieces.append([BREAK, None])
                pieces.append([part, 1.0])
    for start in round_open:  # still open at the end: weighs the rest
        weigh(start, 1.1)
    for start in square_open:
        weigh(start, 1 / 1.1)
    merged: list[list] = []
    for piece in pieces or [["", 1.0]]:
        if merged and piece[1] is not None and merged[-1][1] == piece[1]:
            merged[-1][0] += piece[0]
        else:
            merged.append(list(piece))
    return [Piece(t, w) for t, w in merged]


# --------------------------------------------------------------------------------------------------
# compel


@dataclasses.dataclass(frozen=True)
class Conjunct:
    """One part of a compel conjunction: its weight and its pieces."""

    weight: float
    pieces: tuple[Piece, ...]


_SYNTACTIC = '()",.+-='
_ESCAPES = ("\\(", "\\)", '\\"', "\\,", "\\.", "\\+", "\\-", "\\=")
_UNSUPPORTED = re.compile(r"\.(blend|swap)\(|\b(useLora|withLora)\(")
_NUMBER = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)|-?\d+")


def _fragment(text: str, weight: float = 1.0) -> Piece:
    """compel's Fragment: \\( \\) \\" stand for the characters."""
    return Piece(text.replace("\\(", "(").replace("\\)", ")").replace('\\"', '"'), weight)


@dataclasses.dataclass(frozen=True)
class _Group:
    """A weighted group before flattening: its weight and its children (Pieces and _Groups)."""

    weight: float
    children: tuple


class _Compel:
    """A recursive-descent reading of compel's grammar (`compel.prompt_parser.build_parser_syntax`); each
    method takes the position and returns (node or nodes, next position) or None."""

    def __init__(self, text: str):
        self.s = text

    def ws(self, i: int) -> int:
        while i < len(self.s) and self.s[i].isspace():
            i += 1
        return i

    def word(self, i: int):
        """non_syntax_word: escapes, a sign not followed by space or syntax, any other non-syntax character."""
        s, j = self.s, i
        while j < len(s):
            if s[j:j + 2] in _ESCAPES:
                j += 2
            elif s[j] in "+-" and j + 1 < len(s) and not s[j + 1].isspace() and s[j + 1] not in _SYNTACTIC:
                j += 1
            elif not s[j].isspace() and s[j] not in _SYNTACTIC:
                j += 1
            else:
                break
        return ([_fragment(s[i:j])], j) if j > i else None

    def quoted(self, i: int, inner=None):
        """A "..." string (\\" inside it), its content read as a fragment list (or by `inner`)."""
        s = self.s
        if i >= len(s) or s[i] != '"':
            return None
        j = i + 1
        while j < len(s) and s[j] != '"':
            j += 2 if s.startswith('\\"', j) else 1
        if j >= len(s):
            return None
        content = s[i + 1:j].replace('\\"', '"').replace('"', '\\"')
        if not content.strip():
            return [_fragment("")], j + 1
        nodes = (inner or _Compel.fragments_to_end)(_Compel(content))
        return (nodes, j + 1) if nodes is not None else None

    def fragments_to_end(self):
        nodes, j = self.fragments(0)
        return nodes if self.ws(j) == len(self.s) else None

    def parenthesized(self, i: int):
        if i >= len(self.s) or self.s[i] != "(":
            return None
        nodes, j = self.fragments(i + 1)
        j = self.ws(j)
        return (nodes, j + 1) if j < len(self.s) and self.s[j] == ")" else None

    def fragments(self, i: int):
        """fragment_including_commas_or_periods: what a group holds; stops at what it cannot read."""
        nodes = []
        while True:
            k = self.ws(i)
            for alternative in (self.attention, self.parenthesized, self.quoted, self.word, self.punctuation):
                got = alternative(k)
                if got is not None:
                    nodes += got[0]
                    i = got[1]
                    break
            else:
                return nodes, i

    def punctuation(self, i: int):
        return ([_fragment(self.s[i])], i + 1) if i < len(self.s) and self.s[i] in ",." else None

    def target(self, i: int):
        return self.quoted(i) or self.parenthesized(i) or self.word(i)

    def weight_op(self, i: int):
        """+++ (1.1 each), --- (0.9 each) or a number."""
        s = self.s
        for sign, base in (("+", 1.1), ("-", 0.9)):
            if i < len(s) and s[i] == sign:
                j = i
                while j < len(s) and s[j] == sign:
                    j += 1
                return base ** (j - i), j
        m = _NUMBER.match(s, i)
        return (float(m.group(0)), m.end()) if m else None

    def attention(self, i: int):
        s = self.s
        got = self.target(i)
        if got is not None:  # target.attend(weight)
            nodes, j = got
            j = self.ws(j)
            if s.startswith(".attend", j):
                k = self.ws(j + len(".attend"))
                if k < len(s) and s[k] == "(":
                    w = self.weight_op(self.ws(k + 1))
                    if w is not None:
                        end = self.ws(w[1])
                        if end < len(s) and s[end] == ")":
                            return [_Group(w[0], tuple(nodes))], end + 1
        got = self.quoted(i) or self.parenthesized(i)  # (group)weight, "group"weight: no space before it
        if got is not None:
            nodes, j = got
            w = self.weight_op(j) if j < len(s) and not s[j].isspace() else None
            return ([_Group(w[0], tuple(nodes))], w[1]) if w is not None else None
        got = self.word(i)  # word+++ / word---
        if got is not None and got[1] < len(s) and s[got[1]] in "+-":
            w = self.weight_op(got[1])
            return [_Group(w[0], tuple(got[0]))], w[1]
        return None

    def prompt(self, i: int = 0) -> list:
        """The top level: groups and weights as in `fragments`, and any other run of non-space characters as
        text."""
        nodes = []
        while True:
            i = self.ws(i)
            if i >= len(self.s):
                return nodes
            got = self.attention(i) or self.quoted(i) or self.parenthesized(i)
            if got is None:
                j = i
                while j < len(self.s) and not self.s[j].isspace():
                    j += 1
                got = [_fragment(self.s[i:j])], j
            nodes += got[0]
            i = got[1]

    def conjunction(self):
        """("a", "b").and(w1, w2): [(weight, nodes)] of its parts, or None when the text is not one."""
        s = self.s
        i = self.ws(0)
        if i >= len(s) or s[i] != "(":
            return None
        parts, i = [], i + 1
        while True:
            i = self.ws(i)
            got = self.target(i) or self.quoted(i, inner=lambda c: c.prompt())
            if got is None:
                return None
            parts.append(got[0])
            i = self.ws(got[1])
            if i < len(s) and s[i] == ",":
                i += 1
                continue
            break
        if i >= len(s) or s[i] != ")":
            return None
        i = self.ws(i + 1)
        m = re.compile(r"\.(and|add)\s*\(([^)]*)\)").match(s, i)
        if m is None:
            return None
        options = [o.strip() for o in m.group(2).split(",") if o.strip()]
        try:
            weights = [float(o) for o in options] or [1.0] * len(parts)
        except ValueError:
            raise SdxError(f"prompt {s!r}: .{m.group(1)}() takes one weight per part, numbers") from None
        if len(weights) != len(parts):
            raise SdxError(f"prompt {s!r}: {len(parts)} parts but {len(weights)} weights in .{m.group(1)}()")
        return list(zip(weights, parts))


def _flatten(nodes, scale: float = 1.0) -> list[Piece]:
    out = []
    for node in nodes:
        if isinstance(node, _Group):
            out += _flatten(node.children, scale * node.weight)
        else:
            out.append(Piece(node.text, node.weight * scale))
    return out


def _fuse(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Neighbours of equal weight joined by a space, as compel's flatten does."""
    fused: list[Piece] = []
    for p in pieces:
        if fused and fused[-1].weight == p.weight:
            fused[-1] = Piece(fused[-1].text + " " + p.text, p.weight)
        else:
            fused.append(p)
    return tuple(fused)


def compel(text: str) -> tuple[Conjunct, ...]:
    """compel's reading of `text`: its conjunction's parts (one for a plain prompt)."""
    unsupported = _UNSUPPORTED.search(text)
    if unsupported:
        raise SdxError(f"prompt {text!r}: compel's {unsupported.group(0)[:-1].lstrip('.')}() is not supported by sdx "
                       "(weights, nesting and .and() are)")
    text = re.sub(r",(\S)", r", \1", text)
    if not text.strip():
        return (Conjunct(1.0, (Piece("", 1.0),)),)
    parser = _Compel(text)
    parts = parser.conjunction() or [(1.0, parser.prompt())]
    conjuncts = [Conjunct(w, _fuse(_flatten(nodes))) for w, nodes in parts]
    return tuple(c for c in conjuncts if c.pieces)
