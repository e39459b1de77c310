"""Interventions: change a named part of a model inside its compiled call, without copying the model.

Three means, each addressed by diffusers' module path (`up_blocks.1.attentions.0.transformer_blocks.0.attn1`):

- attention processors (`Processor`): the core of one attention, `q, k, v -> output`, replaced or wrapped.
  The projections stay in `sdx.layers.Attention`; a processor receives an `AttentionCall` (the attention's
  input, keys and values, and helpers: `query`, `attend`, `probabilities`, `output`, `rows`) and returns the
  attention's output. It may call `call.proceed()`, the rest of the chain (the next processor, or the plain
  attention), so processors wrap one another;
- hooks (`Hook`) on named sites other than attention: each up block's skip concatenation
  (`up_blocks.<i>.resnets.<j>.skip`, the pair (hidden states, skip) before they are joined) and each
  block's output (`down_blocks.<i>`, `mid_block`, `up_blocks.<i>`), replaced or wrapped;
- readouts: a processor or hook calls `record(name, value)`; `capture(fn, *args)` returns fn's result and
  every value recorded under it, as explicit outputs of the traced call (a sampler carries them through its
  steps as fixed-shape buffers).

Patterns (`select`) name sites as globs over the dotted paths: `*` matches one component, `**` any number,
other components match as `fnmatch` does (`attn?`); a pattern that matches the leading components of a name
selects it too, so `mid_block` selects every attention of the mid block.

Why a pytree passed into the call, not module surgery, `nnx.sow` or method interception. A model's graph
definition is part of every compiled program's key (`pipelines.executables`); processors set on modules
would change it per run and put their scales in the parameters. `nnx.sow` keeps values in module state,
which the UNet's outlined and rematerialised blocks (`sdx.outline`, `sdx.layers.rematerialised`) trace in
functions of their own and drop. Method interception (flax 0.12's NNX has none; linen's `intercept_methods`
is a global context around `Module` calls) would not reach into those functions either. So the
interventions of a call are one pytree, `Interventions`, carried in the UNet's `TextContext` down to every
block and attention: its static part (which processor where, and their static fields) is the program's
structure, its leaves (the fields a class names in `traced`: scales, gates, per-row data) are the program's
inputs, so a new scale compiles nothing. `record` writes into the innermost `capture`, a scope of the trace
(not module state); the outlined and rematerialised calls capture what is recorded inside them and return it
as outputs of their own, which they record again outside (`forward`).

What a run asks for is static (its `Plan`, by `split`: each object with its traced fields set to None, which
keys the compiled programs; a class from outside this repository makes them uncachable on disk, never
stale) and what it sets is traced (`split`'s leaves, bound back inside the program by `bind`).

A processor that reads the batch's rows by their place (a guidance branch: PAG's perturbed rows) says so
with `per_row`; the sampler then runs every row of the batch in full instead of sharing the rows of one
image's branches before the first attention that reads the text (`pipelines.guidance.Guidance.shared`).
"""

from __future__ import annotations

import contextvars
import dataclasses
import fnmatch
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from sdx.attention import dot_product_attention
from sdx.errors import SdxError

# --------------------------------------------------------------------------------------------------
# Objects whose named fields are program inputs


class Traced:
    """A frozen dataclass whose fields named in `traced` are traced program inputs (arrays or numbers, never
    None) and whose other fields are static (hashable). Every subclass is a pytree: its traced fields are
    the children, the others the static part."""

    traced: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_node(cls, _flatten, functools.partial(_unflatten, cls))


