"""The session record: named state objects plus carried attributes."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Generic, TypeVar, overload

import attrs
import torch

from sessionstate._accounting import ByteCounter, nbytes_by_device
from sessionstate._checks import check_count, describe
from sessionstate._errors import MissingKeyError, reason
from sessionstate._frozen import IMMUTABLE_LEAVES, freeze
from sessionstate._random import RandomKey
from sessionstate._stateobject import ParkedObject, StateObject
from sessionstate._storage import HostBufferPool, ParkedBytes, Tier, park_tree
from sessionstate._tree import (
    field,
    is_record,
    register_record,
    tree_flatten_with_keys,
    tree_leaves,
)

__all__ = ["SessionAttr", "SessionState", "ValueKey", "iter_values"]

_V = TypeVar("_V")
_St = TypeVar("_St", bound="SessionState")
_O = TypeVar("_O", bound=StateObject)

_UNSET: Any = object()

ValueKey = tuple[str, str]
"""Where a value sits in a session: ``("o", name)`` an object, ``("a", name)`` an attribute,
``("f", name)`` a field a subclass adds."""

# Per class: the fields a subclass adds to the two buckets.
_EXTRA_FIELDS: dict[type, tuple[str, ...]] = {}

# Per class: whether `SessionState._replace` may build records directly (no extra fields).
_DIRECT_REPLACE: dict[type, bool] = {}


class SessionAttr(Generic[_V]):
    """Declare one carried value of a session class: its default, coercion and meaning.

    Declared on a `SessionState` subclass, one line per value. Reading an unset attribute
    returns its default; writing goes through `SessionState.with_attrs`, which returns a new
    state and applies ``coerce`` to non-None values.

    Args:
        default: What reading the attribute returns while it is unset. Shared between
            sessions, so it is frozen and checked as an assigned value is (coerced, lists
            as tuples, dicts as `FrozenDict`s; a set or bytearray refused) when the class is
            defined. A default that holds a tensor is stored in every new record, so byte
            accounting, `tree_leaves` and `to_device` see it as they see a set value.
        coerce: Optional callable applied to every non-None value written.
        doc: What the value is; becomes the attribute's docstring.

    >>> class Counter(SessionState):
    ...     steps = SessionAttr(0, coerce=int, doc="Completed steps.")
    >>> s = Counter()
    >>> s.steps, s.with_attrs(steps="3").steps
    (0, 3)
    """

    def __init__(
        self,
        default: _V,
        *,
        coerce: Callable[[Any], _V] | None = None,
        doc: str = "",
    ) -> None:
        self.default = default
        self.coerce = coerce
        self.__doc__ = doc
        self.name = "<unbound>"

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type) -> SessionAttr[_V]: ...
    @overload
    def __get__(self, instance: SessionState, owner: type) -> _V: ...

    def __get__(self, instance: SessionState | None, owner: type) -> SessionAttr[_V] | _V:
        if instance is None:
            return self
        value: _V = instance._attrs.get(self.name, self.default)
        return value

    def __set__(self, instance: SessionState, value: _V) -> None:
        # Records are frozen; route through the record's refusal so the message names the fix.
        setattr(instance, self.name, value)

    def __repr__(self) -> str:
        return f"SessionAttr(name={self.name!r}, default={self.default!r})"

    def convert(self, value: Any) -> Any:
        """Apply ``coerce`` to ``value`` (None passes through unchanged).

        Raises:
            ValueError, TypeError: if ``coerce`` refuses the value (the same class as the
                coercion raised, or ValueError), naming the attribute, the value and the
                coercion.

        >>> SessionAttr(0, coerce=int).convert("7")
        7
        """
        if value is None or self.coerce is None:
            return value
        try:
            return self.coerce(value)
        except Exception as exc:
            coerce = getattr(self.coerce, "__qualname__", repr(self.coerce))
            msg = (
                f"Session attribute `{self.name}` coerces its values with `{coerce}`, which "
                f"refused {describe(value)}: {type(exc).__name__}: {reason(exc)}. "
                f"Pass a value `{coerce}` accepts."
            )
            raise (TypeError if isinstance(exc, TypeError) else ValueError)(msg) from exc


def _as_dict(value: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(value) if value is not None else {}


def _as_frozen_dict(value: Mapping[str, Any] | None) -> dict[str, Any]:
    # Attributes are deeply immutable: lists become tuples, dicts read-only mappings.
    return {k: freeze(v, k) for k, v in value.items()} if value is not None else {}


@register_record
@attrs.frozen(eq=False)
class SessionState:
    """One session's state: named `StateObject`s and carried attributes, as one record.

    A generic session is built directly: ``SessionState(objects={...}, attrs={...})``. A model
    subclasses it and declares its attributes with `SessionAttr`; subclasses are registered as
    pytree nodes automatically. Every method that changes something returns a new state;
    byte accounting covers both buckets and counts an alias between them once.

    Choosing the bucket: a value the manager must be able to act on (release, accumulate,
    stage and commit, rebuild) is a `StateObject`; a value the model assigns wholesale, reads
    back and clears is an attribute. Size is not the criterion; the accounting counts both.

    >>> import torch
    >>> from sessionstate import LatentBuffer
    >>> s = SessionState(objects={"frames": LatentBuffer(dim=0).allocate(maxlen=4)})
    >>> s = s.update_object("frames", lambda b: b.commit(torch.zeros(1, 8)))
    >>> s = s.with_attrs(step=1)
    >>> len(s.object("frames")), s.attrs["step"], s.nbytes_by_device()
    (1, 1, {'cpu': 32})
    """

    _objects: dict[str, StateObject] = field(factory=dict, converter=_as_dict)
    _attrs: dict[str, Any] = field(factory=dict, converter=_as_frozen_dict)

    def __attrs_post_init__(self) -> None:
        for name, obj in self._objects.items():
            _check_object(name, obj, f"attrs={{{name!r}: ...}}")
        for name in self._attrs:
            _declared_attr(type(self), name)
        for name, default in type(self).__tensor_defaults__.items():
            self._attrs.setdefault(name, default)  # the converter's own fresh dict
        _check_disjoint(self._objects, self._attrs)

    def __assignment_fix__(self, name: str) -> str:
        if name in ("objects", "_objects"):
            return "state = state.with_object(name, obj)"
        if name in self._objects:
            return (
                f"state = state.with_object({name!r}, obj)` or "
                f"`state = state.update_object({name!r}, fn)"
            )
        declared = type(self).__session_attrs__
        if declared and name not in declared:
            return f"state = state.with_attrs(...) with one of {sorted(declared)}"
        return f"state = state.with_attrs({name}=...)"

    __session_attrs__: ClassVar[Mapping[str, SessionAttr[Any]]] = MappingProxyType({})
    # Declared defaults that hold a tensor: stored in every record that leaves them unset.
    __tensor_defaults__: ClassVar[Mapping[str, Any]] = MappingProxyType({})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared: dict[str, SessionAttr[Any]] = {}
        for klass in reversed(cls.__mro__):
            for name, value in vars(klass).items():
                if isinstance(value, SessionAttr):
                    if hasattr(SessionState, name):
                        msg = (
                            f"`{cls.__name__}.{name}` would shadow `SessionState.{name}`; "
                            "give the session attribute another name."
                        )
                        raise TypeError(msg)
                    if klass is cls:
                        where = f"{cls.__name__}.{name}"
                        value.default = freeze(value.convert(value.default), where)
                    declared[name] = value
        cls.__session_attrs__ = MappingProxyType(declared)
        cls.__tensor_defaults__ = MappingProxyType(
            {
                name: a.default
                for name, a in declared.items()
                if any(isinstance(leaf, torch.Tensor) for leaf in tree_leaves(a.default))
            }
        )
        register_record(cls)

    @property
    def objects(self) -> Mapping[str, StateObject]:
        """The named state objects (read-only view).

        >>> SessionState().objects
        mappingproxy({})
        """
        return MappingProxyType(self._objects)

    @property
    def attrs(self) -> Mapping[str, Any]:
        """The attributes that are set (read-only view; unset declared ones read as defaults).

        >>> SessionState(attrs={"a": 1}).attrs
        mappingproxy({'a': 1})
        """
        return MappingProxyType(self._attrs)

    @overload
    def object(self, name: str, /) -> StateObject: ...
    @overload
    def object(self, name: str, cls: type[_O], /) -> _O: ...
    def object(self, name: str, cls: type[StateObject] = StateObject, /) -> StateObject:
        """The state object called ``name``; typed as ``cls`` when one is given.

        Raises:
            KeyError: naming the missing object and the ones the session has.
            TypeError: if the object is not a ``cls``, naming both types.

        >>> from sessionstate import LatentBuffer
        >>> SessionState(objects={"ring": LatentBuffer()}).object("ring", LatentBuffer).name
        'buffer'
        """
        try:
            obj = self._objects[name]
        except KeyError:
            msg = (
                f"Session has no state object `{name}`; it has {sorted(self._objects)}. "
                "Add it with `state.with_object(name, obj)`."
            )
            raise MissingKeyError(msg) from None
        if type(obj) is not cls and not isinstance(obj, cls):
            held = type(obj).__name__
            fix = (
                "unpark the session first (`state.unpark()`)."
                if isinstance(obj, ParkedObject)
                else f"store one under `{name}`, or ask for {held}."
            )
            msg = f"State object `{name}` holds a {held}, but {cls.__name__} was asked for; {fix}"
            raise TypeError(msg)
        return obj

    def with_object(self: _St, name: str, obj: StateObject, /) -> _St:
        """Return a new state with ``obj`` stored under ``name`` (added or replaced).

        >>> from sessionstate import LatentBuffer
        >>> s = SessionState().with_object("ring", LatentBuffer())
        >>> list(s.objects)
        ['ring']
        """
        _check_object(name, obj, f"with_attrs({name}=...)")
        objects = {**self._objects, name: obj}
        _check_disjoint(objects, self._attrs)
        return self._replace(objects, self._attrs)

    def update_object(self: _St, name: str, fn: Callable[[_O], _O], /) -> _St:
        """Return a new state with the object ``name`` replaced by ``fn(object)``.

        >>> from sessionstate import LatentBuffer
        >>> s = SessionState(objects={"r": LatentBuffer()})
        >>> s.update_object("r", lambda b: b.allocate(maxlen=2)).object("r").maxlen
        2
        """
        return self.with_object(name, fn(self.object(name)))  # type: ignore[arg-type]

    def split_random(self: _St, n: int, /) -> tuple[_St, ...]:
        """Return ``n`` records that differ only in their random keys, each split ``n`` ways.

        Every `RandomKey` object is split (`RandomKey.split`); the ``i``-th record holds the
        ``i``-th key of each, and every other value is this record's own (nothing copied). A
        record without a key gives itself ``n`` times; a key not allocated yet splits too, so
        each record's key is seeded, at its first draw, as its split of the seeded key. A
        manager's `fork` splits so: the source keeps the first record, each branch one of the
        others; to fork a record by hand (``put(branch, record)``), split it first, or the
        branches draw the same noise.

        Raises:
            ValueError: if ``n`` is not a positive int.
            ParkedError: if a random key is parked (unpark the session first).

        >>> import torch
        >>> from sessionstate import RandomKey
        >>> s = SessionState(objects={"key": RandomKey.seeded(0)}, attrs={"x": torch.zeros(2)})
        >>> a, b = s.split_random(2)
        >>> ka, kb = a.object("key", RandomKey), b.object("key", RandomKey)
        >>> a.attrs["x"] is b.attrs["x"], torch.equal(ka.view(), kb.view())
        (True, False)
        """
        n = check_count(n, "n", fix="; a split makes at least one record")
        splits: dict[str, tuple[RandomKey, ...]] = {}
        for name, obj in self._objects.items():
            if isinstance(obj, ParkedObject) and obj.kind == RandomKey.__name__:
                obj.split(n)  # refused: a parked key says how to unpark it
            if isinstance(obj, RandomKey):
                splits[name] = obj.split(n)
        if not splits:
            return (self,) * n
        return tuple(
            self._replace({**self._objects, **{k: ks[i] for k, ks in splits.items()}}, self._attrs)
            for i in range(n)
        )

    def with_attrs(self: _St, **values: Any) -> _St:
        """Return a new state with the given attributes set (coerced where declared).

        A class that declares attributes with `SessionAttr` accepts only those names.

        Raises:
            AttributeError: for a name the session class does not declare.

        >>> SessionState().with_attrs(language="hello").attrs["language"]
        'hello'
        """
        new = _set_attrs(type(self), self._attrs, values)
        _check_disjoint(self._objects, new)
        return self._replace(self._objects, new)

    def with_values(
        self: _St, objects: Mapping[str, StateObject] | None = None, /, **values: Any
    ) -> _St:
        """Return a new state with ``objects`` stored and the attributes ``values`` set.

        One transition for what a step changes at once: the result equals `with_object` for
        each of ``objects`` followed by ``with_attrs(**values)``, and its checks cover only
        the names given.

        Raises:
            TypeError: for an object that is not a `StateObject` record.
            AttributeError: for an attribute the session class does not declare.
            ValueError: for a name given as both, or already held in the other bucket.

        >>> from sessionstate import LatentBuffer
        >>> s = SessionState().with_values({"ring": LatentBuffer()}, steps=1)
        >>> list(s.objects), dict(s.attrs)
        (['ring'], {'steps': 1})
        """
        new_objects = self._objects
        if objects:
            new_objects = dict(new_objects)
            for name, obj in objects.items():
                _check_object(name, obj, f"with_attrs({name}=...)")
                new_objects[name] = obj
        new_attrs = _set_attrs(type(self), self._attrs, values) if values else self._attrs
        # Only the names given can clash; a clash is reported over the whole record.
        if not new_objects.keys().isdisjoint(values) or (
            objects and not new_attrs.keys().isdisjoint(objects)
        ):
            _check_disjoint(new_objects, new_attrs)
        return self._replace(new_objects, new_attrs)

    def clear_attrs(self: _St, *names: str) -> _St:
        """Return a new state with ``names`` unset (they read as their defaults again).

        >>> s = SessionState(attrs={"a": 1, "b": 2}).clear_attrs("a")
        >>> dict(s.attrs)
        {'b': 2}
        """
        drop = set(names)
        kept = {k: v for k, v in self._attrs.items() if k not in drop}
        for name, default in type(self).__tensor_defaults__.items():
            kept.setdefault(name, default)
        return self._replace(self._objects, kept)

    @property
    def parked(self) -> tuple[str, ...]:
        """Names of the parked state objects (not resident until `unpark`).

        >>> SessionState().parked
        ()
        """
        return tuple(name for name, obj in self._objects.items() if obj.is_parked)

    def park(
        self: _St,
        tier: Tier = "host",
        /,
        *,
        names: Iterable[str] | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        pool: HostBufferPool | None = None,
    ) -> _St:
        """Return a new state with its parkable objects (or those in ``names``) parked.

        The objects are parked together, into one handle of the tier, so a storage two of
        them share is moved once and shared again after `unpark` (see `StateObject.park`);
        so are the blocks of `KVHandle`s in them (shared blocks stay shared, on fresh blocks
        of the same pool). Attributes are never parked: they stay resident. Objects already
        parked are skipped. The host tier copies into ranges of ``pool`` (a `HostBufferPool`)
        when one is given (see `park_tree`).

        Raises:
            UnsupportedTensorError: for a tensor that cannot be moved storage by storage.
            OSError: if the disk tier cannot write its file.
            StaleKVHandleError: for a `KVHandle` made by a step that was rolled back.
            HostPoolFullError: if ``pool`` cannot hold the objects' storages (nothing taken).

        >>> import torch
        >>> from sessionstate import LatentBuffer, tree_equal
        >>> ring = LatentBuffer(dim=0).allocate().commit(torch.ones(2, 2))
        >>> s = SessionState(objects={"r": ring}, attrs={"n": 1})
        >>> parked = s.park("host")
        >>> parked.parked, parked.nbytes_by_device(), tree_equal(parked.unpark(), s)
        (('r',), {}, True)
        """
        chosen = (
            [n for n, obj in self._objects.items() if obj.parkable]
            if names is None
            else list(names)
        )
        tree = {name: self.object(name) for name in chosen}
        tree = {name: obj for name, obj in tree.items() if not obj.is_parked}
        if not tree:
            return self
        label = f"state objects {sorted(tree)}"
        handle = park_tree(tree, tier, label=label, spool_dir=spool_dir, pool=pool)
        objects = dict(self._objects)
        for name, obj in tree.items():
            objects[name] = ParkedObject(
                name=name, kind=type(obj).__name__, handle=handle, key=name
            )
        return self._replace(objects, self._attrs)

    def unpark(self: _St) -> _St:
        """Return a resident state: every parked object unparked (``self`` if none is parked).

        >>> s = SessionState()
        >>> s.unpark() is s
        True
        """
        return self._rebuilt(lambda handle: handle.restore())

    def unpark_on_host(self: _St) -> _St:
        """A copy to read or save, every parked object rebuilt in host memory (``self`` if none
        is parked); this record and its parked bytes are left as they are.

        Takes no device memory and no engine memory: parked tensors come back as CPU copies,
        parked `KVHandle` leaves over standalone pools of just their blocks. A manager's
        `snapshot` of a parked session and a worker's `export_session` read it so (their files
        record the devices the bytes came from), so checkpointing or migrating a parked session
        never needs free device memory or free pool blocks.

        Raises:
            RuntimeError: if a parked object's bytes were released by their owner.
            SnapshotError: if a disk-parked object's file is damaged.

        >>> import torch
        >>> from sessionstate import TensorCache, tree_equal
        >>> s = SessionState(objects={"c": TensorCache().allocate().commit(torch.ones(2))})
        >>> parked = s.park("host")
        >>> tree_equal(parked.unpark_on_host(), s), parked.parked
        (True, ('c',))
        """
        return self._rebuilt(lambda handle: handle.read())

    def _rebuilt(self: _St, take: Callable[[ParkedBytes], Any], /) -> _St:
        # Every parked object rebuilt from the tree `take` gives its handle: one per handle,
        # so storages parked objects shared are shared again (``self`` if none is parked).
        if not self.parked:
            return self
        trees: dict[int, Any] = {}
        objects = dict(self._objects)
        try:
            for name, obj in self._objects.items():
                if isinstance(obj, ParkedObject):
                    tree = trees.get(id(obj.handle))
                    if tree is None:
                        tree = trees[id(obj.handle)] = take(obj.handle)
                    objects[name] = obj.unpark_from(tree)
        except BaseException:
            # All or nothing: what the handles before the failing one restored (engine
            # blocks) goes back now, not when the caller lets go of the error (its
            # traceback holds this frame).
            trees.clear()
            objects.clear()
            raise
        return self._replace(objects, self._attrs)

    def _replace(self: _St, objects: dict[str, StateObject], attributes: dict[str, Any]) -> _St:
        # The transitions build fresh dicts themselves, so skip `attrs.evolve`, which would
        # copy both again through the converters: this runs several times per model step.
        cls = type(self)
        direct = _DIRECT_REPLACE.get(cls)
        if direct is None:
            direct = _DIRECT_REPLACE[cls] = len(attrs.fields(cls)) == 2
        if not direct:  # a subclass with fields of its own
            return attrs.evolve(self, objects=objects, attrs=attributes)
        new = object.__new__(cls)
        object.__setattr__(new, "_objects", objects)
        object.__setattr__(new, "_attrs", attributes)
        return new

    def get_attr(self, name: str, default: Any = _UNSET, /) -> Any:
        """The attribute ``name``: its value, else its declared default, else ``default``.

        Raises:
            KeyError: if the name is unset, undeclared and no ``default`` is given.

        >>> SessionState().get_attr("missing", 5)
        5
        """
        if name in self._attrs:
            return self._attrs[name]
        declared = type(self).__session_attrs__.get(name)
        if declared is not None:
            return declared.default
        if default is not _UNSET:
            return default
        msg = f"Session attribute `{name}` is not set; set it with `state.with_attrs({name}=...)`."
        raise MissingKeyError(msg)

    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes this session keeps alive, per device, over both buckets, each storage once.

        >>> import torch
        >>> x = torch.zeros(80)  # 320 bytes
        >>> from sessionstate import LatentBuffer
        >>> ring = LatentBuffer(dim=0).allocate().commit(x)
        >>> SessionState(objects={"r": ring}, attrs={"alias": x[:8]}).nbytes_by_device()
        {'cpu': 320}
        """
        return nbytes_by_device(self)

    def nbytes_by_value(self) -> dict[str, dict[str, int]]:
        """Bytes per named value (objects first, then attrs), each storage counted once.

        A storage reachable from two values is attributed to the first in that order, so the
        per-value figures sum to `nbytes_by_device`. Fields that a subclass adds are listed
        last, under their field names.

        >>> import torch
        >>> x = torch.zeros(4)
        >>> SessionState(attrs={"a": x, "b": x, "n": 3}).nbytes_by_value()
        {'a': {'cpu': 16}, 'b': {}, 'n': {}}
        """
        counter = ByteCounter()
        out: dict[str, dict[str, int]] = {}
        for (_, name), value in iter_values(self):
            by_device = out.setdefault(name, {})
            keys, leaves, _ = tree_flatten_with_keys(value)
            for key, leaf in zip(keys, leaves, strict=True):
                path = name if key == "<root>" else f"{name}{_sub(key)}"
                for device, nbytes in counter.add(leaf, path=path).items():
                    by_device[device] = by_device.get(device, 0) + nbytes
        return out


