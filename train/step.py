"""One optimizer step as one jitted, ahead-of-time compiled, pure function.

    step(state, batch, seed_key) -> (state, metrics)

`compile_step` gives it; the loss also reads `constants`, arrays fixed for the run (the null text
conditioning), which the compiled program takes as arguments and `compile_step` binds.

`state` is a `TrainState` (trainable parameters, optax state, EMA, optimizer-step count); `batch` a dict
of arrays whose leading axis is the whole step's samples (`accumulation` micro-batches of `micro`
samples) and holds `index`, each sample's global index. Every random draw of the step comes from
`fold_in(fold_in(seed_key, step), index)`, one key per sample: a sample draws the same whether it sits
in a micro-batch of 1 or 64, on one device or split over a mesh, and a resumed run draws what the
uninterrupted one would have.

Gradient accumulation is a `lax.scan` over the micro-batches inside the step (unrolled on the CPU), so
the learning-rate schedule and the EMA count optimizer steps. The mean of the micro-batch losses (and gradients) equals
the loss of the whole batch because every micro-batch has the same size.

Warm starts: the program is kept on disk by `pipelines.executables` under a key of everything it is made
of (the loss, optimizer, schedule and EMA as values: dataclasses and partials of module functions, the
model's graph definition, the arguments' shapes and shardings), so a resumed run, or any later run of the
same configuration, reads it back without tracing. A step made of closures (a test's lambda schedule, a
plain optax transformation) is compiled as usual, JAX's own cache still applying.

Sharding: the state keeps the shardings it was placed with (parameters, gradients, optimizer state and
EMA over `fsdp`, see `sdx.mesh.param_sharding`), the batch is split over every device, and the state's
buffers are donated to the step. Constants already placed on the mesh keep their shardings (a LoRA run's
frozen UNet, split over `fsdp` as the parameters would be); the others are replicated.

A module trained in part (LoRA: its adapters) has its other variables in the constants and a loss that
merges them back (`trained_in_part`): only the trained part is in the state, its gradients, the
optimizer's moments, the EMA and the checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from pipelines import cpu_kernels, executables
from sdx import mesh as meshlib
from train import ema as emalib

LossFn = Callable[[Any, Mapping[str, jax.Array], jax.Array, Any], tuple[jax.Array, dict[str, jax.Array]]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """params: the trainable parameters (float32 master weights); opt: optax state; ema: float32 shadow
    of params, or None; step: optimizer steps done (int32 scalar)."""

    params: Any
    opt: Any
    ema: Any
    step: jax.Array


def init_state(params, tx: optax.GradientTransformation, use_ema: bool) -> TrainState:
    """The state before the first step: the optimizer's per-parameter trees (Adam's moments) and the EMA
    take the parameters' shardings, its scalars (counts) and the step are replicated over the same
    devices. (A plain `jax.jit(tx.init)` would put every moment, unsplit, on the default device.)"""
    _, opt_shardings, replicated = _opt_layout(params, tx)
    opt = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    ema = jax.tree.map(lambda p: jnp.array(p, dtype=jnp.float32, copy=True), params) if use_ema else None
    return TrainState(params=params, opt=opt, ema=ema, step=jax.device_put(jnp.zeros((), jnp.int32), replicated))


def abstract_state(params, tx: optax.GradientTransformation, use_ema: bool) -> TrainState:
    """`init_state`'s shapes, dtypes and shardings (`jax.ShapeDtypeStruct`s), computing and allocating
    nothing: what a resumed run restores its checkpoint onto, so that it never holds a second state (SDXL's
    AdamW + EMA state in float32 is about 41 GB)."""
    opt_shapes, opt_shardings, replicated = _opt_layout(params, tx)
    abstract = lambda x, sharding: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    opt = jax.tree.map(abstract, opt_shapes, opt_shardings)
    params = jax.tree.map(lambda x: abstract(x, x.sharding), params)
    ema = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32, sharding=x.sharding), params) if use_ema else None
    return TrainState(params=params, opt=opt, ema=ema, step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))


def _opt_layout(params, tx: optax.GradientTransformation) -> tuple[Any, Any, jax.sharding.Sharding]:
    """(the optimizer state's shapes (`jax.eval_shape` of its init), its shardings, the replicated sharding
    over the parameters' devices)."""
    shardings = jax.tree.map(lambda x: x.sharding, params)
    replicated = _replicated(jax.tree.leaves(shardings)[0])
    masked = lambda x: isinstance(x, optax.MaskedNode)  # a frozen parameter's place (optimizer.FrozenExcept)
    opt_shapes = jax.eval_shape(tx.init, params)
    opt_shardings = optax.tree_map_params(tx, lambda p, s: p if masked(p) else s, opt_shapes,
                                          shardings, transform_non_params=lambda _: replicated, is_leaf=masked)
    return opt_shapes, opt_shardings, replicated


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """A sharding that replicates an array over the devices of `sharding`."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return meshlib.replicated(sharding.mesh)
    if len(sharding.device_set) == 1:
        return sharding
    raise TypeError(f"parameters placed with {sharding}; place them with a NamedSharding over a mesh")


def sample_keys(seed_key: jax.Array, step: jax.Array, index: jax.Array) -> jax.Array:
    """One key per sample: fold_in(fold_in(seed_key, step), index). index: int[B] -> keys [B]."""
    step_key = jax.random.fold_in(seed_key, step)
    return jax.vmap(lambda i: jax.random.fold_in(step_key, i))(index)


def _micro_batches(tree, accumulation: int):
    """[accumulation * micro, ...] -> [accumulation, micro, ...], micro-batch j taking samples j, j + A,
    j + 2A, ...: each micro-batch keeps the batch axis's split over the devices."""
    def split(x):
        micro = x.shape[0] // accumulation
        x = x.reshape(micro, accumulation, *x.shape[1:])  # (micro, A, ...)
        return jnp.swapaxes(x, 0, 1)  # (A, micro, ...)
    return jax.tree.map(split, tree)


def _unroll() -> bool:
    """The scan's unroll factor: whole on the CPU backend, whose convolutions run about 25x slower inside a
    loop body than outside one (a VAE step at batch 16: 34 s against 1.3 s); a rolled loop elsewhere, which
    keeps one micro-batch's activations alive at a time."""
    return jax.default_backend() == "cpu"


def _accumulated(grad_fn, params, micro, constants):
    """The mean loss, gradients and aux over micro-batches ([A, micro, ...] leaves), one at a time: the
    gradients summed in the scan's carry (their shapes are the parameters'), each micro-batch's loss and aux
    stacked as its outputs, so the loss is traced once, inside the scan (an `eval_shape` of it for the aux's
    shapes traced it twice: 1.3-2.5 s more per compile of a tiny model's step)."""
    def accumulate(grad_sum, xs):
        (loss, aux), grads = grad_fn(params, *xs, constants)
        return jax.tree.map(jnp.add, grad_sum, grads), (loss, aux)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    grad_sum, (losses, aux) = jax.lax.scan(accumulate, zeros, micro, unroll=_unroll())
    count = jax.tree.leaves(micro)[0].shape[0]
    mean = lambda a: jnp.mean(a.astype(jnp.float32), axis=0)  # (A, ...) -> (...)
    return mean(losses), jax.tree.map(lambda g: g / count, grad_sum), jax.tree.map(mean, aux)


def trained_in_part(loss_fn: LossFn, constants, base) -> tuple[LossFn, Any]:
    """(loss, constants) for `compile_step` when the step trains part of a module: `base` (an nnx.State,
    the module's variables that do not train) rides in the constants beside `constants`, and the loss
    merges it with the trained parameters before calling `loss_fn`. A `base` without leaves (the whole
    module trains) changes nothing."""
    if not jax.tree.leaves(base):
        return loss_fn, constants
    return functools.partial(_with_base, loss_fn), {"task": constants, "base": base}


def _with_base(loss_fn: LossFn, params, batch, keys, constants):
    return loss_fn(nnx.merge_state(params, constants["base"]), batch, keys, constants["task"])


def train_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    seed_key: jax.Array,
    constants,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    accumulation: int,
    ema: emalib.EMAConfig | None,
    learning_rate: Callable[[jax.Array], jax.Array],
) -> tuple[TrainState, dict[str, jax.Array]]:
    """See the module docstring. loss_fn(params, micro_batch, keys, constants) -> (scalar loss, aux metrics)."""
    keys = sample_keys(seed_key, state.step, batch["index"])
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if accumulation == 1:
        (loss, aux), grads = grad_fn(state.params, dict(batch), keys, constants)
    else:
        loss, grads, aux = _accumulated(grad_fn, state.params, _micro_batches((dict(batch), keys), accumulation),
                                        constants)

    updates, opt = tx.update(grads, state.opt, state.params)
    params = optax.apply_updates(state.params, updates)
    step = state.step + 1
    shadow = emalib.update(ema, state.ema, params, step) if ema is not None else None
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "lr": learning_rate(state.step), **aux}
    return TrainState(params=params, opt=opt, ema=shadow, step=step), metrics


