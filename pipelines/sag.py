"""Self-Attention Guidance (Hong et al. 2023, "Improving Sample Quality of Diffusion Models Using
Self-Attention Guidance", arXiv:2210.00939), as diffusers' StableDiffusionSAGPipeline computes it.

Each model call reads the mid block's first self-attention map (`mid_block.attentions.0.transformer_blocks.0
.attn1`, recorded by `MapReader` through `sdx.interventions.record`): the latent positions that receive more
than the average attention (mean over heads, sum over queries, > 1) are blurred (9-tap Gaussian, sigma 1)
in the predicted clean latents, which are noised back to the call's level with the predicted noise; a second
UNet call on them, with the first branch's conditioning (the negative prompt's under classifier-free guidance,
else the prompt's), gives `degraded`, and

    prediction = guided + s (first - degraded)

where `first` is the first branch's prediction and `guided` the inner guider's. For SD 1.x and 2.x: diffusers
has no SDXL SAG pipeline, and sdx refuses one. The predicted clean latents read alphas_cumprod at the call's
timestep, so, as diffusers, SAG takes the schedulers with integer timesteps (DDIM, DDPM, PNDM, DPM-Solver,
UniPC), which do not scale the model's input. The scale is traced: a new one compiles nothing.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pipelines.guidance import Around, Guidance, Step, deinterleave
from sdx import interventions
from sdx.errors import SdxError
from sdx.interventions import AttentionCall, Interventions, Processor
from sdx.unet import nearest_resize, token_grid

SITE = "mid_block.attentions.0.transformer_blocks.0.attn1"
MAP = "sag.mid_block_attention"  # the record's name
FLAG = "--sag-scale"


@dataclasses.dataclass(frozen=True)
class MapReader(Processor):
    """The attention, with its probabilities formed in full, recording under `name` how much attention each key
    receives: mean over heads, sum over queries, (B, S)."""

    name: str = MAP
    per_row: ClassVar[bool] = False

    def __call__(self, call: AttentionCall) -> jax.Array:
        p = call.probabilities(call.query(), call.k)  # (B, heads, T, S) float32
        interventions.record(self.name, p.mean(axis=1).sum(axis=1))  # (B, S)
        return call.output(call.mix(p, call.v))


def gaussian_blur(x: jax.Array, size: int = 9, sigma: float = 1.0) -> jax.Array:
    """x (B, H, W, C) float32 blurred per channel by a `size`-tap Gaussian of `sigma`, reflect-padded (torch's
    "reflect"), as diffusers' `gaussian_blur_2d`."""
    taps = np.linspace(-(size - 1) / 2, (size - 1) / 2, size, dtype=np.float32)
    pdf = np.exp(-0.5 * (taps / np.float32(sigma)) ** 2)
    kernel1 = pdf / pdf.sum()
    c = x.shape[-1]
    kernel = np.outer(kernel1, kernel1)[:, :, None, None] * np.ones((1, 1, 1, c), np.float32)  # HWIO, depthwise
    pad = size // 2
    padded = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")
    return jax.lax.conv_general_dilated(padded, jnp.asarray(kernel), (1, 1), "VALID",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=c,
                                        precision=jax.lax.Precision.HIGHEST)


@dataclasses.dataclass(frozen=True)
class SelfAttention(Around):
    """SAG around `inner` (`Unguided` or `ClassifierFree`; None until a request's scales choose it). scale:
    traced."""

    scale: float = 0.75
    inner: Guidance | None = None
    traced: ClassVar[tuple[str, ...]] = ("scale",)
    refused: ClassVar[str] = (f"{FLAG}: Self-Attention Guidance goes with SD 1.x and 2.x text-to-image models, not "
                              "InstructPix2Pix")


    def combine(self, out, scales):
        return self.inner.combine(out, scales)

    def check(self, request, pipe) -> None:
        if pipe.family.xl:
            raise SdxError(f"{FLAG}: Self-Attention Guidance is for SD 1.x and 2.x; diffusers has no SDXL SAG pipeline "
                           "and sdx does not make one up")
        if request.conditioning or pipe.family.inpaint:
            raise SdxError(f"{FLAG}: Self-Attention Guidance runs without ControlNets, T2I-Adapters, an IP-Adapter or "
                           "an inpainting model (as diffusers' StableDiffusionSAGPipeline)")
        if pipe.scheduler.schedule(request.steps)["timesteps"].dtype.kind not in "iu":
            raise SdxError(f"{FLAG}: Self-Attention Guidance reads alphas_cumprod at integer timesteps, as diffusers: "
                           f"{type(pipe.scheduler).__name__} has fractional ones; pass --scheduler ddim, pndm, "
                           "dpmpp_2m or unipc")

    def install(self, unet) -> Interventions:
        if SITE not in unet.sites():
            raise SdxError(f"{FLAG}: Self-Attention Guidance reads the mid block's self-attention ({SITE}); this UNet "
                           "has none")
        return Interventions(attention={SITE: (MapReader(),)})

    def shared(self, family) -> int:
        return 1

    def predict(self, step: Step) -> jax.Array:
        out, records = interventions.capture(step.model, step.model_input)
        interventions.forward({k: v for k, v in records.items() if k != MAP})
        guided = self.inner.combine(out, step.scales)
        first = deinterleave(out, self.branches)[0]  # (B, h, w, C): uncond under classifier-free guidance, else text
        attention = deinterleave(records[MAP], self.branches)[0]  # (B, S)
        x0, eps = _x0_and_noise(step, first)
        b, height, width, _ = x0.shape
        mh, mw = token_grid(attention.shape[1], height, width)
        mask = (attention > 1.0).astype(jnp.float32).reshape(b, mh, mw, 1)
        mask = nearest_resize(mask, (height, width))  # (B, h, w, 1)
        degraded = gaussian_blur(x0) * mask + x0 * (1 - mask)
        degraded = step.scheduler.add_noise(step.state, degraded, eps)
        dtype = step.model_input.dtype
        again = step.model(degraded.astype(dtype), (0,))
        return guided + self.scale * (first - again)


def _x0_and_noise(step: Step, out: jax.Array) -> tuple[jax.Array, jax.Array]:
    """diffusers' `pred_x0` and `pred_epsilon` of the sample `step.latents` and the prediction `out`, from
    alphas_cumprod at the call's (integer) timestep."""
    a = jnp.asarray(step.scheduler.alphas_cumprod)[step.timestep.astype(jnp.int32)]
    sa, sb = jnp.sqrt(a), jnp.sqrt(1 - a)
    x = step.latents
    kind = step.scheduler.prediction_type
    if kind == "epsilon":
        return (x - sb * out) / sa, out
    if kind == "v_prediction":
        return sa * x - sb * out, sb * x + sa * out
    return out, (x - sa * out) / sb  # "sample"
