"""What every sampler shares: the noise schedule, timestep spacing, the sigma ladders, the config parser,
the state pytree and the img2img cut.

Two halves, on purpose:

* the host half (numpy, run once per generation, outside jit) turns a diffusers `scheduler_config.json`
  plus a step count into per-call tables. The training noise schedule (betas, alphas_cumprod) is rebuilt in
  float32 as diffusers builds it in torch, bit for bit (the zero-SNR rescale aside: torch's CPU sqrt is not
  always correctly rounded), because the low-noise sigmas depend on its last bit; sigmas and timesteps
  follow diffusers' numpy code; per-call coefficients are derived in float64 and stored as float32;
* the device half (jax, float32, inside `lax.scan`/`fori_loop`) is each sampler's `_update`: a few
  elementwise lines that read one table row per model call.

A sampler is a frozen dataclass (hashable: close over it or pass it as a static argument) whose fields are
the diffusers config fields it honours, with diffusers' defaults. The per-generation values live in a
`State` pytree, so a jitted loop is compiled once per (sampler config, step count, sample shape).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sdx.config import FLAG, NAME, NATURAL, Kind, check_types, is_list, is_number, optional
from sdx.errors import SdxError

# ----------------------------------------------------------------------------------------------------------
# The training noise schedule, float32 exactly as diffusers computes it in torch.


def _torch_linspace_f32(start: float, end: float, n: int) -> np.ndarray:
    """`torch.linspace(start, end, n, dtype=float32)` bit for bit: a float32 step, every point rounded once
    from `start + step * i`, the second half counted back from `end`."""
    start, end = np.float32(start), np.float32(end)
    if n == 1:
        return np.array([start])
    step = np.float64((end - start) / np.float32(n - 1))
    i = np.arange(n, dtype=np.float64)
    points = np.where(i < n // 2, np.float64(start) + step * i, np.float64(end) - step * (n - 1 - i))
    return points.astype(np.float32)


def _cumprod_f32(x: np.ndarray) -> np.ndarray:
    """torch's CPU cumprod of a float32 tensor: accumulate in float64, store float32."""
    return np.cumprod(x.astype(np.float64)).astype(np.float32)


