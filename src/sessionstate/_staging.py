"""Two-phase writes: state objects whose writes are staged, then committed or discarded."""

from __future__ import annotations

import abc
from typing import Any, TypeVar

from sessionstate._objects import StateObject

__all__ = ["StagedStateObject"]

_S = TypeVar("_S", bound="StagedStateObject")


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
    def stage(self: _S, payload: Any, /) -> _S:
        """Return a new object with ``payload`` staged (not yet visible to ordinary reads)."""

    @abc.abstractmethod
    def commit(self: _S, payload: Any = None, /) -> _S:
        """Return a new object with the staged payload committed (``payload``: stage it first)."""

    @abc.abstractmethod
    def discard(self: _S) -> _S:
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
