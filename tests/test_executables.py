"""pipelines.executables: a kept program is loaded without tracing and computes the same; its key changes
with everything that changes the program (shapes, dtypes, shardings, closed-over values, jit options,
jax.config, the sdx source) and with nothing else; values with no stable text keep nothing; a damaged file
is compiled again. Abstract models are kept the same way. The whole cache across processes: tests/test_sampler.py."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pipelines import executables
from sdx import mesh as meshlib
from sdx import presets
from sdx.layers import Compute, timestep_embedding
from sdx.model_folder import MODEL_KINDS, ModelKind


def _affine(x, y, *, scale, shift):
    return x * scale + y + shift


@dataclasses.dataclass(frozen=True)
class Options:
    scale: float
    names: tuple[str, ...] = ()


def _with_options(x, *, options):
    return x * options.scale


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """executables keeps programs in tmp_path (JAX's own cache stays as the suite has it), and takes this
    file's functions as keyed code."""
    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    monkeypatch.setattr(executables, "PACKAGES", (*executables.PACKAGES, __name__.split(".")[0]))
    executables._installed.cache_clear()  # its source digest then covers this file too
    yield tmp_path
    executables._installed.cache_clear()


def test_a_kept_program_is_loaded_without_tracing_and_computes_the_same(kept, jax_events):
    x, y = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3))
    fn = functools.partial(_affine, scale=2.0, shift=0.5)
    traced = jax_events("jaxpr_trace", "_affine")
    first = executables.compile(fn, x, y)
    assert len(traced) == 1 and len(list(kept.iterdir())) == 1
    again = executables.compile(fn, x, y)
    assert len(traced) == 1  # read back, not traced
    np.testing.assert_array_equal(again(x, y), first(x, y))
    np.testing.assert_array_equal(again(x, y), x * 2.0 + y + 0.5)


def test_donation_and_output_shardings_survive_the_file(kept):
    mesh = meshlib.make_mesh(devices=jax.devices()[:1])
    spec = NamedSharding(mesh, PartitionSpec())
    x, y = jnp.ones((4, 4)), jnp.ones((4, 4))
    fn = functools.partial(_affine, scale=3.0, shift=0.0)
    executables.compile(fn, x, y, donate_argnums=1, out_shardings=spec)
    loaded = executables.compile(fn, x, y, donate_argnums=1, out_shardings=spec)
    out = loaded(x, y)
    assert y.is_deleted()  # donated
    assert out.sharding == spec
    np.testing.assert_array_equal(out, np.full((4, 4), 4.0))


def _path(fn, *args, **options):
    return executables.path_of(fn, args, options)


def test_the_key_changes_with_everything_that_changes_the_program(kept):
    x = jnp.ones((2, 3))
    fn = functools.partial(_affine, scale=2.0, shift=0.5)
    base = _path(fn, x, x)
    assert base == _path(functools.partial(_affine, scale=2.0, shift=0.5), jnp.zeros((2, 3)), jnp.full((2, 3), 7.0, jnp.float32))
    mesh = meshlib.make_mesh(devices=jax.devices()[:1])
    variants = {
        "shape": _path(fn, jnp.ones((3, 2)), jnp.ones((3, 2))),
        "dtype": _path(fn, x.astype(jnp.bfloat16), x),
        "weak type": _path(fn, x, jnp.asarray(1.0)),
        "closed-over value": _path(functools.partial(_affine, scale=2.0, shift=0.25), x, x),
        "closed-over type": _path(functools.partial(_affine, scale=2, shift=0.5), x, x),
        "function": _path(functools.partial(_with_options, options=Options(2.0)), x),
        "donation": _path(fn, x, x, donate_argnums=1),
        "output sharding": _path(fn, x, x, out_shardings=NamedSharding(mesh, PartitionSpec())),
        "tree structure": _path(fn, {"a": x}, x),
        "compiler options": executables.path_of(fn, (x, x), {}, {"xla_cpu_experimental_ynn_fusion_type": ""}),
    }
    with jax.default_matmul_precision("highest"):
        variants["jax.config"] = _path(fn, x, x)
    paths = [base, *variants.values()]
    assert None not in paths
    assert len(set(paths)) == len(paths), {k: v.name for k, v in variants.items()}
    assert base.name.startswith("_affine-")


def test_nested_dataclasses_and_sharded_arguments_are_keyed_by_value(kept):
    x = jnp.ones((2, 3))
    one = _path(functools.partial(_with_options, options=Options(2.0, ("a", "b"))), x)
    assert one == _path(functools.partial(_with_options, options=Options(2.0, ("a", "b"))), x)
    assert one != _path(functools.partial(_with_options, options=Options(2.0, ("a", "c"))), x)
    mesh = meshlib.make_mesh(devices=jax.devices()[:1])
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
    assert _path(functools.partial(_with_options, options=Options(2.0)), placed) != _path(
        functools.partial(_with_options, options=Options(2.0)), x)


class PlainOptions:  # no dataclass: printed by address
    scale = 2.0


