"""The immutability guard: stored tensors' version counters, recorded and verified."""

from __future__ import annotations

import logging
from collections.abc import Hashable

import torch

from sessionstate._errors import ImmutabilityViolationError
from sessionstate._session import SessionState
from sessionstate._tree import tree_flatten_with_keys, tree_leaves

__all__ = ["ImmutabilityGuard"]

logger = logging.getLogger("sessionstate")


class ImmutabilityGuard:
    """Per session, the version counter of every stored tensor, checked on the next access.

    Views share their base's version counter, so an in-place op through any view of a stored
    tensor is seen. Writes that bypass autograd's counter (through ``tensor.numpy()`` or
    ``tensor.data``) are not, and inference-mode tensors keep no counter (a warning says so
    once per guard). The caller serialises access (the manager holds its lock).

    >>> import torch
    >>> from sessionstate import SessionState
    >>> guard = ImmutabilityGuard()
    >>> state = SessionState(attrs={"x": torch.zeros(2)})
    >>> guard.record("a", state)
    >>> state.attrs["x"].add_(1)
    tensor([1., 1.])
    >>> guard.verify("a", state)
    Traceback (most recent call last):
    ...
    sessionstate._errors.ImmutabilityViolationError: Session 'a': the tensor at ...
    """

    def __init__(self) -> None:
        self._versions: dict[Hashable, list[tuple[int, torch.Tensor, int]]] = {}
        self._warned_unversioned = False

    def record(self, session_id: Hashable, state: SessionState) -> None:
        """Remember the version counter of every tensor ``state`` holds, for ``session_id``.

        >>> import torch
        >>> from sessionstate import SessionState
        >>> ImmutabilityGuard().record("a", SessionState(attrs={"x": torch.zeros(2)}))
        """
        # Key paths are costly to render; keep leaf positions and render one on violation.
        versions = []
        for index, leaf in enumerate(tree_leaves(state)):
            version = _version_of(leaf)
            if version is not None:
                versions.append((index, leaf, version))
            elif isinstance(leaf, torch.Tensor) and not self._warned_unversioned:
                self._warned_unversioned = True
                logger.warning(
                    "Session %r: the tensor at `%s` was made under torch.inference_mode() "
                    "and keeps no version counter, so check_immutable cannot watch it "
                    "(warned once per manager). Create session tensors under "
                    "torch.no_grad() to have them checked.",
                    session_id,
                    _key_of(state, index),
                )
        self._versions[session_id] = versions

    def forget(self, session_id: Hashable) -> None:
        """Stop watching ``session_id``.

        >>> ImmutabilityGuard().forget("nobody")
        """
        self._versions.pop(session_id, None)

    def verify(self, session_id: Hashable, state: SessionState) -> None:
        """Check that no tensor recorded for ``session_id`` (held by ``state``) changed.

        Raises:
            ImmutabilityViolationError: naming the session and the key path of the first
                tensor written in place since `record`.

        >>> import torch
        >>> from sessionstate import SessionState
        >>> guard = ImmutabilityGuard()
        >>> state = SessionState(attrs={"x": torch.zeros(2)})
        >>> guard.record("a", state); guard.verify("a", state)
        """
        for index, leaf, version in self._versions.get(session_id, ()):
            now = _version_of(leaf)
            if now is not None and now != version:
                key = _key_of(state, index)
                msg = (
                    f"Session {session_id!r}: the tensor at `{key}` was modified in place after "
                    f"the record was stored (version {version} -> {now}). Records are immutable: "
                    "build new tensors (`t = t + x`, not `t += x` or `t.copy_(...)`), then "
                    f"`drop({session_id!r})` this corrupted session."
                )
                raise ImmutabilityViolationError(msg)


def _key_of(state: SessionState, index: int) -> str:
    keys, _, _ = tree_flatten_with_keys(state)
    return keys[index]


def _version_of(leaf: object) -> int | None:
    if not isinstance(leaf, torch.Tensor):
        return None
    try:
        return int(leaf._version)
    except RuntimeError:  # inference-mode tensors keep no version counter
        return None
