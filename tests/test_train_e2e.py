"""python -m train.pix2pix end to end on a tiny SDXL model and a generated edit dataset: the model it
writes samples, and a run resumed from a checkpoint ends bit-identical to the uninterrupted one, on one
device, on a mesh, and as two processes."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache
from PIL import Image
from safetensors.numpy import load_file

from pipelines import executables
from pipelines.pipeline import Pipeline
from pipelines.request import Request
from pipelines.sampler import enable_compilation_cache
from sdx import model_folder
from tests.processes import child_env
from train import data, diffusion, pix2pix, shapes
from train import step as steplib


@pytest.fixture(scope="module")
def setup(tmp_path_factory, demo_models):
    root = tmp_path_factory.mktemp("e2e")
    model = demo_models("tiny_xl")
    shapes.write_dataset(root / "ds", "edits", count=12, seed=0, size=32)
    return root, model


FLAGS = ["--resolution", "32", "--train_batch_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2",
         "--use_ema", "--ema_decay", "0.9", "--conditioning_dropout_prob", "0.1", "--lr_warmup_steps", "0",
         "--random_flip", "--report_to", "none"]


def _argv(model, data, out, *extra):
    return ["--pretrained_model_name_or_path", str(model), "--dataset_name", str(data), "--output_dir", str(out),
            *FLAGS, *extra]


@pytest.fixture
def compilation_cache(tmp_path):
    """JAX's persistent compilation cache on in this process for the test, as `python -m train.pix2pix` has
    it (train.loop.main): the resumed run loads the step the first compiled. (Without it the time of this
    test depended on whether an earlier test in the same worker had happened to turn a cache on.)"""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    was = {name: getattr(jax.config, name) for name in names}
    enable_compilation_cache(tmp_path / "jax")
    jax_cache.reset_cache()  # JAX decides once per process whether, and where, its cache is used
    yield
    for name, value in was.items():
        jax.config.update(name, value)
    jax_cache.reset_cache()


def test_pix2pix_trains_writes_a_model_and_resumes_exactly(setup, compilation_cache, monkeypatch):
    """Also: validation every 2 steps, the second one with the programs the first compiled (it neither
    compiles nor reads one) and the step's weights: its grid is what the written model samples."""
    root, model = setup
    a, b = root / "a", root / "b"
    Image.fromarray(np.full((40, 48, 3), 200, np.uint8)).save(root / "val.png")
    validation = ["--validation_prompt", "make the circle red", "--val_image_url_or_path", str(root / "val.png"),
                  "--num_validation_images", "2", "--validation_steps", "2", "--validation_inference_steps", "2"]
    programs, per_validation = [], []  # programs compiled or read (`executables.compile`), and how many in each validation
    compile_, validate = executables.compile, diffusion.DiffusionTask.validate
    monkeypatch.setattr(executables, "compile", lambda *a, **k: programs.append(a[0]) or compile_(*a, **k))

    def counted(self, *args):
        before = len(programs)
        validate(self, *args)
        per_validation.append(len(programs) - before)

    monkeypatch.setattr(diffusion.DiffusionTask, "validate", counted)
    inits, init_state = [], steplib.init_state  # a resumed run makes no initial state to overwrite
    monkeypatch.setattr(steplib, "init_state", lambda *a, **k: inits.append(a) or init_state(*a, **k))
    reads, read_arrays = [], model_folder.read_arrays  # nor reads the UNet weights the checkpoint replaces
    monkeypatch.setattr(model_folder, "read_arrays", lambda f, name, **k: reads.append(name) or read_arrays(f, name, **k))
    assert pix2pix.train(_argv(model, root / "ds", a, *validation)) == 0
    assert reads.count("unet") == 1, reads
    reads.clear()
    assert per_validation[0] >= 3 and per_validation[1] == 0, per_validation  # prepare, denoise, decode; then none
    grids = [np.asarray(Image.open(a / "validation" / f"step-00000{s}.png")) for s in (2, 4)]
    assert grids[1].shape == (32, 64, 3) and grids[1].std() > 0  # two 32 px images side by side
    assert not np.array_equal(*grids)  # the second validation sampled the newer weights
    (b / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "2", b / "checkpoints" / "2")
    assert pix2pix.train(_argv(model, root / "ds", b, "--resume_from_checkpoint", "latest")) == 0
    assert (a / "unet.safetensors").read_bytes() == (b / "unet.safetensors").read_bytes()
    assert len(inits) == 1, len(inits)
    assert "unet" not in reads and "vae" in reads, reads
    lines = (a / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and all(np.isfinite(float(l.split('"loss": ')[1].split(",")[0])) for l in lines)

    pipe = Pipeline.load(a)
    assert pipe.family.pix2pix
    image = data.load_image(root / "val.png", 32)[None]
    out = pipe(Request(prompts=["make the circle red"], height=32, width=32, steps=2, image=image,
                       num_images_per_prompt=2, seed=0, guidance_scale=5.0))  # the validation's request
    assert out.shape == (2, 32, 32, 3) and np.isfinite(out).all()
    drawn = np.concatenate(list((out * 255).round().astype(np.uint8)), axis=1)  # side by side, as the grid
    assert np.abs(drawn.astype(int) - grids[1]).max() <= 1


def _mesh_run(model, data, out: Path, *extra: str, resume: bool, processes: int = 1):
    """tests/mesh_train_child.py in `processes` processes of 4 / `processes` fake CPU devices each (the
    test process has one device), joined as one JAX job when there are several; `extra`: more flags.

    Several processes reduce over gloo, XLA's CPU collectives (a test harness: real hosts use NCCL or the
    TPU interconnect). XLA:CPU opens a device group's gloo connections at the group's first collective and
    waits there at most 30 s for the other processes. This job used to stall now and then on a loaded
    2-core machine: the first collectives over most groups came in the first training step, right after
    each process had compiled it (about 50 s when both compile at once on an idle 2-core machine), and
    where the two compiles ended more than 30 s apart the first process failed ("Gloo context
    initialization failed: DEADLINE_EXCEEDED") and waited in JAX's shutdown barrier, the other in the
    step's collective, until the barrier's 5 minutes were out: with a 40 s delay put into one process's
    compile of the step, the job ended after 389 s (it takes about 100), past `STALL`. A mesh over several
    processes' CPU devices now connects every group as it is made (`sdx.mesh.make_mesh`), and with the same
    delay the job passed. A job that still does not end within `STALL` seconds fails, with each process's
    log and Python stacks."""
    # JAX's persistent cache on, as `python -m train.pix2pix` has it: the resumed run loads the step the first compiled
    env = child_env(devices=4 // processes,
                    JAX_COMPILATION_CACHE_DIR=str(out.parent / f"jax-cache-{processes}"))
    if processes > 1:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes))
    argv = [sys.executable, str(Path(__file__).with_name("mesh_train_child.py")), str(out), *(["--resume"] if resume else []),
            "--pretrained_model_name_or_path", str(model), "--dataset_name", str(data), "--fsdp", "2",
            *FLAGS, "--train_batch_size", "1", *extra]  # per device: 4 samples a step over data 2 x fsdp 2
    _run_processes(argv, env, out, processes)


