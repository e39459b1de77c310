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
    """Join a multi-host job when the environment names its coordinator: `JAX_COORDINATOR_ADDRESS`
    (host:port of process 0) on every host, with `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` where JAX
    cannot detect them itself (it does on Cloud TPU pods, SLURM, Open MPI and Kubernetes). Must run
    before anything touches a device: JAX refuses to join once its backend is up."""
    if jax.distributed.is_initialized() or "JAX_COORDINATOR_ADDRESS" not in os.environ:
        return
    count, index = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
    try:
        jax.distributed.initialize(num_processes=int(count) if count else None,
                                   process_id=int(index) if index else None)
    except ValueError as e:  # JAX's own message names what is missing; a malformed number lands here too
        raise SdxError(f"joining the multi-host job of JAX_COORDINATOR_ADDRESS="
                       f"{os.environ['JAX_COORDINATOR_ADDRESS']} failed: {e}") from None


def make_mesh(fsdp: int = 1, devices=None) -> Mesh:
    """A (data, fsdp) mesh over `devices` (all by default); `fsdp` devices share each parameter."""
    devices = list(jax.devices() if devices is None else devices)
    if fsdp < 1 or len(devices) % fsdp:
        raise SdxError(f"--fsdp {fsdp} must divide the number of devices ({len(devices)})")
    grid = np.array(devices).reshape(len(devices) // fsdp, fsdp)  # (data, fsdp)
    mesh = Mesh(grid, (DATA, FSDP))
    if grid.flat[0].platform == "cpu" and len({d.process_index for d in grid.flat}) > 1:
        _connect(mesh)
    return mesh


def _connect(mesh: Mesh) -> None:
    """One collective over each device group of `mesh` (each axis, and both), now, while the processes that
    share it are in step (every one makes the mesh). XLA:CPU opens a group's gloo connections at the group's
    first collective and waits there at most 30 s for the other processes, while later collectives wait as
    long as they need; left to the first program that reduces over the group (a training step, which each
    process reaches after compiling it), two processes whose compiles end more than 30 s apart fail ("Gloo
    context initialization failed: DEADLINE_EXCEEDED"), as a loaded 2-core host showed."""
    ones = jax.make_array_from_process_local_data(batch_sharding(mesh, 1), np.ones(
        sum(d.process_index == jax.process_index() for d in mesh.devices.flat), np.float32))  # one per device
    spec = P((DATA, FSDP))
    for axes in (DATA, FSDP, (DATA, FSDP)):
        jax.block_until_ready(jax.jit(jax.shard_map(lambda x, axes=axes: jax.lax.psum(x, axes), mesh=mesh,
                                                    in_specs=spec, out_specs=spec))(ones))


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


def free_bytes(mesh: Mesh) -> int | None:
    """Memory one device of `mesh` can still allocate: the allocator's limit less what is in use on an
    accelerator; on the CPU, the host's MemAvailable shared by the mesh's devices there. None: unknown."""
    device = mesh.devices.flat[0]
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    local = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
    return kib * 1024 // local


def check_batch(mesh: Mesh, batch: int) -> None:
    devices = mesh.devices.size
    if batch % devices:
        raise SdxError(
            f"a batch of {batch} cannot be split over {devices} devices; use a --batch-size that is a multiple of {devices}"
        )


def global_batch_shapes(tree):
    """The shapes of this host's share of a batch -> the global batch's, as `put_batch` makes it (every
    host's samples stacked on the leading axis)."""
    def grow(s):
        return jax.ShapeDtypeStruct((s.shape[0] * jax.process_count(), *s.shape[1:]), s.dtype)
    return jax.tree.map(grow, tree)


def put_batch(mesh: Mesh, tree):
    """This host's share of a batch (numpy, leading axis = this host's samples) -> global arrays split over
    every device of `mesh` (`jax.make_array_from_process_local_data`: one host or many)."""
    def put(a):
        a = np.asarray(a)
        return jax.make_array_from_process_local_data(batch_sharding(mesh, a.ndim), a)
    return jax.tree.map(put, tree)


def to_host(x: jax.Array) -> np.ndarray:
    """The whole value of `x` as numpy on this host, also when it is split over devices of other hosts
    (then a collective: every process of the job must call it)."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    if x.is_fully_replicated:
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
