"""What conditioning models add inside a UNet, as hooks on its sites (`sdx.interventions`).

A ControlNet adds one residual to each skip connection and one to the mid block's output (diffusers'
`down_block_additional_residuals`, `mid_block_additional_residual`); a T2I-Adapter adds one feature map inside
each of the first down blocks and, SDXL's, one to the mid block's output (`down_intrablock_additional_residuals`).
Each becomes an `Add` hook where the UNet's hooks already act:

- a skip connection's residual at the up block's skip site that concatenates it
  (`up_blocks.<i>.resnets.<j>.skip`, the pair (hidden states, skip)): diffusers adds it once the down blocks
  have run, and only the up block reads a skip;
- a feature map of a down block with attentions at its last transformer's output
  (`down_blocks.<i>.attentions.<last>`), before the downsampler, so the skip taken there carries it; of a block
  without attentions at the block's output (`down_blocks.<i>`: the output and its last skip, the same tensor in
  diffusers, which adds in place);
- the mid block's at `mid_block` (the adapter's first, then the ControlNet's, as diffusers' forward does).

A residual has the rows of the batch (a sampler's guidance branches included); an activation computed once for
rows that share it is widened to them first (`sdx.layers.widen`). A hook added here is the innermost of its site:
an intervention's hook there sees the value with the residual in it.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence
from typing import ClassVar

import jax

from sdx.errors import SdxError
from sdx.interventions import Hook, Interventions
from sdx.layers import widen

SKIP, OUTPUT, BLOCK = "skip", "output", "block"  # what an `Add` adds to


@dataclasses.dataclass(frozen=True)
class Add(Hook):
    """Adds `residual` at a site: to the skip of an up block's skip site (`SKIP`), to a transformer's or the mid
    block's output (`OUTPUT`), or to a down block's output and its last skip (`BLOCK`). `name` says what it is, for
    errors. A residual of shape (B, 1, 1, C) (a ControlNet with global pooling) broadcasts over the positions."""

    residual: jax.Array
    into: str = OUTPUT
    name: str = "residual"
    traced: ClassVar[tuple[str, ...]] = ("residual",)
    per_row: ClassVar[bool] = False

    def __call__(self, site: str, x, *rest) -> tuple:
        if self.into == SKIP:
            skip = self._added(rest[0])
            return widen(x, skip.shape[0]), skip
        if self.into == BLOCK:
            x = self._added(x)
            return x, (*rest[0][:-1], x)
        return (self._added(x),)

    def _added(self, x: jax.Array) -> jax.Array:
        x = widen(x, self.residual.shape[0])
        shape = tuple(self.residual.shape)
        if len(shape) != 4 or any(r not in (1, s) for r, s in zip(shape, x.shape)):
            raise SdxError(f"unet: {self.name} of shape {shape} meets the UNet's activation {tuple(x.shape)} (a model "
                           "made for another UNet?)")
        return x + self.residual.astype(x.dtype)


def skip_sites(unet) -> list[str]:
    """The up-block skip site that reads each skip connection, in the order the down path leaves them (conv_in's
    output first): the up blocks read them last first, resnet j of a block the j-th from the end of its share."""
    sites = []
    for i, block in enumerate(unet.up_blocks):
        sites += [f"up_blocks.{i}.resnets.{j}.skip" for j in range(len(block.resnets))]
    return sites[::-1]


def controlnet(unet, down: Sequence[jax.Array], mid: jax.Array) -> Interventions:
    """A ControlNet's residuals (`sdx.controlnet.ControlNetModel`'s two outputs) as hooks on `unet`."""
    sites = skip_sites(unet)
    if len(down) != len(sites):
        raise SdxError(f"unet: {len(down)} down_block_additional_residuals for {len(sites)} skip connections (a "
                       "ControlNet made for another UNet?)")
    if unet.mid_block is None:
        raise SdxError("unet: a mid_block_additional_residual for a UNet without a mid block")
    hooks = {site: (Add(r, SKIP, f"down_block_additional_residuals[{k}]"),) for k, (site, r) in enumerate(zip(sites, down))}
    return Interventions(sites={**hooks, "mid_block": (Add(mid, OUTPUT, "mid_block_additional_residual"),)})


def adapter(unet, features: Sequence[jax.Array]) -> Interventions:
    """A T2I-Adapter's feature maps (`sdx.t2i_adapter.T2IAdapter`'s output) as hooks on `unet`: one per down
    block from the first, and one more for the mid block's output (SDXL's adapters)."""
    blocks = len(unet.down_blocks)
    if len(features) > blocks + (unet.mid_block is not None):
        raise SdxError(f"unet: {len(features)} down_intrablock_additional_residuals for {blocks} down blocks"
                       f"{' and a mid block' if unet.mid_block is not None else ''} (an adapter made for another UNet?)")
    hooks = {}
    for i, f in enumerate(features):
        name = f"down_intrablock_additional_residuals[{i}]: a T2I-Adapter feature map"
        if i == blocks:
            hooks["mid_block"] = (Add(f, OUTPUT, name),)
        elif unet.down_blocks[i].attentions is not None:
            hooks[f"down_blocks.{i}.attentions.{len(unet.down_blocks[i].attentions) - 1}"] = (Add(f, OUTPUT, name),)
        else:
            hooks[f"down_blocks.{i}"] = (Add(f, BLOCK, name),)
    return Interventions(sites=hooks)


def from_diffusers(unet, down: Sequence[jax.Array] | None, mid: jax.Array | None,
                   intrablock: Sequence[jax.Array] = ()) -> Interventions | None:
    """diffusers' residual arguments of `UNet2DConditionModel.forward` as hooks on `unet` (None without any): a
    ControlNet's `down_block_additional_residuals` and `mid_block_additional_residual`, a T2I-Adapter's
    `down_intrablock_additional_residuals`."""
    if (down is None) != (mid is None):
        raise SdxError("unet: down_block_additional_residuals and mid_block_additional_residual come together (a "
                       "ControlNet's two outputs)")
    found = ([controlnet(unet, down, mid)] if down is not None else []) + ([adapter(unet, intrablock)] if intrablock else [])
    return functools.reduce(operator.or_, found) if found else None
