"""train.checkpoint and train.signals: exact round trips, shardings, keep-K, atomicity under crashes,
async saves against donated buffers, --resume_from_checkpoint, graceful stop on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sdx.errors import SdxError
from tests.processes import child_env
from train import checkpoint
from train.signals import GracefulStop

REPO = Path(__file__).resolve().parents[1]
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # how Orbax names a step folder until its write is committed


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
    params: object
    opt: object
    ema: object
    step: jax.Array
    key: jax.Array
    raw_key: jax.Array


def make_state(seed: int, *, steps: int = 2, width: int = 4, ema: bool = True) -> State:
    """A small training state whose every leaf depends on `seed` (so two seeds differ everywhere)."""
    params = nnx.state(nnx.Linear(3, width, rngs=nnx.Rngs(seed)), nnx.Param)
    tx = optax.adamw(1e-2)
    opt = tx.init(params)
    for i in range(steps):  # non-trivial moments and count
        grads = jax.tree.map(lambda p: jnp.sin(p * (i + 1) + seed), params)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    return State(
        params=params, opt=opt, ema=jax.tree.map(lambda p: p * 0.5, params) if ema else None,
        step=jnp.int32(steps + 10 * seed), key=jax.random.key(seed), raw_key=jax.random.PRNGKey(seed + 1),
    )


def leaves(state) -> list[np.ndarray]:
    def host(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)
    return [host(x) for x in jax.tree.leaves(state)]


def assert_same(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)  # bit-exact: same dtype, every element equal


def run_python(script: str, devices: int | None = None, **kw) -> subprocess.CompletedProcess:
    env = child_env(devices=devices, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, **kw)


# -- round trips


def test_round_trip_is_bit_exact(tmp_path):
    state = make_state(1)
    meta = {"data": '{"next_index": 48, "epoch": 1}', "config_hash": "3f2a", "nested": {"a": [1, 2.5, None]}}
    with checkpoint.Checkpoints(tmp_path, keep=None) as ckpts:
        assert ckpts.save(12, state, meta)
        ckpts.wait()
        assert ckpts.latest() == 12
        like = make_state(2)  # same structure, other values: nothing may leak from it
        restored, restored_meta = ckpts.restore(12, like)
    assert_same(restored, state)
    assert restored_meta == meta
    assert isinstance(restored.opt[0], optax.ScaleByAdamState)  # namedtuples come back as namedtuples
    assert isinstance(restored.params, nnx.State)
    assert restored.ema is not None
    assert jax.dtypes.issubdtype(restored.key.dtype, jax.dtypes.prng_key)
    assert restored.raw_key.dtype == jnp.uint32
    # the restored key draws what the saved one draws
    np.testing.assert_array_equal(jax.random.normal(restored.key, (3,)), jax.random.normal(state.key, (3,)))


def test_small_leaves_are_saved_packed_one_vector_per_dtype(tmp_path, monkeypatch):
    """Leaves of at most PACKED_MAX elements go into one vector per dtype (offsets in tree order), larger
    ones and PRNG keys alone; the layout lists them all and the round trip is bit-exact."""
    monkeypatch.setattr(checkpoint, "PACKED_MAX", 12)
    r = np.random.default_rng(0)
    state = {"bias": jnp.asarray(r.standard_normal(4), jnp.float32), "big": jnp.arange(13, dtype=jnp.float32),
             "count": jnp.int32(7), "half": jnp.asarray(r.standard_normal(5), jnp.bfloat16),
             "kernel": jnp.asarray(r.standard_normal((3, 4)), jnp.float32), "key": jax.random.key(3)}
    like = jax.tree.map(lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else jnp.zeros_like(x), state)
    with checkpoint.Checkpoints(tmp_path) as ckpts:
        ckpts.save(1, state, {})
        ckpts.wait()
        restored, _ = ckpts.restore(1, like)
    assert json.loads((tmp_path / "1" / "layout" / "metadata").read_text()) == [
        ["bias", "float32", [4], 0], ["big", "float32", [13], None], ["count", "int32", [], 0],
        ["half", "bfloat16", [5], 0], ["kernel", "float32", [3, 4], 4], ["key", "key<fry>", [], None]]
    assert_same(restored, state)


def test_arrays_are_stored_uncompressed(tmp_path):
    """zstd off: a leaf of zeros takes its whole size on disk (compressed, its 4 MiB would take a few KiB)."""
    zeros = jnp.zeros(2**20, jnp.float32)  # more than PACKED_MAX elements: saved by Orbax on its own
    with checkpoint.Checkpoints(tmp_path) as ckpts:
        ckpts.save(1, {"zeros": zeros}, {})
        ckpts.wait()
        restored, _ = ckpts.restore(1, {"zeros": jnp.ones_like(zeros)})
    stored = sum(f.stat().st_size for f in (tmp_path / "1" / "state").rglob("*") if f.is_file())
    assert stored >= zeros.nbytes, stored
    assert_same(restored, {"zeros": zeros})


def test_a_checkpoint_written_before_packing_restores(tmp_path):
    """A checkpoint without layout/ (the state saved as one tree of arrays, zstd-compressed as Orbax's
    default handler writes it) restores, and is checked."""
    import orbax.checkpoint as ocp

    state, meta = make_state(1), {"data": "position"}
    handler = ocp.CompositeCheckpointHandler(state=ocp.StandardCheckpointHandler(), meta=ocp.JsonCheckpointHandler())
    with ocp.Checkpointer(handler) as ckptr:
        ckptr.save(tmp_path / "3", args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    with checkpoint.Checkpoints(tmp_path) as ckpts:
        assert ckpts.latest() == 3
        restored, restored_meta = ckpts.restore(3, make_state(2))
        with pytest.raises(SdxError, match=r"mu\.kernel\.value: the checkpoint has float32\[3, 4\], this run float32\[3, 5\]"):
            ckpts.restore(3, make_state(0, width=5))
    assert_same(restored, state)
    assert restored_meta == meta


def test_synchronous_save_is_committed_on_return(tmp_path):
    state = make_state(3, ema=False)
    with checkpoint.Checkpoints(tmp_path, async_save=False) as ckpts:
        ckpts.save(5, state, {})
        assert ckpts.latest() == 5  # no wait(): the write is done
        restored, _ = ckpts.restore(5, state)
    assert restored.ema is None
    assert_same(restored, state)


def test_restore_checks_the_state_matches(tmp_path):
    with checkpoint.Checkpoints(tmp_path) as ckpts:
        ckpts.save(1, make_state(0, ema=False), {})
        with pytest.raises(SdxError, match=r"does not match.*ema\.kernel.*not in the checkpoint"):
            ckpts.restore(1, make_state(0, ema=True))
        with pytest.raises(SdxError, match=r"mu\.kernel\.value: the checkpoint has float32\[3, 4\], this run float32\[3, 5\]"):
            ckpts.restore(1, make_state(0, ema=False, width=5))
        wrong_dtype = dataclasses.replace(make_state(0, ema=False), step=jnp.float32(0))
        with pytest.raises(SdxError, match=r"step: the checkpoint has int32\[\], this run float32\[\]"):
            ckpts.restore(1, wrong_dtype)
        with pytest.raises(SdxError, match="not a complete checkpoint"):
            ckpts.restore(2, make_state(0, ema=False))


def test_meta_must_be_json(tmp_path):
    with checkpoint.Checkpoints(tmp_path) as ckpts:
        with pytest.raises(TypeError, match="JSON"):
            ckpts.save(1, make_state(0), {"position": np.arange(3)})
        with pytest.raises(TypeError, match="JSON"):
            ckpts.save(1, make_state(0), {"loss": float("nan")})
        assert ckpts.steps() == []


def test_restore_onto_a_mesh_takes_the_shardings_of_the_live_state(tmp_path):
    """Saved from one device and from an FSDP layout; restored onto the FSDP layout of 2 fake devices."""
    proc = run_python(f"""
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from tests.test_train_checkpoint import make_state, assert_same
        from train import checkpoint
        assert jax.device_count() == 2, jax.devices()
        mesh = Mesh(np.array(jax.devices()), ("fsdp",))

        def fsdp(x):  # split the last axis when it divides, else replicate (what an FSDP rule does)
            if getattr(x, "ndim", 0) >= 1 and x.shape[-1] % 2 == 0 and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                spec = P(*([None] * (x.ndim - 1)), "fsdp")
            else:
                spec = P()
            return jax.device_put(x, NamedSharding(mesh, spec))

        single = make_state(1)                 # on device 0
        like = jax.tree.map(fsdp, make_state(2))
        split = [x for x in jax.tree.leaves(like) if not x.sharding.is_fully_replicated]
        assert len(split) >= 8, len(split)     # kernels, biases, their moments and EMA are split
        for packed_max in (checkpoint.PACKED_MAX, 4):  # every leaf packed; kernels (3 x 4) saved alone
            checkpoint.PACKED_MAX = packed_max
            ckpts = checkpoint.Checkpoints({str(tmp_path)!r} + f"/{{packed_max}}")
            ckpts.save(1, single, {{}})
            ckpts.save(2, jax.tree.map(fsdp, single), {{}})
            ckpts.wait()
            for step in (1, 2):
                restored, _ = ckpts.restore(step, like)
                assert_same(restored, single)
                for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(like), strict=True):
                    assert got.sharding == want.sharding, (got.sharding, want.sharding)
            # and back onto one device
            restored, _ = ckpts.restore(2, single)
            for got in jax.tree.leaves(restored):
                assert got.sharding == single.params["kernel"].value.sharding, got.sharding
            ckpts.close()
        print("ok", len(split))
    """, devices=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok")


def test_two_processes_pack_what_both_hold_and_restore_onto_their_shardings(tmp_path):
    """Two processes of one CPU device each, one JAX job: small leaves replicated on both hosts are packed
    (from each host's own copy; the vector written once), a small leaf split across the hosts and a large
    one are saved alone, and each process restores its shards onto the live state's shardings."""
    script = textwrap.dedent(f"""
        import json, sys
        import jax, numpy as np
        jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=int(sys.argv[2]))
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from train import checkpoint
        checkpoint.PACKED_MAX = 16
        mesh = Mesh(np.array(jax.devices()), ("data",))
        where = {{"bias": P(), "count": P(), "big": P("data"), "small_split": P("data")}}

        def make(seed):
            r = np.random.default_rng(seed)
            values = {{"bias": r.standard_normal(4).astype(np.float32), "count": np.int32(seed),
                      "big": r.standard_normal((8, 4)).astype(np.float32), "small_split": r.standard_normal(6).astype(np.float32)}}
            return values, {{k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, where[k]), lambda i, v=v: v[i])
                            for k, v in values.items()}}

        values, state = make(1)
        like = make(2)[1]
        with checkpoint.Checkpoints({str(tmp_path)!r}) as ckpts:
            ckpts.save(1, state, {{"data": "position"}})
            ckpts.wait()
            restored, meta = ckpts.restore(1, like)
        assert meta == {{"data": "position"}}, meta
        for k, x in restored.items():
            assert x.sharding == like[k].sharding, (k, x.sharding)
            for shard in x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), values[k][shard.index])
        print("ok", json.dumps(json.loads(open({str(tmp_path / "1" / "layout" / "metadata")!r}).read())))
    """)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"
    env = child_env(PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", script, address, str(i)], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, output in zip(procs, outputs):
        assert p.returncode == 0, output[-4000:]
        layout = json.loads(output.rsplit("ok ", 1)[1].splitlines()[0])
        assert layout == [["bias", "float32", [4], 0], ["big", "float32", [8, 4], None], ["count", "int32", [], 0],
                          ["small_split", "float32", [6], None]]


def test_async_save_is_safe_against_donated_buffers(tmp_path):
    """The loop donates the state to the next step while the save is in flight."""
    def make():
        return {"w": jax.random.normal(jax.random.key(0), (512, 1024)), "step": jnp.int32(3)}

    # (a host view of an array keeps its buffer from being donated: compare against a second copy)
    expected = leaves(make())
    overwrite = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 + 7, s), donate_argnums=0)
    probe = make()
    overwrite(probe)
    assert probe["w"].is_deleted()  # donation works here, so a save that read the buffers late would fail
    state = make()
    with checkpoint.Checkpoints(tmp_path) as ckpts:
        assert ckpts.save(3, state, {"i": 3})
        state = overwrite(state)  # the saved arrays' buffers are donated (or copied, if XLA declines)
        state = overwrite(state)
        jax.block_until_ready(state)
        ckpts.wait()
        restored, meta = ckpts.restore(3, state)
    assert meta == {"i": 3}
    for got, want in zip(leaves(restored), expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert float(state["w"][0, 0]) == 7.0


# -- which checkpoints exist


def test_keep_only_the_newest(tmp_path):
    state = make_state(0, ema=False)
    with checkpoint.Checkpoints(tmp_path, keep=2) as ckpts:
        for step in (10, 20, 30, 40):
            ckpts.save(step, state, {"step": step})
        ckpts.wait()
        assert ckpts.steps() == [30, 40]
        assert ckpts.restore(30, state)[1] == {"step": 30}
    with checkpoint.Checkpoints(tmp_path / "all", keep=None) as ckpts:
        for step in (1, 2, 3):
            ckpts.save(step, state, {})
        ckpts.wait()
        assert ckpts.steps() == [1, 2, 3]
    with pytest.raises(ValueError):
        checkpoint.Checkpoints(tmp_path / "none", keep=0)


def test_saving_a_step_twice_is_a_no_op(tmp_path):
    with checkpoint.Checkpoints(tmp_path) as ckpts:
        assert ckpts.save(4, make_state(0), {"first": True})
        assert not ckpts.save(4, make_state(1), {"first": False}, force=True)  # the stop right after a periodic save
        assert ckpts.latest() == 4  # force waited for the commit
        assert ckpts.restore(4, make_state(2))[1] == {"first": True}


def test_resuming_from_an_earlier_step_drops_the_abandoned_future(tmp_path):
    state = make_state(0, ema=False)
    with checkpoint.Checkpoints(tmp_path) as first_run:
        for step in (100, 200, 300):
            first_run.save(step, state, {"run": 1})
    with checkpoint.Checkpoints(tmp_path) as second_run:  # resumed from 100 (as the loop does), saves every 150
        second_run.restore(checkpoint.resolve(str(tmp_path / "100"), tmp_path), state)
        assert second_run.steps() == [100, 200, 300]  # nothing is removed before the first save
        second_run.save(250, state, {"run": 2})
        second_run.wait()
        assert second_run.steps() == [100, 250]
        assert second_run.latest() == 250
    with checkpoint.Checkpoints(tmp_path) as fresh_run:  # started afresh in the same folder
        fresh_run.save(150, state, {"run": 3})
        fresh_run.wait()
        assert fresh_run.steps() == [100, 150]
        assert fresh_run.restore(100, state)[1] == {"run": 1}


def test_latest_ignores_a_checkpoint_whose_write_was_cut_off(tmp_path):
    state = make_state(0, ema=False)
    with checkpoint.Checkpoints(tmp_path) as ckpts:
        ckpts.save(1, state, {})
        ckpts.save(2, state, {})
        ckpts.wait()
    # what a crash leaves: a complete-looking copy under the temporary name, and a half-written one
    shutil.copytree(tmp_path / "2", tmp_path / f"3{TMP_SUFFIX}")
    (tmp_path / f"4{TMP_SUFFIX}" / "state").mkdir(parents=True)
    (tmp_path / f"4{TMP_SUFFIX}" / "_CHECKPOINT_METADATA").write_text("{}")
    shutil.copytree(tmp_path / "2" / "state", tmp_path / "5" / "state")  # no meta: not a checkpoint
    assert checkpoint.complete_steps(tmp_path) == [1, 2]
    out = tmp_path.parent
    with pytest.raises(SdxError, match="interrupted"):
        checkpoint.resolve(tmp_path / f"3{TMP_SUFFIX}", out)
    shutil.rmtree(tmp_path / "5")
    with checkpoint.Checkpoints(tmp_path) as ckpts:  # a new run cleans up the leftovers and can write step 3
        assert ckpts.latest() == 2
        ckpts.save(3, state, {"again": True})
        ckpts.wait()
        assert ckpts.steps() == [1, 2, 3]
        assert ckpts.restore(3, state)[1] == {"again": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3"]


def gate_commits(open_: Callable[[], bool]) -> None:
    """Hold every later Orbax commit (the rename of `<step>.orbax-checkpoint-tmp`) until open_() is true,
    so that a test's kill or signal lands while the save is still in flight, whatever the machine's load."""
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def gated(self):
        while not open_():
            await asyncio.sleep(0.01)
        await finalize(self)

    atomicity.AtomicRenameTemporaryPath.finalize = gated


def test_a_save_killed_mid_write_is_not_a_checkpoint(tmp_path):
    """SIGKILL while a large asynchronous save is being written: the previous checkpoint stays the latest."""
    ckdir = tmp_path / "checkpoints"
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import asyncio, jax, jax.numpy as jnp, numpy as np
            from tests.test_train_checkpoint import gate_commits
            from train import checkpoint
            ckpts = checkpoint.Checkpoints({str(ckdir)!r})
            ckpts.save(1, {{"w": jnp.zeros((4,)), "step": jnp.int32(1)}}, {{"step": 1}}, force=True)
            gate_commits(lambda: False)  # from here on nothing commits: the kill lands before the rename
            big = jnp.asarray(np.random.default_rng(0).random((64, 1024, 1024), dtype=np.float32))  # 256 MiB
            ckpts.save(2, {{"w": big, "step": jnp.int32(2)}}, {{"step": 2}})
            print("writing", flush=True)
            ckpts.wait()
            print("committed", flush=True)
        """)],
        cwd=REPO, env=child_env(PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line == "writing\n", line + proc.stderr.read()
        in_flight = ckdir / f"2{TMP_SUFFIX}"  # (its items too are written under temporary names)
        wait_for(lambda: any(p.parent.name == "d" and p.is_file() for p in in_flight.rglob("*")))  # data chunks
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    names = sorted(p.name for p in ckdir.iterdir())
    assert names == ["1", f"2{TMP_SUFFIX}"], names  # killed mid-write: step 2 was never committed
    assert checkpoint.complete_steps(ckdir) == [1]
    assert checkpoint.resolve("latest", tmp_path) == ckdir / "1"
    with checkpoint.Checkpoints(ckdir) as ckpts:
        assert ckpts.latest() == 1
        state = {"w": jnp.ones((4,)), "step": jnp.int32(0)}
        restored, meta = ckpts.restore(1, state)
        assert meta == {"step": 1} and int(restored["step"]) == 1
        ckpts.save(2, state, {"step": 2}, force=True)  # the leftover is cleaned up, step 2 written anew
        assert ckpts.steps() == [1, 2]
    assert sorted(p.name for p in ckdir.iterdir()) == ["1", "2"]


# -- --resume_from_checkpoint


def test_resolve(tmp_path, monkeypatch):
    out = tmp_path / "run"
    logged = []
    assert checkpoint.resolve(None, out) is None
    assert checkpoint.resolve("", out) is None
    assert checkpoint.resolve("latest", out, log=logged.append) is None  # no output dir yet
    (out / "checkpoints").mkdir(parents=True)
    assert checkpoint.resolve("latest", out, log=logged.append) is None  # empty
    assert len(logged) == 2 and "starting a new training run" in logged[0]

    with checkpoint.Checkpoints(out / "checkpoints") as ckpts:
        for step in (5, 15, 10):
            ckpts.save(step, make_state(0, ema=False), {"step": step})
    root = (out / "checkpoints").absolute()
    assert checkpoint.resolve("latest", out) == root / "15"
    assert checkpoint.resolve(str(root / "10"), out) == root / "10"  # a path
    assert checkpoint.resolve("5", out) == root / "5"  # a name inside output_dir/checkpoints (diffusers)
    monkeypatch.chdir(out)
    assert checkpoint.resolve("checkpoints/10", out) == root / "10"  # relative to the working directory

    with pytest.raises(SdxError, match="does not exist"):
        checkpoint.resolve(str(tmp_path / "nowhere"), out)
    with pytest.raises(SdxError, match="does not exist"):
        checkpoint.resolve("20", out)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(SdxError, match="is a file"):
        checkpoint.resolve(tmp_path / "file.txt", out)
    with pytest.raises(SdxError, match="not a checkpoint folder"):
        checkpoint.resolve(tmp_path, out)
    with pytest.raises(SdxError, match=r"folder of checkpoints.*15"):
        checkpoint.resolve(root, out)
    # a checkpoint in another run's folder restores too
    state, meta = checkpoint.Checkpoints(tmp_path / "elsewhere").restore(root / "10", make_state(1, ema=False))
    assert meta == {"step": 10}


# -- signals


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_stop_flag_and_handlers_restored():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    logged = []
    with GracefulStop(log=logged.append) as stop:
        assert stop.installed and not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: stop.requested)  # the handler runs in the main thread, between bytecodes
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
        wait_for(lambda: len(stop.received) == 2)
        os.kill(os.getpid(), signal.SIGTERM)
        wait_for(lambda: len(stop.received) == 3)
        assert stop.received == [signal.SIGTERM, signal.SIGINT, signal.SIGTERM]
        assert stop.requested_anywhere()
    assert {s: signal.getsignal(s) for s in before} == before
    assert len(logged) == 2 and "stopping after the checkpoint is written" in logged[1]


def test_stop_off_the_main_thread_is_inert():
    before = signal.getsignal(signal.SIGTERM)
    seen = {}

    def body():
        with GracefulStop() as stop:
            seen["installed"], seen["requested"] = stop.installed, stop.requested
            seen["handler"] = signal.getsignal(signal.SIGTERM)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == {"installed": False, "requested": False, "handler": before}


LOOP = """
import os, sys, time, jax, jax.numpy as jnp, numpy as np
from tests.test_train_checkpoint import gate_commits
from train import checkpoint
from train.signals import GracefulStop
gate_commits(lambda: os.path.exists(sys.argv[2]))  # the test's later signals land while the save is in flight
ckpts = checkpoint.Checkpoints(sys.argv[1])
state = {"w": jnp.asarray(np.random.default_rng(0).random((32, 1024, 1024), dtype=np.float32)), "step": jnp.int32(0)}
step_fn = jax.jit(lambda s: {"w": s["w"] + 1, "step": s["step"] + 1}, donate_argnums=0)
with GracefulStop() as stop:
    for step in range(1, 10_000):
        state = step_fn(state)
        jax.block_until_ready(state)
        print(f"step {step}", flush=True)
        if stop.requested:
            ckpts.save(step, state, {"step": step})
            print("saving", flush=True)  # the write is in flight; its commit waits for the test's signals
            ckpts.save(step, state, {"step": step}, force=True)  # already saved: only waits for the commit
            print(f"saved {step} with {len(stop.received)} signals; continue with --resume_from_checkpoint latest", flush=True)
            break
        time.sleep(0.05)
ckpts.close()
"""


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signals_stop_the_loop_after_a_checkpoint(tmp_path, first):
    """A signal stops the loop at a step boundary; a SIGTERM and a SIGINT during the save do not kill it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP, str(tmp_path / "checkpoints"), str(tmp_path / "signals-sent")], cwd=REPO,
        env=child_env(PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        lines = [proc.stdout.readline()]
        assert lines == ["step 1\n"], proc.stderr.read()
        proc.send_signal(first)  # (it may land before step 1's stop check: then "saving" follows "step 1")
        while lines[-1] != "saving\n":
            line = proc.stdout.readline()
            assert line, "".join(lines) + proc.stderr.read()
            lines.append(line)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)  # (two signals of one kind could merge; these are two kinds, but keep them apart)
        proc.send_signal(signal.SIGINT)
        (tmp_path / "signals-sent").touch()  # lets the save commit
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    step = int(lines[-2].split()[1])
    assert out.startswith(f"saved {step} with 3 signals; continue with --resume_from_checkpoint latest"), out
    assert err.count("stopping after the checkpoint is written") == 1, err
    assert f"{first.name} received" in err and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert checkpoint.complete_steps(tmp_path / "checkpoints") == [step]
    like = {"w": jnp.zeros((32, 1024, 1024), jnp.float32), "step": jnp.int32(0)}
    state, meta = checkpoint.restore(tmp_path / "checkpoints" / str(step), like)
    assert meta == {"step": step} and int(state["step"]) == step
    assert float(state["w"][0, 0, 0]) == pytest.approx(float(np.random.default_rng(0).random(dtype=np.float32)) + step)
