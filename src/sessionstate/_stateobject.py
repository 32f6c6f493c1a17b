"""The `StateObject` contract: a unit of session state with a lifecycle the manager acts on."""

from __future__ import annotations

import abc
import os
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from sessionstate._accounting import nbytes_by_device
from sessionstate._park import Tier, park_tree

if TYPE_CHECKING:
    from sessionstate._objects import ParkedObject

__all__ = ["StateObject"]

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
        from sessionstate._objects import ParkedObject  # defined on top of this module

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