def _apply(x, *, f):
    return f(x)


def _scaled(x, *, by):
    return x * by


@pytest.mark.parametrize("fn", [functools.partial(_apply, f=lambda v: v * 2.0),
                                functools.partial(_scaled, by=np.full(3, 2.0)),
                                functools.partial(_with_options, options=PlainOptions())],
                         ids=["lambda", "array", "printed by address"])
def test_values_without_a_stable_text_keep_nothing_and_still_compile(kept, fn):
    x = jnp.arange(3.0)
    assert executables.path_of(fn, (x,), {}) is None
    np.testing.assert_array_equal(executables.compile(fn, x)(x), [0.0, 2.0, 4.0])
    assert list(kept.iterdir()) == []


def test_code_outside_the_keyed_modules_keeps_nothing(tmp_path, monkeypatch):
    """A researcher's own module (here: this test file) is not in the key's source digest, so its
    functions and classes keep nothing; this repository's code and the keyed libraries do."""
    monkeypatch.setattr(executables, "folder", lambda: tmp_path)
    x = jnp.arange(8.0)
    assert executables.path_of(functools.partial(_affine, scale=2.0, shift=0.0), (x, x), {}) is None
    assert executables.path_of(functools.partial(_with_options, options=Options(2.0)), (x,), {}) is None
    assert executables.path_of(functools.partial(timestep_embedding, dim=8), (x,), {}) is not None
    assert executables.path_of(functools.partial(timestep_embedding, dim=8, flip_sin_to_cos=json.loads), (x,), {}) is None


def test_stored_programs_are_taken_untraced_and_keys_named_after_another(kept, jax_events):
    x = jnp.ones((2, 2))
    first, second = (functools.partial(_affine, scale=float(k), shift=0.0) for k in (1, 2))
    made = executables.path_of(first, (x, x), {})
    after = executables.path_of(second, (x,), {}, after=made)  # takes `first`'s output besides x
    assert after not in (None, executables.path_of(second, (x,), {}),
                         executables.path_of(second, (x,), {}, after=executables.path_of(second, (x, x), {})))
    out = executables.compile(first, x, x)(x, x)
    executables.compile(second, x, out, path=after)
    traced = jax_events("jaxpr_trace", "_affine")
    a, b = executables.compile(first, x, x, path=made), executables.compile(second, x, out, path=after)
    assert len(traced) == 0
    np.testing.assert_array_equal(b(x, a(x, x)), x + x * 2.0 + x * 1.0)


def test_prefetched_programs_are_read_a_few_at_a_time_and_taken_by_compile(kept, monkeypatch, jax_events):
    """`prefetch` reads at most PREFETCH_READERS programs at once (reading one holds about its size again: all
    at once while the weights load were a warm start's peak memory); `compile` takes each read, not read
    again, nor traced."""
    x = jnp.ones((2, 2))
    fns = [functools.partial(_affine, scale=float(k + 1), shift=0.0) for k in range(executables.PREFETCH_READERS + 2)]
    paths = [executables.path_of(fn, (x, x), {}) for fn in fns]
    for fn in fns:
        executables.compile(fn, x, x)
    active, most, calls, read_file = [0], [0], [], executables._read_file

    def counted(path):
        active[0] += 1
        most[0] = max(most[0], active[0])
        calls.append(path)
        time.sleep(0.05)  # long enough for a second reader, were there one, to start meanwhile
        active[0] -= 1
        return read_file(path)

    monkeypatch.setattr(executables, "_read_file", counted)
    traced = jax_events("jaxpr_trace", "_affine")
    executables.prefetch(paths)
    loaded = [executables.compile(fn, x, x, path=path) for fn, path in zip(fns, paths)]
    assert most[0] == executables.PREFETCH_READERS and sorted(calls) == sorted(paths) and not executables._PREFETCHED
    assert len(traced) == 0
    for k, program in enumerate(loaded):
        np.testing.assert_array_equal(program(x, x), x + x * (k + 1.0))


def test_a_damaged_file_is_compiled_again_and_replaced(kept, jax_events):
    x = jnp.ones((2, 2))
    fn = functools.partial(_affine, scale=5.0, shift=1.0)
    executables.compile(fn, x, x)
    (path,) = kept.iterdir()
    path.write_bytes(b"not an executable")
    traced = jax_events("jaxpr_trace", "_affine")
    out = executables.compile(fn, x, x)(x, x)
    np.testing.assert_array_equal(out, np.full((2, 2), 7.0))
    assert len(traced) == 1
    assert path.read_bytes() != b"not an executable"
    executables.compile(fn, x, x)
    assert len(traced) == 1  # the replacement reads back


