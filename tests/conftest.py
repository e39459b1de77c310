"""Fixtures shared by test modules, and the order pytest-xdist hands test files to its workers."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path

import pytest

from tests import processes
from tests.strict_skips import pytest_configure, pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401

processes.configure_this_process()


# -- the order of the test files under `pytest -n N --dist loadfile`

# The files that take longest, longest first (seconds of one worker's time in a full `make test` on a 2-core
# VM, the mean of two runs on 2026-12-07, with tests/processes.py's XLA flags; keep the order when adding or
# speeding up tests, and list a file that takes 20 s or more). xdist hands out whole files, by default those
# with the most tests first: these files, with few tests each, came last, and the worker that drew them ran for
# minutes after the other had finished (1358 s against 1043 s). Given first, the two workers end within seconds
# of each other; every other file follows in xdist's usual order.
SLOW_FILES = (
    "tests/test_docs.py",  # ~321: every page's commands, one process
    "tests/test_sampler.py",  # ~187
    "tests/test_train_e2e.py",  # ~168
    "tests/test_unet.py",  # ~133
    "tests/test_default_models.py",  # ~132
    "tests/test_train_step.py",  # ~125
    "tests/test_train_mesh.py",  # ~107
    "tests/test_train_cli.py",  # ~95
    "tests/test_train_vae.py",  # ~90
    "tests/test_pipelines.py",  # ~83
    "tests/test_inpaint.py",  # ~77
    "tests/test_serve_api.py",  # ~72 (a server, and the sampling command beside it)
    "tests/test_randomness.py",  # ~71
    "tests/test_controlnet_pipelines.py",  # ~69
    "tests/test_train_lora.py",  # ~64
    "tests/test_serve_batching.py",  # ~56
    "tests/test_edm_models.py",  # ~56 (Playground, CosXL, CosXL Edit against diffusers)
    "tests/test_train_textual_inversion.py",  # ~53
    "tests/test_fuzz_readers.py",  # ~51
    "tests/test_research_default_model.py",  # ~50
    "tests/test_plugin_compositions.py",  # ~50
    "tests/test_t2i_adapter_pipelines.py",  # ~48
    "tests/test_controlnet_union_pipelines.py",  # ~48
    "tests/test_serve_progress.py",  # ~47 (one server, long requests watched; 2026-12-07, evening)
    "tests/test_train_cache.py",  # ~46
    "tests/test_ip_adapter_pipelines.py",  # ~45
    "tests/test_schedulers_parity.py",  # ~43
    "tests/test_research_pipelines.py",  # ~41 (FreeU, PAG, SAG against diffusers)
    "tests/test_vae.py",  # ~39
    "tests/test_dreambooth.py",  # ~38
    "tests/test_conv.py",  # ~32
    "tests/test_research_sampling.py",  # ~32
    "tests/test_full_disk.py",  # ~31
    "tests/test_train_vae_loss.py",  # ~29
    "tests/test_ip_adapter.py",  # ~28
    "tests/test_shapes.py",  # ~28
    "tests/test_train_t2i_adapter.py",  # ~28
    "tests/test_serve_engine.py",  # ~27
    "tests/test_serve_controlnet.py",  # ~27
    "tests/test_train_controlnet.py",  # ~27
    "tests/test_nonfinite.py",  # ~26
    "tests/test_serve_page.py",  # ~25
    "tests/test_train_checkpoint.py",  # ~25
    "tests/test_train_objective.py",  # ~24
    "tests/test_attention.py",  # ~24
    "tests/test_serve_edit.py",  # ~24
    "tests/test_serve_webuiapi.py",  # ~23
    "tests/test_controlnet.py",  # ~21
    "tests/test_inpaint_overlay.py",  # ~21
    "tests/test_prompts_file.py",  # ~20
    "tests/test_sample_checkpoints.py",  # ~20
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile with SLOW_FILES first (None, xdist's own scheduler, for every other --dist)."""
    from xdist.scheduler import LoadFileScheduling

    if config.getvalue("dist") != "loadfile" or not hasattr(LoadFileScheduling, "_assign_work_unit"):
        return None  # another --dist, or an xdist whose internals moved: its own order

    class SlowFilesFirst(LoadFileScheduling):
        ordered = False

        def _assign_work_unit(self, node):
            # the first call comes once the queue of files is complete, before any file is handed out
            if not self.ordered:
                self.ordered = True
                rank = {name: i for i, name in enumerate(SLOW_FILES)}
                units = sorted(self.workqueue.items(), key=lambda unit: rank.get(unit[0], len(rank)))  # stable
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

    return SlowFilesFirst(config, log)