def _cosine_betas(n: int, max_beta: float = 0.999) -> np.ndarray:
    """squaredcos_cap_v2: the cosine schedule of Nichol & Dhariwal 2021, discretised per training step."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    return np.array([min(1 - alpha_bar((i + 1) / n) / alpha_bar(i / n), max_beta) for i in range(n)], np.float32)


def _rescale_zero_terminal_snr(betas: np.ndarray) -> np.ndarray:
    """Lin et al. 2023 ("Common Diffusion Noise Schedules and Sample Steps are Flawed"), Algorithm 1:
    shift and scale sqrt(alphas_cumprod) so the last step has zero signal. float32 like diffusers."""
    sqrt_ab = np.sqrt(_cumprod_f32(1.0 - betas))
    first, last = sqrt_ab[0], sqrt_ab[-1]
    sqrt_ab = (sqrt_ab - last) * (first / (first - last))
    ab = sqrt_ab**2
    return 1.0 - np.concatenate([ab[:1], ab[1:] / ab[:-1]])


def train_sigmas(alphas_cumprod: np.ndarray) -> np.ndarray:
    """float32[T]: the noise level sqrt((1 - a) / a) of each training timestep, x_t = x0 + sigma * noise."""
    return np.sqrt((1 - alphas_cumprod) / alphas_cumprod)


def vp_from_sigma(sigma):
    """(alpha, sigma_vp) with x_vp = alpha * x0 + sigma_vp * noise for the noise level sigma."""
    alpha = 1 / np.sqrt(np.asarray(sigma, np.float64) ** 2 + 1)
    return alpha, sigma * alpha


def vp_lambda(sigma):
    """lambda = log(alpha / sigma_vp), half the log-SNR, of the noise level sigma (+inf at sigma = 0): the
    time variable of DPM-Solver and UniPC."""
    alpha, sigma_vp = vp_from_sigma(sigma)
    with np.errstate(divide="ignore"):
        return np.log(alpha) - np.log(sigma_vp)


def x0_coefficients(prediction_type: str, alpha, sigma):
    """(a, b) with x0 = a * x + b * model_output, for a sample x = alpha * x0 + sigma * noise."""
    if prediction_type == "epsilon":
        return 1 / alpha, -sigma / alpha
    if prediction_type == "v_prediction":  # v = alpha * noise - sigma * x0 (Salimans & Ho 2022)
        return alpha, -sigma
    return np.zeros_like(alpha), np.ones_like(alpha)  # "sample"


def eps_coefficients(prediction_type: str, alpha, sigma):
    """(c, d) with noise = c * x + d * model_output, for a sample x = alpha * x0 + sigma * noise."""
    if prediction_type == "epsilon":
        return np.zeros_like(alpha), np.ones_like(alpha)
    if prediction_type == "v_prediction":
        return sigma, alpha
    return 1 / sigma, -alpha / sigma  # "sample"


# ----------------------------------------------------------------------------------------------------------
# Timestep spacing (Lin et al. 2023, Table 2) and the sigma ladders.


def spaced_timesteps(spacing: str, num_train: int, n: int, steps_offset: int) -> np.ndarray:
    """float64[n], descending: which training timesteps n inference steps visit. "linspace" is not rounded
    here (the float samplers keep the fractions, the integer ones round)."""
    if spacing == "linspace":
        return np.linspace(0, num_train - 1, n)[::-1].copy()
    if spacing == "leading":
        return _within(num_train, (np.arange(n) * (num_train // n)).round()[::-1] + steps_offset, steps_offset)
    return np.arange(num_train, 0, -num_train / n).round() - 1  # "trailing"


def _within(num_train: int, timesteps: np.ndarray, steps_offset: int) -> np.ndarray:
    """`timesteps`, or an SdxError when steps_offset put one past the training schedule (diffusers: an IndexError)."""
    if len(timesteps) and timesteps.max() >= num_train:
        raise SdxError(f"scheduler config: steps_offset={steps_offset} puts timestep {int(timesteps.max())} past the "
                       f"{num_train} training timesteps")
    return timesteps


def multistep_timesteps(spacing: str, num_train: int, n: int, steps_offset: int, last: int) -> np.ndarray:
    """int64[n], descending: the spacing DPM-Solver and UniPC use, n + 1 points below `last` with the
    final 0 dropped."""
    if spacing == "linspace":
        return np.linspace(0, last - 1, n + 1).round()[::-1][:-1].astype(np.int64)
    if spacing == "leading":
        ts = (np.arange(n + 1) * (last // (n + 1))).round()[::-1][:-1].astype(np.int64) + steps_offset
        return _within(num_train, ts, steps_offset)
    return np.arange(last, 0, -num_train / n).round().astype(np.int64) - 1  # "trailing"


def karras_sigmas(sigma_min: float, sigma_max: float, n: int, rho: float = 7.0) -> np.ndarray:
    """float64[n]: Karras et al. 2022 eq. 5, noise levels evenly spaced in sigma^(1/rho)."""
    ramp = np.linspace(0, 1, n)
    lo, hi = float(sigma_min) ** (1 / rho), float(sigma_max) ** (1 / rho)
    return (hi + ramp * (lo - hi)) ** rho


SIGMA_KINDS = ("karras", "exponential", "beta")  # the `use_<kind>_sigmas` fields


def sigma_kind(sched: Scheduler) -> str | None:
    """The ladder that replaces the spaced sigmas: "karras", "exponential", "beta" (the sampler's
    `use_<kind>_sigmas` fields, at most one set) or None."""
    kinds = [kind for kind in SIGMA_KINDS if getattr(sched, f"use_{kind}_sigmas", False)]
    if len(kinds) > 1:
        raise SdxError(f"scheduler config: {type(sched).diffusers_class} sets "
                       f"{' and '.join(f'use_{k}_sigmas' for k in kinds)}; at most one of them can be true")
    return kinds[0] if kinds else None


def converted_sigmas(kind: str, sigma_min: float, sigma_max: float, n: int) -> np.ndarray:
    """float64[n], from sigma_max down to sigma_min: "karras" (Karras et al. 2022 eq. 5, rho = 7),
    "exponential" (evenly spaced in log sigma) or "beta" (Lee et al. 2024, "Beta Sampling is All You Need":
    the Beta(0.6, 0.6) quantiles of evenly spaced steps, dense at both ends)."""
    sigma_min, sigma_max = float(sigma_min), float(sigma_max)  # python floats, as diffusers' `.item()`
    if kind == "karras":
        return karras_sigmas(sigma_min, sigma_max, n)
    if kind == "exponential":
        return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), n))
    import scipy.stats  # here: scipy.stats takes a second to import, and only this ladder needs it

    quantiles = scipy.stats.beta.ppf(1 - np.linspace(0, 1, n), 0.6, 0.6)
    return sigma_min + quantiles * (sigma_max - sigma_min)


def sigma_to_t(sigmas: np.ndarray, log_sigmas: np.ndarray) -> np.ndarray:
    """float64[n]: the fractional training timestep of each sigma, interpolating log-sigma linearly.

    sigmas: float64[n]; log_sigmas: float32[T] (log of `train_sigmas`, increasing)."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma[None, :] - log_sigmas[:, None]  # [T, n]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=len(log_sigmas) - 2)
    lo, hi = log_sigmas[low], log_sigmas[low + 1]
    w = np.clip((lo - log_sigma) / (lo - hi), 0, 1)
    return (1 - w) * low + w * (low + 1)