STALL = 300  # seconds; the two-process job takes about 100 on an idle 2-core machine


def _run_processes(argv, env, out: Path, processes: int) -> None:
    """Run `argv` as `processes` processes of one job, each logging to OUT/processI.log. Fails as soon as one
    of them fails (with its log: the others may then wait for it in a collective), or when the job has not
    ended after `STALL` seconds (with every process's log, ending in its threads' Python stacks)."""
    # each process logs to a file: with pipes read one after the other, a process blocked on a full pipe
    # would stall the collective the other one waits in
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / f"process{i}.log" for i in range(processes)]
    procs = []
    for i, log in enumerate(logs):
        with log.open("w") as sink:
            procs.append(subprocess.Popen(argv, cwd=Path(__file__).resolve().parent.parent, stdout=sink,
                                          stderr=subprocess.STDOUT, env={**env, "JAX_PROCESS_ID": str(i)}))
    tail = lambda i: f"process {i}'s log ({logs[i]}), its end:\n{logs[i].read_text()[-4000:]}"
    deadline = time.monotonic() + STALL
    try:
        while None in [p.poll() for p in procs]:  # (every one polled: that sets its returncode)
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            assert not failed, f"process {failed[0]} failed (exit status {procs[failed[0]].returncode}); " + tail(failed[0])
            if time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.send_signal(signal.SIGUSR1)  # the child prints every thread's Python stack
                time.sleep(3)
                raise AssertionError(f"the {processes}-process job did not end within {STALL} s; "
                                     + "\n".join(tail(i) for i in range(processes)))
            time.sleep(0.5)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed (exit status {p.returncode}); {tail(i)}"


def test_a_mesh_resumes_exactly_and_two_hosts_train_as_one(setup):
    """4 devices as data 2 x fsdp 2, the UNet, Adam moments and EMA split over fsdp: 4 steps straight and
    2 + a resume to 4 write the same bytes. The same 4 steps as two processes of 2 devices each (per-host
    data shards, parameters split across hosts, gradients reduced over gloo): the same losses and gradient
    norms at every step as one process of 4, and the same weights up to float32 summation order: all but
    one in a thousand within 1e-5, and none further apart than 4 steps of AdamW can take them (4 · lr 1e-4),
    since AdamW turns a gradient that is ~0 up to rounding (a bias before a group norm) into a step of up
    to lr in the direction of the rounding's sign (the largest difference seen: 3.8e-5, in such biases).
    Gradients not reduced across the hosts would move most weights apart by about lr a step. (One test:
    the two-host run is checked against the one-host run.)"""
    root, model = setup
    one, two = root / "mesh", root / "hosts"
    _mesh_run(model, root / "ds", one, resume=True)
    assert (one / "a" / "unet.safetensors").read_bytes() == (one / "b" / "unet.safetensors").read_bytes()

    # no resume here: only the final checkpoint (written across both hosts) is needed
    _mesh_run(model, root / "ds", two, "--checkpointing_steps", "4", resume=False, processes=2)
    metrics = [[json.loads(line) for line in (d / "a" / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    assert [r["step"] for r in metrics[1]] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in metrics[1]], [r[key] for r in metrics[0]], rtol=2e-6)
    a, b = (load_file(d / "a" / "unet.safetensors") for d in (one, two))
    assert a.keys() == b.keys()
    apart = np.concatenate([np.abs(a[k] - b[k]).ravel() for k in a])
    assert np.quantile(apart, 0.999) < 1e-5 and apart.max() < 4 * 1e-4, (np.quantile(apart, 0.999), apart.max())
