"""Pytree plumbing: the ``record`` decorator and ``tree_*`` helpers in the library's namespace.

optree is wrapped here once. Every other module goes through these helpers, so the namespace
is never forgotten and records flatten the same way everywhere.

Where this module leans on attrs and optree beyond their documented use, and why:

- Assignment messages. A frozen attrs class refuses assignment with "can't set attribute";
  `register_record` replaces that `__setattr__` (and `__delattr__`) with one that names the
  fix. attrs has no public query for "is this class frozen", so the function attrs installs
  is taken from a frozen class built here and compared by identity; a class with its own
  `__setattr__` keeps it.
- optree's marker. `optree.integrations.attrs.register_node` marks a class with
  ``__optree_attrs_fields__`` and refuses a class whose ``__dict__`` has it. attrs copies a
  base's ``__dict__`` into the slotted subclass it builds, marker included, so a subclass of
  a record would be refused; `register_record` deletes the copied marker first (it checks
  the registry, not the marker, to know whether a class is registered). optree has no public
  way to register such a subclass, and registering records by hand with
  `optree.register_pytree_node` would change every treespec, snapshots included.
- Construction under `torch.compile`. The ``__init__`` attrs generates for a frozen slotted
  class sets fields through ``object.__setattr__.__get__(self)``, a bound slot wrapper that
  dynamo cannot trace, so a step that builds a record (``attrs.evolve``, a commit) would break
  the graph. `traceable_init` swaps that one name in the generated method's own globals (attrs
  gives each class its own) for a function that returns the same bound setter when eager and
  a traceable ``functools.partial`` while compiling, and drops the globals' ``__name__`` (else
  dynamo would look the name up in the class's module). attrs has no option for this.
"""

from __future__ import annotations

import functools
import struct
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeVar, overload

import attrs
import optree
import torch
import torch.utils._pytree as torch_pytree
from optree.integrations import attrs as optree_attrs

from sessionstate._errors import ImmutableRecordError
from sessionstate._protocols import ASSIGNMENT_FIX_HOOK

__all__ = [
    "NAMESPACE",
    "PyTree",
    "PyTreeSpec",
    "field",
    "format_accessor",
    "is_record",
    "record",
    "register_record",
    "static_field",
    "traceable_init",
    "tree_equal",
    "tree_flatten",
    "tree_flatten_with_keys",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
]

NAMESPACE = "sessionstate"
"""The optree registry namespace that records are registered in."""

PyTree: TypeAlias = Any
"""Any nesting of records, tuples, lists, dicts and leaves (tensors and plain values)."""

PyTreeSpec: TypeAlias = optree.PyTreeSpec

_T = TypeVar("_T")
_C = TypeVar("_C", bound=type)


@attrs.frozen
class _FrozenProbe:
    pass


_ATTRS_FROZEN_SETATTR: object = _FrozenProbe.__setattr__
"""The `__setattr__` attrs installs on every frozen class (see the module docstring)."""


def field(**kwargs: Any) -> Any:
    """A record field that is a pytree child (tensors live here).

    Same arguments as `attrs.field`.

    >>> import attrs
    >>> @record
    ... class Box:
    ...     value: object = field()
    >>> attrs.fields(Box).value.metadata["pytree_node"]
    True
    """
    return optree_attrs.field(pytree_node=True, **kwargs)


def static_field(**kwargs: Any) -> Any:
    """A record field kept as static treespec data (configuration: sizes, names, flags).

    Static fields survive `tree_map` unchanged and are compared as part of the treespec.

    >>> @record
    ... class Ring:
    ...     maxlen: int = static_field(default=2)
    >>> tree_leaves(Ring()), tree_flatten(Ring())[1]
    ([], PyTreeSpec(CustomTreeNode(Ring[(('maxlen', 2),)], []), namespace='sessionstate'))
    """
    return optree_attrs.field(pytree_node=False, **kwargs)


_OBJECT_SETATTR_GET = object.__setattr__.__get__


def _setattr_get(instance: object) -> Callable[[str, object], None]:
    # What attrs's generated `__init__` calls to get its field setter (see the module docstring).
    if torch.compiler.is_compiling():
        return functools.partial(object.__setattr__, instance)
    return _OBJECT_SETATTR_GET(instance)  # type: ignore[no-any-return]