def sigma_ladder(sched: Scheduler, n: int, *, interpolation: str = "linear", sigma_min: float | None = None,
                 sigma_max: float | None = None, final: str = "zero", round_karras: bool = False):
    """The Euler-family schedule (Euler, Heun, LMS, KDPM2 in diffusers): (timesteps float32[n], sigmas
    float32[n + 1]), the last sigma being 0 or the smallest training sigma. A `sigma_kind` ladder spans the
    spaced schedule's ends unless sigma_min/sigma_max are given; its timesteps are rounded where diffusers
    rounds Karras ones (`round_karras`)."""
    ts = spaced_timesteps(sched.timestep_spacing, sched.num_train_timesteps, n, sched.steps_offset)
    ts = ts.astype(np.float32)
    train = train_sigmas(sched.alphas_cumprod)
    if interpolation == "linear":
        sigmas = np.interp(ts, np.arange(len(train)), train)
    else:  # "log_linear": n + 1 sigmas evenly spaced in log sigma, in float32 like torch
        sigmas = np.exp(_torch_linspace_f32(np.log(train[-1]), np.log(train[0]), n + 1))
    kind = sigma_kind(sched)
    if kind:
        lo = sigmas[-1] if sigma_min is None else sigma_min
        hi = sigmas[0] if sigma_max is None else sigma_max
        sigmas = converted_sigmas(kind, lo, hi, n)
        ts = sigma_to_t(sigmas, np.log(train))
        ts = (ts.round() if round_karras and kind == "karras" else ts).astype(np.float32)
    last = train[0] if final == "sigma_min" else 0.0
    return ts, np.append(sigmas, last).astype(np.float32)


