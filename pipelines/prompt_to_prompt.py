"""Prompt-to-prompt editing (Hertz et al. 2022, "Prompt-to-Prompt Image Editing with Cross Attention
Control", arXiv:2208.01626), built on `sdx.interventions` alone: an example of what a researcher's own
processors do, in one file.

A source prompt and its edit are generated side by side from the same noise, in one batch (image 0 the
source, image 1 the edit). For the first `cross` share of the model calls, the edit's cross-attention
probabilities are the source's, mapped onto the edit's tokens; for the first `self_` share its self-attention
probabilities (of maps of at most 16 x 16 positions) are the source's too, so the picture keeps the source's
layout while the words change what is drawn. Three edits, as in the paper:

- word swap (`word_swap`): "a red circle ..." -> "a red square ...": every token takes the source's maps;
- refinement (`refinement`): words added to the prompt keep their own maps, the others take the source's;
- reweighting (`reweight`): one prompt, one word's maps scaled by a factor.

Only the prompt branch's rows are edited (classifier-free guidance's negative rows keep their own
attention, as the paper's code does).

    pipe = Pipeline.load("default")
    edit = word_swap(pipe, "a red circle on a blue background", "a red square on a blue background")
    source, edited = pipe(edit_request(pipe, edit, seed=0))
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pipelines import guidance
from pipelines.family import TOKENIZER_OF
from pipelines.request import Request
from sdx.errors import SdxError
from sdx.interventions import AttentionCall, Intervention, Interventions, Processor

SELF_POSITIONS = 16 * 16  # self-attention maps of at most this many positions take the source's (the paper's)


@dataclasses.dataclass(frozen=True)
class _Edit(Processor):
    """The shared part of both processors: the prompt branch's rows of images 1.. take image 0's
    probabilities, transformed by `change`, while `share < until`."""

    branches: int
    text_branch: int
    until: float
    traced: ClassVar[tuple[str, ...]] = ("until",)

    def change(self, source: jax.Array, own: jax.Array) -> jax.Array:
        raise NotImplementedError

    def edited(self, call: AttentionCall, p: jax.Array) -> jax.Array:
        """p (rows, heads, T, S) with the edit's prompt rows replaced while the edit runs."""
        rows = p.reshape(-1, self.branches, *p.shape[1:])  # (images, branches, heads, T, S)
        text = rows[:, self.text_branch]  # (images, heads, T, S)
        new = jnp.concatenate([text[:1], self.change(text[:1], text[1:])], axis=0)
        on = call.share < self.until
        return rows.at[:, self.text_branch].set(jnp.where(on, new, text)).reshape(p.shape)

    def __call__(self, call: AttentionCall) -> jax.Array:
        p = call.probabilities(call.query(), call.k)
        return call.output(call.mix(self.edited(call, p), call.v))


@dataclasses.dataclass(frozen=True)
class CrossEdit(_Edit):
    """Cross-attention: the source's maps in the edit's token order (`mapper` (S, S): source token s feeds
    edit token t with weight mapper[s, t]), times `weights` (S,), where `alpha` (S,) is 1; the edit's own where
    it is 0."""

    mapper: jax.Array = None
    alpha: jax.Array = None
    weights: jax.Array = None
    traced: ClassVar[tuple[str, ...]] = ("until", "mapper", "alpha", "weights")

    def change(self, source, own):
        mapped = jnp.einsum("bhts,su->bhtu", source, self.mapper.astype(source.dtype)) * self.weights
        return self.alpha * mapped + (1 - self.alpha) * own


@dataclasses.dataclass(frozen=True)
class SelfEdit(_Edit):
    """Self-attention: the source's maps, for maps of at most `SELF_POSITIONS` positions."""

    def change(self, source, own):
        return jnp.broadcast_to(source, own.shape)

    def __call__(self, call: AttentionCall) -> jax.Array:
        return call.proceed() if call.h.shape[1] > SELF_POSITIONS else super().__call__(call)


@dataclasses.dataclass(frozen=True)
class PromptToPrompt(Intervention):
    """An edit of a source prompt (image 0) into another (image 1): token mapper (S, S), alpha (S,), weights (S,)
    (see `CrossEdit`), cross and self_: the shares of the model calls during which the edit's cross- and
    self-attention take the source's. The guidance layout (`branches`, `text_branch`) is the request's
    guider's (`edit_request`). prompts: (source, edited), which `edit_request` moves into the request (left
    None there, every edit of one layout runs the same compiled programs: the rest is traced)."""

    mapper: np.ndarray
    alpha: np.ndarray
    weights: np.ndarray
    cross: float = 0.8
    self_: float = 0.4
    branches: int = 2
    text_branch: int = 1
    prompts: tuple[str, str] | None = None
    traced: ClassVar[tuple[str, ...]] = ("mapper", "alpha", "weights", "cross", "self_")

    def install(self, unet) -> Interventions:
        layout = (self.branches, self.text_branch)
        cross = CrossEdit(*layout, self.cross, self.mapper, self.alpha, self.weights)
        own = SelfEdit(*layout, self.self_)
        return Interventions(attention={path: (cross if kind == "cross" else own,)
                                        for path, kind in unet.sites().items() if kind in ("self", "cross")})

    def check(self, request, pipe) -> None:
        if len(request.prompts) != 2 or request.num_images_per_prompt != 1 or (request.batch_size or 0) < 2:
            raise SdxError("prompt-to-prompt: generate the source and the edited prompt, one image each, in one batch "
                           "(edit_request)")


