"""PNDM / PLMS sampler: Liu, Ren, Lin & Zhao 2022, "Pseudo Numerical Methods for Diffusion Models on
Manifolds". Every update is the "transfer" part (their eq. 11, the DDIM-like move between two
alphas_cumprod) applied to a combination of noise predictions: pseudo Runge-Kutta (PRK, 4 calls per step)
for the first three steps, then the linear multistep (PLMS, Adams-Bashforth) formulas of order 1-4. With
skip_prk_steps (what Stable Diffusion configs set) the warm-up is a 2nd-order pseudo-improved-Euler step.

Matches diffusers' PNDMScheduler. Its per-call bookkeeping (which prediction goes into the history, which
sample a call starts from, the Runge-Kutta accumulator) depends only on the call counter, so the host
turns it into table rows and the device update is branch-free.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sdx.schedulers.common import Scheduler, eps_coefficients, spaced_timesteps

# Adams-Bashforth weights on the noise history, newest first, by the number of predictions in it
_PLMS = {1: [1.0], 2: [3 / 2, -1 / 2], 3: [23 / 12, -16 / 12, 5 / 12], 4: [55 / 24, -59 / 24, 37 / 24, -9 / 24]}


@dataclasses.dataclass(frozen=True)
class PNDM(Scheduler):
    skip_prk_steps: bool = False
    set_alpha_to_one: bool = False
    timestep_spacing: str = "leading"

    diffusers_class = "PNDMScheduler"
    prediction_types = ("epsilon", "v_prediction")

    def _schedule(self, n):
        T = self.num_train_timesteps
        steps = spaced_timesteps(self.timestep_spacing, T, n, self.steps_offset).round()[::-1].astype(np.int64)
        if self.skip_prk_steps:  # every timestep once, the second-to-last twice (the warm-up's corrector)
            prk, plms = steps[:0], np.concatenate([steps[:-1], steps[-2:-1], steps[-1:]])[::-1]
        else:  # 3 Runge-Kutta steps of 4 calls each over the top 4 timesteps, at t, t - h/2, t - h/2, t - h
            half = np.tile([0, T // n // 2], 4)
            prk, plms = (steps[-4:].repeat(2) + half)[:-1].repeat(2)[1:-1][::-1], steps[:-3][::-1]
        return {"timesteps": np.concatenate([prk, plms]).astype(np.int64), "prk": prk, "ratio": np.array(T // n)}

    def _table(self, schedule, begin, end):
        ratio, prk = int(schedule["ratio"]), schedule["prk"]
        acp = self.alphas_cumprod.astype(np.float64)
        final = 1.0 if self.set_alpha_to_one else acp[0]
        rows = []
        stored = 0  # predictions in diffusers' `ets` list
        for counter, t in enumerate(schedule["timesteps"][begin:end]):
            t = int(t)
            row = dict(push=0.0, w_out=0.0, w_ets=np.zeros(4), w_acc=0.0, acc_keep=1.0, acc_add=0.0,
                       save=0.0, from_saved=0.0)
            if counter < len(prk):  # pseudo Runge-Kutta: k1..k4 at t, t - h/2, t - h/2, t - h
                phase = counter % 4
                prev_t, t = t - (0 if counter % 2 else ratio // 2), int(prk[counter // 4 * 4])
                row.update(from_saved=1.0, w_out=1.0)
                if phase == 0:
                    row.update(push=1.0, save=1.0, acc_add=1 / 6)
                    stored += 1
                elif phase in (1, 2):
                    row.update(acc_add=1 / 3)
                else:  # (k1 + 2 k2 + 2 k3 + k4) / 6, then reset the accumulator
                    row.update(w_out=1 / 6, w_acc=1.0, acc_keep=0.0)
            else:  # linear multistep
                prev_t = t - ratio
                if counter == 1:  # the warm-up's corrector: redo step 0 with the mean of both predictions
                    prev_t, t = t, t + ratio
                    row.update(w_out=0.5, from_saved=1.0)
                    row["w_ets"][0] = 0.5
                else:
                    row["push"] = 1.0
                    stored = min(stored + 1, 4)
                    row["w_ets"][:stored] = _PLMS[stored]
                    row["save"] = float(counter == 0)
            a_t, a_prev = acp[t], (acp[prev_t] if prev_t >= 0 else final)
            c, d = eps_coefficients(self.prediction_type, np.sqrt(a_t), np.sqrt(1 - a_t))
            denom = a_t * np.sqrt(1 - a_prev) + np.sqrt(a_t * (1 - a_t) * a_prev)
            row.update(c=c, d=d, sample_scale=np.sqrt(a_prev / a_t), eps_scale=-(a_prev - a_t) / denom)
            rows.append(row)
        return {k: np.array([r[k] for r in rows], np.float64) for k in rows[0]}

    def _history(self):
        return {"ets": (4,), "saved": (), "acc": ()}

    def _update(self, row, history, model_output, sample, noise):
        ets = jnp.where(row["push"] > 0, jnp.concatenate([model_output[None], history["ets"][:-1]]), history["ets"])
        out = row["w_out"] * model_output + jnp.tensordot(row["w_ets"], ets, 1) + row["w_acc"] * history["acc"]
        saved = jnp.where(row["save"] > 0, sample, history["saved"])
        start = jnp.where(row["from_saved"] > 0, saved, sample)
        eps = row["c"] * start + row["d"] * out  # v-prediction is converted after combining, as diffusers does
        acc = row["acc_keep"] * history["acc"] + row["acc_add"] * model_output
        return {"ets": ets, "saved": saved, "acc": acc}, row["sample_scale"] * start + row["eps_scale"] * eps
