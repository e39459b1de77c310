"""`python -m train.pix2pix` on a mesh, run in a subprocess by tests/test_train_e2e.py:

    python tests/mesh_train_child.py OUT [--resume] TRAIN_FLAGS...

trains into OUT/a; with --resume also copies OUT/a's step-2 checkpoint into OUT/b and resumes there.
Every parameter of the tiny model is split over fsdp (sdx splits only tensors of 2**18 elements or
more, which a tiny model has none of); the child checks the training state really is split, and that the
models were built knowing the batch is split over the 4 devices (`Compute.batch_shards`).

It prints every thread's Python stack on SIGUSR1 (what tests/test_train_e2e.py asks for when the job stalls)."""

from __future__ import annotations

import faulthandler
import shutil
import signal
import sys
from pathlib import Path

import jax

from sdx import mesh as meshlib
from train import models, pix2pix, step as steplib

meshlib.param_sharding.__defaults__ = (1,)
split: list[int] = []  # per run: the state's leaves split over fsdp (a resumed run's restore target's)
shards: set[int] = set()  # Compute.batch_shards of the models built on a mesh
computes = models.computes


def _computes(cfg, mesh=None):
    out = computes(cfg, mesh)
    if mesh is not None:  # (without one: a caller asking for a dtype alone)
        shards.update(c.batch_shards for c in out.values())
    return out


def _recording(make):
    def recorded(*args, **kwargs):
        state = make(*args, **kwargs)
        split.append(sum(meshlib.FSDP in str(x.sharding.spec) for x in jax.tree.leaves(state) if len(x.shape)))
        return state
    return recorded


steplib.init_state, steplib.abstract_state = _recording(steplib.init_state), _recording(steplib.abstract_state)
models.computes = _computes
out, rest = Path(sys.argv[1]), sys.argv[2:]
resume = rest[:1] == ["--resume"]
flags = rest[1:] if resume else rest
faulthandler.register(signal.SIGUSR1, all_threads=True)
assert pix2pix.train([*flags, "--output_dir", str(out / "a")]) == 0
if resume:
    (out / "b" / "checkpoints").mkdir(parents=True)
    shutil.copytree(out / "a" / "checkpoints" / "2", out / "b" / "checkpoints" / "2")
    assert pix2pix.train([*flags, "--output_dir", str(out / "b"), "--resume_from_checkpoint", "latest"]) == 0
assert jax.device_count() == 4 and len(split) == 1 + resume and all(n > 100 for n in split), (jax.device_count(), split)
assert shards == {4}, shards  # every model's batch is split over the 4 devices
print("state leaves split over fsdp:", split)
