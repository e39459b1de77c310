"""Parameters without random initialisation: abstract models, the torch-key mapping, materialising.

A model is first built abstractly (`abstract(...)`: shapes only, via `nnx.eval_shape`); its parameter
paths joined by dots are the diffusers/transformers keys with the last part renamed. `from_torch_keys`
maps a flat `{torch_key: array}` onto those paths strictly (every source tensor used once, every
parameter filled, every shape checked), `to_torch_keys` is its inverse (for exporting), and
`materialize` puts the arrays on the device(s) and returns the live module.

Reading and writing files (safetensors, JSON) is `sdx.io`'s job; the arrays here are whatever it
handed out (memory-mapped views), so nothing is copied before it is cast or sliced for a device, and
`materialize` reads `READERS` tensors at once (`io.host_copy`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from sdx import io
from sdx.errors import SdxError

# torch's `weight` is a kernel (Linear/Conv), a scale (norms) or an embedding table in Flax.
_WEIGHT_NAMES = ("kernel", "scale", "embedding")

Sharding = Callable[[str, tuple[int, ...]], jax.sharding.Sharding] | jax.sharding.Sharding | None


class _ShapeOnlyRngs(nnx.Rngs):
    """An `nnx.Rngs` whose every stream gives one constant key and counts nothing, for `abstract`.

    Under `nnx.eval_shape` each draw from a real Rngs updates a traced counter, and flax 0.12's
    Variable update then asks the tracer for its `sharding`, whose error message walks the whole
    jaxpr traced so far: quadratic in the number of parameters (the SDXL UNet took 155 s to build
    abstractly, the tiny test UNet 7 s). The values drawn are thrown away, so a constant key is enough.
    """

    def __init__(self):
        super().__init__()

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return self

    def __call__(self) -> jax.Array:
        return jax.random.key(0)


def abstract(build: Callable[[nnx.Rngs], nnx.Module]) -> nnx.Module:
    """The module `build(rngs)` would make, with ShapeDtypeStructs in place of arrays."""
    return nnx.eval_shape(lambda: build(_ShapeOnlyRngs()))


def as_class(model: nnx.Module, cls: type[nnx.Module]) -> nnx.Module:
    """`model` rebuilt as `cls`, a subclass of its class built from the same (config, compute) (a researcher's
    UNet with its own `__call__`), holding the very same arrays (nothing copied, shardings kept)."""
    if not issubclass(cls, type(model)):
        raise TypeError(f"{cls.__name__} is not a subclass of {type(model).__name__}")
    rebuilt = abstract(lambda rngs: cls(model.config, model.compute, rngs=rngs))
    nnx.update(rebuilt, nnx.state(model))
    return rebuilt


def param_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """{'down_blocks.0.resnets.0.conv1.kernel': shape, ...} for every parameter of `model`."""
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, path)): tuple(v.get_value().shape) for path, v in nnx.to_flat_state(state)}


# --------------------------------------------------------------------------------------------------
# torch <-> sdx, one rule each way
#
# A torch kernel is (out, in, *spatial) (Linear: (out, in); Conv2d: OIHW); a Flax kernel is
# (*spatial, in, out) (Linear: (in, out); Conv: HWIO). `weight` becomes kernel/scale/embedding, every
# other name (`bias`) is kept. The two functions below are exact inverses except for the one lossy
# case `_to_flax` accepts: a Linear stored as a 1x1 conv (old VAE attention), exported back as a Linear.


def _to_flax(name: str, array: np.ndarray, target_ndim: int) -> np.ndarray:
    if name != "kernel":
        return array
    if array.ndim == 4 and target_ndim == 2:  # a Linear stored as a 1x1 conv (old VAE attention)
        array = array[:, :, 0, 0]
    if array.ndim >= 2:
        return array.transpose(*range(2, array.ndim), 1, 0)  # (out, in, *k) -> (*k, in, out)
    return array


def _to_torch(name: str, array: np.ndarray) -> np.ndarray:
    if name != "kernel" or array.ndim < 2:
        return array
    n = array.ndim
    return array.transpose(n - 1, n - 2, *range(n - 2))  # (*k, in, out) -> (out, in, *k)


def torch_key(path: str) -> str:
    """The torch key of an sdx parameter path: `...to_q.kernel` -> `...to_q.weight`."""
    prefix, _, last = path.rpartition(".")
    return f"{prefix}.weight" if last in _WEIGHT_NAMES else path


def from_torch_keys(
    targets: Mapping[str, tuple[int, ...]], source: Mapping[str, np.ndarray], *, where: str
) -> dict[str, np.ndarray]:
    """Map torch-keyed tensors onto sdx parameter paths; `where` names the file in errors.

    The results are (possibly transposed) views of the sources, not copies.
    """
    out: dict[str, np.ndarray] = {}
    for key, array in source.items():
        prefix, dot, last = key.rpartition(".")
        names = _WEIGHT_NAMES if last == "weight" else (last,)
        found = [n for n in names if f"{prefix}{dot}{n}" in targets]  # a top-level parameter has no prefix
        if not found:
            raise SdxError(f"{where}: tensor {key!r} has no place in the model (unexpected key)")
        path = f"{prefix}{dot}{found[0]}"
        if path in out:
            raise SdxError(f"{where}: tensor {key!r} fills {path}, which another tensor already filled")
        converted = _to_flax(found[0], np.asarray(array), len(targets[path]))
        if tuple(converted.shape) != tuple(targets[path]):
            raise SdxError(
                f"{where}: tensor {key!r} has shape {tuple(np.shape(array))}, the model expects "
                f"{tuple(targets[path])} (as {path}); the checkpoint and the config disagree"
            )
        out[path] = converted
    missing = sorted(set(targets) - set(out))
    if missing:
        names = [torch_key(p) if torch_key(p) == p else f"{torch_key(p)} (as {p})" for p in missing[:5]]
        shown = ", ".join(names) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise SdxError(f"{where}: {len(missing)} parameter(s) missing from the checkpoint: {shown}")
    return out


def to_torch_keys(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `from_torch_keys`: {sdx path: Flax-layout array} -> {torch key: torch-layout array} (views)."""
    out: dict[str, np.ndarray] = {}
    for path, array in arrays.items():
        key = torch_key(path)
        if key in out:
            raise SdxError(f"parameters {path} and another both export as torch key {key!r}")
        out[key] = _to_torch(path.rpartition(".")[2], np.asarray(array))
    return out


