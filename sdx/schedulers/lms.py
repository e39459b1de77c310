"""LMS sampler: the linear multistep (Adams-Bashforth) method of order up to 4 on the probability-flow ODE
in sigma, as in Karras et al. 2022 / k-diffusion's `sample_lms` (Crowson): the next sample is the current
one plus the integral, from sigma_i to sigma_{i+1}, of the Lagrange polynomial through the last few
derivatives.

Matches diffusers' LMSDiscreteScheduler (order 4). diffusers integrates each Lagrange basis polynomial with
scipy.integrate.quad; here the polynomials (degree <= 3) are integrated exactly with 4-point
Gauss-Legendre quadrature on the host, once per call, into the table.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.schedulers.common import SigmaScheduler, sigma_ladder

_ORDER = 4
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(_ORDER)  # exact for polynomials of degree <= 7


def lms_coefficients(sigmas: np.ndarray, i: int, order: int) -> np.ndarray:
    """float64[order]: integral over [sigmas[i], sigmas[i+1]] of the Lagrange basis polynomials through
    sigmas[i], sigmas[i-1], ..., sigmas[i-order+1] (newest first)."""
    lo, hi = sigmas[i], sigmas[i + 1]
    tau = (hi - lo) / 2 * _NODES + (hi + lo) / 2  # quadrature points mapped onto [lo, hi]
    knots = sigmas[i - np.arange(order)]
    coeffs = np.empty(order)
    for j in range(order):
        basis = np.prod([(tau - knots[k]) / (knots[j] - knots[k]) for k in range(order) if k != j], axis=0)
        coeffs[j] = (hi - lo) / 2 * np.sum(_WEIGHTS * basis)
    return coeffs


@dataclasses.dataclass(frozen=True)
class LMS(SigmaScheduler):
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False

    diffusers_class = "LMSDiscreteScheduler"

    def _schedule(self, n):
        ts, sigmas = sigma_ladder(self, n)
        return {"timesteps": ts, "sigmas": sigmas}

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        coeffs = np.zeros((end - begin, _ORDER))
        for k, i in enumerate(range(begin, end)):
            order = min(i + 1, _ORDER)  # diffusers counts the order from the schedule's start...
            coeffs[k, :order] = lms_coefficients(sigmas, i, order)
            coeffs[k, k + 1:] = 0.0  # ...but has only the k + 1 derivatives seen since `begin`
        return {**self._denoiser(sigmas[begin:end]), "coeffs": coeffs}

    def _history(self):
        return {"derivatives": (_ORDER - 1,)}  # newest first

    def _update(self, row, history, model_output, sample, noise):
        x0 = row["a"] * sample + row["b"] * model_output
        derivatives = jnp.concatenate([((sample - x0) / row["sigma"])[None], history["derivatives"]])
        prev = sample + jnp.tensordot(row["coeffs"], derivatives, 1)
        return {"derivatives": derivatives[:-1]}, prev