def _run_folder(tmp_path_factory, name: str) -> Path:
    """The folder `name` that every pytest-xdist worker of this test run sees (made if missing)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    shared.mkdir(exist_ok=True)
    return shared


# -- the demo models


@pytest.fixture(scope="session")
def demo_build(tmp_path_factory):
    """demo_build(name, where) -> what `convert.demo.demo_folder(name, where)` gives (the sdx folder of
    demo model `name`, random weights from seed 0, in `where`), copied from one build per test run: the
    first worker to ask builds it (about 20 s each) in a folder every pytest-xdist worker of the run sees,
    under a lock; the others wait for it and copy it."""
    from convert.demo import demo_folder

    shared = _run_folder(tmp_path_factory, "demo-builds")

    def build(name: str, where: Path) -> Path:
        with open(shared / "lock", "w") as lock, contextlib.ExitStack() as unlock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            unlock.callback(fcntl.flock, lock, fcntl.LOCK_UN)
            built = demo_folder(name, shared)
        out = Path(where) / built.name
        if not out.exists():
            shutil.copytree(built, out)
        return out

    return build


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory, demo_build):
    """demo(name) -> the sdx folder of demo model `name` (random weights), made once per test session, where
    `python -m sdx.sample --model NAME` finds it when $SDX_CACHE is `demo.cache`."""
    cache = tmp_path_factory.mktemp("sdx-cache")

    def demo(name: str):
        return demo_build(name, cache / "models")

    demo.cache = cache
    return demo


# -- what JAX does while a test runs


MIN_COMPILE_SECS = 1.0  # JAX's default; 0 (every program, eager operations' too) made the suite no faster


@pytest.fixture(scope="session")
def compilation_cache_folder(tmp_path_factory) -> Path:
    """The folder of JAX's persistent compilation cache that every worker of the test run, and every
    process they start, uses (see `shared_compilation_cache`)."""
    folder = _run_folder(tmp_path_factory, "jax-cache")
    processes.share_compilation_cache(folder, MIN_COMPILE_SECS)
    return folder


@pytest.fixture(autouse=True)
def shared_compilation_cache(compilation_cache_folder, monkeypatch):
    """Each test starts with JAX's persistent compilation cache on (for programs that took `MIN_COMPILE_SECS`
    or more to compile) in one folder that every worker of the test run and every process they start use:
    the suite compiles the same tiny models' programs in many tests and processes, and XLA's compile is
    much of its time. A test may set its own folder (a `python -m sdx.sample` run in the worker sets its
    `--cache`'s); the next test starts with the shared one again.

    In the workers this is JAX's cache alone, keyed by the lowered program, so every program is still
    traced: sdx's own executables (`pipelines.executables`, keyed without tracing) stay off there unless a
    test turns them on with a folder of its own, since tests patch code that runs while a program is
    traced (to record what was traced, or to change a constant), which those keys do not see."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as jax_cache

    from pipelines import executables

    shared = str(compilation_cache_folder)
    if jax.config.jax_compilation_cache_dir != shared or not jax.config.jax_enable_compilation_cache:
        jax.config.update("jax_compilation_cache_dir", shared)
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
        jax_cache.reset_cache()  # JAX decides once per process whether, and where, its cache is used
    own_folder = executables.folder
    monkeypatch.setattr(executables, "folder", lambda: None if jax.config.jax_compilation_cache_dir == shared
                        else own_folder())


@pytest.fixture
def jax_events():
    """jax_events(kind=None, fun_name=None) -> a list that gets the function name of each jax.monitoring event
    "/jax/core/compile/{kind}_duration" (kind "backend_compile": XLA compiles a program; "jaxpr_trace": a
    function is traced; None: every duration event), of the function `fun_name` only when given, until the
    test ends."""
    import jax

    listeners = []

    def record(kind: str | None = None, fun_name: str | None = None) -> list[str]:
        seen, event = [], None if kind is None else f"/jax/core/compile/{kind}_duration"

        def listen(name, _secs, **fields):
            if event in (None, name) and fun_name in (None, fields.get("fun_name")):
                seen.append(fields.get("fun_name", ""))

        jax.monitoring.register_event_duration_secs_listener(listen)
        listeners.append(listen)
        return seen

    yield record
    for listen in listeners:
        jax.monitoring.unregister_event_duration_listener(listen)