def check_arrays(targets: Mapping[str, tuple[int, ...]], arrays: Mapping[str, np.ndarray], *, where: str) -> None:
    """Strict check of sdx-keyed arrays against a model's parameter shapes: none missing, none extra, same shapes."""
    extra = sorted(set(arrays) - set(targets))
    if extra:
        raise SdxError(f"{where}: tensor {extra[0]!r} has no place in the model (unexpected key)"
                       + (f", and {len(extra) - 1} more" if len(extra) > 1 else ""))
    missing = sorted(set(targets) - set(arrays))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise SdxError(f"{where}: {len(missing)} parameter(s) missing: {shown}")
    for key, shape in targets.items():
        if tuple(arrays[key].shape) != tuple(shape):
            raise SdxError(
                f"{where}: tensor {key!r} has shape {tuple(arrays[key].shape)}, the model expects {tuple(shape)}"
            )


class SourceTensors(dict):
    """{key: array}, plus `where`: the file (or index file) they came from, for error messages."""

    def __init__(self, arrays: Mapping[str, np.ndarray] = (), *, where: str):
        super().__init__(arrays)
        self.where = where


def where_of(tensors: Mapping[str, np.ndarray], default: str) -> str:
    return getattr(tensors, "where", None) or default


# --------------------------------------------------------------------------------------------------
# Materialising


def _read(value: np.ndarray, dtype, target: jax.sharding.Sharding | None, on_use: bool = False) -> np.ndarray:
    """The host side of `_place`, run in a reader thread: for a CPU, a view into the file the CPU can use in
    place (`io.in_place`), its pages read into the OS page cache (`io.read_ahead`; the process maps them as it
    uses them) unless they are to be read `on_use` (an embedding table, of which a generation gathers a few
    rows: SDXL's two token tables are 0.4 GB of pages it never touches; a model's `READ_ON_USE`
    parameters); else `value` read and cast
    (`io.host_copy`: aligned, so a CPU keeps it as the device buffer); `value` itself for a sharded target
    (each device reads its slice)."""
    if target is not None and not target.is_fully_replicated:
        return value
    devices = target.device_set if target is not None else {jax.devices()[0]}
    if (isinstance(value, np.ndarray) and value.dtype == np.dtype(dtype) and io.in_place(value)
            and all(d.platform == "cpu" for d in devices)):
        if not on_use:
            io.read_ahead(value)
        return value
    return io.host_copy(value, dtype)


def _place(host: np.ndarray, dtype, target: jax.sharding.Sharding | None) -> jax.Array:
    """`_read`'s result on `target`'s devices, in the calling thread (whose default device and mesh apply).
    A sharded target reads each device's slice alone: a memory-mapped tensor is never fully copied."""
    if target is None or target.is_fully_replicated:
        return jax.device_put(host, target)
    return jax.make_array_from_callback(tuple(host.shape), target, lambda index: io.host_copy(host[index], dtype))


