"""Whether this process runs the code that this repository's source files hold.

`pipelines.executables` keys a compiled program by the text of its source files (`source_digest`), not by
the program: a program stored by one process is read back by another whose sdx source is the same. A
process that changed sdx's code after importing it (a researcher's experiment that replaces
`sdx.unet.UpBlock2D.__call__`, a test that sets a module constant) would be handed the program of the
unchanged code. `first_change` finds such a change by comparing the live modules with their files:

- every function and class a module's file defines at its top level (and every method a class body
  defines) is still the one that file defined: the same name, made from that file's code, and every
  function it is wrapped in comes from this repository (a `functools.wraps` wrapper from elsewhere is seen);
- every name a module imports from another of this repository's modules is still that module's object;
- every constant a module or class body (not an enum's) assigns an immutable literal to (`BLOCKED_LOGITS =
  4096`) still has that value.

Objects added to a module or a class under new names, and changes to the libraries (jax, flax), are not
seen: programs keyed by a library's version assume its code is the installed one.
"""

from __future__ import annotations

import ast
import enum
import functools
import importlib.util
import operator
import pickle
import sys
import sysconfig
import types
from pathlib import Path

from sdx import io
from sdx.errors import SdxError

_MISSING = object()


def first_change(packages: tuple[str, ...], root: Path, ignore: frozenset[str] = frozenset(),
                 store: Path | None = None) -> str | None:
    """A sentence naming the first object of `packages` (modules loaded from files under `root`) that is no
    longer what its source file says, or None when all are; `ignore`: full names not to check. store: a
    file that keeps what the source files define (valid while they are unchanged: name it by their digest),
    so that a process need not parse them (69 files of a sampling run: 0.4 s on a 2-core CPU)."""
    if store is not None and not _FACTS:
        _FACTS.update(_read_store(store))
    known = len(_FACTS)
    change = _first_change(packages, root, ignore)
    if store is not None and len(_FACTS) > known:
        _write_store(store)
    return change


def _first_change(packages: tuple[str, ...], root: Path, ignore: frozenset[str]) -> str | None:
    for name, module in sorted(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if module is None or name.split(".")[0] not in packages or not file or not file.endswith(".py"):
            continue
        path = Path(file).resolve()
        if root not in path.parents:
            continue
        change = _module_change(module, _facts(str(path), packages), tuple(root / p for p in packages), ignore)
        if change is not None:
            return f"{name}.{change}"
    return None


def _module_change(module: types.ModuleType, facts: _Facts, ours: tuple[Path, ...], ignore: frozenset[str]) -> str | None:
    for name, methods in facts.classes.items():
        cls = vars(module).get(name, _MISSING)
        if not isinstance(cls, type) or cls.__module__ != module.__name__ or cls.__qualname__ != name:
            return f"{name} is {_describe(cls)}"
        for method in methods:
            if not _defined_in(vars(cls).get(method, _MISSING), facts.file, method, ours):
                return f"{name}.{method} is {_describe(vars(cls).get(method, _MISSING))}"
        for constant, value in ({} if issubclass(cls, enum.Enum) else facts.class_constants[name]).items():
            if not _equal(vars(cls).get(constant, _MISSING), value):
                return f"{name}.{constant} is {vars(cls).get(constant, _MISSING)!r}, not {value!r}"
    for name in facts.functions:
        if f"{module.__name__}.{name}" in ignore:
            continue
        if not _defined_in(vars(module).get(name, _MISSING), facts.file, name, ours):
            return f"{name} is {_describe(vars(module).get(name, _MISSING))}"
    for name, value in facts.constants.items():
        if not _equal(vars(module).get(name, _MISSING), value):
            return f"{name} is {vars(module).get(name, _MISSING)!r}, not {value!r}"
    for name, (source, attribute) in facts.imports.items():
        owner = sys.modules.get(importlib.util.resolve_name(source, module.__package__) if source.startswith(".")
                                else source)
        if owner is None:
            continue
        want = getattr(owner, attribute, _MISSING)
        if want is _MISSING:  # a submodule imported by name
            want = sys.modules.get(f"{owner.__name__}.{attribute}", _MISSING)
        if vars(module).get(name, _MISSING) is not want:
            return f"{name} is {_describe(vars(module).get(name, _MISSING))}, not {owner.__name__}.{attribute}"
    return None


def _defined_in(obj, file: str, name: str, ours: tuple[Path, ...]) -> bool:
    """Whether `obj` is the function (or method, property, static or class method) `def name` in `file`
    made, wrapped only in wrappers whose code is the packages' own (in the folders `ours`) or an installed
    library's."""
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    elif isinstance(obj, property):
        obj = obj.fget
    elif isinstance(obj, functools.cached_property):
        obj = obj.func
    innermost = None
    seen = 0
    while obj is not None and seen < 16:  # a decorator chain, outermost first
        if isinstance(obj, types.FunctionType):
            if not _trusted(obj.__code__.co_filename, ours):
                return False
            innermost = obj
        obj, seen = getattr(obj, "__wrapped__", None), seen + 1
    return innermost is not None and innermost.__code__.co_filename == file and innermost.__code__.co_name == name


@functools.lru_cache(maxsize=None)
def _trusted(code_file: str, ours: tuple[Path, ...]) -> bool:
    """Whether code from `code_file` may wrap a function of the packages: their own code (in the folders
    `ours`; not the repository's tests or a script beside them), the standard library's or an installed
    package's (`functools.lru_cache`, `jax.jit`), or generated code (dataclasses' methods)."""
    if code_file.startswith("<"):
        return True
    path = Path(code_file).resolve()
    return any(path.is_relative_to(where) for where in (*ours, *_LIBRARY_DIRS))


_LIBRARY_DIRS = tuple({Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes)


def _equal(live, value) -> bool:
    return type(live) is type(value) and live == value


def _describe(obj) -> str:
    """What replaced an object: `module.name (file)`."""
    if obj is _MISSING:
        return "missing"
    code = getattr(obj, "__code__", None)
    where = f" ({code.co_filename})" if code is not None else ""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}{where}"


class _Facts:
    """What a source file defines at its top level, and in its classes' bodies."""

    def __init__(self, file: str, tree: ast.Module, packages: tuple[str, ...]):
        self.file = file
        self.functions: list[str] = []
        self.classes: dict[str, list[str]] = {}
        self.constants: dict[str, object] = {}
        self.class_constants: dict[str, dict[str, object]] = {}
        self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, attribute)
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.append(node.name)
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = [n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                self.class_constants[node.name] = _literals(node.body)
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in packages):
                source = "." * node.level + (node.module or "")
                for alias in node.names:
                    if alias.name != "*":
                        self.imports[alias.asname or alias.name] = (source, alias.name)
        self.constants = _literals(tree.body)
        # a name defined twice (a def replaced by a later assignment, a conditional import) is not checked
        defined = [*self.functions, *self.classes, *self.constants, *self.imports]
        twice = {n for n in defined if defined.count(n) > 1}
        self.functions = [n for n in self.functions if n not in twice]
        self.classes = {n: m for n, m in self.classes.items() if n not in twice}
        self.constants = {n: v for n, v in self.constants.items() if n not in twice}
        self.imports = {n: v for n, v in self.imports.items() if n not in twice}


