"""Compiled programs kept on disk under a key computed without tracing, so a warm start skips tracing,
lowering and compiling.

JAX's persistent compilation cache is keyed by the lowered program: to find an executable, every run
still traces the function and lowers it first. For SD 1.5 on a 2-core CPU that is about 3.5 s of a
warm start (the UNet's trace alone is 1 s; SDXL's is longer), against 0.9 s to read the executables.

This cache keys a program by what determines it instead: the function and everything it closes over
(its `functools.partial` arguments: graph definitions, the plan, dtypes; a training step's loss, optimizer
and schedule), the shapes, dtypes, weak types, shardings and layouts of its arguments, the jit and compiler
options, and the environment it was compiled in (the sdx source, the versions of Python, numpy, jax,
jaxlib, flax, optax and ml_dtypes, every `jax.config` value, `XLA_FLAGS`,
the devices). Anything in a key that has no stable text (an array, a lambda, an object printed by
address) makes the program uncachable here: it is compiled as usual, and JAX's own cache (keyed by the
lowered program) still applies. So does code that is not what this repository's files hold, since the
source digest would not see it, with one warning line each: a class or function from a module that is
neither this repository's nor a keyed library's (a researcher's own block or processor), and, for every
program of the process, any of sdx's functions, classes, methods or constants replaced after import
(`pipelines.source_check`: a patched `UpBlock2D.__call__`).
A program that also takes another's outputs (the sampler's denoise takes prepare's) names that program's
key instead of their shardings (`path_of(..., after=)`), so `prefetch` can read both files at once.
An abstract argument (`jax.ShapeDtypeStruct` with a sharding) has the same text as an array of its shape,
dtype and sharding in the default layout, so keys can be known before the weights are: `prefetch` starts
reading those files then, and `compile` takes what it has read (`Pipeline.load(first=...)`: while the
weights load).
The abstract models a load fills with weights are kept beside them (`abstract_model`): building one is
Python work (SD 1.5's three 1.3 s, SDXL's four 2.3 s on a 2-core CPU) that a warm start would repeat
(within one process `ModelKind.abstract` keeps what it built).
A file that cannot be read back is compiled again and replaced. A program kept here is compiled with
JAX's cache off (see `_without_jax_cache`), so JAX does not keep a second copy.

The cache lives in `executables/` inside JAX's cache folder (`jax_compilation_cache_dir`) and is on
exactly when JAX's is (`pipelines.sampler.enable_compilation_cache`). Multi-process runs skip it. Every
change to the source gives new keys, so the folder is kept under a size (`jax_compilation_cache_max_size`
when that is set, else `MAX_BYTES`; JAX's own files are capped by JAX): after each write the least
recently used files go first (a file read back counts as used).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import pickle
import sys
import types
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from pipelines import source_check
from sdx import io
from sdx.errors import SdxError

PACKAGES = ("sdx", "pipelines", "train", "convert")  # this repository's code, keyed by its source
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes", "builtins", "functools", "operator")  # by version
ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 2 * 2**30  # the folder's size while jax_compilation_cache_max_size is -1 (no limit for JAX's own)


class Unkeyable(Exception):
    """A value with no text that is the same in every process."""


class ForeignCode(Unkeyable):
    """A class or function whose code the key cannot see: from outside this repository and the keyed libraries."""


_WARNED: set[str] = set()


def _warn_once(what: str) -> None:
    if what not in _WARNED:
        _WARNED.add(what)
        print(f"warning: {what} read from or kept in the disk cache (they compile as usual; JAX's own cache, keyed by "
              "the traced program, still applies)", file=sys.stderr)


KEYED = "keyed"  # `compile`'s default: the file `path_of` gives for all of `compile`'s own arguments


def compile(fn: functools.partial, *args, path: Path | None | str = KEYED, compiler_options: dict | None = None,
            **jit_options) -> jax.stages.Compiled:
    """`jax.jit(fn, **jit_options).lower(*args).compile(compiler_options)`, or the executable stored in its
    file: `path` (None: not kept), by default the one `path_of` keys by all of `args`."""
    lowered = lambda: jax.jit(fn, **jit_options).lower(*args)
    path = path_of(fn, args, jit_options, compiler_options) if path == KEYED else path
    if path is None:
        return lowered().compile(compiler_options)
    loaded = _read(path)
    if loaded is not None:
        return loaded
    compiled = _without_jax_cache(lambda: lowered().compile(compiler_options))
    _store(path, compiled)
    return compiled


def prefetch(paths: list[Path | None | str]) -> None:
    """Start reading the executables stored in `paths` (those that exist) in the background, `PREFETCH_READERS`
    at a time, in order (XLA reads each on one core); `compile` then takes them from there instead of reading
    again. Keys known before the arguments exist can be prefetched: `Pipeline.load` computes its first
    request's from the abstract models and loads the weights meanwhile. A prefetched program no one asks for
    stays in memory until the process ends."""
    todo = [p for p in paths if isinstance(p, Path) and p not in _PREFETCHED and p.is_file()]
    if not todo:
        return
    pool = ThreadPoolExecutor(max_workers=PREFETCH_READERS)
    for path in todo:
        _PREFETCHED[path] = pool.submit(_read_file, path)
    pool.shutdown(wait=False)


_PREFETCHED: dict[Path, Future] = {}  # `prefetch`'s reads, until `_read` takes them
PREFETCH_READERS = 2
"""Programs `prefetch` reads at once. While XLA reads a program it holds about as much memory again as the
program keeps (SDXL's UNet step keeps 0.25 GiB), and SDXL's three read at once beside the loading weights
were a warm `python -m sdx.sample`'s peak: 13.92 GiB RSS, 13.66 read one at a time. With the VAE's encoder
left unread at load (`AutoencoderKL.READ_ON_USE`): 13.53 one at a time, 13.60 two at a time; one at a time made
the programs ready 1-1.3 s later, two as early as three (2-core CPU, benchmarks/LOG.md)."""


def _read(path: Path | None | str) -> jax.stages.Compiled | None:
    future = _PREFETCHED.pop(path, None) if isinstance(path, Path) else None
    return future.result() if future is not None else _read_file(path)


def _read_file(path: Path | None | str) -> jax.stages.Compiled | None:
    if not isinstance(path, Path) or not path.is_file():
        return None
    try:
        payload, in_tree, out_tree = pickle.loads(path.read_bytes())
        loaded = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception:  # written by an incompatible build, or damaged: compiled again and replaced
        return None
    _touch(path)
    return loaded


def _without_jax_cache(compile_: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
    """compile_() with JAX's persistent cache off: on a CPU, an executable JAX's cache loaded serializes
    without its kernels (the copy fails with "Function ... not found" when it runs). JAX decides once per
    process whether its cache is used, so the switch is followed by `reset_cache` both ways."""
    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    jax_cache.reset_cache()
    try:
        return compile_()
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        jax_cache.reset_cache()


def _store(path: Path, compiled: jax.stages.Compiled) -> None:
    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
    except Exception:  # an executable the backend cannot serialize (or one with constants): not kept
        return
    _write(path, blob)


def _write(path: Path, blob: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        io.atomic_write(path, lambda f: f.write(blob))
        _prune(path.parent, keep=path)
    except (OSError, SdxError):  # a full or read-only cache: the run goes on without it
        pass


def _touch(path: Path) -> None:
    """Mark a file used now (its modification time orders what `_prune` removes)."""
    try:
        os.utime(path)
    except OSError:  # a read-only cache is still read
        pass


def _prune(where: Path, keep: Path) -> None:
    """Remove the least recently used files of `where` until it holds at most the cap (see the module
    docstring); `keep`, the file just written, stays."""
    cap = jax.config.jax_compilation_cache_max_size
    cap = MAX_BYTES if cap < 0 else cap
    files = []
    for f in where.iterdir():
        if f.name.startswith("."):  # another process's write in progress (`io.atomic_write`)
            continue
        try:
            files.append((f.stat(), f))
        except FileNotFoundError:  # removed meanwhile by another process
            continue
    total = sum(st.st_size for st, _ in files)
    for st, f in sorted(files, key=lambda sf: sf[0].st_mtime_ns):
        if total <= cap:
            break
        if f != keep:
            f.unlink(missing_ok=True)
            total -= st.st_size


def abstract_model(kind, config, compute) -> nnx.Module:
    """`kind.abstract(config, compute)` (an `sdx.model_folder.ModelKind`), kept in `folder()` as its graph
    definition and parameter shapes, pickled, under a key of the three and `environment()` (the sdx source
    included, so a pickle always names the classes it was made from); reading one back takes
    milliseconds."""
    where = folder()
    if where is None:
        return kind.abstract(config, compute)
    try:
        text = "\n".join((environment(), _text(kind), _text(config), _text(compute)))
        path = where / f"model-{hashlib.sha256(text.encode()).hexdigest()}"
    except Unkeyable as e:
        _warn_foreign(e)
        path = None
    if path is not None and path.is_file():
        try:
            model = nnx.merge(*pickle.loads(path.read_bytes()))
            _touch(path)
            return model
        except Exception:  # written by an incompatible build, or damaged: built again and replaced
            pass
    model = kind.abstract(config, compute)
    if path is not None:
        _write(path, pickle.dumps(nnx.split(model)))
    return model


def folder() -> Path | None:
    """Where executables are kept: `executables/` in JAX's cache folder; None when that is off (a size
    cap of 0 included), when several processes share the run, or when this process changed sdx's code
    (`source_check.first_change`, with one warning line)."""
    jax_folder = jax.config.jax_compilation_cache_dir
    if (not jax_folder or not jax.config.jax_enable_compilation_cache or jax.process_count() > 1
            or jax.config.jax_compilation_cache_max_size == 0):
        return None
    change = code_change()
    if change is not None:
        _warn_once(f"{change}: this process changed sdx's code after importing it, so no compiled program is")
        return None
    return Path(jax_folder) / "executables"


def code_change() -> str | None:
    """What this process changed in sdx's code after importing it (`source_check.first_change`, its facts
    kept beside the programs), or None. `folder` itself is where programs go, not what they are (tests
    point it elsewhere)."""
    jax_folder = jax.config.jax_compilation_cache_dir
    name = f"source-{hashlib.sha256(_installed().encode()).hexdigest()[:32]}"  # the sdx source's digest among the rest
    store = Path(jax_folder) / "executables" / name if jax_folder else None
    return source_check.first_change(PACKAGES, ROOT, ignore=frozenset({f"{__name__}.folder"}), store=store)


def _warn_foreign(e: Unkeyable) -> None:
    if isinstance(e, ForeignCode):
        _warn_once(f"{e} is not sdx's code, so the compiled programs that use it are not")


def path_of(fn: functools.partial, args: tuple, jit_options: dict, compiler_options: dict | None = None,
            after: Path | None = None) -> Path | None:
    """The file of `jax.jit(fn, **jit_options).lower(*args).compile(compiler_options)`'s executable; None
    when it is not kept.

    after: the file of the program whose outputs the program also takes (beyond `args`), with their
    shardings as its output shardings if any: that program's key determines them, so this key holds
    its name instead, and both files can be read before either is."""
    where = folder()
    if where is None:
        return None
    try:
        text = "\n".join((environment(), _text(fn), _text(jit_options), _text(compiler_options), _arguments(args)))
    except Unkeyable as e:
        _warn_foreign(e)
        return None
    if after is not None:
        text += f"\nafter {after.name}"
    return where / f"{_name(fn.func).rsplit('.', 1)[-1]}-{hashlib.sha256(text.encode()).hexdigest()}"


def environment() -> str:
    """The text of everything outside a program's arguments that changes what it compiles to."""
    return "\n".join((_installed(), f"XLA_FLAGS={os.environ.get('XLA_FLAGS')}",
                      f"LIBTPU_INIT_ARGS={os.environ.get('LIBTPU_INIT_ARGS')}",
                      *(f"{k}={v!r}" for k, v in sorted(jax.config.values.items()))))