def traceable_init(cls: _C) -> _C:
    """Let `torch.compile` trace the ``__init__`` attrs generated for ``cls`` (frozen, slotted).

    `register_record` calls this; call it for a frozen attrs class that is not a record but is
    built inside a compiled step. A class without such an ``__init__`` is returned unchanged.

    >>> import attrs
    >>> @attrs.frozen
    ... class Pair:
    ...     a: int
    >>> traceable_init(Pair)(1).a
    1
    """
    init = cls.__dict__.get("__init__")
    globs = getattr(init, "__globals__", None)
    if globs is not None and "_cached_setattr_get" in globs and globs is not globals():
        globs["_cached_setattr_get"] = _setattr_get
        # Without a module name dynamo guards on this dict itself, rather than looking the
        # setter up in the class's module, which has no such name.
        globs.pop("__name__", None)
    return cls


def _is_registered_with_optree(cls: type) -> bool:
    # Ask the registry itself: attrs copies a class's `__dict__` (optree's marker included)
    # when it rebuilds a slotted subclass, so the marker alone would vouch for a new class.
    return optree.register_pytree_node.get(cls, namespace=NAMESPACE) is not None


def is_record(cls: type, /) -> bool:
    """Whether ``cls`` is registered as a pytree node in the library's namespace.

    Builtin containers (dict, tuple, ...) count as registered: they are pytree nodes too.

    >>> @record
    ... class Box:
    ...     value: object = field()
    >>> is_record(Box), is_record(int)
    (True, False)
    """
    return _is_registered_with_optree(cls)


def register_record(cls: _C) -> _C:
    """Register an attrs class as a pytree node with optree (our namespace) and torch.

    Idempotent: registering a class twice is a no-op. `record` calls this; call it directly
    only for an attrs class you did not create with `record` (or for a subclass that adds no
    fields, which `SessionState` does for you).

    >>> import attrs
    >>> @attrs.frozen(eq=False)
    ... class Pair:
    ...     a: object
    ...     b: object
    >>> Pair = register_record(Pair)
    >>> tree_leaves(Pair(1, 2))
    [1, 2]
    >>> register_record(Pair) is Pair
    True
    """
    if not _is_registered_with_optree(cls):
        if "__optree_attrs_fields__" in cls.__dict__:  # copied from a base by attrs
            delattr(cls, "__optree_attrs_fields__")
        optree_attrs.register_node(cls, namespace=NAMESPACE)
        if cls.__setattr__ is _ATTRS_FROZEN_SETATTR:
            cls.__setattr__ = _refuse_assignment  # type: ignore[method-assign,assignment]
            cls.__delattr__ = _refuse_deletion  # type: ignore[method-assign,assignment]
        traceable_init(cls)
    if cls not in torch_pytree.SUPPORTED_NODES:
        _register_with_torch(cls)
    return cls


def _register_with_torch(cls: type) -> None:
    children_fields: list[attrs.Attribute[Any]] = []
    static_fields: list[attrs.Attribute[Any]] = []
    for a in attrs.fields(cls):
        if a.metadata.get("pytree_node", True):
            children_fields.append(a)
        elif a.init:
            static_fields.append(a)
    child_names = tuple(a.name for a in children_fields)
    child_aliases = tuple(str(a.alias) for a in children_fields)
    static_names = tuple(a.name for a in static_fields)
    static_aliases = tuple(str(a.alias) for a in static_fields)

    def flatten(obj: Any) -> tuple[list[Any], tuple[Any, ...]]:
        return [getattr(obj, n) for n in child_names], tuple(getattr(obj, n) for n in static_names)

    def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
        children, context = flatten(obj)
        keys = [torch_pytree.GetAttrKey(n) for n in child_names]
        return list(zip(keys, children, strict=True)), context

    def unflatten(children: Any, context: tuple[Any, ...]) -> Any:
        kwargs = dict(zip(child_aliases, children, strict=True))
        kwargs.update(zip(static_aliases, context, strict=True))
        return cls(**kwargs)

    torch_pytree.register_pytree_node(
        cls,
        flatten,
        unflatten,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        flatten_with_keys_fn=flatten_with_keys,
    )


