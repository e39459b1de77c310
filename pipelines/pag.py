"""Perturbed-Attention Guidance (Ahn et al. 2024, "Self-Rectifying Diffusion Sampling with Perturbed-Attention
Guidance", arXiv:2403.17377), as diffusers' StableDiffusion(XL)PAGPipeline computes it.

One more branch in the guidance batch: the text branch again, its self-attentions in the chosen layers
perturbed, each query attending to itself alone (the attention map replaced by the identity, so the output is
the values: diffusers' PAGIdentitySelfAttnProcessor2_0). The prediction moves away from it:

    with classifier-free guidance: uncond + g (text - uncond) + s_t (text - perturbed), then guidance_rescale
    without:                       text + s_t (text - perturbed)

s_t = max(s - a (1000 - t), 0) at timestep t (`adaptive_scale` a; a = 0: s throughout). Layers are site
patterns (`sdx.interventions.select`: "mid_block", every self-attention of the mid block; "up_blocks.1",
"down_blocks.2.attentions.1"); diffusers' `pag_applied_layers`, regular expressions searched in the module paths
("mid"), are translated into them where a user gives them (`--pag-layers`, `diffusers_layers`). The batch is
[uncond, text, perturbed] per image (image-major, `pipelines.guidance`); its rows are read by place, so the
UNet runs all of them in full (no rows shared before the first text-reading attention).
"""

from __future__ import annotations

import dataclasses
import re
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from pipelines.guidance import Around, Guidance, Step, Unguided, deinterleave, interleave, rescale
from sdx.errors import SdxError
from sdx.interventions import AttentionCall, Interventions, Processor, attention_paths, select
from sdx.layers import Rows

FLAG = "--pag-layers"


@dataclasses.dataclass(frozen=True)
class Identity(Processor):
    """The perturbed branch's self-attention: the rows of `layout.rows` attend each query to itself (the
    output is to_out of the values), the other rows proceed."""

    layout: Rows

    def __call__(self, call: AttentionCall) -> jax.Array:
        if call.v.shape[1] != call.h.shape[1]:
            raise SdxError(f"PAG's identity attention at {call.path}: a cross-attention (its values are the text's)")
        kept = call.rows(self.layout, self.layout.others()).proceed()  # (B * (n - 1), T, C)
        mine = call.rows(self.layout, self.layout.rows)
        return self.layout.join(kept, mine.output(mine.v))  # (B * n, T, C)


def diffusers_layers(unet: nnx.Module, layers: tuple[str, ...]) -> tuple[str, ...]:
    """diffusers' `pag_applied_layers` as site patterns: the paths of the self-attentions they select as
    diffusers' `_set_pag_attn_processor` does (each a regular expression searched in the path); an SdxError for a
    malformed one, one that matches no module of `unet`, and one whose modules have no self-attention."""
    sites = unet.sites()
    selves = [path for path, kind in sites.items() if kind == "self"]
    modules = [".".join(map(str, path)) for path, m in nnx.iter_graph(unet) if isinstance(m, nnx.Module) and path]
    found = []
    if not layers:
        raise SdxError(f"{FLAG}: give at least one layer (e.g. mid)")
    for layer in layers:
        try:
            pattern = re.compile(layer)
        except re.error as e:
            raise SdxError(f"{FLAG} {layer!r}: not a regular expression ({e})") from None
        hits = [path for path in selves if pattern.search(path)]
        if not hits and any(pattern.search(m) for m in modules):
            raise SdxError(f"{FLAG} {layer!r}: the modules it names have no self-attention, which PAG perturbs "
                           f"(this UNet's: {', '.join(selves) or 'none'})")
        if not hits:
            raise SdxError(f"{FLAG} {layer!r}: matches no module of this UNet (e.g. mid, up_blocks.1, "
                           f"{selves[0] if selves else 'down_blocks.0'})")
        found += [h for h in hits if h not in found]
    return tuple(found)


@dataclasses.dataclass(frozen=True)
class PerturbedAttention(Around):
    """PAG around `inner` (`Unguided` or `ClassifierFree`; None until a request's scales choose it, `around`),
    perturbing the self-attentions the site patterns `layers` select. scale, adaptive_scale: traced."""

    layers: tuple[str, ...] = ("mid_block",)
    scale: float = 3.0
    adaptive_scale: float = 0.0
    inner: Guidance | None = None
    traced: ClassVar[tuple[str, ...]] = ("scale", "adaptive_scale")
    per_row: ClassVar[bool] = True
    refused: ClassVar[str] = ("--pag-scale: Perturbed-Attention Guidance goes with text-to-image models (with or "
                              "without classifier-free guidance), not InstructPix2Pix")


    def check(self, request, pipe) -> None:
        if any(getattr(one, "guess_mode", False) for one in request.conditioning):
            raise SdxError("--pag-scale: Perturbed-Attention Guidance and --guess-mode do not go together in sdx (guess "
                           "mode gives the ControlNets the text branch alone, PAG's batch has two that read the text)")

    @property
    def branches(self) -> int:
        return self.inner.branches + 1

    def install(self, unet) -> Interventions:
        processor = Identity(Rows(self.branches, (self.branches - 1,)))
        if not self.layers:
            raise SdxError(f"{FLAG}: give at least one layer (e.g. mid)")
        selves = attention_paths(unet, "self")
        paths = dict.fromkeys(p for pattern in self.layers
                              for p in select(selves, pattern, f"{FLAG} {pattern!r}", kind="self-attention"))
        return Interventions(attention={path: (processor,) for path in paths})

    def conditioning(self, text, negative):
        inner = self.inner.conditioning(text, negative)
        return interleave(*deinterleave(inner, self.inner.branches), text)

    def shared(self, family) -> int:
        return 1

    def signal_scale(self, timestep: jax.Array) -> jax.Array:
        """s_t, diffusers' `_get_pag_scale`."""
        return jnp.maximum(self.scale - self.adaptive_scale * (1000.0 - timestep), 0.0)

    def predict(self, step: Step) -> jax.Array:
        parts = deinterleave(step.model(step.model_input), self.branches)
        text, perturbed = parts[-2], parts[-1]
        no_rescale = dataclasses.replace(step.scales, rescale=jnp.zeros_like(step.scales.rescale))
        guided = self.inner.combine(interleave(*parts[:-1]), no_rescale)
        guided = guided + self.signal_scale(step.timestep) * (text - perturbed)
        return guided if isinstance(self.inner, Unguided) else rescale(guided, text, step.scales.of("rescale", text))