def _words(tokenizer, prompt: str) -> list[list[int]]:
    """Each word's token positions in the text context (position 0 is the start token)."""
    spans, at = [], 1
    for word in prompt.split():
        n = len(tokenizer.content_ids([word])[0])
        spans.append(list(range(at, at + n)))
        at += n
    if at - 1 != len(tokenizer.content_ids([prompt])[0]):
        raise SdxError(f"prompt-to-prompt: {prompt!r} tokenizes differently word by word")
    if at >= tokenizer.max_length:
        raise SdxError(f"prompt-to-prompt: {prompt!r} is longer than one 77-token chunk")
    return spans


def _edit(pipe, source: str, target: str, pairs, kept, weights=None, **shares) -> PromptToPrompt:
    """The PromptToPrompt whose mapper joins source word i's tokens to target word j's for each (i, j) of
    `pairs` (a target token takes the mean of its source word's), `kept`: the target words that take the
    source's maps; the start token and the tail (end token, padding) are joined in order."""
    tokenizer = pipe.tokenizers[TOKENIZER_OF[pipe.family.encoders[0]]]
    s_words, t_words = _words(tokenizer, source), _words(tokenizer, target)
    n = tokenizer.max_length
    mapper, alpha = np.zeros((n, n), np.float32), np.zeros(n, np.float32)
    mapper[0, 0] = alpha[0] = 1.0
    for i, j in pairs:
        for t in t_words[j]:
            mapper[s_words[i], t] = 1.0 / len(s_words[i])
    for j in kept:
        alpha[t_words[j]] = 1.0
    s_end, t_end = s_words[-1][-1] + 1, t_words[-1][-1] + 1  # the end tokens
    for t in range(t_end, n):
        mapper[min(t - t_end + s_end, n - 1), t] = 1.0
    alpha[t_end:] = 1.0
    w = np.ones(n, np.float32) if weights is None else weights
    return PromptToPrompt(mapper, alpha, w, **shares, prompts=(source, target))


def word_swap(pipe, source: str, target: str, **shares) -> PromptToPrompt:
    """Word swap: prompts of as many words; every token takes the source's maps."""
    n = len(source.split())
    if len(target.split()) != n:
        raise SdxError("prompt-to-prompt word swap: the prompts need as many words (use refinement for added words)")
    return _edit(pipe, source, target, [(i, i) for i in range(n)], range(n), **shares)


def refinement(pipe, source: str, target: str, **shares) -> PromptToPrompt:
    """Refinement: `target` is `source` with words added; the source's words keep its maps, the added ones
    their own."""
    s, t = source.split(), target.split()
    pairs, i = [], 0
    for j, word in enumerate(t):
        if i < len(s) and word == s[i]:
            pairs.append((i, j))
            i += 1
    if i != len(s):
        raise SdxError("prompt-to-prompt refinement: the target must hold the source's words in order")
    return _edit(pipe, source, target, pairs, [j for _, j in pairs], **shares)


def reweight(pipe, prompt: str, word: str, factor: float, **shares) -> PromptToPrompt:
    """Reweighting: `prompt` against itself, the maps of `word` times `factor`."""
    words = prompt.split()
    if word not in words:
        raise SdxError(f"prompt-to-prompt reweight: {word!r} is not a word of {prompt!r}")
    tokenizer = pipe.tokenizers[TOKENIZER_OF[pipe.family.encoders[0]]]
    weights = np.ones(tokenizer.max_length, np.float32)
    weights[_words(tokenizer, prompt)[words.index(word)]] = factor
    n = len(words)
    return _edit(pipe, prompt, prompt, [(i, i) for i in range(n)], range(n), weights, **shares)


def edit_request(pipe, edit: PromptToPrompt, **fields) -> Request:
    """The request that generates `edit`'s two prompts side by side in one batch, both from image 0's initial
    noise for the request's seed (unless `fields` gives `latents`), with the guidance layout of its guider;
    the pipeline's defaults (`Pipeline.complete`) for what `fields` leaves open. A deterministic sampler keeps
    the two on the same path (a stochastic one draws each image's step noise from its own key)."""
    request = pipe.complete(Request(prompts=list(edit.prompts), batch_size=2, **fields))
    guider = guidance.of_request(pipe.family, request.guidance_scale, request.image_guidance_scale, request.guidance)
    edit = dataclasses.replace(edit, branches=guider.branches, text_branch=guider.text_branch, prompts=None)
    request = dataclasses.replace(request, interventions=(*request.interventions, edit))
    if request.latents is not None:
        return request
    h, w = request.height // pipe.factor, request.width // pipe.factor
    noise = jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(request.seed), 0), (h, w, pipe.channels))
    return dataclasses.replace(request, latents=np.asarray(noise).transpose(2, 0, 1)[None])  # (1, C, h, w)
