"""The table: the latest record per session, its LRU order, the cap, the lock, the counters.

`Table` holds the records and the parts the manager is built from, as plain attributes that
the other rooms of the manager read: the `SessionLedger` (what the stored records hold, per
device), the `BudgetPolicy` (what to park or evict; it changes nothing), `Parking` (the tier,
the spool directory and the handles it made), the optional `ImmutabilityGuard`, the
`Reporter` of events and the engine pools. Its methods are the writes every room goes
through: admitting a new session at the cap, evicting, refusing, storing and forgetting a
record. Making room, reading and storing records, families, steps, observation and prefetch
are rooms of their own above it (see the subpackage's docstring).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any, Generic

import torch
from typing_extensions import TypeVar

from sessionstate._checks import (
    HOST_POOL_FULL_CHOICES,
    ON_FULL_CHOICES,
    check_bool,
    check_choice,
    check_count,
    describe,
    is_int,
)
from sessionstate._checks import check_session_id as check_session_id
from sessionstate._errors import SessionAdmissionError
from sessionstate._manager._events import EventHook, Reporter, SessionEvent
from sessionstate._manager._guard import ImmutabilityGuard
from sessionstate._manager._ledger import SessionLedger, entries_of
from sessionstate._manager._parking import HostPoolFull, Parking
from sessionstate._manager._policy import (
    BudgetPolicy,
    OnFull,
    check_max_bytes,
    parse_nbytes,
)
from sessionstate._protocols import EnginePool, StorageEntry
from sessionstate._session import SessionState
from sessionstate._storage import (
    HostBufferPool,
    Tier,
    check_tier,
)

__all__ = ["DEFAULT_MAX_SESSIONS", "NO_DEVICES", "SessionT", "Table", "batch_ids", "not_held"]

logger = logging.getLogger("sessionstate")

DEFAULT_MAX_SESSIONS = 64
"""The default session cap of a `SessionStateManager`."""

SessionT = TypeVar("SessionT", bound=SessionState, default=SessionState)
"""The record type a manager holds; `SessionState` when the manager is not parameterised."""

NO_DEVICES: frozenset[Hashable] = frozenset()


class Table(Generic[SessionT]):
    """The records by session id, least recently used first, with the cap, lock and parts.

    Built by `SessionStateManager` from its (checked) arguments; every attribute is read
    and written by the manager's rooms under ``lock``.
    """

    def __init__(
        self,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        *,
        on_full: OnFull = "evict",
        check_immutable: bool = False,
        max_bytes: Mapping[str, int | str] | str | None = None,
        park_tier: Tier | None = None,
        spool_dir: str | os.PathLike[str] | None = None,
        host_pool_bytes: int | str | None = None,
        host_pool_full: HostPoolFull = "disk",
        keep_parked_copies: bool = True,
        pools: Sequence[EnginePool] = (),
        on_event: EventHook | None = None,
    ) -> None:
        check_bool(check_immutable, "check_immutable")
        check_bool(keep_parked_copies, "keep_parked_copies")
        self.reporter = Reporter(on_event)
        self.pools: tuple[EnginePool, ...] = check_pools(pools)
        check_count(max_sessions, "max_sessions", fix=f"; the default is {DEFAULT_MAX_SESSIONS}")
        check_choice(on_full, "on_full", ON_FULL_CHOICES)
        self.max_sessions = max_sessions
        self.on_full: OnFull = on_full
        budget = check_max_bytes(max_bytes)
        # The parts: the accounting of what is stored, the budget's decisions, and parking
        # (which carries them out). The table, its lock and counters and the make-room loop
        # are the manager's own.
        self.ledger = SessionLedger(per_session=budget is not None)
        self.policy = None if budget is None else BudgetPolicy(budget)
        tier = "host" if park_tier is None else check_tier(park_tier, "park_tier")
        if park_tier == "host" and budget and all(on_cpu(device) for device in budget):
            msg = (
                f"`park_tier='host'` with a budget on cpu alone ({budget_text(budget)}) frees "
                "nothing: the host tier parks into host memory, which is the cpu's. Pass "
                "`park_tier='disk'` to free cpu memory, or budget the accelerator "
                "(`max_bytes={'cuda:0': '24GiB'}`)."
            )
            warnings.warn(msg, stacklevel=3)  # the caller of `SessionStateManager(...)`
        self.parking = Parking(
            tier,
            None if spool_dir is None else os.fspath(spool_dir),
            host_pool=host_pool(host_pool_bytes, host_pool_full, tier, budget),
            host_pool_full=host_pool_full,
            keep_copies=keep_parked_copies,
            reporter=self.reporter,
        )
        self.records: OrderedDict[Hashable, SessionT] = OrderedDict()
        # Per session, the devices on which its stored record holds nothing the policy would
        # park (all parked already, or staying for sharing with a resident value), and the
        # `park_until` predicates that pick nothing of it: a scan for room passes it by in one
        # lookup until a write to the table replaces the record.
        self.nothing_to_park: dict[Hashable, frozenset[Hashable]] = {}
        self.check_immutable = check_immutable
        self.guard = ImmutabilityGuard() if check_immutable else None
        # Under the guard, versions are per session: an object a sibling unparked (and might
        # have written into) is not handed to another session.
        self.parking.share_restored = self.guard is None
        self.warned_eviction = False
        self.lock = _Lock(threading.RLock(), self.reporter)
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.forks = 0
        self.schedule: list[Hashable] = []  # `expect`'s order of next use (first = next)
        self.scheduled_prefetches = 0
        self.families = False  # whether a fork or a family restore was ever made

    def raise_max_sessions(self, n: int, /) -> bool:
        if not is_int(n):
            msg = (
                f"`max_sessions` must be a positive int, got {n!r} ({type(n).__name__}); "
                "pass the new cap as an int."
            )
            raise TypeError(msg)
        if n <= 0:
            msg = (
                f"`max_sessions` must be a positive int, got {n!r} ({type(n).__name__}); "
                "pass a cap above the current one (the cap never goes down at runtime)."
            )
            raise ValueError(msg)
        with self.lock:
            if n <= self.max_sessions:
                return False
            self.max_sessions = n
            return True

    def drop(self, session_id: Hashable, /) -> bool:
        check_session_id(session_id)
        with self.lock:
            return self.forget(session_id)

    def clear(self) -> None:
        with self.lock:
            for session_id in list(self.records):
                self.forget(session_id)

    def admit(self, session_id: Hashable, keep: Collection[Hashable] = ()) -> None:
        # `session_id` is new: at the cap, evict the least recently used (not in `keep`, a
        # batch being stored) or refuse.
        if len(self.records) < self.max_sessions:
            return
        if self.on_full == "refuse":
            msg = (
                f"Cannot admit session {session_id!r}: the manager holds "
                f"{self.max_sessions} sessions (its cap) and `on_full='refuse'`. Drop a "
                "finished session first, or raise `max_sessions`."
            )
            self.refuse(session_id, SessionAdmissionError(msg))
        # A batch no larger than the cap (`put_many` checks) leaves one outside it.
        evicted = next(sid for sid in self.records if sid not in keep)
        self.evict(evicted, f"the session cap (max_sessions={self.max_sessions})")

    def evict(self, session_id: Hashable, by: str) -> None:
        nbytes = sum(entry[3] for entry in self.storages_of(session_id).values())
        if self.parking.is_parked(session_id):  # and what its tier held
            nbytes += sum(self.parking.parked_need(session_id).values())
        self.forget(session_id)
        self.evictions += 1
        first = not self.warned_eviction  # its warning is this eviction's WARNING line
        self.warn_evicted(session_id, by)
        event = SessionEvent("evict", session_id, nbytes, reason=f"evicted by {by}")
        self.reporter.emit(event, warned=first)

    def refuse(self, session_id: Hashable, error: Exception | None) -> None:
        # Report and raise `error` (nothing when None). Callers pass it inline and it is not
        # kept in this frame: the traceback holds the frames it passes through, and a frame
        # holding the error would be a cycle keeping the caller's records (their KV blocks)
        # alive until the cyclic collector runs.
        if error is None:
            return
        self.reporter.emit(SessionEvent("refuse", session_id, reason=str(error)))
        try:
            raise error
        finally:
            del error

    def warn_evicted(self, evicted: Hashable, by: str) -> None:
        # One warning per manager; `stats()` counts every eviction.
        if self.warned_eviction:
            return
        self.warned_eviction = True
        logger.warning(
            "Session %r was evicted by %s although nobody ended it; its state is lost. End "
            "finished sessions explicitly with `drop(session_id)` (`drop_session(session_id)` "
            "on a model pipeline), or raise the cap. Warned once per manager; "
            "`stats()['evictions']` counts every eviction.",
            evicted,
            by,
        )

    def set_record(self, session_id: Hashable, state: SessionT) -> None:
        # Every write of a held session's record goes through here: what a scan for room
        # noted of the record it replaces goes with it.
        self.records[session_id] = state
        self.nothing_to_park.pop(session_id, None)

    def forget(self, session_id: Hashable) -> bool:
        state = self.records.pop(session_id, None)
        self.nothing_to_park.pop(session_id, None)
        if self.guard is not None:
            self.guard.forget(session_id)
        self.ledger.set(session_id, {})
        self.parking.untrack(session_id)
        return state is not None

    def record_versions(self, session_id: Hashable, state: SessionState) -> None:
        if self.guard is not None:
            self.guard.record(session_id, state)

    def verify(self, session_id: Hashable, state: SessionState) -> None:
        if self.guard is not None:
            self.guard.verify(session_id, state)

    def verify_read(self, session_id: Hashable, state: SessionState) -> None:
        # A record a step read, checked before its successor is stored, if it is still the
        # stored one (a record replaced meanwhile had its versions recorded anew).
        if self.guard is not None:
            with self.lock:
                if self.records.get(session_id) is state:
                    self.guard.verify(session_id, state)

    def storages_of(self, session_id: Hashable) -> dict[Hashable, StorageEntry]:
        # The storages the session's stored record holds resident, each once, by identity
        # (from the ledger: no record is walked).
        return {entry[1]: entry for entry in entries_of(self.ledger.held(session_id))}

    def held_blocks(self, session_id: Hashable, pool: EnginePool) -> int:
        # The pool's blocks the session's stored record holds resident.
        return sum(map(pool.owns_entry, self.storages_of(session_id).values()))

    def await_prefetch(self, *session_ids: Hashable) -> None:
        # Wait, outside the lock, for the sessions' background restores: other sessions'
        # calls go on meanwhile. Costs one lookup per session when nothing is prefetched.
        parking = self.parking
        with self.lock:
            pending = [handle for sid in session_ids for handle in parking.pending(sid)]
        for handle in pending:
            handle.wait_prefetch()


class _Lock:
    """The manager's re-entrant lock, under which `on_event` callbacks run: what one raises
    beyond `Exception` (a KeyboardInterrupt) is held by the reporter until the outermost
    holder lets go, when the manager's state is whole again, and raised then."""

    __slots__ = ("_depth", "_lock", "_reporter")

    def __init__(self, lock: Any, reporter: Reporter) -> None:
        self._lock = lock
        self._reporter = reporter
        self._depth = 0
        reporter.defer = True  # the manager emits under its lock only

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if self._depth or self._reporter.deferred is None:
            self._lock.release()
            return
        raised, self._reporter.deferred = self._reporter.deferred, None
        self._lock.release()
        raise raised