@overload
def record(cls: _C, /) -> _C: ...
@overload
def record(cls: None = None, /) -> Callable[[_C], _C]: ...


@typing.dataclass_transform(frozen_default=True, field_specifiers=(field, static_field))
def record(cls: _C | None = None, /) -> _C | Callable[[_C], _C]:
    """Make a class an immutable pytree record.

    The class becomes a frozen attrs class with ``eq=False`` (tensors have no truthful ``==``;
    compare records with `tree_equal`) and is registered as a pytree node with optree in the
    library's namespace and with torch's pytree, so `torch.compile` and `torch.export` see the
    tensors inside. Fields declared with `static_field` are configuration kept in the treespec;
    all other fields are children.

    >>> import torch
    >>> @record
    ... class Counter:
    ...     total: torch.Tensor
    ...     name: str = static_field(default="c")
    >>> c = Counter(torch.zeros(2))
    >>> tree_map(lambda t: t + 1, c)
    Counter(total=tensor([1., 1.]), name='c')
    >>> torch.utils._pytree.tree_leaves(c)
    [tensor([0., 0.])]
    """

    def wrap(cls: _C) -> _C:
        if "__attrs_attrs__" in cls.__dict__ and _is_registered_with_optree(cls):
            return cls  # already a record
        return register_record(attrs.frozen(cls, eq=False))

    return wrap if cls is None else wrap(cls)


def _assignment_fix(record: object, name: str) -> str:
    # A record may define `__assignment_fix__(name)` naming its own transition method.
    hook = getattr(record, ASSIGNMENT_FIX_HOOK, None)
    if hook is not None:
        return str(hook(name))
    return f"obj = attrs.evolve(obj, {name}=...)"


def _refuse_assignment(self: object, name: str, value: object) -> None:
    # attrs' frozen classes say only "can't set attribute"; say what to do instead.
    msg = (
        f"`{type(self).__name__}` is immutable; `obj.{name} = ...` cannot assign. "
        f"Use `{_assignment_fix(self, name)}`, which returns a new record."
    )
    raise ImmutableRecordError(msg)


def _refuse_deletion(self: object, name: str) -> None:
    msg = (
        f"`{type(self).__name__}` is immutable; `del obj.{name}` cannot delete. "
        f"Use `{_assignment_fix(self, name)}`, which returns a new record."
    )
    raise ImmutableRecordError(msg)


