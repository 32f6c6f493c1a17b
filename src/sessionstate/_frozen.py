"""Deep immutability for carried values, and the one table of the containers a record holds.

A record is immutable only as deep as the values it holds. A list or a dict stored as a
session attribute could be mutated through the read-only attribute view, and the change would
reach every version of the session that shares it. `freeze` converts those containers on the
way in and refuses mutable containers it cannot convert faithfully, naming the fix.

`CONTAINERS` lists every container kind a record may hold (besides records and leaves): its
snapshot tag, the snapshot format that first stored it, whether it maps keys to values, and
how to build one from its children. The snapshot encoder and decoder dispatch on it; optree
and torch pytree flatten each kind (builtins natively, `FrozenDict` through its registrations
below), and `tree_equal` and the byte accounting read records through optree. A test checks
every kind against each of those readers, so a kind added here is known everywhere or fails.
"""

from __future__ import annotations

import collections
from collections.abc import (
    Callable,
    Iterator,
    Mapping,
    MutableMapping,
    MutableSequence,
    MutableSet,
)
from types import MappingProxyType
from typing import Any, NamedTuple, NoReturn, TypeVar

import optree
import torch
import torch.utils._pytree as torch_pytree

from sessionstate._tree import NAMESPACE

__all__ = [
    "CONTAINERS",
    "CONTAINERS_BY_CLASS",
    "CONTAINERS_BY_TAG",
    "IMMUTABLE_LEAVES",
    "ContainerKind",
    "FrozenDict",
    "freeze",
]

_K = TypeVar("_K")
_V = TypeVar("_V")


class FrozenDict(Mapping[_K, _V]):
    """A read-only mapping, registered as a pytree node (its values are children).

    Session attributes hold one wherever a dict was given. It compares equal to a dict with the
    same items, pickles, and has no method that changes it.

    >>> d = FrozenDict({"a": 1})
    >>> d["a"], dict(d), d == {"a": 1}
    (1, {'a': 1}, True)
    """

    __slots__ = ("_data",)
    _data: dict[_K, _V]

    def __init__(self, items: Mapping[_K, _V] | None = None, /) -> None:
        object.__setattr__(self, "_data", dict(items) if items is not None else {})

    def __getitem__(self, key: _K) -> _V:
        return self._data[key]

    def __iter__(self) -> Iterator[_K]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __setattr__(self, name: str, value: object) -> NoReturn:
        msg = "`FrozenDict` is immutable; build a new one: `FrozenDict({**d, key: value})`."
        raise AttributeError(msg)

    def __reduce__(self) -> tuple[type[FrozenDict[_K, _V]], tuple[dict[_K, _V]]]:
        return (type(self), (self._data,))


def _flatten(d: FrozenDict[Any, Any]) -> tuple[list[Any], tuple[Any, ...], tuple[Any, ...]]:
    keys = tuple(d)
    return [d[k] for k in keys], keys, keys


def _unflatten(keys: tuple[Any, ...], values: Any) -> FrozenDict[Any, Any]:
    return FrozenDict(dict(zip(keys, values, strict=True)))


optree.register_pytree_node(
    FrozenDict,
    _flatten,  # type: ignore[arg-type]
    _unflatten,  # type: ignore[arg-type]
    path_entry_type=optree.MappingEntry,
    namespace=NAMESPACE,
)


def _torch_flatten(d: FrozenDict[Any, Any]) -> tuple[list[Any], tuple[Any, ...]]:
    keys = tuple(d)
    return [d[k] for k in keys], keys


def _torch_flatten_with_keys(
    d: FrozenDict[Any, Any],
) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
    keys = tuple(d)
    return [(torch_pytree.MappingKey(k), d[k]) for k in keys], keys


torch_pytree.register_pytree_node(
    FrozenDict,
    _torch_flatten,
    lambda values, keys: _unflatten(keys, values),
    serialized_type_name="sessionstate.FrozenDict",
    flatten_with_keys_fn=_torch_flatten_with_keys,
)


class ContainerKind(NamedTuple):
    """One container kind a record may hold (see `CONTAINERS`)."""

    cls: type
    tag: str  # its snapshot node type
    mapping: bool  # children by key (str, int or bool in a snapshot), else by position
    since: int  # the first snapshot format version that stores it
    build: Callable[[Any], Any]  # one from a list of children, or a dict of them


CONTAINERS: tuple[ContainerKind, ...] = (
    ContainerKind(tuple, "tuple", mapping=False, since=1, build=tuple),
    ContainerKind(list, "list", mapping=False, since=1, build=list),
    ContainerKind(dict, "dict", mapping=True, since=1, build=dict),
    ContainerKind(FrozenDict, "frozendict", mapping=True, since=3, build=FrozenDict),
)
"""Every container kind a record may hold besides records, in the order messages list them.

>>> [kind.tag for kind in CONTAINERS]
['tuple', 'list', 'dict', 'frozendict']
"""

CONTAINERS_BY_CLASS: dict[type, ContainerKind] = {kind.cls: kind for kind in CONTAINERS}
CONTAINERS_BY_TAG: dict[str, ContainerKind] = {kind.tag: kind for kind in CONTAINERS}

_FIXES: dict[type, str] = {
    set: "a frozenset (`frozenset(value)`)",
    bytearray: "bytes (`bytes(value)`)",
    collections.deque: "a tuple (`tuple(value)`)",
}


IMMUTABLE_LEAVES = frozenset({torch.Tensor, int, float, bool, str, bytes, type(None)})
"""Types `freeze` returns as they are (the common attribute values)."""


def freeze(value: Any, where: str, /) -> Any:
    """Return ``value`` deeply immutable: lists as tuples, dicts as `FrozenDict`s, recursively.

    Values that need no change are returned as they are (the same object). ``where`` names the
    value in error messages.

    Raises:
        TypeError: for a mutable container with no faithful immutable form here (a set, a
            bytearray, a deque, any other mutable sequence, set or mapping), naming the fix.

    >>> freeze({"ids": [1, 2]}, "cfg")
    FrozenDict({'ids': (1, 2)})
    >>> t = (1, "a")
    >>> freeze(t, "t") is t
    True
    """
    kind = type(value)
    if kind in IMMUTABLE_LEAVES:  # the common attribute values, returned as they are
        return value
    if kind is list:
        return tuple(freeze(v, f"{where}[{i}]") for i, v in enumerate(value))
    if kind is tuple:
        items = tuple(freeze(v, f"{where}[{i}]") for i, v in enumerate(value))
        return value if all(a is b for a, b in zip(items, value, strict=True)) else items
    if kind is FrozenDict:
        frozen = {k: freeze(v, f"{where}[{k!r}]") for k, v in value.items()}
        return value if all(frozen[k] is v for k, v in value.items()) else FrozenDict(frozen)
    if isinstance(value, (dict, MappingProxyType)):
        return FrozenDict({k: freeze(v, f"{where}[{k!r}]") for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        items = tuple(freeze(v, f"{where}.{f}") for f, v in zip(value._fields, value, strict=True))
        same = all(a is b for a, b in zip(items, value, strict=True))
        return value if same else kind._make(items)
    if isinstance(value, (MutableSequence, MutableSet, MutableMapping, bytearray)):
        fix = _FIXES.get(kind, "an immutable equivalent (a tuple, a frozenset, bytes)")
        msg = (
            f"Session attribute value `{where}` is a mutable {kind.__name__}: {value!r}. "
            f"Session state is immutable all the way down; store {fix} instead."
        )
        raise TypeError(msg)
    return value
