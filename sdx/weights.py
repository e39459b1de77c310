"""Parameters without random initialisation: abstract models, the torch-key mapping, materialising.

A model is first built abstractly (`abstract(...)`: shapes only, via `nnx.eval_shape`); its parameter
paths joined by dots are the diffusers/transformers keys with the last part renamed. `from_torch_keys`
maps a flat `{torch_key: array}` onto those paths strictly (every source tensor used once, every
parameter filled, every shape checked), and `materialize` puts the arrays on the device(s) and
returns the live module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sdx.errors import SdxError

# torch's `weight` is a kernel (Linear/Conv), a scale (norms) or an embedding table in Flax.
_WEIGHT_NAMES = ("kernel", "scale", "embedding")


def abstract(build: Callable[[nnx.Rngs], nnx.Module]) -> nnx.Module:
    """The module `build(rngs)` would make, with ShapeDtypeStructs in place of arrays."""
    return nnx.eval_shape(lambda: build(nnx.Rngs(0)))


def param_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """{'down_blocks.0.resnets.0.conv1.kernel': shape, ...} for every parameter of `model`."""
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, path)): tuple(v.get_value().shape) for path, v in nnx.to_flat_state(state)}


def _to_flax(name: str, array: np.ndarray, target_ndim: int) -> np.ndarray:
    if name != "kernel":
        return array
    if array.ndim == 4 and target_ndim == 2:  # a Linear stored as a 1x1 conv (old VAE attention)
        array = array[:, :, 0, 0]
    if array.ndim == 2:
        return array.T  # (out, in) -> (in, out)
    if array.ndim == 4:
        return array.transpose(2, 3, 1, 0)  # OIHW -> HWIO
    return array


def from_torch_keys(
    targets: Mapping[str, tuple[int, ...]], source: Mapping[str, np.ndarray], *, where: str
) -> dict[str, np.ndarray]:
    """Map torch-keyed tensors onto sdx parameter paths; `where` names the file in errors."""
    out: dict[str, np.ndarray] = {}
    for key, array in source.items():
        prefix, _, last = key.rpartition(".")
        names = _WEIGHT_NAMES if last == "weight" else (last,)
        found = [n for n in names if f"{prefix}.{n}" in targets]
        if not found:
            raise SdxError(f"{where}: tensor {key!r} has no place in the model (unexpected key)")
        path = f"{prefix}.{found[0]}"
        converted = _to_flax(found[0], np.asarray(array), len(targets[path]))
        if tuple(converted.shape) != tuple(targets[path]):
            raise SdxError(
                f"{where}: tensor {key!r} has shape {tuple(np.shape(array))}, the model expects "
                f"{tuple(targets[path])} (as {path}); the checkpoint and the config disagree"
            )
        out[path] = converted
    missing = sorted(set(targets) - set(out))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise SdxError(f"{where}: {len(missing)} parameter(s) missing from the checkpoint: {shown}")
    return out


def materialize(
    model: nnx.Module,
    arrays: Mapping[str, np.ndarray],
    *,
    dtype: jnp.dtype | None = None,
    sharding: Callable[[str, tuple[int, ...]], jax.sharding.Sharding] | jax.sharding.Sharding | None = None,
) -> nnx.Module:
    """Fill the abstract `model` with `arrays` (keyed by parameter path), cast to `dtype`, placed by `sharding`.

    `sharding` is one Sharding for every parameter, or a function of (path, shape) giving one.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    flat = []
    for path, var in nnx.to_flat_state(params):
        key = ".".join(map(str, path))
        if key not in arrays:
            raise SdxError(f"parameter {key} was not provided")
        value = np.asarray(arrays[key])
        value = value.astype(dtype or var.get_value().dtype)
        target = sharding(key, value.shape) if callable(sharding) else sharding
        flat.append((path, var.replace(jax.device_put(value, target) if target is not None else jnp.asarray(value))))
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)


def load_torch_state(model: nnx.Module, source: Mapping[str, np.ndarray], *, where: str, dtype=None, sharding=None):
    """Strictly map a torch state dict onto an abstract model and materialise it."""
    return materialize(model, from_torch_keys(param_shapes(model), source, where=where), dtype=dtype, sharding=sharding)