def multistep_ladder(sched: Scheduler, n: int, *, sigma_min: float | None, sigma_max: float | None, last: int,
                     round_karras: bool = True):
    """The DPM-Solver / UniPC / DEIS schedule before its final sigma: (timesteps int64[n], sigmas float64[n]).
    A `sigma_kind` ladder spans the training sigmas unless sigma_min/sigma_max are given."""
    train = train_sigmas(sched.alphas_cumprod)
    ts = multistep_timesteps(sched.timestep_spacing, sched.num_train_timesteps, n, sched.steps_offset, last)
    kind = sigma_kind(sched)
    if not kind:
        return ts, np.interp(ts, np.arange(len(train)), train)
    sigmas = converted_sigmas(kind, train[0] if sigma_min is None else sigma_min,
                              train[-1] if sigma_max is None else sigma_max, n)
    ts = sigma_to_t(sigmas, np.log(train))
    return (ts.round() if round_karras and kind == "karras" else ts).astype(np.int64), sigmas


# ----------------------------------------------------------------------------------------------------------
# The state pytree every sampler uses.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
    """Everything that changes per generation, as float32/int32 arrays (traced, never static).

    Rows of `table` line up with `timesteps`: call k of the loop (one model evaluation) reads row k.
    """

    timesteps: jax.Array  # f32[calls]: the timestep the model sees at each call
    table: dict[str, jax.Array]  # f32[calls, ...]: per-call coefficients computed on the host
    history: dict[str, jax.Array]  # f32[..., *sample.shape]: what a multistep sampler remembers
    index: jax.Array  # i32[]: calls done so far
    init_noise_sigma: jax.Array  # f32[]: text-to-image starts from noise * init_noise_sigma
    noise_scales: jax.Array  # f32[calls + 1, 2]: (signal, noise) of the forward process at each call's level,
    # x_k = noise_scales[k, 0] * x0 + noise_scales[k, 1] * noise; the last row (1, 0) is the clean end

    @property
    def timestep(self) -> jax.Array:
        """f32[]: the timestep of the next model call."""
        return self.timesteps[self.index]

    @property
    def num_calls(self) -> int:
        return self.timesteps.shape[0]


# ----------------------------------------------------------------------------------------------------------
# The sampler base class and its config parser.

_BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
_SPACINGS = ("leading", "trailing", "linspace")
# Fields that describe the model rather than the sampler: a sampler without them must not drop them.
_MODEL_FIELDS = {"rescale_betas_zero_snr": False, "timestep_type": "discrete"}
_MAX_TRAIN_TIMESTEPS = 100_000  # the tables are this long (every model: 1000)
# the JSON kind of each annotation the scheduler dataclasses use (infinities are meaningful: diffusers'
# lambda_min_clipped defaults to -inf)
_REAL: Kind = ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v))
_FIELD_KINDS: dict[str, Kind] = {
    "bool": FLAG, "int": NATURAL, "float": _REAL, "float | None": optional(_REAL), "str": NAME,
    "tuple[float, ...] | None": optional(("a non-empty list of numbers", lambda v: is_list(v, is_number))),
    "tuple[int, ...]": ("a list of integers >= 0", lambda v: isinstance(v, tuple) and all(NATURAL[1](x) for x in v)),
}


def check_field(cls: type, name: str, value: Any, allowed) -> None:
    """Refuse a config value sdx does not implement, naming the field and the value."""
    if value not in allowed:
        raise SdxError(f"scheduler config: {cls.diffusers_class} {name}={value!r} is not supported by sdx "
                       f"(supported: {', '.join(map(repr, allowed))})")