def tree_leaves(tree: PyTree, /, *, is_leaf: Callable[[Any], bool] | None = None) -> list[Any]:
    """The leaves of ``tree`` in traversal order, records included.

    >>> tree_leaves({"b": (1, 2), "a": None})
    [1, 2]
    """
    return optree.tree_leaves(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_flatten(
    tree: PyTree, /, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[Any], PyTreeSpec]:
    """Split ``tree`` into its leaves and a treespec (which holds the static fields).

    >>> leaves, spec = tree_flatten({"x": 1, "y": [2, 3]})
    >>> leaves
    [1, 2, 3]
    >>> tree_unflatten(spec, [4, 5, 6])
    {'x': 4, 'y': [5, 6]}
    """
    return optree.tree_flatten(tree, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_unflatten(treespec: PyTreeSpec, leaves: Sequence[Any], /) -> PyTree:
    """Rebuild a tree from a treespec and leaves (inverse of `tree_flatten`).

    >>> _, spec = tree_flatten((1, {"a": 2}))
    >>> tree_unflatten(spec, ["p", "q"])
    ('p', {'a': 'q'})
    """
    return optree.tree_unflatten(treespec, leaves)


def tree_map(
    func: Callable[..., Any],
    tree: PyTree,
    /,
    *rests: PyTree,
    is_leaf: Callable[[Any], bool] | None = None,
) -> PyTree:
    """Apply ``func`` to every leaf; static fields (configuration) are carried over unchanged.

    >>> tree_map(lambda x: x * 10, {"a": 1, "b": (2, 3)})
    {'a': 10, 'b': (20, 30)}
    """
    return optree.tree_map(func, tree, *rests, is_leaf=is_leaf, namespace=NAMESPACE)


def tree_flatten_with_keys(
    tree: PyTree, /, *, is_leaf: Callable[[Any], bool] | None = None
) -> tuple[list[str], list[Any], PyTreeSpec]:
    """Like `tree_flatten`, plus each leaf's key path written as Python access syntax.

    Record fields print as ``.name`` (a leading underscore dropped: records expose such
    fields through public properties), mapping keys as ``['key']``, positions as ``[i]``.

    >>> keys, leaves, _ = tree_flatten_with_keys({"vae": [7, 8]})
    >>> keys
    ["['vae'][0]", "['vae'][1]"]
    """
    accessors, leaves, spec = optree.tree_flatten_with_accessor(
        tree, is_leaf=is_leaf, namespace=NAMESPACE
    )
    return [format_accessor(a) for a in accessors], leaves, spec


def format_accessor(accessor: optree.PyTreeAccessor, /) -> str:
    """Render an optree accessor as ``objects['ring'].chunks[1]``.

    >>> accessors, _, _ = optree.tree_flatten_with_accessor({"a": (1,)})
    >>> format_accessor(accessors[0])
    "['a'][0]"
    """
    parts: list[str] = []
    for entry in accessor:
        if isinstance(entry, optree.GetAttrEntry):
            name = str(entry.name).lstrip("_") or str(entry.name)
            parts.append(f".{name}")
        else:
            parts.append(f"[{entry.entry!r}]")
    return "".join(parts).lstrip(".") or "<root>"


def tree_equal(a: PyTree, b: PyTree, /) -> bool:
    """Whether two trees have the same structure, static data and bitwise-equal leaves.

    Tensors are equal when dtype, shape, device and every element's bits match: stricter
    than `torch.equal`, since ``-0.0`` differs from ``0.0`` and a NaN equals only the same
    NaN. Meta tensors are equal when dtype and shape match. Python floats and complex numbers
    follow the same bitwise rule, so a record equals its own pickle round trip. NumPy arrays
    compare by dtype, shape and bytes; other leaves by type and ``==``.

    >>> import torch
    >>> x = torch.tensor([1.0, float("nan")])
    >>> tree_equal({"a": x}, {"a": x.clone()})
    True
    >>> tree_equal({"a": x}, {"a": x.double()})
    False
    >>> tree_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    False
    """
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    return all(_leaf_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Reinterpret floats as same-width ints, so -0.0 != 0.0 and NaN payloads are compared.
    t = t.resolve_neg()  # a lazy negation (e.g. `z.conj().imag`) cannot be reinterpreted
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dtype.is_floating_point:
        return t.contiguous().view(_INT_OF_WIDTH[t.element_size()])
    return t


def _tensor_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.dtype != y.dtype or x.device != y.device or x.layout != y.layout:
        return False
    if x.is_nested or y.is_nested:
        if not (x.is_nested and y.is_nested):
            return False
        xs, ys = x.unbind(), y.unbind()
        return len(xs) == len(ys) and all(_tensor_equal(a, b) for a, b in zip(xs, ys, strict=True))
    if x.shape != y.shape:
        return False
    if x.is_meta:
        return True
    if x.layout != torch.strided:  # sparse: compare the values they denote
        x, y = x.to_dense(), y.to_dense()
    return torch.equal(_bits(x), _bits(y))


def _leaf_equal(x: Any, y: Any) -> bool:
    if type(x) is not type(y) and not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return False
    if isinstance(x, torch.Tensor):
        return _tensor_equal(x, y)
    if x is y:
        return True
    if type(x) is float:  # bitwise, as tensors: NaN equals the same NaN, -0.0 != 0.0
        return struct.pack("<d", x) == struct.pack("<d", y)
    if type(x) is complex:
        return struct.pack("<dd", x.real, x.imag) == struct.pack("<dd", y.real, y.imag)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.ndarray):
        return bool(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes())
    try:
        return bool(x == y)
    except Exception:  # a leaf whose == raises is simply not equal
        return False