@functools.lru_cache(maxsize=1)
def _installed() -> str:
    """The versions, the sdx source and the devices: fixed for the life of a process."""
    import flax

    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    return "\n".join((
        f"python {sys.version}", f"numpy {np.__version__}", f"jax {jax.__version__}",
        f"jaxlib {metadata.version('jaxlib')}", f"ml_dtypes {metadata.version('ml_dtypes')}",
        f"flax {flax.__version__}", f"optax {metadata.version('optax')}", f"sdx source {source_digest(ROOT)}",
        f"platform {jax.devices()[0].client.platform_version}", f"devices {devices}",
    ))


def source_digest(root: Path) -> str:
    """SHA-256 of every Python file of `PACKAGES` under `root`, with its path."""
    digest = hashlib.sha256()
    for package in PACKAGES:
        for file in sorted((root / package).rglob("*.py")):
            digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def _arguments(args: tuple) -> str:
    """The tree structure and each leaf's shape, dtype, weak type, sharding and layout."""
    leaves, tree = jax.tree.flatten(args)
    return _checked(str(tree)) + "\n" + "\n".join(_leaf(x) for x in leaves)


def _leaf(x) -> str:
    """An array's or an abstract value's (`jax.ShapeDtypeStruct` with a sharding) text: the same for both."""
    if getattr(x, "sharding", None) is None:  # a host value: traced by its type alone, but its dtype decides the program
        raise Unkeyable(type(x).__name__)
    return f"{x.shape} {x.dtype} {getattr(x, 'weak_type', False)} {_sharding(x.sharding)} {_layout(x)}"


