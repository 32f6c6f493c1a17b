"""Exceptions raised by the library.

Each one subclasses the builtin a caller would already catch for that kind of mistake, so
``except ValueError`` keeps working, while the library's own class lets a caller be precise.
Every class here is public: `sessionstate`'s table of public names lists them, once.
"""

from __future__ import annotations

from typing import Any

import attrs


class NotAllocatedError(RuntimeError):
    """A `StateObject` was used before `allocate()` (or after `evict()`)."""


class UnsupportedTensorError(TypeError):
    """A tensor whose storage the byte accounting cannot attribute (e.g. an opaque subclass)."""


class MissingKeyError(KeyError):
    """A name or key that is not there (a `KeyError` whose message prints unquoted)."""

    def __str__(self) -> str:
        # KeyError quotes its argument; a full sentence reads better unquoted.
        return str(self.args[0]) if self.args else ""


class SessionStateLostError(MissingKeyError):
    """A session's state was asked for but is not held (never started, dropped or evicted).

    Raised by a continuation (`SessionStateManager.require`, a model's ``forward(...,
    begin=False)``) and by a model's readers. It is a `MissingKeyError`, hence a `KeyError`,
    so code written against the earlier `KeyError` keeps working.
    """


class SessionAdmissionError(RuntimeError):
    """A new session was refused because the manager is full and configured to refuse."""


class ImmutableRecordError(attrs.exceptions.FrozenInstanceError):
    """An assignment to a field of an immutable record (a `FrozenInstanceError`)."""

    def __init__(self, msg: str) -> None:
        # attrs' constructor takes no message and sets a fixed one; replace it with ours.
        super().__init__()
        self.msg = msg
        self.args = (msg,)


class ImmutabilityViolationError(RuntimeError):
    """A tensor reachable from a stored record was written in place (see ``check_immutable``)."""


class SnapshotError(ValueError):
    """A snapshot file (or bytes) that cannot be loaded: not a snapshot, newer, damaged."""


class ParkedError(NotAllocatedError):
    """A parked `StateObject` was read or changed before `unpark()` (it is not resident)."""


class ParkingError(RuntimeError):
    """Parking or unparking a session failed; the session is left as it was, named here."""


class IncompleteStateError(ValueError):
    """A state object read or committed while partially initialised (some layers missing)."""


class KVPoolExhaustedError(RuntimeError):
    """A `KVPool` had no free block for an append, or too few to take parked KV back.

    Attributes:
        pool: The pool that was short (an `EnginePool`; None where it is not known).
        needed: The free blocks the operation needed there (0 where it is not known).
    """

    def __init__(self, message: str, /, *, pool: Any = None, needed: int = 0) -> None:
        super().__init__(message)
        self.pool = pool
        self.needed = needed


class StaleKVHandleError(RuntimeError):
    """A `KVHandle` made by a step that was rolled back was used."""


class HostPoolFullError(MemoryError):
    """A `HostBufferPool` has no free run large enough for what was asked."""


def reason(exc: BaseException, /) -> str:
    """``exc``'s message as a clause inside another message: without its closing period
    (its type's name when it has none).

    >>> f"Cannot unpark: {reason(RuntimeError('The pool is full.'))}. Retry."
    'Cannot unpark: The pool is full. Retry.'
    """
    text = str(exc).rstrip().removesuffix(".")
    return text or type(exc).__name__


class BudgetTextError(ValueError):
    """A byte budget written as text that is not one (``"cpu=lots"``, ``"cuda=1GiB"``).

    Raised wherever a budget is read from text, by one parser: `SessionStateManager`'s
    ``max_bytes``, the deploy config's ``session_state_max_bytes`` and its environment
    variable (which warns with it instead), and ``sessionstate ab --max-bytes``. A budget is
    one byte count (``"24GiB"``) or ``device=count`` pairs (``"cuda:0=24GiB,cpu=8GiB"``).
    ``rule`` names the rule broken: ``"device"`` (a key that is not a device as tensors report
    it), ``"twice"`` (a device named again), ``"count"`` (not a byte count) or ``"zero"`` (a
    count of 0 where a positive one is asked for); ``part`` is the text that breaks it. It is a
    `ValueError`.

    >>> import sessionstate as ss
    >>> try:
    ...     ss.SessionStateManager(max_bytes="cpu=lots")
    ... except ss.BudgetTextError as error:
    ...     print(error.rule, error.part)
    count lots
    """

    def __init__(self, message: str, /, *, rule: str, part: str) -> None:
        super().__init__(message)
        self.rule = rule
        self.part = part