def iter_values(state: SessionState, /) -> Iterator[tuple[ValueKey, Any]]:
    """Every value ``state`` holds under its `ValueKey`: objects, then attributes, then fields.

    The one reader of a session's buckets for byte accounting (`nbytes_by_value`, the
    manager's ledger); fields a subclass adds come last, under their field names.

    >>> [key for key, _ in iter_values(SessionState(attrs={"n": 1}))]
    [('a', 'n')]
    """
    for name, obj in state._objects.items():
        yield ("o", name), obj
    for name, value in state._attrs.items():
        yield ("a", name), value
    cls = type(state)
    extra = _EXTRA_FIELDS.get(cls)
    if extra is None:
        extra = _EXTRA_FIELDS[cls] = tuple(
            a.name for a in attrs.fields(cls) if a.name not in ("_objects", "_attrs")
        )
    for name in extra:
        yield ("f", name), getattr(state, name)


def _check_disjoint(objects: Mapping[str, Any], attributes: Mapping[str, Any]) -> None:
    both = objects.keys() & attributes.keys()
    if both:
        msg = (
            f"Session values {sorted(both)} are both state objects and attributes; a name "
            "lives in one bucket. Rename one, or `clear_attrs(...)` before `with_object(...)`."
        )
        raise ValueError(msg)