def _layout(x) -> str:
    """The text of `x`'s layout: row-major for the default one on a CPU or GPU and for an abstract value
    (which has none), so that keys computed before the arrays exist match theirs; any other by its repr (a
    TPU's tiled default included: its abstract keys then miss, and the program is read when needed)."""
    layout = getattr(getattr(x, "format", None), "layout", None)
    if layout is None or (tuple(layout.major_to_minor) == tuple(range(len(x.shape))) and not layout.tiling
                          and not layout.sub_byte_element_size_in_bits):
        return "row-major"
    return _checked(repr(layout))


@functools.lru_cache(maxsize=256)
def _sharding(sharding: jax.sharding.Sharding) -> str:  # shardings are few and shared by many arrays
    return f"{_checked(repr(sharding))} on {sorted(d.id for d in sharding.device_set)}"


def _text(x) -> str:
    """A canonical text of a static value: equal in every process for equal values."""
    kind = type(x)
    if kind in _SCALARS:
        return repr(x)
    if kind in _EMPTY:  # many of a graph definition's attributes
        return _EMPTY[kind]
    if isinstance(x, enum.Enum):
        return f"{_name(kind)}.{x.name}"
    if isinstance(x, (type, types.FunctionType, types.BuiltinFunctionType)):
        return _name(x)
    if isinstance(x, functools.partial):
        return f"partial({_name(x.func)}, {_text(x.args)}, {_text(x.keywords)})"
    if isinstance(x, np.dtype):
        return f"dtype({x})"
    if isinstance(x, jax.sharding.Sharding):
        return _sharding(x)
    if isinstance(x, jax.tree_util.PyTreeDef):
        return _checked(str(x))
    if isinstance(x, (list, tuple)):
        return f"{_name(kind)}({', '.join(map(_text, x))})"
    if isinstance(x, (set, frozenset)):
        return f"{_name(kind)}({', '.join(sorted(map(_text, x)))})"
    if isinstance(x, Mapping):
        return f"{_name(kind)}({{{', '.join(f'{_text(k)}: {_text(v)}' for k, v in x.items())}}})"
    if kind is nnx.GraphDef:
        return _graph_text(x)
    if isinstance(x, nnx.Variable):  # a model state's leaf, as in a training step's tree of shardings
        return f"{_name(kind)}({_text(x.get_value())}, {_text(x.get_metadata())})"
    if dataclasses.is_dataclass(x):
        return _dataclass_text(x)
    raise Unkeyable(kind.__name__)


