"""Resumable training checkpoints: a thin layer over an Orbax `CheckpointManager`.

    ckpts = Checkpoints(output_dir / "checkpoints", keep=cfg.checkpoints_total_limit, async_save=True)
    ckpts.save(step, state, meta, force=False) -> bool  # returns once the arrays are on the host;
                                               # force=True: once the checkpoint is committed
    ckpts.latest() -> int | None               # newest *complete* checkpoint on disk
    ckpts.steps() -> list[int]                 # every complete checkpoint, oldest first
    ckpts.restore(step_or_path, like) -> (state, meta)
    ckpts.wait(); ckpts.close()                # (also a context manager)
    resolve(cfg.resume_from_checkpoint, output_dir) -> Path | None   # diffusers' semantics
    restore(path, like) -> (state, meta)       # one checkpoint folder, without a manager

What a checkpoint holds is only what changes during training: `state`, a pytree of arrays (the
trainable parameters, the optax state, the EMA shadow, the step count, a PRNG key — typed keys are
fine), and `meta`, a small JSON dict (the data iterator's position, the config, ...). Frozen models
(VAE, text encoders) never go in; they are reloaded from the model folder.

Small leaves are saved packed: every leaf of at most `PACKED_MAX` elements that is whole on this host
(not split across hosts) goes into one vector per dtype, copied to the host in one transfer. Orbax's cost
is per array (its asyncio machinery: 2-3 ms an array on a 2-core CPU; the tiny_xl UNet's AdamW + EMA state,
1,169 arrays, committed in 3.08 s and restored in 2.35 s array by array, 0.34 s and 0.21 s packed:
benchmarks/checkpoint.py); a real model's state has as many small leaves (norms, biases, the step). The
large ones are saved alone, with their shardings. `layout/`
lists every leaf in tree order (its name, dtype, shape, and its offset in its dtype's vector when packed):
restore reads it first, checks the live state against it, reads the arrays and places the packed leaves
with the live state's shardings. (A checkpoint without `layout/`, written before packing, is one tree of
arrays and restores as such.)

Layout (Orbax's), one folder per optimizer step under `output_dir/checkpoints/`:

    output_dir/checkpoints/500/state/         the arrays (OCDBT / zarr), one file set per host
    output_dir/checkpoints/500/layout/metadata  the list of leaves (JSON)
    output_dir/checkpoints/500/meta/metadata  the JSON dict
    output_dir/checkpoints/500/_CHECKPOINT_METADATA, commit_success.txt
    output_dir/checkpoints/1000.orbax-checkpoint-tmp/   a save in flight (or cut off by a crash)

Atomicity: Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only
after every host's writes have finished (the rename is the commit; on object stores without an atomic
rename it writes `commit_success.txt` instead). Only committed folders count as checkpoints here:
`latest`, `steps` and `resolve` never return a folder whose write was interrupted, and a new
`Checkpoints` removes the leftovers of interrupted writes.

Asynchrony: `save` waits for the previous save to be committed, copies every array to host memory
and returns; a background thread writes the files and commits. The packed leaves are copied into their
vectors (new host memory) before `save` returns; the others by Orbax's device-to-host transfer, also
done before `save` returns for every array (only a PyTree handler with
`save_device_host_concurrent_bytes` defers some, and none is set here). So the caller may donate the
state's buffers to the next step at once: the checkpoint holds its own host copy (on the CPU backend
a zero-copy view that keeps the buffer alive, so XLA declines the donation and the step copies).

Steps: saving a step this object already saved does nothing (returns False), e.g. the stop checkpoint
right after the periodic one of the same step. Checkpoints this object did not write that lie beyond
the point the current run started from (the step it restored from this directory, else the step being
saved) belong to an abandoned run (resumed from an earlier step, or started afresh in the same
folder); they are deleted before the first save, with a log line, so that "latest" always names the
newest state of the current run. Nothing is deleted before that first save.

Multi-host: every process calls every method with the same arguments; Orbax synchronises the hosts,
each writes its own shards, and the primary host commits. Nothing here is host-specific.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import tree as ocp_tree

from sdx import io
from sdx.errors import SdxError

STATE, LAYOUT, META = "state", "layout", "meta"
CHECKPOINTS_DIR = "checkpoints"  # under --output_dir
PACKED_MAX = 2**18  # elements: a leaf this small is saved packed (as `sdx.mesh.param_sharding` never splits it)
COMPRESSED = False  # zstd for the state's arrays (see `_handlers`)


def _handlers() -> dict[str, ocp.CheckpointHandler]:
    """The state's arrays uncompressed (`COMPRESSED`): Orbax's default zstd saves under a tenth of the bytes
    of float32 weights and moments and spends host CPU on every save, in the time a preempted machine has
    for its last checkpoint (`benchmarks/checkpoint.py --compare compression`: SD 1.5's UNet at half width,
    3.3 GiB of state, committed in 9.1 s against 10.4 s, 8 % larger, on a 2-core CPU whose disk is the
    limit). Compressed checkpoints (written before) restore as well."""
    return {STATE: ocp.PyTreeCheckpointHandler(use_compression=COMPRESSED), LAYOUT: ocp.JsonCheckpointHandler(),
            META: ocp.JsonCheckpointHandler()}


def _restore_args(target: Any) -> ocp.args.PyTreeRestore:
    """Read the state's arrays as `target` (ShapeDtypeStructs with shardings, numpy arrays) gives them."""
    return ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))