def test_the_folder_keeps_under_its_cap_dropping_the_least_recently_used(kept, monkeypatch, jax_events):
    x = jnp.ones((2, 2))
    programs = [functools.partial(_affine, scale=float(k), shift=0.0) for k in range(4)]
    executables.compile(programs[0], x, x)
    (first,) = kept.iterdir()
    size = first.stat().st_size
    monkeypatch.setattr(executables, "MAX_BYTES", int(2.5 * size))  # room for two
    executables.compile(programs[1], x, x)
    old = first.stat().st_mtime_ns - 10**9
    for path in kept.iterdir():  # both written a second ago, programs[0]'s first
        os.utime(path, ns=(old, old + (path != first)))
    traced = jax_events("jaxpr_trace", "_affine")
    executables.compile(programs[0], x, x)  # read back: now the most recently used
    assert len(traced) == 0
    executables.compile(programs[2], x, x)  # a third: programs[1]'s file goes
    kept_paths = {executables.path_of(p, (x, x), {}) for p in programs[:3]}
    assert set(kept.iterdir()) == kept_paths - {executables.path_of(programs[1], (x, x), {})}
    jax.config.update("jax_compilation_cache_max_size", size)  # JAX's cap, when set, is this folder's too
    try:
        executables.compile(programs[3], x, x)
        assert list(kept.iterdir()) == [executables.path_of(programs[3], (x, x), {})]
    finally:
        jax.config.update("jax_compilation_cache_max_size", -1)


@pytest.fixture
def jax_cache_config():
    """Restores the jax.config values the tests change (a CLI test in this process may have set them)."""
    was = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache,
           jax.config.jax_compilation_cache_max_size)
    yield
    jax.config.update("jax_compilation_cache_dir", was[0])
    jax.config.update("jax_enable_compilation_cache", was[1])
    jax.config.update("jax_compilation_cache_max_size", was[2])


def test_programs_are_kept_exactly_when_jax_s_cache_is_on(jax_cache_config, tmp_path):
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    assert executables.folder() == tmp_path / "executables"
    jax.config.update("jax_enable_compilation_cache", False)
    assert executables.folder() is None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_max_size", 0)  # as JAX's own: a cap of 0 keeps nothing
    assert executables.folder() is None
    jax.config.update("jax_compilation_cache_max_size", -1)
    jax.config.update("jax_compilation_cache_dir", None)
    assert executables.folder() is None
    assert executables.path_of(functools.partial(_affine, scale=1.0, shift=0.0), (jnp.ones(2),) * 2, {}) is None


def test_the_source_digest_follows_every_python_file(tmp_path):
    for package in executables.PACKAGES:
        (tmp_path / package / "sub").mkdir(parents=True)
        (tmp_path / package / "sub" / "a.py").write_text("x = 1\n")
    before = executables.source_digest(tmp_path)
    assert executables.source_digest(tmp_path) == before
    (tmp_path / executables.PACKAGES[-1] / "sub" / "a.py").write_text("x = 2\n")
    assert executables.source_digest(tmp_path) != before
    assert executables.source_digest(executables.ROOT) in executables.environment()


def test_an_abstract_model_is_kept_keyed_by_its_compute_and_built_again_from_a_damaged_file(kept, monkeypatch):
    kind = MODEL_KINDS["vae"]
    config = kind.config_from_diffusers(presets.get("tiny").configs["vae"])
    built = executables.abstract_model(kind, config, Compute())
    (path,) = kept.iterdir()
    build = ModelKind.abstract
    monkeypatch.setattr(ModelKind, "abstract", lambda *a: pytest.fail("built, not read"))
    read = executables.abstract_model(kind, config, Compute())
    assert nnx.graphdef(read) == nnx.graphdef(built)
    shapes = lambda model: jax.tree.map(lambda a: (a.shape, a.dtype), nnx.state(model))
    assert shapes(read) == shapes(built)

    monkeypatch.setattr(ModelKind, "abstract", build)
    executables.abstract_model(kind, config, Compute(attention="chunked"))  # another compute: another file
    assert len(list(kept.iterdir())) == 2
    path.write_bytes(b"damaged")
    again = executables.abstract_model(kind, config, Compute())
    assert nnx.graphdef(again) == nnx.graphdef(built) and path.read_bytes() != b"damaged"


def test_a_graph_definition_is_put_in_text_once_per_value(monkeypatch):
    """Several programs' keys hold one model's graph definition, and a model built alike has an equal one:
    their text is made once; a definition that differs gets its own."""
    kind = MODEL_KINDS["vae"]
    config = kind.config_from_diffusers(presets.get("tiny").configs["vae"])
    first, second = (nnx.graphdef(kind.abstract(config, Compute())) for _ in range(2))
    assert first is not second and first == second
    made = []
    make = executables._dataclass_text
    monkeypatch.setattr(executables, "_dataclass_text", lambda x: made.append(type(x)) or make(x))
    texts = [executables._text(g) for g in (first, first, second, first)]
    assert len(set(texts)) == 1
    assert made.count(nnx.GraphDef) == 1
    other = nnx.graphdef(kind.abstract(dataclasses.replace(config, latent_channels=config.latent_channels + 1), Compute()))
    assert executables._text(other) != texts[0] and made.count(nnx.GraphDef) == 2
