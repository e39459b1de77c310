"""The diffusers scripts' optimizer as an optax transformation: `accelerator.clip_grad_norm_(params,
max_grad_norm)` then `torch.optim.AdamW(params, lr, betas, weight_decay, eps)` stepped by the scheduler.

torch's AdamW and optax's adamw are the same update: p ← p − lr·(m̂/(√v̂ + ε) + wd·p) with m̂, v̂ the
bias-corrected moments (ε outside the square root, decoupled weight decay on every parameter, scaled by
the learning rate of the step). The clipping is torch's `clip_grad_norm_` formula, g × min(1, max_norm /
(‖g‖ + 1e-6)), not optax's clip_by_global_norm (which has no 1e-6 and leaves a norm of exactly
max_norm alone), so gradients match torch's to float32 rounding.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax


def clip_grad_norm(max_norm: float) -> optax.GradientTransformation:
    """torch.nn.utils.clip_grad_norm_: scale all gradients by min(1, max_norm / (global_norm + 1e-6))."""

    def update(updates, state, params=None):
        del params
        scale = jnp.minimum(1.0, max_norm / (optax.global_norm(updates) + 1e-6))
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


class _Transformation(abc.ABC):
    """An optax transformation described by the dataclass fields of its subclass: `init` and `update` are
    those of `transformation()`. As a value (no closures), a compiled step that applies it is keyed by its
    fields (`pipelines.executables`)."""

    @abc.abstractmethod
    def transformation(self) -> optax.GradientTransformation: ...

    def init(self, params):
        return self.transformation().init(params)

    def update(self, updates, state, params=None):
        return self.transformation().update(updates, state, params)


@dataclasses.dataclass(frozen=True)
class AdamW(_Transformation):
    """Clipping (none when max_grad_norm is None) then AdamW; `learning_rate` a float or a `train.lr`
    schedule, read with the count of updates done before this one. Defaults: the scripts' flag defaults."""

    learning_rate: float | Callable[[jax.Array], jax.Array]
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 1e-2
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def transformation(self) -> optax.GradientTransformation:
        adam = optax.adamw(self.learning_rate, b1=self.beta1, b2=self.beta2, eps=self.eps, weight_decay=self.weight_decay)
        return adam if self.max_grad_norm is None else optax.chain(clip_grad_norm(self.max_grad_norm), adam)


@dataclasses.dataclass(frozen=True)
class FrozenExcept(_Transformation):
    """`inner` on the parameters whose leaf in `frozen` (a tree of bools shaped like the parameters) is
    False; the others get a zero update and no optimizer state. This is torch's optimizer built over a
    subset of the parameters: the clipping norm is the trained parameters' alone, and weight decay never
    touches the frozen ones."""

    inner: optax.GradientTransformation | _Transformation
    frozen: Any

    def transformation(self) -> optax.GradientTransformation:
        labels = jax.tree.map(lambda f: "frozen" if f else "trained", self.frozen)
        return optax.multi_transform({"trained": self.inner, "frozen": optax.set_to_zero()}, labels)


@dataclasses.dataclass(frozen=True)
class ScaledLearningRates(_Transformation):
    """`inner`, then each parameter's update times its factor in `scales` (a tree of floats shaped like
    the parameters): torch's parameter groups with learning rates of their own under one scheduler (a group
    of learning rate lr_g steps with lr_g · schedule(t) / lr), the clipping still over every group. AdamW's
    whole update, weight decay included, is proportional to the learning rate, so the scaled update is the
    group's exactly."""

    inner: optax.GradientTransformation | _Transformation
    scales: Any

    def transformation(self) -> optax.GradientTransformation:
        def update(updates, state, params=None):
            del params
            return jax.tree.map(lambda u, f: (u * f).astype(u.dtype), updates, self.scales), state

        return optax.chain(self.inner, optax.GradientTransformation(lambda params: optax.EmptyState(), update))
