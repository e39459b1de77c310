"""Learning-rate schedules: the curves of diffusers' `get_scheduler` (diffusers/optimization.py) as optax
schedules `count -> lr`, jittable, float32.

Step convention: `count` is the number of optimizer steps done before this one (optax's count: 0 for
the first update), and the schedule returns the learning rate that update uses. That is what the
diffusers scripts' LambdaLR gives optimizer step `count` (`lr_scheduler.get_last_lr()` read before
`optimizer.step()`; the lambda is evaluated at the number of `lr_scheduler.step()` calls so far), so
with warm-up the first update has learning rate 0, as in diffusers.

The one difference, on purpose: diffusers' scripts build the schedule with
`num_warmup_steps=lr_warmup_steps * num_processes` and `num_training_steps=max_train_steps *
num_processes`, because accelerate's scheduler wrapper steps it once per process per optimizer step.
sdx counts optimizer steps whatever the number of devices, so `warmup_steps` and `total_steps` here are
the flags' values as given, and the curve over optimizer steps is the one diffusers draws on one process.

Curves (multipliers of the peak rate; W = warmup_steps, T = total_steps, k = count):
  constant              1
  constant_with_warmup  k/W for k < W, then 1
  linear                k/W, then max(0, (T − k)/(T − W))
  cosine                k/W, then max(0, ½(1 + cos(π·2·0.5·progress))), progress = (k − W)/(T − W)
                        (diffusers' get_scheduler passes no num_cycles to it: always a half cosine)
  cosine_with_restarts  k/W, then 0 once progress ≥ 1, else ½(1 + cos(π·((num_cycles·progress) mod 1)))
  polynomial            k/W, then (peak − lr_end)(1 − (k − W)/(T − W))^power + lr_end; lr_end after T
  piecewise_constant    step_rules "m1:s1,m2:s2,...,m_last": m_i while k < s_i (first matching boundary
                        in increasing order), else m_last
Denominators are max(1, ·) as in diffusers.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from sdx.errors import SdxError

# what each curve reads besides the peak rate: the others keep their defaults, so that runs differing only in
# them (a constant rate with another --max_train_steps) have equal schedules, and the same compiled step
READS = {
    "constant": (),
    "constant_with_warmup": ("warmup_steps",),
    "linear": ("warmup_steps", "total_steps"),
    "cosine": ("warmup_steps", "total_steps"),
    "cosine_with_restarts": ("warmup_steps", "total_steps", "num_cycles"),
    "polynomial": ("warmup_steps", "total_steps", "power", "lr_end"),
    "piecewise_constant": ("step_rules",),
}
SCHEDULES = tuple(READS)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A learning-rate curve as a value (`schedule` makes it): called with optax's count, it gives the
    float32 rate. Being a plain dataclass of numbers, a compiled training step that reads it is keyed by
    its fields (`pipelines.executables`)."""

    name: str
    learning_rate: float
    warmup_steps: int = 0
    total_steps: int | None = None
    num_cycles: int = 1
    power: float = 1.0
    lr_end: float = 1e-7
    step_rules: str | None = None

    def __call__(self, count: jax.Array) -> jax.Array:
        k = jnp.asarray(count).astype(jnp.float32)
        return (self.learning_rate * self._multiplier(k)).astype(jnp.float32)

    def _multiplier(self, k):  # k: f32 scalar
        name, W, T = self.name, self.warmup_steps, self.total_steps
        warmup = k / max(1.0, W)
        span = max(1, (T or 0) - W)
        if name == "constant":
            return jnp.ones_like(k)
        if name == "constant_with_warmup":
            return jnp.where(k < W, warmup, 1.0)
        if name == "linear":
            return jnp.where(k < W, warmup, jnp.maximum(0.0, (T - k) / span))
        progress = (k - W) / span
        if name == "cosine":
            after = jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(math.pi * 0.5 * 2.0 * progress)))
        elif name == "cosine_with_restarts":
            after = jnp.where(progress >= 1.0, 0.0,
                              jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(math.pi * jnp.mod(self.num_cycles * progress, 1.0)))))
        elif name == "polynomial":
            remaining = jnp.maximum(1.0 - progress, 0.0)
            lr = jnp.where(k > T, self.lr_end, (self.learning_rate - self.lr_end) * remaining**self.power + self.lr_end)
            return jnp.where(k < W, warmup, lr / self.learning_rate)
        else:  # piecewise_constant: no warm-up, as diffusers
            rules, last = _parse_rules(self.step_rules)
            after = jnp.full_like(k, last)
            for boundary, value in reversed(rules):
                after = jnp.where(k < boundary, value, after)
            return after
        return jnp.where(k < W, warmup, after)


def scale_lr(learning_rate: float, accumulation: int, batch_size: int, devices: int) -> float:
    """diffusers' --scale_lr: learning_rate × gradient_accumulation_steps × train_batch_size × processes.
    batch_size is per device (--train_batch_size), devices the number of data-parallel devices, so the
    product is the number of samples in one optimizer step."""
    return learning_rate * accumulation * batch_size * devices


def _parse_rules(step_rules: str) -> tuple[list[tuple[int, float]], float]:
    """diffusers' step_rules string -> ([(boundary, multiplier)] sorted by boundary, last multiplier)."""
    try:
        *rules, last = step_rules.split(",")
        table = {}
        for rule in rules:
            value, steps = rule.split(":")
            table[int(steps)] = float(value)
        return sorted(table.items()), float(last)
    except ValueError:
        raise SdxError(f"step_rules {step_rules!r}: expected 'multiplier:step,...,multiplier', "
                       "e.g. '1:10,0.1:20,0.01'") from None


def schedule(name: str, learning_rate: float, *, warmup_steps: int = 0, total_steps: int | None = None,
             num_cycles: int = 1, power: float = 1.0, lr_end: float = 1e-7, step_rules: str | None = None) -> Schedule:
    """The optax schedule `count -> f32 lr` of diffusers' `get_scheduler(name, ...)` with peak
    `learning_rate` (see the module docstring for the curves and the step convention), checked."""
    if name not in SCHEDULES:
        raise SdxError(f"unknown learning-rate schedule {name!r} (choose from {', '.join(SCHEDULES)})")
    if warmup_steps < 0:
        raise SdxError(f"lr_warmup_steps must be >= 0, got {warmup_steps}")
    if "total_steps" in READS[name] and total_steps is None:
        raise SdxError(f"the {name} learning-rate schedule needs the number of training steps")
    if name == "polynomial":
        if not learning_rate > lr_end:
            raise SdxError(f"polynomial schedule: lr_end ({lr_end}) must be smaller than the learning rate "
                           f"({learning_rate})")
        if total_steps <= warmup_steps:
            raise SdxError(f"polynomial schedule: max_train_steps ({total_steps}) must exceed lr_warmup_steps "
                           f"({warmup_steps})")
    if name == "piecewise_constant":
        if step_rules is None:
            raise SdxError("the piecewise_constant learning-rate schedule needs step_rules")
        _parse_rules(step_rules)  # refuse a malformed string now, not at trace time
    given = dict(warmup_steps=warmup_steps, total_steps=total_steps, num_cycles=num_cycles, power=power, lr_end=lr_end,
                 step_rules=step_rules)
    return Schedule(name, learning_rate, **{k: given[k] for k in READS[name]})