def _sub(key: str) -> str:
    return key if key.startswith("[") else f".{key}"


_OBJECT_RECORDS: set[type] = set()  # StateObject classes found to be records


def _check_object(name: str, obj: object, carried_fix: str) -> None:
    if type(obj) in _OBJECT_RECORDS:  # a class stays a record once registered
        return
    if not isinstance(obj, StateObject):
        msg = (
            f"State object `{name}` must be a StateObject (e.g. LatentBuffer), got "
            f"{type(obj).__name__}; carried values go in `{carried_fix}`."
        )
        raise TypeError(msg)
    if not is_record(type(obj)):
        msg = (
            f"State object `{name}` is a `{type(obj).__qualname__}`, a StateObject that is not "
            "a record, so its tensors would be invisible to byte accounting, the immutability "
            f"guard and `tree_map`. Decorate `{type(obj).__qualname__}` with "
            "`@sessionstate.record`."
        )
        raise TypeError(msg)
    _OBJECT_RECORDS.add(type(obj))


def _set_attrs(
    cls: type[SessionState], attributes: Mapping[str, Any], values: Mapping[str, Any]
) -> dict[str, Any]:
    """A copy of ``attributes`` with ``values`` set, coerced where declared and frozen."""
    new = dict(attributes)
    declared = cls.__session_attrs__
    for name, value in values.items():
        if declared:
            attr = declared.get(name)
            if attr is None:
                _declared_attr(cls, name)  # raises, naming the declared ones
            value = attr.convert(value)  # type: ignore[union-attr]
        # The common values (tensors, numbers, None) are immutable leaves: no call to freeze.
        new[name] = value if type(value) in IMMUTABLE_LEAVES else freeze(value, name)
    return new


def _declared_attr(cls: type[SessionState], name: str) -> SessionAttr[Any] | None:
    """The declaration of ``name``; None on a class that declares nothing (any name goes)."""
    declared = cls.__session_attrs__
    if not declared:
        return None
    if name not in declared:
        msg = (
            f"`{cls.__name__}` declares no attribute `{name}`; declared: "
            f"{sorted(declared)}. Declare it with `{name} = SessionAttr(...)`."
        )
        raise AttributeError(msg)
    return declared[name]
