"""The device mesh and the sharding rules, kept out of the model code.

One `jax.sharding.Mesh` over every device with axes (`data`, `fsdp`): a batch is split over `data`;
parameters are replicated, or split over `fsdp` along their largest divisible axis when they would not
fit on one device. Multi-host runs call `jax.distributed.initialize()` first (see `initialize`);
on the CPU, tests fake devices with `XLA_FLAGS=--xla_force_host_platform_device_count=N`.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sdx.errors import SdxError

DATA, FSDP = "data", "fsdp"


def initialize() -> None:
    """Join a multi-host job when the environment describes one (JAX's own coordinator variables)."""
    if jax.process_count() == 1 and any(k in os.environ for k in ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS")):
        jax.distributed.initialize()


def make_mesh(fsdp: int = 1, devices=None) -> Mesh:
    """A (data, fsdp) mesh over `devices` (all by default); `fsdp` devices share each parameter."""
    devices = list(jax.devices() if devices is None else devices)
    if fsdp < 1 or len(devices) % fsdp:
        raise SdxError(f"--fsdp {fsdp} must divide the number of devices ({len(devices)})")
    grid = np.array(devices).reshape(len(devices) // fsdp, fsdp)  # (data, fsdp)
    return Mesh(grid, (DATA, FSDP))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Split the leading (batch) axis over `data` and `fsdp` together; the rest replicated."""
    return NamedSharding(mesh, P((DATA, FSDP), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def param_sharding(mesh: Mesh, min_size: int = 2**18):
    """(path, shape) -> Sharding: replicated when `fsdp` is 1 or the tensor is small, else split over
    `fsdp` along the largest axis it divides (ties: the last such axis, usually the output features)."""
    n = mesh.shape[FSDP]

    def rule(path: str, shape: tuple[int, ...]) -> NamedSharding:
        if n == 1 or int(np.prod(shape)) < min_size:
            return replicated(mesh)
        axes = [i for i, d in enumerate(shape) if d % n == 0]
        if not axes:
            return replicated(mesh)
        axis = max(axes, key=lambda i: (shape[i], i))
        spec = [None] * len(shape)
        spec[axis] = FSDP
        return NamedSharding(mesh, P(*spec))

    return rule


def check_batch(mesh: Mesh, batch: int) -> None:
    devices = mesh.devices.size
    if batch % devices:
        raise SdxError(
            f"a batch of {batch} cannot be split over {devices} devices; use a --batch-size that is a multiple of {devices}"
        )


def put_batch(mesh: Mesh, tree):
    """This host's share of a batch (numpy, leading axis = this host's samples) -> global arrays split over
    every device of `mesh` (`jax.make_array_from_process_local_data`: one host or many)."""
    def put(a):
        a = np.asarray(a)
        return jax.make_array_from_process_local_data(batch_sharding(mesh, a.ndim), a)
    return jax.tree.map(put, tree)