def batch_ids(session_ids: Sequence[Hashable], method: str) -> list[Hashable]:
    """The ids of a batch, each checked, distinct and at least one (``method`` is named)."""
    ids = list(session_ids)
    for session_id in ids:
        check_session_id(session_id)
    if not ids or len(set(ids)) != len(ids):
        msg = f"`{method}` needs distinct session ids, got {ids!r}; name each session once."
        raise ValueError(msg)
    return ids


def not_held(subject: str, missing: object = None, *, then: str = "") -> str:
    """The one wording of "this manager does not hold it": ``subject``, why, ``then``, the fix.

    >>> not_held("Cannot fork session 'x'")
    "Cannot fork session 'x': this manager does not hold it (never created, dropped, or evicted). `session_ids()` lists the held ones."
    """  # noqa: E501 - a doctest's expected output is one line
    what = "it" if missing is None else repr(missing)
    return (
        f"{subject}: this manager does not hold {what} (never created, dropped, or evicted). "
        + (f"{then} " if then else "")
        + "`session_ids()` lists the held ones."
    )


def check_pools(pools: object) -> tuple[EnginePool, ...]:
    if isinstance(pools, EnginePool) or not isinstance(pools, (tuple, list)):
        msg = (
            f"`pools` must be a tuple or list of engine pools, got {describe(pools)}; pass "
            "`pools=(kv_pool,)`."
        )
        raise TypeError(msg)
    for pool in pools:
        if not isinstance(pool, EnginePool):
            msg = (
                f"`pools` holds {describe(pool)}, which is not an engine pool: it needs "
                "`name`, `block_nbytes`, `num_blocks`, `free_blocks`, `session_blocks`, "
                "`owns_entry` and `blocks_for_step` (see `sessionstate.EnginePool`; a "
                "`KVPool` has them)."
            )
            raise TypeError(msg)
    return tuple(pools)


def host_pool(
    nbytes: object, full: object, tier: Tier, budget: Mapping[str, int] | None
) -> HostBufferPool | None:
    # The host tier's pool, from the manager's arguments (checked; None: no pool).
    check_choice(full, "host_pool_full", HOST_POOL_FULL_CHOICES)
    if nbytes is None:
        return None
    count = parse_nbytes(nbytes, name="host_pool_bytes")
    if count <= 0:
        msg = (
            f"`host_pool_bytes` must be a positive byte count, got {nbytes!r}; pass None for "
            "no host pool, or the bytes the host tier may hold (e.g. '8GiB')."
        )
        raise ValueError(msg)
    if tier != "host":
        return None  # the disk tier holds no host bytes
    cuda = budget is None or any(device.startswith("cuda") for device in budget)
    return HostBufferPool(count, pin_memory=cuda and torch.cuda.is_available())


def on_cpu(device: str) -> bool:
    return torch.device(device).type == "cpu"


def budget_text(budget: Mapping[str, int]) -> str:
    """A budget as the text form ``max_bytes`` takes: ``"cpu=1048576"``."""
    return ",".join(f"{device}={nbytes}" for device, nbytes in budget.items())