def _literals(body: list[ast.stmt]) -> dict[str, object]:
    """{name: value} of the statements `NAME = value` (and annotated ones) in `body` whose value is an
    immutable constant (`_constant`): a list or dict a module fills as it loads is not its literal any more."""
    out = {}
    for node in body:
        targets, value = ((node.targets, node.value) if isinstance(node, ast.Assign)
                          else ([node.target], node.value) if isinstance(node, ast.AnnAssign) and node.value else ([], None))
        if len(targets) != 1 or not isinstance(targets[0], ast.Name):
            continue
        try:
            out[targets[0].id] = _constant(value)
        except _NotConstant:
            continue
    return out


class _NotConstant(Exception):
    pass


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.LShift: operator.lshift,
              ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _constant(node: ast.expr):
    """The value of an expression of immutable literals (numbers, strings, None, tuples) and arithmetic on
    them (`64 * 2**20`), or _NotConstant."""
    if isinstance(node, ast.Constant) and isinstance(node.value, _IMMUTABLE):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(map(_constant, node.elts))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_constant(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _constant(node.left), _constant(node.right)
        if isinstance(node.op, (ast.Pow, ast.LShift)) and not (isinstance(right, int) and 0 <= right <= 256):
            raise _NotConstant
        try:
            return _OPERATORS[type(node.op)](left, right)
        except (TypeError, ArithmeticError, ValueError):
            raise _NotConstant from None
    raise _NotConstant


_FACTS: dict[tuple[str, tuple[str, ...]], _Facts] = {}  # by (file, packages), for the life of the process


def _facts(file: str, packages: tuple[str, ...]) -> _Facts:
    key = (file, packages)
    if key not in _FACTS:
        _FACTS[key] = _Facts(file, ast.parse(Path(file).read_bytes(), filename=file), packages)
    return _FACTS[key]


def _read_store(store: Path) -> dict:
    try:
        facts = pickle.loads(store.read_bytes())
        return facts if isinstance(facts, dict) else {}
    except Exception:  # missing, damaged or written by another build: parsed again
        return {}


def _write_store(store: Path) -> None:
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        io.atomic_write(store, lambda f: f.write(pickle.dumps(_FACTS)))
    except (OSError, SdxError):  # a full or read-only cache: parsed again next time
        pass