@dataclasses.dataclass(frozen=True)
class Scheduler:
    """Base of all samplers. Fields are the diffusers config fields; subclasses restate one to change its
    default to that diffusers class's default.

    Pipeline use (any sampler, one model call per loop iteration):

        state = sched.set_timesteps(num_inference_steps, latents.shape, begin=begin, end=end)
        x = noise * state.init_noise_sigma            # or sched.add_noise(state, image_latents, noise)
        for each call (lax.fori_loop over state.num_calls):
            out = model(sched.scale_model_input(state, x), state.timestep)
            state, x = sched.step(state, out, x, noise_k)   # noise_k only read if sched.stochastic
    """

    num_train_timesteps: int = 1000
    beta_start: float = 0.0001
    beta_end: float = 0.02
    beta_schedule: str = "linear"
    trained_betas: tuple[float, ...] | None = None
    prediction_type: str = "epsilon"
    timestep_spacing: str = "linspace"
    steps_offset: int = 0

    diffusers_class: ClassVar[str] = ""
    order: ClassVar[int] = 1  # model calls per inference step (diffusers' scheduler.order)
    prediction_types: ClassVar[tuple[str, ...]] = ("epsilon", "v_prediction", "sample")
    zero_snr_floor: ClassVar[bool] = False  # diffusers pins alphas_cumprod[-1] to 2**-24 after rescaling
    fixed: ClassVar[Mapping[str, tuple]] = {}  # diffusers fields sdx only takes at these values
    inert: ClassVar[frozenset[str]] = frozenset()  # diffusers fields that cannot change sdx's math
    discrete: ClassVar[bool] = True  # timesteps are training steps (EDM samplers': log noise levels)
    spaced: ClassVar[bool] = True  # timestep_spacing shapes the schedule (not LCM's, TCD's, singlestep's, EDM's)

    # -- construction ------------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Mapping[str, Any], **overrides: Any) -> Scheduler:
        """Build from a diffusers scheduler_config.json dict, as `XScheduler.from_config(config, **overrides)`
        does: fields of other scheduler classes are ignored, fields of this one are honoured or refused."""
        defaulted = set(config.get("_use_default_values", ()))
        own = {f.name for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in {**{k: v for k, v in config.items() if k not in defaulted}, **overrides}.items():
            if key.startswith("_") or key in cls.inert:
                continue
            if key in own:
                kwargs[key] = tuple(value) if isinstance(value, list) else value
            elif key in cls.fixed:
                check_field(cls, key, value, cls.fixed[key])
            elif key in _MODEL_FIELDS and value != _MODEL_FIELDS[key]:
                raise SdxError(f"scheduler config: {key}={value!r} describes the model, and {cls.diffusers_class} "
                               "cannot follow it; pick another scheduler")
        return cls(**cls._compat(kwargs))

    @classmethod
    def _compat(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Value renames diffusers applies when loading another class's config (e.g. solver_type)."""
        return kwargs

    def __post_init__(self) -> None:
        cls = type(self)
        check_types(f"scheduler config ({cls.diffusers_class})", self.__dict__,
                    {f.name: _FIELD_KINDS[f.type] for f in dataclasses.fields(self)})
        if not 2 <= self.num_train_timesteps <= _MAX_TRAIN_TIMESTEPS:
            raise SdxError(f"scheduler config: num_train_timesteps={self.num_train_timesteps} must be in "
                           f"[2, {_MAX_TRAIN_TIMESTEPS}]")
        if not (0 <= self.beta_start < 1 and 0 <= self.beta_end < 1):
            raise SdxError(f"scheduler config: beta_start={self.beta_start} and beta_end={self.beta_end} must lie "
                           "in [0, 1)")
        if self.trained_betas is not None and not all(0 < b < 1 for b in self.trained_betas):
            raise SdxError("scheduler config: trained_betas must all lie in (0, 1)")
        for name in ("sigma_min", "sigma_max"):  # the Karras ladder's ends, in the samplers that read them
            value = getattr(self, name, None)
            if value is not None and not 0 <= value < math.inf:
                raise SdxError(f"scheduler config: {name}={value} must be a finite noise level >= 0")
        check_field(cls, "beta_schedule", self.beta_schedule, _BETA_SCHEDULES)
        check_field(cls, "prediction_type", self.prediction_type, cls.prediction_types)
        check_field(cls, "timestep_spacing", self.timestep_spacing, _SPACINGS)
        sigma_kind(self)

    @functools.cached_property
    def alphas_cumprod(self) -> np.ndarray:
        """float32[num_train_timesteps]: the training schedule's cumulative product of (1 - beta)."""
        n = self.num_train_timesteps
        if self.trained_betas is not None:
            betas = np.asarray(self.trained_betas, np.float32)
        elif self.beta_schedule == "linear":
            betas = _torch_linspace_f32(self.beta_start, self.beta_end, n)
        elif self.beta_schedule == "scaled_linear":
            betas = _torch_linspace_f32(self.beta_start**0.5, self.beta_end**0.5, n) ** 2
        else:
            betas = _cosine_betas(n)
        if len(betas) != n or not np.all((betas > 0) & (betas < 1)):
            source = "trained_betas" if self.trained_betas is not None else (
                f"beta_schedule={self.beta_schedule!r}, beta_start={self.beta_start}, beta_end={self.beta_end}")
            raise SdxError(f"scheduler config: {source} gives {len(betas)} betas, not all in (0, 1); a noise "
                           f"schedule needs num_train_timesteps={n} betas strictly between 0 and 1")
        zero_snr = getattr(self, "rescale_betas_zero_snr", False)  # a field of most samplers, not all
        if zero_snr:
            betas = _rescale_zero_terminal_snr(betas)
        alphas_cumprod = _cumprod_f32(1.0 - betas)
        if zero_snr and self.zero_snr_floor:
            alphas_cumprod[-1] = 2.0**-24  # keeps the last sigma finite (4096)
        return alphas_cumprod

    # -- host: per-generation tables ----------------------------------------------------------------------

    def schedule(self, num_inference_steps: int) -> dict[str, np.ndarray]:
        """Host arrays as diffusers' `set_timesteps(num_inference_steps)` leaves them: "timesteps" (one entry
        per model call) and, for the samplers that have them, "sigmas" (one more than the calls)."""
        if not isinstance(num_inference_steps, (int, np.integer)) or num_inference_steps < 1:
            raise SdxError(f"num_inference_steps={num_inference_steps!r} must be a positive integer")
        return self._schedule(int(num_inference_steps))

    def timesteps(self, num_inference_steps: int) -> np.ndarray:
        """float32[calls]: diffusers' `scheduler.timesteps` after `set_timesteps(num_inference_steps)`."""
        return self.schedule(num_inference_steps)["timesteps"].astype(np.float32)

    def set_timesteps(self, num_inference_steps: int, shape: tuple[int, ...], begin: int = 0,
                      end: int | None = None) -> State:
        """The state for model calls [begin, end) of `timesteps(num_inference_steps)` on samples of `shape`
        (see `denoising_range` for img2img / refiner cuts). Host-side; the result is a pytree of arrays."""
        schedule = self.schedule(num_inference_steps)
        calls = len(schedule["timesteps"])
        end = calls if end is None else end
        if not 0 <= begin < end <= calls:
            raise SdxError(f"denoising range [{begin}, {end}) is empty or outside the {calls} model calls of "
                           f"{num_inference_steps} {type(self).__name__} steps")
        table = self._table(schedule, begin, end)
        return State(
            timesteps=jnp.asarray(schedule["timesteps"][begin:end], jnp.float32),
            table={k: jnp.asarray(v, jnp.float32) for k, v in table.items()},
            history={k: jnp.zeros((*n, *shape), jnp.float32) for k, n in self._history().items()},
            index=jnp.zeros((), jnp.int32),
            init_noise_sigma=jnp.asarray(self._init_noise_sigma(schedule), jnp.float32),
            noise_scales=jnp.asarray([*(self._noise_level(schedule, k) for k in range(begin, end)), (1.0, 0.0)],
                                     jnp.float32),
        )

    def _schedule(self, n: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _table(self, schedule: dict[str, np.ndarray], begin: int, end: int) -> dict[str, np.ndarray]:
        """Per-call rows for calls [begin, end), each array with leading axis end - begin."""
        raise NotImplementedError

    def _history(self) -> dict[str, tuple[int, ...]]:
        """Names and leading shapes of the sample-shaped buffers carried between calls."""
        return {}

    def _init_noise_sigma(self, schedule: dict[str, np.ndarray]) -> float:
        return 1.0

    def _noise_level(self, schedule: dict[str, np.ndarray], k: int) -> tuple[float, float]:
        """(signal, noise) scales of the forward process at call `k`: from the call's sigma where the
        schedule has sigmas (DPM-Solver, UniPC), else from alphas_cumprod at its timestep (DDIM, DDPM, PNDM)."""
        if "sigmas" in schedule:
            return vp_from_sigma(schedule["sigmas"][k])
        a = np.float64(self.alphas_cumprod[int(schedule["timesteps"][k])])
        return np.sqrt(a), np.sqrt(1 - a)

    # -- device: one model call ---------------------------------------------------------------------------

    @property
    def stochastic(self) -> bool:
        """True when `step` reads its `noise` argument."""
        return False

    def draw_noise(self, state: State, key: jax.Array, call: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        """One image's `noise` for the state's next call (float32, `shape`): `key` is the image's own
        step-noise key and `call` the call's index in the full schedule. A fresh draw from fold_in(key, call),
        unless the sampler's noise is one path over all its calls (`sdx.schedulers.dpmpp_sde`)."""
        return jax.random.normal(jax.random.fold_in(key, call), shape, jnp.float32)

    def scale_model_input(self, state: State, sample: jax.Array) -> jax.Array:
        """The model's input for the current call (the identity unless the sampler scales it)."""
        return sample

    def add_noise(self, state: State, original: jax.Array, noise: jax.Array) -> jax.Array:
        """`original` noised to the level of the state's next call, as diffusers' `scheduler.add_noise(x0,
        noise, timesteps[i])` after `set_begin_index(begin)`: at the first call the img2img start; after a
        step, the level inpainting blends the known region at (clean after the last call)."""
        signal, sigma = state.noise_scales[state.index, 0], state.noise_scales[state.index, 1]
        return (signal * original.astype(jnp.float32) + sigma * noise.astype(jnp.float32)).astype(original.dtype)

    def step(self, state: State, model_output: jax.Array, sample: jax.Array,
             noise: jax.Array | None = None) -> tuple[State, jax.Array]:
        """One model call's update: (state after the call, next sample in `sample`'s dtype). The arithmetic
        is float32 whatever the model's dtype; keep the loop's latents in float32."""
        if self.stochastic and noise is None:
            raise SdxError(f"{type(self).__name__} is stochastic: step() needs noise shaped like the sample")
        row = {k: v[state.index] for k, v in state.table.items()}
        noise = None if noise is None else noise.astype(jnp.float32)
        history, prev = self._update(row, state.history, model_output.astype(jnp.float32),
                                     sample.astype(jnp.float32), noise)
        return dataclasses.replace(state, history=history, index=state.index + 1), prev.astype(sample.dtype)

    def _update(self, row: dict[str, jax.Array], history: dict[str, jax.Array], model_output: jax.Array,
                sample: jax.Array, noise: jax.Array | None) -> tuple[dict[str, jax.Array], jax.Array]:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class SigmaScheduler(Scheduler):
    """Samplers on the variance-exploding ladder x = x0 + sigma * noise (Karras et al. 2022's ODE form):
    the model sees x / sqrt(sigma^2 + 1), text-to-image starts from noise at the top sigma. The schedule must
    hold "sigmas" with one entry per call plus the final one."""

    def _init_noise_sigma(self, schedule):
        top = np.float64(schedule["sigmas"].max())
        return top if self.timestep_spacing in ("linspace", "trailing") else np.sqrt(top**2 + 1)

    def _noise_level(self, schedule, k):
        return 1.0, schedule["sigmas"][k]

    def scale_model_input(self, state, sample):
        sigma = state.table["sigma"][state.index]
        return (sample.astype(jnp.float32) / jnp.sqrt(sigma**2 + 1)).astype(sample.dtype)

    def _denoiser(self, sigma: np.ndarray) -> dict[str, np.ndarray]:
        """Rows "sigma", "a", "b" with x0 = a * x + b * model_output at noise level sigma."""
        alpha, sigma_vp = vp_from_sigma(sigma)
        a, b = x0_coefficients(self.prediction_type, alpha, sigma_vp)
        return {"sigma": sigma, "a": a * alpha, "b": b}  # the model saw alpha * x

    def _euler_step(self, sigma: np.ndarray, sigma_to: np.ndarray) -> dict[str, np.ndarray]:
        """Rows "sigma", "c_x", "c_m": the Euler step x + (sigma_to - sigma) * (x - x0) / sigma, written as
        (sigma_to / sigma) * x + (1 - sigma_to / sigma) * x0 and expanded over x and the model output: no
        cancellation in float32 even from sigma = 4096 (zero-SNR), where x is ~1e4 and the result ~10."""
        rows = self._denoiser(sigma)
        keep = sigma_to / sigma
        return {"sigma": sigma, "c_x": keep + (1 - keep) * rows["a"], "c_m": (1 - keep) * rows["b"]}


# ----------------------------------------------------------------------------------------------------------
# img2img / refiner: which calls of the full schedule a run takes.


def denoising_range(sched: Scheduler, num_inference_steps: int, *, strength: float = 1.0,
                    denoising_start: float | None = None, denoising_end: float | None = None) -> tuple[int, int]:
    """[begin, end) of `sched.timesteps(num_inference_steps)` to run, as diffusers' img2img pipelines cut it.

    strength: StableDiffusion(XL)Img2ImgPipeline.get_timesteps: skip the first (1 - strength) of the steps.
    denoising_start: SDXL img2img/refiner: start at the first call whose timestep is below
        round(T * (1 - denoising_start)); strength is then ignored. A 2nd-order sampler (Heun) gets one call
        more when the count is even, so the run never starts between the two halves of a step.
    denoising_end: SDXL base/img2img: stop before the first call whose timestep is below
        round(T * (1 - denoising_end)).
    Pass the result to `sched.set_timesteps(num_inference_steps, shape, begin=begin, end=end)`; start from
    `sched.add_noise(state, x0, noise)` unless denoising_start is given (the refiner continues the base's
    latents as they are).
    """
    if not 0.0 <= strength <= 1.0:
        raise SdxError(f"strength={strength} must be in [0, 1]")
    for name, value in (("denoising_start", denoising_start), ("denoising_end", denoising_end)):
        if value is not None and not 0.0 < value < 1.0:
            raise SdxError(f"{name}={value} must be strictly between 0 and 1")
    if not sched.discrete and (denoising_start is not None or denoising_end is not None):
        raise SdxError(f"denoising_start / denoising_end compare timesteps with training steps; {type(sched).__name__}'s "
                       "timesteps are noise levels (EDM), so only strength can cut its schedule")
    if denoising_start is not None and denoising_end is not None and denoising_start >= denoising_end:
        raise SdxError(f"denoising_start={denoising_start} must be below denoising_end={denoising_end}")
    ts = sched.timesteps(num_inference_steps)
    T = sched.num_train_timesteps
    if denoising_start is None:
        t_start = max(num_inference_steps - min(int(num_inference_steps * strength), num_inference_steps), 0)
        begin = t_start * sched.order
    else:
        calls = int((ts < int(round(T - denoising_start * T))).sum())
        if sched.order == 2 and calls % 2 == 0:
            calls += 1
        begin = len(ts) - calls
    end = len(ts)
    if denoising_end is not None:
        end = begin + int((ts[begin:] >= int(round(T - denoising_end * T))).sum())
    if begin >= end:
        raise SdxError(f"strength={strength}, denoising_start={denoising_start}, denoising_end={denoising_end} "
                       f"leave no denoising step out of {num_inference_steps}; raise the step count or strength")
    return begin, end