READERS = 4  # parameters read at once: enough reads in flight to fill a disk's queue (see `io.host_copy`)


def materialize(
    model: nnx.Module,
    arrays: Mapping[str, np.ndarray],
    *,
    dtype: jnp.dtype | None = None,
    sharding: Sharding = None,
) -> nnx.Module:
    """Fill the abstract `model` with `arrays` (keyed by parameter path), cast to `dtype`, placed by `sharding`.

    `sharding` is one Sharding for every parameter, or a function of (path, shape) giving one.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    for path, var in nnx.to_flat_state(rest):
        if isinstance(var.get_value(), jax.ShapeDtypeStruct):
            key = ".".join(map(str, path))
            raise SdxError(f"model state {key} is not a parameter and has no value; it cannot be materialised")
    todo, on_use = [], getattr(model, "READ_ON_USE", ())
    for path, var in nnx.to_flat_state(params):
        key = ".".join(map(str, path))
        if key not in arrays:
            raise SdxError(f"parameter {key} was not provided")
        value = arrays[key]
        todo.append((path, var, value, dtype or var.get_value().dtype, _target(sharding, key, tuple(value.shape))))
    with ThreadPoolExecutor(READERS) as pool:
        hosts = pool.map(lambda job: _read(*job[2:], on_use=job[0][-1] == "embedding" or job[0][0] in on_use), todo)
        flat = [(path, var.replace(_place(host, dtype, target)))
                for (path, var, _, dtype, target), host in zip(todo, hosts)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)


def unmap(tree) -> None:
    """Take the file pages under the CPU arrays of `tree` that use a weight file in place (`io.in_place`) out
    of this process (`io.unmap`): the page cache keeps them and the next use maps them again. Other arrays
    are left alone."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                if shard.device.platform == "cpu":
                    io.unmap(shard.data.unsafe_buffer_pointer(), shard.data.nbytes)


def _target(sharding: Sharding, key: str, shape: tuple[int, ...]) -> jax.sharding.Sharding | None:
    return sharding(key, shape) if callable(sharding) else sharding


def placed_abstract(model: nnx.Module, *, dtype: jnp.dtype | None = None, sharding: Sharding = None) -> nnx.Module:
    """The abstract `model` with each parameter's dtype and sharding as `materialize` (same arguments) would
    give it: what the keys of its programs are computed from before the weights exist (`pipelines.executables`)."""
    graphdef, state = nnx.split(model)
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):  # a parameter (`materialize` refuses any other abstract state)
            target = _target(sharding, ".".join(map(str, path)), tuple(value.shape))
            var = var.replace(jax.ShapeDtypeStruct(value.shape, dtype or value.dtype, sharding=target))
        flat.append((path, var))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_torch_state(model: nnx.Module, source: Mapping[str, np.ndarray], *, where: str, dtype=None, sharding=None):
    """Strictly map a torch state dict onto an abstract model and materialise it."""
    return materialize(model, from_torch_keys(param_shapes(model), source, where=where), dtype=dtype, sharding=sharding)


# --------------------------------------------------------------------------------------------------
# dtypes

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}


def dtype_of(name: str) -> np.dtype:
    """'float32' | 'bfloat16' | 'float16' -> numpy dtype (bfloat16 from ml_dtypes, as jax uses)."""
    if name not in DTYPES:
        raise SdxError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def is_float(dtype) -> bool:
    """numpy floating types and the ml_dtypes ones (bfloat16, float8), which numpy does not call floating."""
    dtype = np.dtype(dtype)
    return np.issubdtype(dtype, np.floating) or dtype in _ML_FLOATS


_ML_FLOATS = {np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)}


# --------------------------------------------------------------------------------------------------
# Casting on the way out


class _LazyCast:
    """An array-like cast to `dtype` only when written (keeps peak memory at one tensor)."""

    def __init__(self, array, dtype: np.dtype):
        self.array, self.dtype, self.shape = array, np.dtype(dtype), tuple(array.shape)

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.array).astype(self.dtype, copy=False)
        return a if dtype is None else a.astype(dtype, copy=False)


def lazy_cast(array, dtype: np.dtype):
    """`array` as `dtype` for `sdx.io.write_safetensors`, converted when written; integer tensors stay as they are."""
    if not is_float(array.dtype) or np.dtype(array.dtype) == np.dtype(dtype):
        return array
    return _LazyCast(array, dtype)