def _flatten(obj: Traced):
    names = type(obj).traced
    static = tuple((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in names)
    return tuple(getattr(obj, n) for n in names), static


def _unflatten(cls, static, children):
    obj = object.__new__(cls)  # no __post_init__: jax rebuilds pytrees with placeholder leaves
    for name, value in (*static, *zip(cls.traced, children)):
        object.__setattr__(obj, name, value)
    return obj


def split(obj):
    """(static, leaves): `obj` (a pytree of `Traced` objects) with every traced leaf set to None, hashable, for
    a `Plan`; and the leaves as numpy values (Python floats as float32, ints as int32), for the program's
    inputs. `bind(static, leaves)` puts them back."""
    leaves, tree = jax.tree.flatten(obj)
    host = lambda x: np.asarray(x, np.float32 if isinstance(x, float) else np.int32 if isinstance(x, int) else None)
    return jax.tree.unflatten(tree, [None] * len(leaves)), tuple(host(x) for x in leaves)


def bind(static, leaves):
    """The inverse of `split`: `static` with its None leaves replaced by `leaves`, in order."""
    return jax.tree.unflatten(jax.tree.structure(static, is_leaf=lambda x: x is None), list(leaves))


# --------------------------------------------------------------------------------------------------
# Processors and hooks


class Processor(Traced):
    """An attention's core (see the module docstring). `__call__(call) -> (B, T, C)`, the attention's output
    for `call.h`'s rows (before a residual the attention may add)."""

    per_row: ClassVar[bool] = True  # reads rows by their place in the batch (see the module docstring)

    def __call__(self, call: AttentionCall) -> jax.Array:
        raise NotImplementedError

    def restrict(self, pick: Callable[[jax.Array], jax.Array]) -> Processor | None:
        """This processor for a call restricted to some of its rows (`AttentionCall.rows`; `pick` takes them
        from a (B, ...) array): itself by default; None to leave it out."""
        return self


class Hook(Traced):
    """A site's function: `__call__(site, *values) -> tuple of values`, the same structure back (the site's
    name tells which one it is: `up_blocks.1.resnets.0.skip` gets (hidden states, skip))."""

    per_row: ClassVar[bool] = True

    def __call__(self, site: str, *values) -> tuple:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One attention call as its processors see it.

    module: the `sdx.layers.Attention` (its `to_q`, `to_out`, `heads`, `head_dim`, backend); h (B, T, C): its
    input (after the VAE's group norm); k, v (B, S, heads, head_dim): its keys and values (of h for
    self-attention, of the text for cross-attention); path: the attention's module path; step: the model
    call's index in the sampler's schedule (a traced int32 scalar), None outside a sampler; calls: the
    schedule's model calls (static), None outside a sampler; rest: the processors still to run, innermost
    last; q: the queries (B, T, heads, head_dim) when a processor has made them already (`query` makes them
    otherwise)."""

    module: Any
    h: jax.Array
    k: jax.Array
    v: jax.Array
    path: str | None = None
    step: jax.Array | None = None
    rest: tuple[Processor, ...] = ()
    calls: int | None = None
    q: jax.Array | None = None

    @property
    def share(self) -> jax.Array:
        """() float32: the share of the sampler's schedule done before this call (step / calls)."""
        if self.step is None:
            raise SdxError(f"attention {self.path}: this processor reads the sampler's step; run the model in a "
                           "sampler")
        return self.step.astype(jnp.float32) / self.calls

    def query(self) -> jax.Array:
        """(B, T, heads, head_dim): to_q of h (`q` when given)."""
        if self.q is not None:
            return self.q
        q = self.module.to_q(self.h)
        return q.reshape(q.shape[0], q.shape[1], self.module.heads, self.module.head_dim)

    def attend(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        """softmax(q k^T / sqrt(head_dim)) v with the model's backend: (B, T, H, D), (B, S, H, D) -> (B, T, H, D)."""
        m = self.module
        return dot_product_attention(q, k, v, backend=m.backend, chunk_size=m.chunk, shards=m.shards)

    def probabilities(self, q: jax.Array, k: jax.Array) -> jax.Array:
        """(B, heads, T, S) float32: the attention probabilities, softmax(q k^T / sqrt(head_dim)) over the keys,
        formed in full (what a processor that reads or changes them takes; `mix` finishes the attention)."""
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        return jax.nn.softmax(logits / math.sqrt(q.shape[-1]), axis=-1)

    def mix(self, probabilities: jax.Array, v: jax.Array) -> jax.Array:
        """(B, heads, T, S) probabilities and (B, S, H, D) values -> (B, T, H, D) in v's dtype."""
        out = jnp.einsum("bhqk,bkhd->bqhd", probabilities.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return out.astype(v.dtype)

    def output(self, o: jax.Array) -> jax.Array:
        """to_out of (B, T, H, D) per-head outputs -> (B, T, C)."""
        return self.module.to_out[0](o.reshape(o.shape[0], o.shape[1], -1))  # (B, T, H*D) -> (B, T, C)

    def added_output(self, o: jax.Array) -> jax.Array:
        """to_out's linear map alone (no bias) of (B, T, H, D) per-head outputs -> (B, T, C): what adding `o` to
        the attention before to_out adds to its output (to_out(a + o) = to_out(a) + added_output(o))."""
        return self.module.to_out[0].without_bias(o.reshape(o.shape[0], o.shape[1], -1))  # (B, T, H*D) -> (B, T, C)

    def proceed(self, **changes) -> jax.Array:
        """The rest of the chain on this call (with `changes` to its fields, e.g. other values `v=`): the next
        processor, or the plain attention `output(attend(query(), k, v))`."""
        call = dataclasses.replace(self, **changes) if changes else self
        if call.rest:
            return call.rest[0](dataclasses.replace(call, rest=call.rest[1:]))
        return call.output(call.attend(call.query(), call.k, call.v))

    def rows(self, layout, which: tuple[int, ...]) -> AttentionCall:
        """This call restricted to rows `which` of each period of `layout` (`sdx.layers.Rows`), image-major:
        h, k, v and every processor still to run (`Processor.restrict`)."""
        pick = lambda a: layout.pick(a, which)
        rest = tuple(p for p in (r.restrict(pick) for r in self.rest) if p is not None)
        q = None if self.q is None else pick(self.q)
        return dataclasses.replace(self, h=pick(self.h), k=pick(self.k), v=pick(self.v), rest=rest, q=q)


# --------------------------------------------------------------------------------------------------
# What one call runs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Interventions:
    """The interventions of one model call: attention: {attention path: processors, outermost first}; sites:
    {site name: hooks, outermost first}; step: the sampler's model-call index (traced), and calls: its
    schedule's model calls (static), None outside one."""

    attention: Mapping[str, tuple[Processor, ...]] = dataclasses.field(default_factory=dict)
    sites: Mapping[str, tuple[Hook, ...]] = dataclasses.field(default_factory=dict)
    step: jax.Array | None = None
    calls: int | None = dataclasses.field(default=None, metadata={"static": True})

    def __or__(self, other: Interventions) -> Interventions:
        """Both, this one's outermost where they share a site."""
        join = lambda a, b: {k: a.get(k, ()) + b.get(k, ()) for k in {**a, **b}}
        step = self.step if self.step is not None else other.step
        return Interventions(join(self.attention, other.attention), join(self.sites, other.sites), step,
                             self.calls or other.calls)

    @property
    def per_row(self) -> bool:
        return any(p.per_row for ps in (*self.attention.values(), *self.sites.values()) for p in ps)

    def only(self, paths: Iterable[str | None]) -> Interventions:
        """The processors of `paths` alone, no hooks (what a transformer block passes on)."""
        return Interventions({p: self.attention[p] for p in paths if p in self.attention}, {}, self.step, self.calls)

    def restrict(self, pick: Callable[[jax.Array], jax.Array]) -> Interventions:
        """These interventions for a call on some rows of the batch (`Processor.restrict`; hooks as they are)."""
        kept = lambda ps: tuple(r for r in (p.restrict(pick) for p in ps) if r is not None)
        return Interventions({k: kept(ps) for k, ps in self.attention.items()}, self.sites, self.step, self.calls)

    def at_site(self, site: str, *values) -> tuple:
        """The hooks of `site` applied to `values` (outermost last: the innermost sees the model's values)."""
        for hook in reversed(self.sites.get(site, ())):
            values = tuple(hook(site, *values))
        return values


def hooked(interventions: Interventions | None, site: str, *values) -> tuple:
    """`values` through the hooks of `site`, unchanged without interventions."""
    return values if interventions is None else interventions.at_site(site, *values)


@dataclasses.dataclass(frozen=True)
class Readout:
    """Where a sampler is, for an intervention that reads out across its model calls: images: the batch's;
    latent: (h, w); tokens: the text context's length; branches: guidance branches per image, text_branch:
    the one that reads the prompt (image j's is row j * branches + text_branch of the UNet's batch); calls:
    the model calls of the full schedule; index: this call's among them (traced; None before the first)."""

    images: int
    latent: tuple[int, int]
    tokens: int
    branches: int
    text_branch: int
    calls: int
    index: jax.Array | None = None


class Intervention(Traced):
    """What a generation asks for (`pipelines.request.Request.interventions`): `install(model)` places its
    processors and hooks on a model, from the model's `sites()`; raises `SdxError` for a model it cannot
    act on (before anything is compiled). `per_row` as for processors.

    One that reads something out of a sampler's run gives its buffer (`readout`: a pytree of arrays with the
    batch's images first, batch-split like the latents, or None) and folds each model call's records into it
    (`accumulate`); the sampler returns the last buffer (`pipelines.pipeline.Pipeline.generate`)."""

    per_row: ClassVar[bool] = True

    def install(self, model) -> Interventions:
        return Interventions()

    def check(self, request, pipe) -> None:
        """Refuse, in the user's terms, a request (`pipelines.request.Request`) or a pipeline this intervention
        cannot serve; nothing by default."""

    def readout(self, at: Readout):
        return None

    def accumulate(self, buffer, records: Mapping[str, Any], at: Readout):
        return buffer


@dataclasses.dataclass(frozen=True)
class At(Intervention):
    """`what` (a `Processor` or a `Hook`) at every attention, or site, that `pattern` selects (`select`).
    kind: "self" or "cross" to select only self- or only cross-attentions, None for both."""

    pattern: str
    what: Processor | Hook
    kind: str | None = None
    traced: ClassVar[tuple[str, ...]] = ("what",)

    def install(self, model) -> Interventions:
        where = f"intervention at {self.pattern!r}"
        if isinstance(self.what, Processor):
            names = select(attention_paths(model, self.kind), self.pattern, where, kind="attention")
            return Interventions(attention={n: (self.what,) for n in names})
        names = select(list(model.sites()), self.pattern, where, kind="site")
        return Interventions(sites={n: (self.what,) for n in names})

    @property
    def per_row(self) -> bool:
        return type(self.what).per_row


def installed(model, interventions: Iterable[Intervention]) -> Interventions:
    """The interventions of a call on `model`, the first given outermost."""
    out = Interventions()
    for one in interventions:
        out = out | one.install(model)
    return out


def attention_paths(model, kind: str | None = None) -> list[str]:
    """The paths of `model`'s attentions (`model.sites()` of kind "self"/"cross"), or of one kind."""
    return [name for name, k in model.sites().items() if k in ("self", "cross") and kind in (None, k)]


# --------------------------------------------------------------------------------------------------
# Patterns


_GLOB = re.compile(r"[*?\[\]]")


def select(names: list[str], pattern: str, where: str, kind: str = "site") -> list[str]:
    """The `names` (dotted paths) that `pattern` selects (see the module docstring), in order; an SdxError
    naming `where` when the pattern is malformed, names a component no path has, or selects nothing."""
    parts = pattern.split(".")
    if not pattern or any(p == "" for p in parts):
        raise SdxError(f"{where}: {pattern!r} is not a pattern (dot-separated names, * or **)")
    known = {c for n in names for c in n.split(".")}
    for part in parts:  # a word no path has (an index out of range only matches nothing)
        if not _GLOB.search(part) and not part.isdigit() and part not in known:
            tops = sorted({n.split(".")[0] for n in names})
            raise SdxError(f"{where}: {part!r} names nothing in this model (its {kind}s start with "
                           f"{', '.join(tops)}; e.g. {names[0] if names else 'none'})")
    found = [n for n in names if _matches(parts, n.split("."))]
    if not found:
        raise SdxError(f"{where}: {pattern!r} matches no {kind} of this model (e.g. {', '.join(names[:3])})")
    return found


def _matches(pattern: list[str], name: list[str]) -> bool:
    """Whether `pattern` matches the whole of `name` or its leading components."""
    if not pattern:
        return True
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_matches(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatch.fnmatchcase(name[0], head) and _matches(rest, name[1:])


# --------------------------------------------------------------------------------------------------
# Readouts


_RECORDS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("sdx_records", default=None)


def record(name: str, value) -> None:
    """Put `value` (an array or pytree of arrays) among the outputs of the innermost `capture` under `name`,
    once per name."""
    records = _RECORDS.get()
    if records is None:
        raise SdxError(f"record({name!r}): nothing captures here; call the model through sdx.interventions.capture")
    if name in records:
        raise SdxError(f"record({name!r}): recorded twice in one capture")
    records[name] = value


def capture(fn: Callable, *args, **kwargs) -> tuple[Any, dict]:
    """(fn(*args, **kwargs), {name: value} of everything `record`ed while it ran)."""
    token = _RECORDS.set({})
    try:
        out = fn(*args, **kwargs)
        return out, _RECORDS.get()
    finally:
        _RECORDS.reset(token)


def forward(records: Mapping[str, Any]) -> None:
    """Record `records` in the enclosing capture: how a function traced on its own (an outlined or
    rematerialised block) hands out what was recorded inside it. Nothing to do without records; without an
    enclosing capture, records are an error (`record`)."""
    for name, value in records.items():
        record(name, value)
