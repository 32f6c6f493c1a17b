"""The `StateObject` contract (a unit of session state with a lifecycle the manager acts on),
the `ParkedObject` that stands in for one while a tier holds its bytes, the two-phase
`StagedStateObject`, and `SingleValueObject`, the lifecycle of one value replaced wholesale."""

from __future__ import annotations

import abc
import os
from typing import Any, ClassVar, Generic, Self, TypeVar

import attrs

from sessionstate._accounting import nbytes_by_device
from sessionstate._errors import NotAllocatedError, ParkedError
from sessionstate._storage import ParkedBytes, Tier, park_tree
from sessionstate._tree import field, register_record, static_field

__all__ = ["ParkedObject", "SingleValueObject", "StagedStateObject", "StateObject"]

_S = TypeVar("_S", bound="StateObject")


class StateObject(abc.ABC):
    """The lifecycle contract of one typed unit of session state.

    Every method except the queries (`view`, `nbytes_by_device`, `is_allocated`) is a pure
    transition: it returns a new object and leaves ``self`` valid and unchanged. Implementations
    are `record` classes, so a session moves between devices with
    `sessionstate.to_device` and keeps its configuration. A subclass must be a record too
    (decorate it with `record`): `SessionState` refuses one that is not.

    Lifecycle: ``allocate(**sizing)`` makes an object usable; ``commit(payload)`` adds to it;
    ``view(...)`` reads it; ``reset()`` empties it and keeps its configuration; ``evict()``
    releases its storage and makes it non-resident (``allocate`` again before further use);
    ``park(tier)`` moves its storages to host memory or disk without losing a bit (a
    `ParkedObject`, not resident) and ``unpark()`` brings them back.
    """

    parkable: ClassVar[bool] = True
    """Whether a manager under a byte budget may park this object (`park`)."""

    @property
    @abc.abstractmethod
    def is_allocated(self) -> bool:
        """Whether the object may be committed to and viewed."""

    @abc.abstractmethod
    def allocate(self: _S, **sizing: Any) -> _S:
        """Return a new, empty, allocated object sized by ``sizing``."""

    @abc.abstractmethod
    def commit(self: _S, payload: Any, /) -> _S:
        """Return a new object holding ``payload`` as well."""

    @abc.abstractmethod
    def view(self) -> Any:
        """Read the object's contents (a query; nothing changes)."""

    @abc.abstractmethod
    def reset(self: _S) -> _S:
        """Return a new, empty object with the same configuration."""

    @abc.abstractmethod
    def evict(self: _S) -> _S:
        """Return a new object whose storage is released (not resident)."""

    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes this object keeps alive, per device (see `sessionstate.nbytes_by_device`)."""
        return nbytes_by_device(self)

    @property
    def is_parked(self) -> bool:
        """Whether the object is parked (its bytes held by a tier, not resident).

        >>> from sessionstate import LatentBuffer
        >>> LatentBuffer().is_parked
        False
        """
        return False

    def park(
        self,
        tier: Tier = "host",
        /,
        *,
        name: str | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> ParkedObject:
        """Return this object parked: each of its storages moved once to ``tier``.

        Engine-owned leaves whose class offloads (a `KVHandle`) move too: their blocks are
        copied to the tier and return to their pool once nothing holds ``self``; `unpark`
        takes fresh blocks from the same pool, all or nothing (`KVPoolExhaustedError`).

        A pure transition: ``self`` stays valid (its memory is freed once nothing else holds
        it). The parked object is not resident and refuses reads until `unpark`, which
        rebuilds this object bit for bit with its aliases (two views of one storage stay views
        of one storage).

        Args:
            tier: ``"host"`` (host memory, pinned for CUDA storages, copies synchronised
                before this returns) or ``"disk"`` (one snapshot file in ``spool_dir``).
            name: Names the object in messages (defaults to its ``name`` field, if any).
            spool_dir: The disk tier's directory (a new temporary one when None).

        Raises:
            UnsupportedTensorError: for a tensor that cannot be moved storage by storage.
            OSError: if the disk tier cannot write its file.

        >>> import torch
        >>> from sessionstate import LatentBuffer, tree_equal
        >>> ring = LatentBuffer(dim=0).allocate(maxlen=2).commit(torch.ones(1, 3))
        >>> parked = ring.park("host")
        >>> parked.is_parked, parked.nbytes_by_device(), parked.nbytes_parked
        (True, {}, {'host': 12})
        >>> tree_equal(parked.unpark(), ring)
        True
        """
        label_name = name if name is not None else str(getattr(self, "name", "?"))
        label = f"{type(self).__name__} `{label_name}`"
        handle = park_tree(self, tier, label=label, spool_dir=spool_dir)
        return ParkedObject(name=label_name, kind=type(self).__name__, handle=handle)

    def unpark(self) -> StateObject:
        """Return the resident object: ``self`` unless it is parked.

        >>> from sessionstate import LatentBuffer
        >>> buf = LatentBuffer()
        >>> buf.unpark() is buf
        True
        """
        return self


# -- one value, replaced wholesale: the lifecycle `TensorCache` and `KVCache` share ----------

_T = TypeVar("_T")


class SingleValueObject(StateObject, Generic[_T]):
    """A state object that holds one value (None while empty), replaced wholesale.

    The lifecycle is written once here: `allocate` empties and allocates, `view` returns the
    value, `reset` empties it, `evict` empties and deallocates; a subclass writes `commit`
    (what it accepts, and how cheaply it builds the successor). A subclass is a record whose
    fields are the value (named by ``value_field``), a static ``name`` and ``allocated``;
    ``holds`` and ``commits`` word its messages.

    >>> import torch
    >>> from sessionstate import TensorCache
    >>> cache = TensorCache().allocate().commit(torch.ones(1))
    >>> isinstance(cache, SingleValueObject), cache.reset().view(), cache.evict().is_allocated
    (True, None, False)
    """

    value_field: ClassVar[str]
    """The record field that holds the value."""

    holds: ClassVar[str]
    """The value as a message names it (``"contents"``, ``"a handle"``)."""

    commits: ClassVar[str]
    """What `commit` takes, as a message names it (``"tree"``, ``"handle"``)."""

    name: str
    allocated: bool

    def __attrs_post_init__(self) -> None:
        if getattr(self, self.value_field) is not None and not self.allocated:
            msg = (
                f"{type(self).__name__} `{self.name}` holds {self.holds} but is not allocated; "
                f"build it with `.allocate()` and `.commit({self.commits})`."
            )
            raise ValueError(msg)

    @property
    def is_allocated(self) -> bool:
        """Whether the object was allocated (and not evicted since).

        >>> from sessionstate import TensorCache
        >>> TensorCache().is_allocated, TensorCache().allocate().is_allocated
        (False, True)
        """
        return self.allocated

    def allocate(self) -> Self:  # type: ignore[override]
        """Return an empty, allocated object.

        >>> from sessionstate import KVCache
        >>> KVCache().allocate().view() is None
        True
        """
        return self._emptied(allocated=True)

    def view(self) -> _T | None:
        """The held value, or None while empty.

        Raises:
            NotAllocatedError: if the object is not allocated.

        >>> from sessionstate import TensorCache
        >>> TensorCache().allocate().view() is None
        True
        """
        self._require_allocated("view")
        value: _T | None = getattr(self, self.value_field)
        return value

    def reset(self) -> Self:
        """Return an empty object (still allocated); its value goes once nothing holds it.

        >>> import torch
        >>> from sessionstate import TensorCache
        >>> TensorCache().allocate().commit(torch.ones(1)).reset().view() is None
        True
        """
        self._require_allocated("reset")
        return self._emptied(allocated=True)

    def evict(self) -> Self:
        """Return an object with its value released and not resident; `allocate` to reuse it.

        >>> import torch
        >>> from sessionstate import TensorCache
        >>> TensorCache().allocate().commit(torch.ones(1)).evict().is_allocated
        False
        """
        return self._emptied(allocated=False)

    def _emptied(self, *, allocated: bool) -> Self:
        # The record's class is an attrs class (a subclass), which mypy cannot see from here.
        evolve: Any = attrs.evolve
        emptied: Self = evolve(self, **{self.value_field: None, "allocated": allocated})
        return emptied

    def _require_allocated(self, action: str) -> None:
        if not self.allocated:
            msg = (
                f"Cannot {action} {type(self).__name__} `{self.name}`: it is not allocated; "
                "call `.allocate()` first."
            )
            raise NotAllocatedError(msg)


# -- a state object parked by a tier: what stands in a record while its bytes are away ----


def _parked_refusal(obj: ParkedObject, action: str) -> ParkedError:
    msg = (
        f"Cannot {action} {obj.kind} `{obj.name}`: it is parked on the {obj.handle.tier} tier "
        "and not resident. Call `.unpark()` first (a manager does so on `get`, "
        "`get_or_create` and `require`)."
    )
    return ParkedError(msg)


@register_record
@attrs.frozen(eq=False)
class ParkedObject(StateObject):
    """A `StateObject` whose storages a tier holds (see `StateObject.park`); not resident.

    It has no tensor leaves, so byte accounting counts nothing for it but the engine-owned
    leaves it keeps in place (``engine``: those whose class does not implement the offload
    protocol; a `KVHandle`'s blocks move to the tier with the object and return to their
    pool); `nbytes_parked` says what the tier holds. Every read or change raises
    `ParkedError`, through any method or property of the parked kind (``concat``, ``stage``,
    ``has_staged``, ``len(...)``); `unpark` returns the object as it was.

    Args:
        name: The parked object's name (for messages).
        kind: The parked object's class name.
        handle: The tier's handle on the bytes.
        key: Where the object sits in the handle's tree when several objects were parked
            together (so storages they share stay shared); None when parked alone.
        engine: The engine-owned leaves left in place, those without the offload protocol
            (from the handle by default).

    >>> import torch
    >>> from sessionstate import TensorCache
    >>> parked = TensorCache(name="feat").allocate().commit((torch.zeros(2),)).park()
    >>> parked.is_allocated, parked.kind, parked.unpark().view()
    (False, 'TensorCache', (tensor([0., 0.]),))
    """

    name: str = static_field()
    kind: str = static_field()
    handle: ParkedBytes = static_field(repr=False)
    key: str | None = static_field(default=None, repr=False)
    engine: tuple[Any, ...] = field(
        default=attrs.Factory(lambda self: self.handle.engine.get(self.key, ()), takes_self=True),
        repr=False,
    )
    """The engine-owned leaves left in place (no offload protocol): still held, counted here."""

    parkable: ClassVar[bool] = False

    def __getattr__(self, attribute: str) -> Any:
        # Only reached for names the class lacks: the parked kind's own methods and properties
        # (`concat`, `stage`, `has_staged`, ...) are refused as reads of a parked object.
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        raise _parked_refusal(self, f"use `{attribute}` of")

    def __len__(self) -> int:
        """Refused: unpark first."""
        raise _parked_refusal(self, "take the length of")

    def __bool__(self) -> bool:
        return True

    @property
    def is_allocated(self) -> bool:
        """Always False: a parked object cannot be used until unparked."""
        return False

    @property
    def is_parked(self) -> bool:
        """Always True."""
        return True

    @property
    def nbytes_parked(self) -> dict[str, int]:
        """Bytes the tier holds for this object, keyed by tier (``host`` or ``disk``)."""
        return {self.handle.tier: self.handle.nbytes}

    @property
    def nbytes_unparked(self) -> dict[str, int]:
        """Bytes per device that `unpark` makes resident again."""
        return dict(self.handle.nbytes_by_device)

    def allocate(self, **sizing: Any) -> ParkedObject:
        """Refused: unpark first."""
        raise _parked_refusal(self, "allocate")

    def commit(self, payload: Any = None, /) -> ParkedObject:
        """Refused: unpark first."""
        raise _parked_refusal(self, "commit to")

    def view(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: unpark first."""
        raise _parked_refusal(self, "view")

    def reset(self) -> ParkedObject:
        """Refused: unpark first."""
        raise _parked_refusal(self, "reset")

    def evict(self) -> ParkedObject:
        """Refused: unpark first (or drop the whole session)."""
        raise _parked_refusal(self, "evict")

    def park(
        self,
        tier: Tier = "host",
        /,
        *,
        name: str | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> ParkedObject:
        """Already parked: returns ``self``."""
        return self

    def unpark(self) -> StateObject:
        """Return the object as it was parked: fresh storages, every bit and alias kept.

        Raises:
            RuntimeError: if the tier no longer holds the bytes (its owner released them), or
                cannot read them back (a damaged spool file).
        """
        restored = self.handle.restore()
        return self.unpark_from(restored)

    def unpark_from(self, restored: Any, /) -> StateObject:
        """This object, taken from the tree its handle restored (see `ParkedBytes.restore`).

        >>> import torch
        >>> from sessionstate import TensorCache
        >>> parked = TensorCache().allocate().park()
        >>> parked.unpark_from(parked.handle.restore()).is_allocated
        True
        """
        obj = restored if self.key is None else restored[self.key]
        assert isinstance(obj, StateObject)
        return obj


# -- two-phase writes: state objects whose writes are staged, then committed or discarded --

_SS = TypeVar("_SS", bound="StagedStateObject")


class StagedStateObject(StateObject):
    """A `StateObject` with two-phase writes: ``stage``, then ``commit()`` or ``discard()``.

    A step that writes in several pieces (one layer at a time, say) stages each piece, reads
    its own staged writes back with ``view(include_staged=True)``, and commits once at the end,
    so the writes become visible to ordinary readers only once the whole step succeeded. All
    three are pure transitions: they return a new object and leave ``self`` unchanged.

    Staged bytes are reported apart from committed ones: `nbytes_by_device` counts committed
    storages only, `staged_nbytes_by_device` the storages only the staged payload holds.
    (`sessionstate.nbytes_by_device` over a whole session still counts both: the number
    describes what the process is holding.)

    >>> import torch
    >>> from sessionstate import EncodeOnceKV
    >>> kv = EncodeOnceKV().allocate(num_layers=1, branches=("cond",))
    >>> staged = kv.stage({"cond": [(torch.zeros(2), torch.zeros(2))]})
    >>> staged.is_empty, staged.commit().is_empty, staged.discard().has_staged
    (True, False, False)
    >>> isinstance(kv, StagedStateObject)
    True
    """

    @property
    @abc.abstractmethod
    def has_staged(self) -> bool:
        """Whether a staged payload is waiting for ``commit()`` or ``discard()``."""

    @abc.abstractmethod
    def stage(self: _SS, payload: Any, /) -> _SS:
        """Return a new object with ``payload`` staged (not yet visible to ordinary reads)."""

    @abc.abstractmethod
    def commit(self: _SS, payload: Any = None, /) -> _SS:
        """Return a new object with the staged payload committed (``payload``: stage it first)."""

    @abc.abstractmethod
    def discard(self: _SS) -> _SS:
        """Return a new object with the staged payload dropped, the committed one kept."""

    @abc.abstractmethod
    def view(self, *, include_staged: bool = False) -> Any:
        """Read the committed contents, or the staged writes over them."""

    @abc.abstractmethod
    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes the committed contents keep alive, per device (staged bytes excluded)."""

    @abc.abstractmethod
    def staged_nbytes_by_device(self) -> dict[str, int]:
        """Bytes only the staged payload keeps alive, per device (never counted as committed)."""