def step_program(state: TrainState, batch_shapes: Mapping[str, jax.ShapeDtypeStruct], seed_key: jax.Array, mesh,
                 constants=None, **kw) -> tuple[functools.partial, tuple, dict]:
    """What `compile_step` compiles, as (function, arguments, jit options): `pipelines.executables` keys the
    program by them and by the compiler options `compile_step` adds on a CPU. `constants` come back placed
    on `mesh` (`_placed_constants`)."""
    replicated = meshlib.replicated(mesh)
    constants = _placed_constants({} if constants is None else constants, mesh)
    state_shardings = jax.tree.map(lambda x: x.sharding, state)
    batch_shardings = {k: meshlib.batch_sharding(mesh, len(v.shape)) for k, v in batch_shapes.items()}
    shapes = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_shardings[k]) for k, v in batch_shapes.items()}
    options = dict(in_shardings=(state_shardings, batch_shardings, replicated, jax.tree.map(lambda x: x.sharding, constants)),
                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))
    return functools.partial(train_step, **kw), (state, shapes, seed_key, constants), options


def _placed_constants(constants, mesh):
    """`constants` with each leaf not yet placed on `mesh` replicated over it (one host or many); a leaf
    placed there already (a NamedSharding over `mesh`) stays as it is, not copied."""
    on_mesh = lambda x: isinstance(x, jax.Array) and isinstance(x.sharding, jax.sharding.NamedSharding) \
        and x.sharding.mesh == mesh
    leaves, tree = jax.tree.flatten(constants)
    moved = iter(jax.jit(lambda xs: xs, out_shardings=meshlib.replicated(mesh))([x for x in leaves if not on_mesh(x)]))
    return jax.tree.unflatten(tree, [x if on_mesh(x) else next(moved) for x in leaves])


def compile_step(state: TrainState, batch_shapes: Mapping[str, jax.ShapeDtypeStruct], seed_key: jax.Array, mesh,
                 constants=None, **kw) -> Callable[[TrainState, Mapping[str, jax.Array], jax.Array], tuple]:
    """`train_step` compiled ahead of time for these shapes (or read back, see the module docstring), as
    step(state, batch, seed_key) with `constants` (a tree of arrays, default none) bound: the state keeps its
    shardings and is donated, the batch is split over every device of `mesh`, metrics come back replicated.
    kw: `train_step`'s keyword arguments. On a CPU it is compiled with the sampler's XLA options
    (`pipelines.cpu_kernels`: a training step 0.84-0.88× the time of XLA's defaults, benchmarks/LOG.md)."""
    fn, args, options = step_program(state, batch_shapes, seed_key, mesh, constants, **kw)
    compiled = executables.compile(fn, *args, compiler_options=cpu_kernels.compiler_options(mesh), **options)
    constants = args[-1]
    return lambda state, batch, seed_key: compiled(state, batch, seed_key, constants)
