"""LoRA adapters on a model's linear layers: what `python -m train.text_to_image_lora` trains.

An adapter adds scale · (x · down) · up to its layer's output x · kernel + bias, with down (in, rank), up
(rank, out) and scale = alpha / rank. This is peft's LoRA layer (lora_A = downᵀ, lora_B = upᵀ, scaling
lora_alpha / r): like peft, the adapter computes in its weights' dtype (float32) and its result is added
in the layer's. An adapter is the child `lora` of the `sdx.layers.Linear` it adapts, so the base weights
keep their paths (diffusers' key paths) and a model without adapters is the model as it was.

- `attach`: an adapter on every linear layer whose path ends in one of `targets` (diffusers' LoRA
  scripts: the UNet attentions' to_q, to_k, to_v and to_out.0, `TARGETS`; the text encoders' q_proj,
  k_proj, v_proj and out_proj, `TEXT_TARGETS`), down drawn from N(0, 1/rank²) (peft's
  `init_lora_weights="gaussian"`), up zero: the model computes exactly what it did.
- `fused`: the model without adapters, each kernel plus scale · down · up (diffusers' `fuse_lora`),
  what the sampler's `--lora` makes of the file `state_dict` gives.
- `state_dict`: the adapters as diffusers writes them (`unet.<module>.lora_A.weight`, `.lora_B.weight`;
  `text_encoder.text_model.<module>...` for a text encoder; float32), with the scale folded into lora_B
  so that any reader's default alpha (= rank) is right.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdx import mesh as meshlib
from sdx.layers import Linear

TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


class LoRAParam(nnx.Param):
    """An adapter's weight: the parameters a LoRA run trains (`nnx.split(model, LoRAParam, ...)`)."""


class LoRA(nnx.Module):
    def __init__(self, din: int, dout: int, rank: int, alpha: float, key: jax.Array):
        self.down = LoRAParam(jax.random.normal(key, (din, rank), jnp.float32) / rank)
        self.up = LoRAParam(jnp.zeros((rank, dout), jnp.float32))
        self.scale = alpha / rank

    def __call__(self, x):
        return (x.astype(jnp.float32) @ self.down[...]) @ self.up[...] * self.scale

    def delta(self) -> jax.Array:
        """What the adapter adds to its layer's kernel: scale · down · up, (in, out)."""
        return self.scale * (self.down[...] @ self.up[...])


def _linears(model: nnx.Module) -> list[tuple[str, Linear]]:
    """(dotted path, layer) of each linear layer of `model`, in path order."""
    found = [(".".join(map(str, path)), node) for path, node in nnx.iter_graph(model) if isinstance(node, Linear)]
    return sorted(found, key=lambda item: item[0])


def _adapters(model: nnx.Module) -> list[tuple[str, Linear]]:
    """(dotted path, layer) of each linear layer of `model` that has an adapter, in path order."""
    return [(name, layer) for name, layer in _linears(model) if layer.lora is not None]


def attach(model: nnx.Module, rank: int, alpha: float, key: jax.Array, targets: Sequence[str] = TARGETS,
           sharding: jax.sharding.Sharding | None = None) -> int:
    """Put a fresh adapter on each target layer of `model` (in place; the i-th in path order drawn from
    fold_in(key, i); placed with `sharding` when given); returns how many. Raises ValueError when no layer
    matches."""
    layers = [(name, layer) for name, layer in _linears(model)
              if any(name == t or name.endswith("." + t) for t in targets)]
    if not layers:
        raise ValueError(f"no linear layer of the model ends in any of {list(targets)}")
    for i, (_, layer) in enumerate(layers):
        din, dout = layer.kernel.shape
        layer.lora = LoRA(din, dout, rank, alpha, jax.random.fold_in(key, i))
    if sharding is not None:
        nnx.update(model, jax.device_put(nnx.state(model, LoRAParam), sharding))
    return len(layers)


def fused(model: nnx.Module) -> nnx.Module:
    """A new model without adapters, each adapted kernel + scale · down · up (summed in float32, stored in
    the kernel's dtype); the other weights are shared with `model`, which is left as it was."""
    graphdef, state = nnx.split(model)
    out = nnx.merge(graphdef, jax.tree.map(lambda x: x, state))  # new modules and variables over the same arrays
    for _, layer in _adapters(out):
        kernel = layer.kernel[...]
        layer.kernel.set_value((kernel.astype(jnp.float32) + layer.lora.delta()).astype(kernel.dtype))
        del layer.lora
    return out


def state_dict(model: nnx.Module, prefix: str = "unet") -> dict[str, np.ndarray]:
    """{`prefix`.<module>.lora_A.weight: (rank, in), .lora_B.weight: (out, rank)} of every adapter of
    `model`, float32 on the host, lora_B scaled by the adapter's scale (a reader's W + B·A is then the
    trained layer's kernel). Each adapter must be readable from this process (`sdx.mesh.to_host`)."""
    out = {}
    for name, layer in _adapters(model):
        lora = layer.lora
        out[f"{prefix}.{name}.lora_A.weight"] = np.ascontiguousarray(meshlib.to_host(lora.down[...]).T)
        out[f"{prefix}.{name}.lora_B.weight"] = np.ascontiguousarray(meshlib.to_host(lora.up[...] * lora.scale).T)
    return out
