"""What both reference models' session paths share: the bespoke table and the managed rules.

A model is its networks, its state records and its step. Session bookkeeping is written once
here, so the two models cannot drift apart: the bespoke path's capped table (`SessionTable`:
cap, ``on_full``, ``begin``, the once-per-table eviction warning, the counters), the managed
path's manager built from every resolved setting (`build_manager`), its "publish only after
the whole step succeeded" rule (`managed_forward`), and its read of a session that may be
parked (`resident`), and its prefetch of the session a scheduler steps next (`prefetch`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

import torch

from sessionstate import (
    KVPool,
    SessionAdmissionError,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
    SessionStateSettings,
    nbytes_by_device,
)
from sessionstate._checks import check_session_id

__all__ = [
    "SessionMessages",
    "SessionTable",
    "build_manager",
    "device_key",
    "managed_forward",
    "prefetch",
    "resident",
]

logger = logging.getLogger("sessionstate")

S = TypeVar("S")
R = TypeVar("R", bound=SessionState)
O = TypeVar("O")  # noqa: E741 - a step's output, as in `step(state, x) -> (state, out)`


class SessionMessages:
    """The messages both paths give for a session that is not held, worded per model.

    Args:
        model: How messages name the model (``"DreamZero"``).
        argument: The name of ``forward``'s input in the fix (``"obs"``).

    >>> messages = SessionMessages("Toy", "obs")
    >>> messages.unknown("a")
    "Toy session 'a' is not held (never started, dropped or evicted); call `forward(obs, session_id)` to start it."
    """  # noqa: E501 - a doctest's expected output is one line

    def __init__(self, model: str, argument: str) -> None:
        self.model = model
        self.argument = argument

    def unknown(self, session_id: Hashable) -> str:
        """The message for a lookup of a session that is not held."""
        return (
            f"{self.model} session {session_id!r} is not held (never started, dropped or "
            f"evicted); call `forward({self.argument}, session_id)` to start it."
        )

    def lost(self, session_id: Hashable) -> str:
        """The message for ``forward(..., begin=False)`` of a session that is not held."""
        return (
            f"Cannot continue {self.model} session {session_id!r}: it is not held (never "
            "started, dropped or evicted), so its state is lost. Start it again with "
            f"`forward({self.argument}, {session_id!r}, begin=True)`, or raise the session cap."
        )


class SessionTable(Generic[S]):
    """Session id to mutable state, least recently used first, capped as upstream.

    Counts hits, misses and evictions the way the manager counts them, and warns once on the
    first eviction.

    Args:
        model: How messages name the model (``"DreamZero"``).
        new: Makes a new session's state.
        max_sessions: The cap.
        on_full: At the cap, ``"evict"`` the least recently used session or ``"refuse"`` the
            new one with `SessionAdmissionError`.
        lost: The message of a continuation (``begin=False``) of a session not held.
        unknown: The message of a read of a session not held.

    >>> table = SessionTable("Toy", dict, 1, "evict", lost=str, unknown=str)
    >>> first = table.state("a", None)
    >>> table.state("a", None) is first, table.counts
    (True, {'hits': 1, 'misses': 1, 'evictions': 0})
    """

    def __init__(
        self,
        model: str,
        new: Callable[[], S],
        max_sessions: int,
        on_full: str,
        *,
        lost: Callable[[Hashable], str],
        unknown: Callable[[Hashable], str],
    ) -> None:
        self.states: OrderedDict[Hashable, S] = OrderedDict()
        self.model = model
        self.new = new
        self.max_sessions = max_sessions
        self.on_full = on_full
        self.counts = {"hits": 0, "misses": 0, "evictions": 0}
        self._lost = lost
        self._unknown = unknown
        self._warned_eviction = False

    def state(self, session_id: Hashable, begin: bool | None) -> S:
        """The session's state to step: held (now most recently used), or new.

        Args:
            session_id: The session.
            begin: ``True`` starts the session afresh (replacing a held one), ``False``
                continues a held one and never starts one, ``None`` does either.

        Raises:
            SessionStateLostError: if ``begin`` is False and the session is not held.
            SessionAdmissionError: if the session is new, the table is full and ``on_full``
                is ``"refuse"``.
        """
        states = self.states
        state = None if begin else states.get(session_id)
        if state is not None:
            self.counts["hits"] += 1
            states.move_to_end(session_id)
            return state
        if begin and session_id in states:  # a restart replaces the held state
            state = states[session_id] = self.new()
            states.move_to_end(session_id)
            return state
        if not begin:  # counted as the manager's `get` counts it
            self.counts["misses"] += 1
        if begin is False:
            raise SessionStateLostError(self._lost(session_id))
        if self.on_full == "refuse" and len(states) >= self.max_sessions:
            msg = (
                f"Cannot admit {self.model} session {session_id!r}: the bespoke session table "
                f"holds {self.max_sessions} sessions (its cap) and "
                "`on_full='refuse'`. Drop a finished session first with `drop_session`, or "
                "raise the cap."
            )
            raise SessionAdmissionError(msg)
        state = states[session_id] = self.new()
        if len(states) > self.max_sessions:
            evicted, _ = states.popitem(last=False)
            self.counts["evictions"] += 1
            if not self._warned_eviction:
                self._warned_eviction = True
                logger.warning(
                    "%s session %r was evicted by the bespoke session cap (%d) although "
                    "nobody ended it; its state is lost. End finished sessions explicitly with "
                    "`drop_session(session_id)`, or raise the cap. Warned once per pipeline; "
                    "`stats()['evictions']` counts every eviction.",
                    self.model,
                    evicted,
                    self.max_sessions,
                )
        return state

    def held(self, session_id: Hashable) -> S:
        """The held state of ``session_id``, leaving the LRU order alone.

        Raises:
            SessionStateLostError: if the session is not held.
        """
        state = self.states.get(session_id)
        if state is None:
            raise SessionStateLostError(self._unknown(session_id))
        return state

    def drop(self, session_id: Hashable) -> bool:
        """End a session; returns whether it was held."""
        return self.states.pop(session_id, None) is not None

    def stats(self, values: Callable[[Hashable], Mapping[str, object]]) -> dict[str, int]:
        """The manager's `stats()` keys, computed by hand over every session's ``values``
        (each storage once)."""
        held = [values(sid) for sid in self.states]
        totals = nbytes_by_device(held) if held else {}
        out = {"sessions": len(self.states), "max_sessions": self.max_sessions, **self.counts}
        out["total_nbytes"] = sum(totals.values())
        out.update({f"nbytes:{d}": n for d, n in sorted(totals.items())})
        return out


def device_key(device: torch.device) -> str:
    """How a budget names ``device``: as its tensors report it (CUDA with its index).

    >>> device_key(torch.device("cpu"))
    'cpu'
    """
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def build_manager(
    record: type[R], settings: SessionStateSettings, device: torch.device
) -> SessionStateManager[R]:
    """The managed path's manager, honouring every resolved setting.

    The cap, ``on_full``, the immutability guard, the byte budget (a single count is a budget
    for the model's ``device``), the park tier, the spool directory and the host tier's
    buffer pool (``host_pool_bytes``, ``host_pool_full``).

    Args:
        record: The model's session record class (it types the manager).
        settings: The resolved session-state settings.
        device: The model's device.

    >>> from sessionstate import SessionState, resolve_session_state_config
    >>> settings = resolve_session_state_config(None, {"OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES": "1KiB"})
    >>> build_manager(SessionState, settings, torch.device("cpu")).max_bytes
    {'cpu': 1024}
    """  # noqa: E501 - a doctest line
    budget = settings.max_bytes
    return SessionStateManager[R](
        settings.max_sessions,
        on_full=settings.on_full,
        check_immutable=settings.check_immutable,
        max_bytes={device_key(device): budget} if isinstance(budget, int) else budget,
        park_tier=settings.park_tier,
        spool_dir=settings.spool_dir,
        host_pool_bytes=settings.host_pool_bytes,
        host_pool_full=settings.host_pool_full,
    )


def prefetch(
    manager: SessionStateManager[R] | None,
    session_id: Hashable,
    *,
    make_room: bool = False,
    kv_pool: KVPool | None = None,
    kv_blocks: int = 0,
) -> bool:
    """Start unparking ``session_id`` in the background (`SessionStateManager.prefetch`).

    What both pipelines' ``prefetch`` do; False on the bespoke path (``manager`` None), for a
    session not held or not parked, and for a prefetch that does not fit.

    Args:
        manager: The managed path's manager, or None.
        session_id: The session the scheduler steps next.
        make_room: Park the least recently used other sessions to fit it, rather than drop it.
        kv_pool: An engine pool the background restore takes blocks from while the current
            step runs: the prefetch starts only if it has ``kv_blocks`` free (the prefetched
            session's window and what one step can need, so the step running meanwhile never
            runs short); with ``make_room`` other sessions' KV is parked until it has.
        kv_blocks: The free blocks of ``kv_pool`` a prefetch needs.

    >>> from sessionstate import SessionState
    >>> prefetch(None, "a"), prefetch(SessionStateManager[SessionState](), "a")
    (False, False)
    """
    check_session_id(session_id)
    if manager is None:
        return False
    state = manager.peek(session_id)
    if state is None or not state.parked:
        return False
    if kv_pool is not None:
        pool = kv_pool

        def room() -> bool:
            return pool.free_blocks >= kv_blocks

        if not room() and make_room:
            # Parked sessions have nothing to park; kept, their own prefetches stay.
            parked = [sid for sid in manager.session_ids() if _is_parked(manager, sid)]
            manager.park_until(room, frees=pool.owns_entry, keep={session_id, *parked})
        if not room():
            return False
    return manager.prefetch(session_id, make_room=make_room)


def managed_forward(
    manager: SessionStateManager[R],
    session_id: Hashable,
    begin: bool | None,
    *,
    new: Callable[[], R],
    step: Callable[[R], tuple[R, O]],
    lost: Callable[[Hashable], str],
    guard: AbstractContextManager[object] | None = None,
) -> O:
    """One managed step of ``session_id``: read, step, and publish only if the step succeeded.

    Args:
        manager: Holds the latest record of every session.
        session_id: The session.
        begin: As `SessionTable.state`.
        new: Makes a new session's record.
        step: ``step(state) -> (state, out)``, pure.
        lost: The message of a continuation of a session not held.
        guard: Entered around the step and the publication (a KV pool's transaction, which
            gives back what a failed step took).

    Raises:
        SessionStateLostError: if ``begin`` is False and the session is not held.
    """
    state = None if begin else manager.get(session_id)
    if state is None:
        if begin is False:
            raise SessionStateLostError(lost(session_id))
        state = new()
    with guard if guard is not None else contextlib.nullcontext():
        state, out = step(state)
        # Published only after the whole step succeeded: a failed step leaves the stored
        # record (or the absence of one) exactly as it was.
        manager.put(session_id, state)
    return out


def _is_parked(manager: SessionStateManager[R], session_id: Hashable) -> bool:
    state = manager.peek(session_id)
    return state is not None and bool(state.parked)


def resident(
    manager: SessionStateManager[R], session_id: Hashable, unknown: Callable[[Hashable], str]
) -> R:
    """The latest record of ``session_id``, resident, leaving the LRU order alone.

    A parked session is read through a resident copy; the stored record stays parked. A
    concurrent `get` may unpark the stored record (releasing its parked bytes) between the
    peek and the read: the read then starts again from the record that replaced it.

    Raises:
        SessionStateLostError: if the session is not held.

    >>> from sessionstate import SessionState
    >>> m = SessionStateManager[SessionState]()
    >>> m.put("a", SessionState())
    >>> resident(m, "a", str).parked, m.stats()["hits"]
    ((), 0)
    """
    while True:
        state = manager.peek(session_id)
        if state is None:
            raise SessionStateLostError(unknown(session_id))
        try:
            return state.unpark()
        except (RuntimeError, OSError):
            if manager.peek(session_id) is state:  # nobody replaced it: a real failure
                raise