def _is_complete(path: Path) -> bool:
    """A committed checkpoint folder: not a temporary one, and both items present."""
    return (path.is_dir() and ocp.step.is_path_finalized(path)
            and (path / STATE).is_dir() and (path / META).is_dir())


def _is_temporary(path: Path) -> bool:
    return ocp.step.TMP_DIR_SUFFIX in path.name


def _os_error(e: BaseException) -> OSError | None:
    """The OS error behind a failed write (tensorstore's is only in the text), or None for another kind."""
    if isinstance(e, OSError) and e.errno is not None:
        return e
    found = re.search(r"os_error_code='?(\d+)", str(e))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1)))) if found else None


def complete_steps(directory: str | os.PathLike) -> list[int]:
    """The committed checkpoints' steps in `directory`, oldest first (in-flight or cut-off writes excluded)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = ocp.step.standard_name_format().find_all(directory)
    return sorted(m.step for m in found if _is_complete(Path(m.path)))


def _abstract(leaf: Any) -> Any:
    """Shape, dtype and sharding of a leaf of the live state: the restore target."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    return ocp.utils.to_shape_dtype_struct(leaf)


def _is_key(dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _name(path: tuple) -> str:
    """A leaf's dotted name from its tree path: `opt.0.mu.kernel.value`."""
    parts = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return ".".join(map(str, parts)) or "<root>"


def _pack(state: Any) -> tuple[dict[str, dict[str, Any]], list[list]]:
    """(arrays, layout): the leaves saved alone ({"leaves": {tree index: array}}) and the packed vectors
    ({"packed": {dtype: host vector}}), and the layout rows [name, dtype, shape, offset or None]."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    small = [i for i, (_, x) in enumerate(flat) if x.size <= PACKED_MAX and not _is_key(x.dtype)
             and (x.is_fully_addressable or x.is_fully_replicated)]
    # one batched device-to-host copy; a leaf replicated across hosts from this host's copy
    hosts = dict(zip(small, jax.device_get([flat[i][1] if flat[i][1].is_fully_addressable
                                            else flat[i][1].addressable_data(0) for i in small])))
    alone, groups, rows = {}, {}, []
    for i, (path, x) in enumerate(flat):
        offset = None
        if i in hosts:
            group = groups.setdefault(str(x.dtype), [])
            offset = sum(v.size for v in group)
            group.append(np.ravel(hosts[i]))
        else:
            alone[str(i)] = x
        rows.append([_name(path), str(x.dtype), list(x.shape), offset])
    arrays = {"leaves": alone, "packed": {dtype: np.concatenate(group) for dtype, group in groups.items()}}
    return {k: v for k, v in arrays.items() if v}, rows


def _unpack(arrays: Mapping[str, Mapping[str, Any]], rows: list[list], like: list) -> list:
    """The leaves in tree order: those saved alone as read, the packed ones cut from their vector and
    placed with the sharding of the live state's leaf."""
    out = []
    for i, ((_, dtype, shape, offset), want) in enumerate(zip(rows, like, strict=True)):
        if offset is None:
            out.append(arrays["leaves"][str(i)])
            continue
        host = np.asarray(arrays["packed"][dtype][offset:offset + int(np.prod(shape))]).reshape(shape)
        out.append(jax.make_array_from_callback(tuple(shape), want.sharding, lambda index, host=host: host[index]))
    return out


def _check_matches(saved: Mapping[str, tuple], wanted: Mapping[str, Any], where: Path) -> None:
    """Every array of the training state is in the checkpoint with its shape and dtype, and nothing else is.
    saved: {name: (dtype text, shape)}; wanted: {name: live leaf or its abstract value}."""
    problems = []
    for key in sorted(wanted.keys() - saved.keys()):
        problems.append(f"{key} is not in the checkpoint")
    for key in sorted(saved.keys() - wanted.keys()):
        problems.append(f"{key} is in the checkpoint but not in this run's state")
    for key in sorted(saved.keys() & wanted.keys()):
        (have_dtype, have_shape), want = saved[key], wanted[key]
        if _is_key(want.dtype):
            continue  # stored as its raw uint32 data, of another shape (Orbax checks it on restore)
        if list(have_shape) != list(want.shape) or have_dtype != str(want.dtype):
            problems.append(f"{key}: the checkpoint has {have_dtype}{list(have_shape)}, "
                            f"this run {want.dtype}{list(want.shape)}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise SdxError(f"checkpoint {where} does not match this run's training state (was it written with another "
                       f"model, optimizer or EMA setting?): {shown}")


class Checkpoints:
    """Save, list and restore training checkpoints in `directory` (see the module docstring).

    keep: keep only the newest `keep` checkpoints (diffusers' `checkpoints_total_limit`); None keeps all.
    async_save: write in a background thread (False: `save` returns once the checkpoint is committed).
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int | None = None, async_save: bool = True):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 or None, got {keep}")
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            cleanup_tmp_directories=True,  # the leftovers of writes cut off by a crash
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_handlers())
        self._written: set[int] = set()  # steps this object saved
        self._in_flight: int | None = None  # the step of the last save started
        self._resumed_from: int | None = None  # the step restored from this directory, if any
        self._closed = False

    # -- writing

    def save(self, step: int, state: Any, meta: Mapping[str, Any], *, force: bool = False) -> bool:
        """Start writing checkpoint `step`; returns False when this object already saved that step.

        Waits for the previous save to be committed, then returns as soon as `state`'s arrays are copied
        to the host (the caller may donate them right after). `meta` must be a JSON-able dict.
        force: also wait until this checkpoint is committed (the last one before the process exits).
        """
        step = int(step)
        if step in self._written:
            if force:
                self.wait()
            return False
        try:
            meta = json.loads(json.dumps(dict(meta), allow_nan=False))
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint meta must be a JSON-able dict: {e}") from None
        self.wait()
        self._manager.reload()  # the manager's list of steps, read from disk
        last_good = step - 1 if self._resumed_from is None else min(self._resumed_from, step - 1)
        stale = [s for s in self._manager.all_steps() if s > last_good and s not in self._written]
        for s in stale:  # left by a run that went further than the point this one started from
            _stderr(f"removing checkpoint {self.path(s)}: an earlier run's, past the step this run started from")
            self._manager.delete(s)
        arrays, layout = _pack(state)
        args = ocp.args.Composite(**{STATE: ocp.args.PyTreeSave(arrays), LAYOUT: ocp.args.JsonSave(layout),
                                     META: ocp.args.JsonSave(meta)})
        self._in_flight = step
        # force=True to Orbax: the caller decides when to save (Orbax's own policy would skip steps)
        with self._write_errors():
            self._manager.save(step, args=args, force=True)
        self._written.add(step)
        if force:
            self.wait()
        return True

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raises what its background write raised
        (a write the file system refused, a full disk: `SdxError`)."""
        with self._write_errors():
            self._manager.wait_until_finished()

    @contextlib.contextmanager
    def _write_errors(self) -> Iterator[None]:
        """A write the file system refused (Orbax reports tensorstore's as ValueError with the OS error in
        its text) becomes one SdxError; the cut-off checkpoint's temporary folder is removed."""
        try:
            yield
        except (OSError, ValueError, RuntimeError) as e:
            error = _os_error(e)
            if error is None:
                raise
            step, self._in_flight = self._in_flight, None
            for leftover in self.directory.glob(f"{step}{ocp.step.TMP_DIR_SUFFIX}*"):
                shutil.rmtree(leftover, ignore_errors=True)
            latest = self.latest()
            kept = f"the newest complete one is {self.path(latest)}" if latest is not None else "no complete one yet"
            raise SdxError(f"checkpoint: {io.write_error(self.path(step), error)} ({kept})") from None

    def close(self) -> None:
        """Wait for the save in flight and release Orbax's threads. Idempotent."""
        if not self._closed:
            self._closed = True
            self._manager.close()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints on disk, oldest first (a save in flight is not one yet)."""
        return complete_steps(self.directory)

    def latest(self) -> int | None:
        """The newest committed checkpoint's step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> Path:
        return self.directory / str(int(step))

    def restore(self, checkpoint: int | str | os.PathLike, like: Any) -> tuple[Any, dict[str, Any]]:
        """Read checkpoint `checkpoint` (a step in this directory, or a checkpoint folder anywhere).

        like: the live training state (or its `jax.ShapeDtypeStruct`s): the restored state has its tree
        structure (namedtuples, dataclasses, nnx.State), dtypes and shardings, so a state restored onto a
        mesh is laid out as the state it replaces. Every array must be in the checkpoint with the same
        shape and dtype (SdxError naming the differences otherwise).
        """
        self.wait()  # a checkpoint in flight may be the one asked for
        path = self.path(checkpoint) if isinstance(checkpoint, int) else Path(checkpoint)
        if not _is_complete(path):
            raise SdxError(f"{path} is not a complete checkpoint")
        out = restore(path, like)
        if path.absolute().parent == self.directory and path.name.isdigit():
            self._resumed_from = int(path.name)
        return out


def restore(path: str | os.PathLike, like: Any) -> tuple[Any, dict[str, Any]]:
    """`Checkpoints.restore` for one checkpoint folder, without a manager (see there)."""
    path = Path(path).absolute()
    flat, tree = jax.tree_util.tree_flatten_with_path(like)
    wanted = {_name(p): x for p, x in flat}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_handlers())) as ckptr:
        if not (path / LAYOUT).is_dir():
            return _restore_tree(ckptr, path, like, wanted)
        read = ckptr.restore(path, args=ocp.args.Composite(**{LAYOUT: ocp.args.JsonRestore(),
                                                                META: ocp.args.JsonRestore()}))
        rows = read[LAYOUT]
        _check_matches({name: (dtype, shape) for name, dtype, shape, _ in rows}, wanted, path)
        like_leaves = list(wanted.values())
        sizes = {}
        for _, dtype, shape, offset in rows:
            if offset is not None:
                sizes[dtype] = max(sizes.get(dtype, 0), offset + int(np.prod(shape)))
        target = {"leaves": {str(i): _abstract(like_leaves[i]) for i, row in enumerate(rows) if row[3] is None},
                  "packed": {dtype: np.empty(n, dtype) for dtype, n in sizes.items()}}
        target = {k: v for k, v in target.items() if v}
        arrays = ckptr.restore(path, args=ocp.args.Composite(**{STATE: _restore_args(target)}))[STATE]
    return jax.tree.unflatten(tree, _unpack(arrays, rows, like_leaves)), dict(read[META])