def _dataclass_text(x) -> str:
    kind = type(x)
    names = _fields(kind)
    if not names:
        _EMPTY[kind] = f"{_name(kind)}()"
        return _EMPTY[kind]
    return f"{_name(kind)}({', '.join(f'{n}={_text(getattr(x, n))}' for n in names)})"


_SCALARS = frozenset((type(None), bool, int, float, complex, str, bytes))
_EMPTY: dict[type, str] = {}  # dataclasses without fields: their text is their type's
_GRAPH_TEXTS: dict[nnx.GraphDef, str] = {}  # by value: hashing and comparing one is a tenth of making its text


def _graph_text(graphdef: nnx.GraphDef) -> str:
    """A model's graph definition as text, made once per value: several programs' keys hold the same one (the
    UNet's: prepare's and denoise's), and `Pipeline.load(first=...)` keys its first request twice, over the
    abstract models and then over the loaded ones, whose definitions are equal (SDXL's UNet: 0.15 s to make
    its text, 0.02 s to hash and compare it)."""
    try:
        text = _GRAPH_TEXTS.get(graphdef)
    except TypeError:  # an attribute without a hash (a researcher's own module): made each time
        return _dataclass_text(graphdef)
    if text is None:
        if len(_GRAPH_TEXTS) >= 64:  # the oldest goes
            del _GRAPH_TEXTS[next(iter(_GRAPH_TEXTS))]
        text = _GRAPH_TEXTS[graphdef] = _dataclass_text(graphdef)
    return text


@functools.lru_cache(maxsize=None)
def _fields(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(kind))


def _name(obj) -> str:
    module = getattr(obj, "__module__", None) or ""
    name = f"{module}.{getattr(obj, '__qualname__', None)}"
    if "<" in name:  # a lambda or a local function: its closure is not in its name
        raise Unkeyable(name)
    if module.split(".")[0] not in (*PACKAGES, *LIBRARIES):  # code whose changes no key would see
        raise ForeignCode(name) if module else Unkeyable(name)
    return name


def _checked(text: str) -> str:
    if " at 0x" in text:  # an object printed by its address
        raise Unkeyable(text)
    return text
