"""UniPC sampler: Zhao, Bai, Rao, Zhou & Lu 2023, "UniPC: A Unified Predictor-Corrector Framework for Fast
Sampling of Diffusion Models", Algorithms 1-3: a multistep UniP predictor of order p, and a UniC corrector
that reuses the model call at the new point to raise the previous step's accuracy by one order, for free.
B(h) is h ("bh1") or e^h - 1 ("bh2"); predict_x0 chooses the data-prediction (default) or noise form.

Matches diffusers' UniPCMultistepScheduler (solver_p unsupported). Both updates are linear in the sample
and the stored model-output conversions, so their weights (including the small rho linear solves) are
computed on the host per call and the device update is two weighted sums.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.errors import SdxError
from sdx.schedulers.common import (
    Scheduler,
    check_field,
    eps_coefficients,
    multistep_ladder,
    sigma_kind,
    train_sigmas,
    vp_from_sigma,
    vp_lambda,
    x0_coefficients,
)


def unipc_coefficients(sigmas: np.ndarray, t: int, s: list[int], order: int, corrector: bool,
                       predict_x0: bool, bh1: bool) -> tuple[float, np.ndarray]:
    """Weights of one UniP (corrector=False) or UniC (corrector=True) update from sigmas[s[0]] to sigmas[t].

    s: indices of the stored model-output conversions m0 (at s[0], newest), m1, ... The result is
    (c_x, c) with x_t = c_x * x_{s0} + sum_j c[j] * m_j, where c[order] weighs the conversion at t itself
    (the new model call, used by UniC only)."""
    lam_t, lam_s0 = vp_lambda(sigmas[t]), vp_lambda(sigmas[s[0]])
    alpha_t, sigma_t = vp_from_sigma(sigmas[t])
    alpha_s0, sigma_s0 = vp_from_sigma(sigmas[s[0]])
    h = lam_t - lam_s0
    hh = -h if predict_x0 else h
    h_phi_1 = np.expm1(hh)
    b_h = hh if bh1 else np.expm1(hh)
    rks = np.array([(vp_lambda(sigmas[s[j]]) - lam_s0) / h for j in range(1, order)] + [1.0])
    # rho: the paper's weights on the divided differences D_j = (m_j - m0) / r_j (and D_t = m_t - m0)
    if (order == 1 and corrector) or (order == 2 and not corrector):
        rhos = np.array([0.5])
    elif order == 1:
        rhos = np.zeros(0)
    else:  # solve R rho = b, b_k = k! * phi_{k+1}(hh) / B(h), phi_{k+1} = phi_k / hh - 1 / k!
        b, h_phi_k, factorial = [], h_phi_1 / hh - 1, 1
        for k in range(1, order + 1):
            b.append(h_phi_k * factorial / b_h)
            factorial *= k + 1
            h_phi_k = h_phi_k / hh - 1 / factorial
        R = np.stack([rks ** (k - 1) for k in range(1, order + 1)])  # [order, order]
        rhos = np.linalg.solve(R, b) if corrector else np.linalg.solve(R[:-1, :-1], b[:-1])
    # x_t = c_x x - scale h_phi_1 m0 - scale B(h) (sum_j rho_j D_j [+ rho_t D_t])
    scale = alpha_t if predict_x0 else sigma_t
    c_x = sigma_t / sigma_s0 if predict_x0 else alpha_t / alpha_s0
    c = np.zeros(order + 1)  # weights on m0 .. m_{order-1}, then m_t
    c[0] = -scale * h_phi_1
    for j in range(1, order):
        w = -scale * b_h * rhos[j - 1] / rks[j - 1]
        c[j] += w
        c[0] -= w
    if corrector:
        w = -scale * b_h * rhos[-1]
        c[order] += w
        c[0] -= w
    return c_x, c


@dataclasses.dataclass(frozen=True)
class UniPC(Scheduler):
    solver_order: int = 2
    predict_x0: bool = True
    solver_type: str = "bh2"
    lower_order_final: bool = True
    disable_corrector: tuple[int, ...] = ()
    use_karras_sigmas: bool = False
    use_exponential_sigmas: bool = False
    use_beta_sigmas: bool = False
    sigma_min: float | None = None
    sigma_max: float | None = None
    final_sigmas_type: str = "zero"
    rescale_betas_zero_snr: bool = False

    diffusers_class = "UniPCMultistepScheduler"
    zero_snr_floor = True
    fixed = {"thresholding": (False, None), "solver_p": (None,), "use_flow_sigmas": (False, None),
             "use_dynamic_shifting": (False, None), "shift_terminal": (None,)}
    inert = frozenset({"dynamic_thresholding_ratio", "sample_max_value", "flow_shift", "time_shift_type"})

    @classmethod
    def _compat(cls, kwargs):
        if kwargs.get("solver_type") in ("midpoint", "heun", "logrho"):  # diffusers' rename for DPM configs
            kwargs["solver_type"] = "bh2"
        return kwargs

    def __post_init__(self):
        super().__post_init__()
        cls = type(self)
        check_field(cls, "solver_type", self.solver_type, ("bh1", "bh2"))
        check_field(cls, "solver_order", self.solver_order, (1, 2, 3))
        check_field(cls, "final_sigmas_type", self.final_sigmas_type, ("zero", "sigma_min"))
        if self.final_sigmas_type == "zero" and (self.solver_type == "bh1" or not self.predict_x0):
            raise SdxError(f"scheduler config: UniPCMultistepScheduler solver_type={self.solver_type!r} with "
                           f"predict_x0={self.predict_x0} steps to sigma = 0 through 0 * inf (diffusers returns NaN "
                           "there); set final_sigmas_type='sigma_min' or use solver_type='bh2', predict_x0=true")

    def _schedule(self, n):
        ts, sigmas = multistep_ladder(self, n, sigma_min=self.sigma_min,
                                      sigma_max=self.sigma_max, last=self.num_train_timesteps)
        if self.final_sigmas_type == "zero":
            final = 0.0
        else:  # the smallest sigma of the ladder: the Karras end, or the first training sigma
            final = sigmas[-1] if sigma_kind(self) else train_sigmas(self.alphas_cumprod)[0]
        return {"timesteps": ts, "sigmas": np.append(sigmas, final).astype(np.float32)}

    def _table(self, schedule, begin, end):
        sigmas = schedule["sigmas"].astype(np.float64)
        calls, p = len(schedule["timesteps"]), self.solver_order
        rows = {"c_x": np.zeros(end - begin), "c_m": np.zeros((end - begin, p)),  # predictor
                "u_x": np.ones(end - begin), "u_last": np.zeros(end - begin),  # corrector
                "u_m": np.zeros((end - begin, p)), "u_t": np.zeros(end - begin)}
        prev_order = 0
        for k, i in enumerate(range(begin, end)):
            if k > 0 and i - 1 not in self.disable_corrector:  # correct the previous step with this call
                c_x, c = unipc_coefficients(sigmas, i, [i - 1 - j for j in range(prev_order)], prev_order,
                                            True, self.predict_x0, self.solver_type == "bh1")
                rows["u_x"][k], rows["u_last"][k] = 0.0, c_x
                rows["u_m"][k, :prev_order], rows["u_t"][k] = c[:-1], c[-1]
            order = min(min(p, calls - i) if self.lower_order_final else p, k + 1)
            c_x, c = unipc_coefficients(sigmas, i + 1, [i - j for j in range(order)], order, False,
                                        self.predict_x0, self.solver_type == "bh1")
            rows["c_x"][k], rows["c_m"][k, :order] = c_x, c[:-1]
            prev_order = order
        alpha, sigma_vp = vp_from_sigma(sigmas[begin:end])
        convert = x0_coefficients if self.predict_x0 else eps_coefficients
        rows["a"], rows["b"] = convert(self.prediction_type, alpha, sigma_vp)
        return rows

    def _history(self):
        return {"m": (self.solver_order,), "last_sample": ()}  # earlier conversions, newest first

    def _update(self, row, history, model_output, sample, noise):
        m_t = row["a"] * sample + row["b"] * model_output  # converted from the uncorrected sample
        corrected = (row["u_x"] * sample + row["u_last"] * history["last_sample"] + row["u_t"] * m_t
                     + jnp.tensordot(row["u_m"], history["m"], 1))
        m = jnp.concatenate([m_t[None], history["m"][:-1]])
        prev = row["c_x"] * corrected + jnp.tensordot(row["c_m"], m, 1)
        return {"m": m, "last_sample": corrected}, prev
