"""Conditioning plug-ins: how a request's ControlNets, T2I-Adapters and IP-Adapters (and one's own methods)
enter the sampler's model call, through one boundary.

A method is two objects:

- its request part, an `Input` in `Request.conditioning` (a `pipelines.control.Control`, a
  `pipelines.t2i_adapter.AdapterImage`, a `pipelines.image_prompt.ImagePrompt`): what the user gives (images,
  scales, windows), checked in the user's terms (`check`), matched in order to the pipeline's models of its
  `kind` (the k-th `Control` to the k-th ControlNet), and turned into one compiled call's program part (`plugin`);
- its program part, a `Plugin`: a `sdx.interventions.Traced` whose static fields are part of the `Plan` (a new
  value compiles anew) and whose traced fields are program inputs with the batch's rows first (images,
  per-row scales, per-call tables: a new image or scale compiles nothing, and the rows of requests that share a
  plan stack into one call). In the prepare program it makes what every model call reads (`prepare`: a
  ControlNet's text projections, a T2I-Adapter's feature maps, an IP-Adapter's image keys and values); in each
  model call it gives the UNet processors and hooks on its sites (`contribute`: a ControlNet's residuals at the
  skip connections and the mid block, `sdx.residuals`; an IP-Adapter's attention at every cross-attention).

The sampler knows none of them by name: it asks each plug-in which of its models it reads (`models`), binds its
traced values, and folds what they contribute into the UNet's call (`pipelines.denoiser`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import numpy as np

from pipelines.family import Family
from sdx.interventions import Interventions, Traced

PREPARE, DENOISE = "prepare", "denoise"  # the programs a plug-in's models are read in


def model_name(kind: str, k: int) -> str:
    """The `Sampler.models` key of the pipeline's k-th model of `kind` ("controlnet_0", "ip_adapter_1")."""
    return f"{kind}_{k}"


@dataclasses.dataclass(frozen=True)
class Batch:
    """One compiled call's share of a request, as `Input.plugin` reads it.

    take: (1 or one per prompt, ...) -> (rows, ...), the values of this call's images (the request's images in
    diffusers' order, the last call padded); rows: images per call; steps: the request's; calls: the model calls
    of the full schedule, of which [begin, end) run; cut: `--denoising-end` cut the schedule; family: the
    pipeline's."""

    take: Callable[[np.ndarray], np.ndarray]
    rows: int
    steps: int
    calls: int
    begin: int
    end: int
    cut: bool
    family: Family

    def per_row(self, value: float) -> np.ndarray:
        """(rows,) float32: `value` for every image of the call."""
        return np.full((self.rows,), value, np.float32)


@dataclasses.dataclass(frozen=True)
class Ready:
    """What the prepare program offers a plug-in: cond, the UNet batch's conditioning (`pipelines.guidance
    .Conditioning`, B * branches rows, image-major); guide, the run's guider (its branches and which read the
    negative prompt); blank, the rows whose text may be zeros (`sdx.layers.BlankRows`) or None; unet; dtype,
    the UNet's compute dtype; family."""

    cond: Any
    guide: Any
    blank: Any
    unet: Any
    dtype: Any
    family: Family


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """One model call as a plug-in sees it: latents (B, h, w, C), scaled for the model, without the channels a
    model appends; timestep (); index: the call's place among those that run (traced, from 0); cond: the UNet
    batch's conditioning; branches: guidance branches per image; shared: how many consecutive rows of the UNet
    batch take the same input (`pipelines.guidance.Guidance.shared`); unet."""

    latents: jax.Array
    timestep: jax.Array
    index: jax.Array
    cond: Any
    branches: int
    shared: int
    unet: Any

    @property
    def xl(self) -> bool:
        return self.unet.add_embedding is not None

    def added(self, cond) -> dict | None:
        """SDXL's added conditioning of `cond`'s rows (None for other UNets)."""
        return {"text_embeds": cond.pooled, "time_ids": cond.time_ids} if self.xl else None


class Plugin(Traced):
    """A conditioning method's program part (see the module docstring). `model` names its model in the sampler
    (`model_name`); a method without one reads no model (`reads` empty)."""

    reads: ClassVar[tuple[str, ...]] = ()  # the programs that read `model`

    def models(self, program: str) -> tuple[str, ...]:
        """The `Sampler.models` names `program` (PREPARE or DENOISE) reads for this plug-in."""
        return (self.model,) if program in self.reads else ()

    def prepare(self, models: Mapping, ready: Ready) -> Any:
        """What every model call reads, made once per image in the prepare program (a pytree; None by default)."""
        return None

    def contribute(self, models: Mapping, prepared: Any, call: ModelCall) -> Interventions:
        """The processors and hooks this plug-in puts on the UNet for one model call."""
        return Interventions()


class Input:
    """A conditioning method's request part (see the module docstring): a frozen dataclass in
    `Request.conditioning`. kind: the pipeline's models it is matched to (None: a method with no model of its own,
    whose `plugin` gets model None); flag: the command-line flag that loads them, for messages."""

    kind: ClassVar[str | None] = None
    flag: ClassVar[str] = ""

    def size(self) -> tuple[int, int] | None:
        """The generation size its image implies (text-to-image takes the first such size), or None."""
        return None

    def check(self, request, pipe, model: str) -> None:
        """Refuse, in the user's terms, what the request or the pipeline's model `model` cannot take."""

    def plugin(self, batch: Batch, model: str, pipe) -> Plugin:
        raise NotImplementedError
