"""The model a sampler step calls: the UNet with the request's conditioning plug-ins at one model call.

k-diffusion's samplers are short because everything about the model sits behind one `model(x, sigma)`. Here
that boundary is `Denoiser`: assembled for each model call from the UNet, its text context (the projections
prepare made, the interventions placed once, the call's index), the plug-ins bound to their traced values with
what their prepare made (`pipelines.plugin`: ControlNets, T2I-Adapters, IP-Adapters) and an LCM UNet's guidance
embedding. A guider calls it on the guidance batch's input, or on some branches alone (SAG's second call, which
runs the UNet without the plug-ins, as diffusers' SAG pipeline takes none); it knows nothing of the methods it
runs, and the sampler knows nothing of them either.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from pipelines import guidance
from pipelines.plugin import ModelCall
from sdx.layers import Rows, TextContext
from sdx.unet import guidance_scale_embedding


@dataclasses.dataclass(frozen=True)
class Denoiser:
    """One model call's model. models: the denoise program's, by name; text: the UNet's context at this call;
    call: what the plug-ins see of it (`pipelines.plugin.ModelCall`); plugins: (bound plug-in, what its prepare
    made) pairs, outermost first; scales: the request's guidance scales (an LCM UNet embeds guidance_scale - 1)."""

    models: Mapping
    text: TextContext
    call: ModelCall
    plugins: tuple
    scales: guidance.Scales

    def __call__(self, x_in: jax.Array, branches: tuple[int, ...] | None = None) -> jax.Array:
        """The UNet's output, float32, for x_in the guidance batch's input (`Guidance.model_input`'s rows), or
        with `branches` for those branches' rows alone (x_in of B * len(branches) rows, none shared)."""
        unet, call = self.models["unet"], self.call
        t = jnp.broadcast_to(call.timestep, (x_in.shape[0],))
        if branches is not None:
            rows = guidance.branch_rows(call.cond, call.branches, branches)
            text = self.text.rows(Rows(call.branches, branches), branches)
            return unet.forward(x_in, t, text, call.added(rows), self._embedding(x_in)).astype(jnp.float32)
        added = [plugin.contribute(self.models, prepared, call) for plugin, prepared in self.plugins]
        text = unet.with_interventions(self.text, None, functools.reduce(operator.or_, added)) if added else self.text
        return unet.forward(x_in, t, text, call.added(call.cond), self._embedding(x_in)).astype(jnp.float32)

    def _embedding(self, x_in: jax.Array) -> jax.Array | None:
        """An LCM UNet's `timestep_cond`, the embedding of guidance_scale - 1 for each row of x_in; None for others."""
        dim = self.models["unet"].config.time_cond_proj_dim
        if dim is None:
            return None
        w = self.scales.text - 1
        return guidance_scale_embedding(jnp.repeat(w, x_in.shape[0] // w.shape[0]), dim)