def _restore_tree(ckptr: ocp.Checkpointer, path: Path, like: Any, wanted: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A checkpoint without a layout (written before packing): the state is one tree of arrays."""
    saved = ckptr.metadata(path).item_metadata[STATE]
    saved_flat = ocp_tree.to_flat_dict(saved.tree if hasattr(saved, "tree") else saved)
    _check_matches({".".join(k): (str(v.dtype), list(v.shape)) for k, v in saved_flat.items()}, wanted, path)
    args = ocp.args.Composite(**{STATE: _restore_args(jax.tree.map(_abstract, like)),
                                 META: ocp.args.JsonRestore()})
    out = ckptr.restore(path, args=args)
    return out[STATE], dict(out[META])


def _stderr(message: str) -> None:
    if jax.process_index() == 0:
        print(message, file=sys.stderr)


def resolve(resume_from_checkpoint: str | os.PathLike | None, output_dir: str | os.PathLike, *,
            log: Callable[[str], None] = _stderr) -> Path | None:
    """diffusers' `--resume_from_checkpoint`: the checkpoint folder to resume from, or None to start fresh.

    None or "": start fresh. "latest": the newest committed checkpoint in `output_dir/checkpoints`, or
    None (with a log line, as diffusers) when there is none. Anything else names one checkpoint folder:
    a path, or a folder name (a step) inside `output_dir/checkpoints`; one that does not exist, is not a
    checkpoint or whose write was interrupted is an SdxError.
    """
    if resume_from_checkpoint is None or str(resume_from_checkpoint) == "":
        return None
    root = Path(output_dir) / CHECKPOINTS_DIR
    if str(resume_from_checkpoint) == "latest":
        steps = complete_steps(root)
        if not steps:
            log(f"no checkpoint in {root} to resume from; starting a new training run")
            return None
        return (root / str(steps[-1])).absolute()
    given = Path(resume_from_checkpoint)
    path = given if given.exists() or given.is_absolute() else root / given
    flag = f"--resume_from_checkpoint {resume_from_checkpoint}"
    if not path.exists():
        raise SdxError(f"{flag}: {given} does not exist (nor {root / given}); name a checkpoint folder such as "
                       f"{root / '500'}, or 'latest'")
    if not path.is_dir():
        raise SdxError(f"{flag}: {path} is a file, not a checkpoint folder")
    if _is_temporary(path):
        raise SdxError(f"{flag}: {path} is a checkpoint whose write was interrupted; use a complete one or 'latest'")
    if not _is_complete(path):
        if complete_steps(path):
            raise SdxError(f"{flag}: {path} is a folder of checkpoints; name one of them "
                           f"(e.g. {path / str(complete_steps(path)[-1])}) or use 'latest'")
        raise SdxError(f"{flag}: {path} is not a checkpoint folder (one holds {STATE}/ and {META}/, "
                       f"e.g. {root / '500'})")
    return path.absolute()
