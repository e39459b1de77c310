"""What the two-call samplers on the variance-exploding ladder share (KDPM2, KDPM2 ancestral, DPM++ SDE,
DPM++ 2S ancestral): each step calls the model at its start sigma, moves to an intermediate noise level,
calls the model there, and then updates from the sample the step started from. Both updates are linear:

    start = x at a step's first call, else the sample its first call saw
    x_next = c_s * start + c_x * x + c_o * model_output + std * noise

with the per-call coefficients computed on the host (`rows`), so the device update is one line for all of
them. As in diffusers, a run starts with a first call wherever it begins (img2img), and calls alternate.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.schedulers.common import SigmaScheduler, sigma_to_t, train_sigmas


def ancestral_split(sigma_from, sigma_to):
    """(sigma_down, sigma_up) of an ancestral step from sigma_from to sigma_to (eta = 1): an ODE step to
    sigma_down, then noise of std sigma_up, sigma_down^2 + sigma_up^2 = sigma_to^2 (k-diffusion's
    `get_ancestral_step`)."""
    sigma_from, sigma_to = np.asarray(sigma_from, np.float64), np.asarray(sigma_to, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.minimum(sigma_to, np.sqrt(sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2))
    up = np.where(sigma_to == 0, 0.0, up)
    return np.sqrt(sigma_to**2 - up**2), up


@dataclasses.dataclass(frozen=True)
class TwoStage(SigmaScheduler):
    order = 2
    prediction_types = ("epsilon", "v_prediction")

    def rows(self, sigma_in: np.ndarray, first: np.ndarray, *, euler_dt=None, to=None, std=None) -> dict:
        """Per-call rows from the sigma each call evaluates at (`sigma_in`, also the model input's scale) and
        whether it is a step's first call. The update is either an Euler step from `start` by `euler_dt`
        along the slope at this call, (x - x0) / sigma_in, or (`to`) the step from `start` (at sigma
        `to[0]`) to `to[1]` straight onto this call's x0: start + (1 - to[1] / to[0]) * (x0 - start)."""
        rows = self._denoiser(sigma_in)  # x0 = a * x + b * model_output
        if euler_dt is not None:
            scale = euler_dt / sigma_in
            c_s, c_x, c_o = np.ones_like(sigma_in), scale * (1 - rows["a"]), -scale * rows["b"]
        else:
            keep = to[1] / to[0]
            c_s, c_x, c_o = keep, (1 - keep) * rows["a"], (1 - keep) * rows["b"]
        return {"sigma": sigma_in, "first": first.astype(np.float64), "c_s": c_s, "c_x": c_x, "c_o": c_o,
                "std": np.zeros_like(sigma_in) if std is None else std}

    def _noise_level(self, schedule, k):  # "sigmas" holds one per step; call k is at interleaved(sigmas)[k]
        return 1.0, interleaved(schedule["sigmas"])[k]

    def _history(self):
        return {"start": ()}

    def _update(self, row, history, model_output, sample, noise):
        start = jnp.where(row["first"] > 0, sample, history["start"])
        prev = row["c_s"] * start + row["c_x"] * sample + row["c_o"] * model_output
        if self.stochastic:
            prev = prev + row["std"] * noise
        return {"start": start}, prev


def interleaved(base: np.ndarray) -> np.ndarray:
    """diffusers' [b0, b1, b1, b2, b2, ..., b_n, b_n] layout of per-step values, indexed by model call."""
    return np.concatenate([base[:1], base[1:].repeat(2), base[-1:]])


def midpoint_timesteps(sched: SigmaScheduler, ts: np.ndarray, mids: np.ndarray) -> np.ndarray:
    """float32[2n - 1]: [t0, t(mid_0), t1, t(mid_1), ..., t_{n-1}]: the step timesteps with the fractional
    training timestep of each midpoint sigma between them."""
    t_mid = sigma_to_t(mids, np.log(train_sigmas(sched.alphas_cumprod)))
    return np.stack([ts, np.append(t_mid, 0)], axis=1).reshape(-1)[:-1].astype(np.float32)


def log_midpoints_f32(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """float32: exp of the mean of the logs, as diffusers' torch `start.log().lerp(end.log(), 0.5).exp()` on
    float32 tensors (lerp at weight 1/2: end - (end - start) / 2); 0 where `end` is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        log_start, log_end = np.log(start.astype(np.float32)), np.log(end.astype(np.float32))
        return np.exp(log_end - (log_end - log_start) * np.float32(0.5))


def first_calls(begin: int, end: int) -> np.ndarray:
    """bool[end - begin]: which calls of a run start a step (the run's first, then every other)."""
    return (np.arange(begin, end) - begin) % 2 == 0
