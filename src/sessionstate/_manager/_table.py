"""The manager: the one mutable part, a thin table of the latest record per session.

The manager owns the table, its lock, its counters, cap admission and the loop that makes room
under a byte budget; it is built from parts that each do one job: a `SessionLedger` (what the
stored records hold, per device), a `BudgetPolicy` (what to park or evict; it changes
nothing), `Parking` (the tier, the spool directory and the handles it made) and an optional
`ImmutabilityGuard`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import threading
import types
import warnings
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from typing import Any, Generic, cast

import torch
from typing_extensions import TypeVar

from sessionstate._accounting import EngineBlock, count_entries
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
from sessionstate._errors import (
    KVPoolExhaustedError,
    ParkingError,
    SessionAdmissionError,
    SessionStateLostError,
    SnapshotError,
    reason,
)
from sessionstate._events import EventHook, Reporter, SessionEvent, span
from sessionstate._kv._pool import kv_shortfall
from sessionstate._manager._guard import ImmutabilityGuard
from sessionstate._manager._ledger import SessionLedger, Values, entries_of
from sessionstate._manager._parking import HostPoolFull, Parking, parked_objects
from sessionstate._manager._policy import (
    BudgetPolicy,
    OnFull,
    check_max_bytes,
    objects_to_park,
    parse_nbytes,
)
from sessionstate._manager._schedule import check_schedule, park_order, prefetch_plan
from sessionstate._protocols import EnginePool, StorageEntry
from sessionstate._session import SessionState
from sessionstate._stateobject import ParkedObject
from sessionstate._storage import (
    HostBufferPool,
    HostPoolFullError,
    ParkedBytes,
    Tier,
    check_tier,
    inspect_snapshot,
    load_state,
    recorded_devices,
    save_state,
)

__all__ = ["DEFAULT_MAX_SESSIONS", "SessionStateManager", "SessionT"]

logger = logging.getLogger("sessionstate")

DEFAULT_MAX_SESSIONS = 64
"""The default session cap of a `SessionStateManager`."""

SessionT = TypeVar("SessionT", bound=SessionState, default=SessionState)
OutT = TypeVar("OutT")
"""The record type a manager holds; `SessionState` when the manager is not parameterised."""


class SessionStateManager(Generic[SessionT]):
    """Maps session id to the latest `SessionState`, capped by least-recently-used eviction.

    Generic over the record type: a ``SessionStateManager[MySession]`` takes and returns
    ``MySession`` records, so callers need no ``isinstance`` checks; unparameterised, it holds
    any `SessionState`.

    The manager stores records, never mutates them: models thread a state through
    ``step(state, inputs) -> (state, out)`` and `put` the result. Evicting a session drops it
    from the table only; a caller still holding its record keeps working on it.

    `get`, `get_or_create`, `require` and `put` mark a session most recently used; ``in`` and
    ``len`` do not. All methods are safe to call from several threads.

    The first eviction logs a warning on the ``sessionstate`` logger naming the evicted session
    and how to end sessions explicitly; later ones are only counted (``stats()["evictions"]``).

    Args:
        max_sessions: The cap on retained sessions (default 64).
        on_full: What a new session does at the cap: ``"evict"`` (default) drops the least
            recently used session, as the bespoke caches do; ``"refuse"`` raises
            `SessionAdmissionError` and keeps serving the residents.
        check_immutable: Record every stored tensor's version counter and verify it on the
            session's next access, raising `ImmutabilityViolationError` that names the session
            and the leaf's key path if an in-place op wrote into it (through the tensor or any
            view of it). Writes that bypass the counter (``tensor.numpy()``, ``tensor.data``,
            ``tensor.untyped_storage().fill_()``)
            and inference-mode tensors (which have no counter; a warning says so once) are
            not seen. Off by default, and then free.
        max_bytes: A byte budget per device, as a mapping (``{"cuda:0": "24GiB"}``) or the
            text a model's config and its environment variable take (``"cuda:0=24GiB,cpu=8GiB"``);
            None (default) applies only the session cap. Over budget, the least recently used
            sessions' parkable objects are parked first, then ``on_full`` applies. A bare count
            (``"24GiB"``, an int) raises `ValueError` asking for its device: a config applies it
            to its model's device, which a manager does not know.
        park_tier: Where the budget parks objects: ``"host"`` (None, the default, means it)
            or ``"disk"``. ``"host"`` asked for with a budget on ``cpu`` alone warns: host
            memory is the cpu's, so parking there frees nothing.
        spool_dir: The root the disk tier spools into (the system temporary directory when
            None). The manager writes into a locked subdirectory of its own, removed with the
            manager; a disk-tier manager removes, when it is built, the subdirectories that
            processes which ended without cleaning up (``kill -9``) left in the root.
        host_pool_bytes: The host tier parks into one preallocated, pre-touched
            `HostBufferPool` of this many bytes (an int or text such as ``"8GiB"``; pinned when
            CUDA is available and the budget names a CUDA device, so device-to-host copies are
            asynchronous) instead of allocating host memory per park. None (default): no pool.
            Ignored on the disk tier. The pool holds parked bytes only: unparking onto the CPU
            allocates its destination afresh (`HostBufferPool.cpu_restores` stays off), so
            the pool's size is what the host tier may hold.
        host_pool_full: What a park the host pool cannot hold does: ``"disk"`` (default)
            spills it to the disk tier (into the spool directory; ``host_pool_spills`` counts
            them), ``"refuse"`` leaves that session resident, as one with nothing parkable
            (the budget parks others, then applies ``on_full``).
        keep_parked_copies: Whether an unpark keeps the tier's copy of the objects it brings
            back, for as long as the session holds them unchanged (default True): parking
            the session again then copies only what changed (``reparks`` and
            ``nbytes_reparked`` count what it did not copy). Objects holding K/V are always
            copied. Unchanged means the very objects unparked, every tensor's version counter
            as it was: in-place writes through any view are seen; writes that bypass the
            counter (as for ``check_immutable``) are not, and records are immutable. A kept
            copy costs its tier's memory while it lasts (``nbytes_kept:host`` and
            ``nbytes_kept:disk``): at most the resident sessions' parked-before bytes; in a
            host pool, kept copies are the first to go when a park does not fit. False: an
            unpark releases the copy, and every park copies.
        on_event: Called with each `SessionEvent` (park, unpark, prefetch, fork, evict, refuse),
            under the manager's lock: it must not call the manager, and what it raises is
            logged, never raised; a `BaseException` that is not an `Exception` (a
            KeyboardInterrupt) is raised once the call that emitted the event has finished
            its work, so the manager's state stays whole. Every event is also logged on the
            ``sessionstate`` logger at DEBUG, evictions at WARNING (at most one line a
            minute, with a count).
        pools: Engine pools of fixed-size blocks whose room the manager makes (`EnginePool`,
            e.g. a `KVPool` declaring ``step_tokens``): `step` parks the least recently used
            other sessions' objects holding a pool's blocks until the step's room is free,
            and `prefetch` starts only with room for the restored session beside a step's.

    >>> import torch
    >>> from sessionstate import SessionState
    >>> manager = SessionStateManager(max_sessions=2)
    >>> for sid in ["a", "b", "c"]:
    ...     manager.put(sid, SessionState(attrs={"x": torch.zeros(4)}))
    >>> manager.session_ids(), "a" in manager
    (['b', 'c'], False)
    >>> manager.stats()["evictions"], manager.stats()["nbytes:cpu"]
    (1, 32)
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
        self._reporter = Reporter(on_event)
        self._pools: tuple[EnginePool, ...] = _check_pools(pools)
        check_count(max_sessions, "max_sessions", fix=f"; the default is {DEFAULT_MAX_SESSIONS}")
        check_choice(on_full, "on_full", ON_FULL_CHOICES)
        self._max_sessions = max_sessions
        self._on_full: OnFull = on_full
        budget = check_max_bytes(max_bytes)
        # The parts: the accounting of what is stored, the budget's decisions, and parking
        # (which carries them out). The table, its lock and counters and the make-room loop
        # are the manager's own.
        self._ledger = SessionLedger(per_session=budget is not None)
        self._policy = None if budget is None else BudgetPolicy(budget)
        tier = "host" if park_tier is None else check_tier(park_tier, "park_tier")
        if park_tier == "host" and budget and all(_on_cpu(device) for device in budget):
            msg = (
                f"`park_tier='host'` with a budget on cpu alone ({_budget_text(budget)}) frees "
                "nothing: the host tier parks into host memory, which is the cpu's. Pass "
                "`park_tier='disk'` to free cpu memory, or budget the accelerator "
                "(`max_bytes={'cuda:0': '24GiB'}`)."
            )
            warnings.warn(msg, stacklevel=2)
        self._parking = Parking(
            tier,
            None if spool_dir is None else os.fspath(spool_dir),
            host_pool=_host_pool(host_pool_bytes, host_pool_full, tier, budget),
            host_pool_full=host_pool_full,
            keep_copies=keep_parked_copies,
            reporter=self._reporter,
        )
        self._table: OrderedDict[Hashable, SessionT] = OrderedDict()
        # Per session, the devices on which its stored record holds nothing the policy would
        # park (all parked already, or staying for sharing with a resident value), and the
        # `park_until` predicates that pick nothing of it: a scan for room passes it by in one
        # lookup until a write to the table replaces the record.
        self._nothing_to_park: dict[Hashable, frozenset[Hashable]] = {}
        self._check_immutable = check_immutable
        self._guard = ImmutabilityGuard() if check_immutable else None
        # Under the guard, versions are per session: an object a sibling unparked (and might
        # have written into) is not handed to another session.
        self._parking.share_restored = self._guard is None
        self._warned_eviction = False
        self._lock = _Lock(threading.RLock(), self._reporter)
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._forks = 0
        self._schedule: list[Hashable] = []  # `expect`'s order of next use (first = next)
        self._scheduled_prefetches = 0
        self._families = False  # whether a fork or a family restore was ever made

    @property
    def max_sessions(self) -> int:
        """The cap on retained sessions.

        >>> SessionStateManager(3).max_sessions
        3
        """
        return self._max_sessions

    def raise_max_sessions(self, n: int, /) -> bool:
        """Raise the cap to ``n`` at runtime; returns whether the cap went up.

        A serving runner publishes its capacity once it knows its device. The cap never goes
        down at runtime: an ``n`` not above the current cap changes nothing and returns False.

        Raises:
            TypeError: if ``n`` is not an int.
            ValueError: if ``n`` is not positive.

        >>> m = SessionStateManager(2)
        >>> m.raise_max_sessions(8), m.raise_max_sessions(4), m.max_sessions
        (True, False, 8)
        """
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
        with self._lock:
            if n <= self._max_sessions:
                return False
            self._max_sessions = n
            return True

    @property
    def check_immutable(self) -> bool:
        """Whether stored tensors are checked for in-place writes on each access.

        >>> SessionStateManager(check_immutable=True).check_immutable
        True
        """
        return self._check_immutable

    @property
    def max_bytes(self) -> dict[str, int] | None:
        """The byte budget per device, or None when only the session cap applies.

        >>> SessionStateManager(max_bytes={"cpu": "1KiB"}).max_bytes
        {'cpu': 1024}
        """
        return None if self._policy is None else dict(self._policy.max_bytes)

    @property
    def host_pool(self) -> HostBufferPool | None:
        """The host tier's buffer pool (``host_pool_bytes``), or None.

        >>> SessionStateManager(host_pool_bytes="4KiB").host_pool.total
        4096
        """
        return self._parking.host_pool

    @property
    def keep_parked_copies(self) -> bool:
        """Whether an unpark keeps the tier's copy of what it restored (see the argument).

        >>> SessionStateManager(keep_parked_copies=False).keep_parked_copies
        False
        """
        return self._parking.keep_copies

    @property
    def park_tier(self) -> Tier:
        """Where the budget parks objects: ``"host"`` or ``"disk"``.

        >>> SessionStateManager().park_tier
        'host'
        """
        return self._parking.tier

    @property
    def on_full(self) -> OnFull:
        """What a new session does at the cap: ``"evict"`` or ``"refuse"``.

        >>> SessionStateManager().on_full
        'evict'
        """
        return self._on_full

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._table

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    def __repr__(self) -> str:
        return (
            f"SessionStateManager(sessions={len(self)}, max_sessions={self._max_sessions}, "
            f"on_full={self._on_full!r})"
        )

    def session_ids(self) -> list[Hashable]:
        """Ids of the retained sessions, least recently used first.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.put("b", SessionState()); _ = m.get("a")
        >>> m.session_ids()
        ['b', 'a']
        """
        with self._lock:
            return list(self._table)

    def get(self, session_id: Hashable, /) -> SessionT | None:
        """The latest record of ``session_id``, or None (counted as a miss).

        >>> SessionStateManager().get("nobody") is None
        True
        """
        check_session_id(session_id)
        return self._read(session_id, touch=True)

    def _read(self, session_id: Hashable, *, touch: bool) -> SessionT | None:
        # `get`; `touch=False` leaves the LRU order alone (a step's read: its session becomes
        # the most recently used when the step publishes, and stays where it was if it fails).
        self._await_prefetch(session_id)
        with self._lock:
            state = self._table.get(session_id)
            if state is None:
                self._misses += 1
                return None
            self._verify(session_id, state)
            state = self._resident(session_id, state)
            self._hits += 1
            if touch:
                self._table.move_to_end(session_id)
            return state

    def get_many(self, session_ids: Sequence[Hashable], /) -> list[SessionT]:
        """The latest records of ``session_ids``, all resident at once, for one batched step.

        One room check for the whole batch: the parked ones' bytes are checked, then the
        least recently used sessions outside the batch are parked (or, per ``on_full``,
        evicted) until every one of them fits with the others, then each is unparked; no
        session of the batch is parked to make room for another. Each counts as a hit, and
        they become the most recently used, in the order given.

        Raises:
            SessionStateLostError: if any is not held (nothing changes).
            ValueError: if no id is given, or one twice.
            SessionAdmissionError: if the budget cannot hold the whole batch; no session is
                lost (those unparked before the refusal stay resident). Split the batch.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> for sid in "abc": m.put(sid, SessionState(attrs={"n": sid}))
        >>> [r.attrs["n"] for r in m.get_many(["c", "a"])], m.session_ids()
        (['c', 'a'], ['b', 'c', 'a'])
        """
        return self._read_many(self._batch_ids(session_ids, "get_many"), touch=True)

    def _read_many(self, ids: list[Hashable], *, touch: bool) -> list[SessionT]:
        # `get_many` of checked ids; `touch=False` leaves the LRU order alone, as `_read`.
        self._await_prefetch(*ids)
        with self._lock:
            missing = [sid for sid in ids if sid not in self._table]
            if missing:
                msg = _not_held(f"Cannot get the batch {ids!r}", missing, then="Nothing changed.")
                raise SessionStateLostError(msg)
            for session_id in ids:  # every record, before anything is parked or unparked
                self._verify(session_id, self._table[session_id])
            parking = self._parking
            need: dict[str, int] = {}
            parked = [sid for sid in ids if parking.is_parked(sid)]
            counted: set[int] = set()  # parked bytes the batch brings back once, for all
            holders: list[Hashable] = []
            for session_id in parked:
                holders += self._holders(session_id)
                try:
                    for device, nbytes in parking.check(session_id, counted).items():
                        need[device] = need.get(device, 0) + nbytes
                except BaseException:
                    parking.discard(session_id)
                    raise
                parking.unreserve(session_id)
            if parked:
                try:
                    self._make_room(parked[0], need, keep=[*ids, *holders])
                except BaseException:
                    for session_id in parked:  # what `check` read, and their prefetches, go
                        parking.discard(session_id)
                    raise
            out: list[SessionT] = []
            for session_id in ids:
                state = self._table[session_id]
                if parking.is_parked(session_id):
                    try:
                        state = self._unpark(session_id, state, keep=ids)
                    except BaseException:
                        parking.discard(session_id)
                        raise
                    self._store_unparked(session_id, state)
                out.append(state)
            self._hits += len(ids)
            if touch:
                for session_id in ids:
                    self._table.move_to_end(session_id)
            return out

    def put_many(
        self, items: Mapping[Hashable, SessionT] | Sequence[tuple[Hashable, SessionT]], /
    ) -> None:
        """Store the records of a batched step, all or nothing.

        Like `put` for each, in order, except that no session of the batch is parked or
        evicted to make room for another, and a refusal of any (the cap, the budget, a record
        that cannot be counted) puts every session of the batch back as it was.

        Raises:
            TypeError: if a record is not a `SessionState`.
            ValueError: if an id is given twice.
            SessionAdmissionError: as `put`; nothing of the batch changes.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put_many({"a": SessionState(attrs={"n": 1}), "b": SessionState(attrs={"n": 2})})
        >>> m.session_ids(), m.stats()["sessions"]
        (['a', 'b'], 2)
        """
        pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
        ids = self._batch_ids([sid for sid, _ in pairs], "put_many")
        for sid, record in pairs:  # every record checked before anything is stored
            _check_state(record, sid)
        with self._lock:
            if not self._batch_fits(ids):
                fresh = sum(sid not in self._table for sid in ids)
                msg = (
                    f"Cannot store the batch {ids!r}: {fresh} new sessions beside "
                    f"{len(self._table)} held, and the cap (max_sessions="
                    f"{self._max_sessions}, `on_full={self._on_full!r}`) cannot hold the batch. "
                    "Store a smaller batch, drop finished sessions, or raise `max_sessions`."
                )
                self._refuse(ids[0], SessionAdmissionError(msg))
            self._store_batch(pairs, ids)

    def _batch_fits(self, ids: list[Hashable]) -> bool:
        # Whether the cap holds the batch: no larger than the cap, and with
        # `on_full="refuse"` no more new sessions than free places.
        fresh = sum(sid not in self._table for sid in ids)
        room = self._max_sessions - len(self._table)
        return len(ids) <= self._max_sessions and (self._on_full != "refuse" or fresh <= room)

    def _store_batch(self, pairs: Sequence[tuple[Hashable, SessionT]], ids: list[Hashable]) -> None:
        # Under the lock, once the batch fits the cap: each put, no member parked or evicted
        # for another; a refusal of any puts every member back as it was, and the LRU order.
        # A batch the budget cannot hold even alone is refused before anything is parked or
        # evicted for it.
        ledger, parking, table = self._ledger, self._parking, self._table
        walked = [ledger.values_for(session_id, state) for session_id, state in pairs]
        if any(sid not in table or parking.is_parked(sid) for sid in ids) or any(
            _stores_parked(values, state) for values, (_, state) in zip(walked, pairs, strict=True)
        ):
            self._store_batch_by_one(pairs, ids, walked)
            return
        # Every member held and resident before and after (a batched step's records): the
        # ledger moved once for the batch, one room check, then the table.
        grown = ledger.growth(walked)
        replaced = ledger.set_many(zip(ids, walked, strict=True))
        try:
            policy = self._policy
            if policy is not None:
                # Over a budget, the batch alone may be (each member then fits alone: it
                # holds no more than the batch).
                if policy.over(ledger, {}):
                    self._refuse_batch_over_budget(ids, walked)
                self._make_room(ids[0], {}, ids)
        except BaseException:
            ledger.set_many(zip(ids, replaced, strict=True))
            ledger.undo_growth(grown)
            raise
        for session_id, state in pairs:
            self._set_record(session_id, state)
            table.move_to_end(session_id)
            parking.track(session_id, state, {})
            self._record_versions(session_id, state)

    def _store_batch_by_one(
        self, pairs: Sequence[tuple[Hashable, SessionT]], ids: list[Hashable], walked: list[Values]
    ) -> None:
        # `_store_batch` when a member is new or holds parked objects: put by put.
        done: list[Hashable] = []
        try:
            olds = [self._ledger.held(sid) for sid in ids]
            self._refuse_batch_over_budget(ids, walked, olds)
        except BaseException:
            self._ledger.undo_growth(self._ledger.growth(walked))
            raise
        before = {sid: self._table.get(sid) for sid in ids}
        order = list(self._table)
        # The parked bytes of the records the batch replaces are held until it is stored
        # whole: a refusal puts those records back, and their bytes must still be there.
        parking = self._parking
        replaced = [
            obj for r in before.values() if r is not None for obj in parked_objects(r).values()
        ]
        parking.replacing = tuple(replaced)
        try:
            for (session_id, state), values in zip(pairs, walked, strict=True):
                self._put_locked(session_id, state, touch=True, keep=ids, values=values)
                done.append(session_id)
        except BaseException:
            # (the failed put cut its own walk's extensions off; those never put, here)
            self._ledger.undo_growth(self._ledger.growth(walked[len(done) + 1 :]))
            for session_id in reversed(done):
                previous = before[session_id]
                if previous is None:
                    self._forget(session_id)
                else:
                    self._put_locked(session_id, previous, touch=False, keep=ids)
            for session_id in order:
                if session_id in self._table:
                    self._table.move_to_end(session_id)
            raise
        finally:
            parking.replacing = ()
            parking.abandon(replaced)  # what no stored record holds any more

    def _refuse_batch_over_budget(
        self, ids: list[Hashable], walked: list[Values], olds: Sequence[Values] = ()
    ) -> None:
        # Refuse a batch whose records together (each storage once) exceed a device's whole
        # budget: storing it would evict or park every other session and still not fit.
        # `olds`: the records the members held (stored put by put: while a member is put, the
        # members after it still hold theirs), so a batch refused midway evicts no one.
        policy = self._policy
        if policy is None:
            return
        totals = count_entries(entry for values in walked for entry in entries_of(values))
        for device, budget in policy.max_bytes.items():
            if totals.get(device, 0) > budget:
                msg = (
                    f"Cannot store the batch {ids!r}: together it holds {totals[device]} "
                    f"bytes on {device}, more than the whole budget of {budget} bytes "
                    "there (`max_bytes`); storing it would evict or park every other "
                    "session and still not fit. Store a smaller batch, or raise the "
                    f"budget for {device}."
                )
                self._refuse(ids[0], SessionAdmissionError(msg))
        for k in range(len(olds) - 1) if any(olds[1:]) else ():
            held = [*walked[: k + 1], *olds[k + 1 :]]
            peak = count_entries(entry for values in held for entry in entries_of(values))
            for device, budget in policy.max_bytes.items():
                if peak.get(device, 0) > budget:
                    msg = (
                        f"Cannot store the batch {ids!r}: while {ids[k]!r} is stored, the "
                        "batch's new records up to it and the records the members after it "
                        f"still hold come to {peak[device]} bytes on {device}, more than the "
                        f"whole budget of {budget} bytes there (`max_bytes`); storing it "
                        "would evict or park every other session and still not fit. List "
                        "the sessions it replaces first, store a smaller batch, or raise the "
                        f"budget for {device}."
                    )
                    self._refuse(ids[0], SessionAdmissionError(msg))

    def _batch_ids(self, session_ids: Sequence[Hashable], method: str) -> list[Hashable]:
        ids = list(session_ids)
        for session_id in ids:
            check_session_id(session_id)
        if not ids or len(set(ids)) != len(ids):
            msg = f"`{method}` needs distinct session ids, got {ids!r}; name each session once."
            raise ValueError(msg)
        return ids

    def peek(self, session_id: Hashable, /, *, on_host: bool = False) -> SessionT | None:
        """The latest record of ``session_id``, or None, for inspection only.

        Unlike `get`, it leaves the LRU order and the hit/miss counters alone, so looking at
        a session (for a size table, a dashboard) does not keep it resident. With
        ``check_immutable``, it raises for a corrupted record, as `get` does.

        With ``on_host=True``, a parked session's objects are read into host memory
        (`SessionState.unpark_on_host`, under the manager's lock): the record returned holds
        them readable, the stored one stays parked, and no device memory or pool block is
        taken.

        Raises:
            TypeError: for an ``on_host`` that is not a bool.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.put("b", SessionState())
        >>> m.peek("a") is not None, m.session_ids(), m.stats()["hits"]
        (True, ['a', 'b'], 0)
        """
        check_session_id(session_id)
        check_bool(on_host, "on_host")
        with self._lock:
            state = self._table.get(session_id)
            if state is not None:
                self._verify(session_id, state)
                if on_host and state.parked:
                    state = self._read_parked(session_id, state)
            return state

    def require(self, session_id: Hashable, /) -> SessionT:
        """The latest record of ``session_id``; never creates one.

        Use it for a continuation: a session that was evicted or never began raises instead
        of silently starting from scratch.

        Raises:
            SessionStateLostError: if the manager does not hold ``session_id``.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState())
        >>> m.require("a").attrs
        mappingproxy({})
        """
        state = self.get(session_id)
        if state is None:
            msg = (
                f"Session {session_id!r} is not held by this manager (never created, dropped, "
                "or evicted by the LRU cap); its state is lost. Start it again with "
                "`get_or_create`, or raise the cap."
            )
            raise SessionStateLostError(msg)
        return state

    def get_or_create(self, session_id: Hashable, factory: Callable[[], SessionT], /) -> SessionT:
        """The latest record of ``session_id``, or ``factory()`` stored as a new session.

        The factory runs under the manager's lock, so concurrent callers create a session
        once. It must not block on other threads that use this manager.

        Raises:
            TypeError: if ``factory`` is not callable (checked first: nothing is counted), or
                returns something that is not a `SessionState`.
            SessionAdmissionError: if the session is new, the manager is full and
                ``on_full="refuse"``.
            UnsupportedTensorError: if the new record holds a tensor whose bytes cannot be
                counted; nothing is stored.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> first = m.get_or_create("a", SessionState)
        >>> m.get_or_create("a", SessionState) is first
        True
        """
        check_session_id(session_id)
        if not callable(factory):
            msg = (
                f"Session {session_id!r}: `factory` must be a callable that returns a new "
                f"SessionState, got {factory!r} ({type(factory).__name__}); pass the class "
                "itself (e.g. `SessionState`) or a function."
            )
            raise TypeError(msg)
        self._await_prefetch(session_id)
        with self._lock:
            state = self._table.get(session_id)
            if state is not None:
                self._verify(session_id, state)
                state = self._resident(session_id, state)
                self._hits += 1
                self._table.move_to_end(session_id)
                return state
            self._misses += 1
            if self._on_full == "refuse":
                self._admit(session_id)  # refuse before paying for the factory
            created = factory()
            _check_state(created, session_id)
            # Evict only once the new record exists: a failing factory costs no resident. A
            # factory that stored this session itself (re-entrantly) made room already.
            self._put_locked(session_id, created, touch=False)
            return created

    def put(self, session_id: Hashable, state: SessionT, /) -> None:
        """Store ``state`` as the latest record of ``session_id`` (replacing any earlier one).

        Replacing a record is how a session recovers from an immutability violation: ``put``
        does not check the record it replaces.

        Raises:
            TypeError: if ``state`` is not a `SessionState`.
            SessionAdmissionError: as `get_or_create`.
            UnsupportedTensorError: if ``state`` holds a tensor whose bytes cannot be counted
                (nothing stored changes).

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"step": 1}))
        >>> m.get("a").attrs["step"]
        1
        """
        check_session_id(session_id)
        _check_state(state, session_id)
        with self._lock:
            self._put_locked(session_id, state, touch=True)

    def fork(
        self, source_id: Hashable, /, *branch_ids: Hashable, share_random: bool = False
    ) -> None:
        """Branch ``source_id`` into new sessions ``branch_ids``, each holding its record.

        Nothing is copied: a record is immutable, so every branch stores the source's latest
        record itself and shares every storage with it, counted once by the totals and the
        budget (`session_stats` tells what a session holds alone and what it shares). A
        branch that steps copies only what it writes: a buffer's new chunk, a `KVPool`'s
        partial block (the pool copies a block another branch wrote past). A parked source
        forks parked: its branches hold the same parked bytes, which stay on the tier until
        the last session holding them unparks or goes. Under a budget the sharing holds: an
        object a sibling parked already is not parked again, and one a sibling unparked and
        still holds comes back as that object. K/V objects park per session, and their
        blocks come back shared: an unpark takes back the live blocks of the same tokens a
        sibling holds (`KVPool`).

        Random state is split: a record's `RandomKey` objects are split (`split_random`)
        into one key for the source and one per branch, so no two of them draw the same
        noise; every other value stays shared. With ``share_random=True`` every branch holds
        the source's record itself, key included, and draws what the source would. (A
        record forked by hand, ``put(branch, record)``, is the record itself: split it first.)

        The source becomes the most recently used session, then the branches in order.

        Raises:
            SessionStateLostError: if ``source_id`` is not held.
            ValueError: if no branch is named, or a branch id is held already or repeated.
            SessionAdmissionError: if the cap cannot hold the branches: more than the cap
                leaves beside the source, or, with ``on_full="refuse"``, more than its free
                places. Nothing changes.

        >>> import torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.zeros(4)}))
        >>> m.fork("a", "b", "c")
        >>> m.session_ids(), m.stats()["total_nbytes"], m.peek("b") is m.peek("a")
        (['a', 'b', 'c'], 16, True)
        """
        check_session_id(source_id)
        for branch_id in branch_ids:
            if isinstance(branch_id, list | set):  # the ids as one collection, not unpacked
                msg = (
                    f"`fork` takes each branch id as its own argument, got the collection "
                    f"{branch_id!r}; unpack it: `fork({source_id!r}, *ids)`."
                )
                raise TypeError(msg)
            check_session_id(branch_id)
        share_random = check_bool(share_random, "share_random")
        if not branch_ids:
            msg = f"`fork({source_id!r})` names no branch; pass the new ids: `fork(source, 'b1')`."
            raise ValueError(msg)
        self._await_prefetch(source_id)
        with self._lock:
            state = self._table.get(source_id)
            if state is None:
                msg = _not_held(f"Cannot fork session {source_id!r}")
                raise SessionStateLostError(msg)
            seen: set[Hashable] = set()
            for branch_id in branch_ids:
                if branch_id in self._table or branch_id in seen:
                    held = "the source" if branch_id == source_id else "a held session"
                    if branch_id in seen:
                        held = "named twice"
                    msg = (
                        f"Cannot fork session {source_id!r} into {branch_id!r}: that id is "
                        f"{held}. Name new ids (drop a session to reuse its id)."
                    )
                    raise ValueError(msg)
                seen.add(branch_id)
            self._admit_branches(source_id, len(branch_ids))
            # The source's record with its keys split, then one per branch (the same record
            # n + 1 times when it holds no key, or the key is shared).
            n = len(branch_ids) + 1
            records = (state,) * n if share_random else state.split_random(n)
            self._table.move_to_end(source_id)
            added: list[Hashable] = []
            try:
                for branch_id, record in zip(branch_ids, records[1:], strict=True):
                    self._put_locked(branch_id, record, touch=True, like=source_id)
                    self._parking.forked(source_id, branch_id)
                    added.append(branch_id)
                    self._reporter.emit(
                        SessionEvent("fork", branch_id, 0, reason=f"of {source_id!r}")
                    )
                if records[0] is not state:
                    # The source's record with its own split key: only the key changed, but
                    # its new key is held alone (the old one may be a branch's now), so its
                    # room is made as a put's, never parking a branch; nothing of the source
                    # is parked and a prefetch of it stays reserved.
                    values = self._ledger.values_for(source_id, records[0])
                    grown = self._ledger.growth((values,))
                    previous = self._ledger.set(source_id, values)
                    try:
                        self._make_room(source_id, {}, added)
                    except BaseException:
                        self._ledger.set(source_id, previous)
                        self._ledger.undo_growth(grown)
                        raise
                    self._set_record(source_id, records[0])
                    self._record_versions(source_id, records[0])
            except BaseException:
                for branch_id in added:
                    self._forget(branch_id)
                raise
            self._forks += len(added)
            self._families = True

    def _admit_branches(self, source_id: Hashable, n: int) -> None:
        # A fork's room in the cap, checked before anything changes.
        free = self._max_sessions - len(self._table)
        if n <= self._max_sessions - 1 and (self._on_full != "refuse" or n <= free):
            return
        if n > self._max_sessions - 1:
            why = f"the cap (max_sessions={self._max_sessions}) leaves {self._max_sessions - 1}"
        else:
            why = f"`on_full='refuse'` and the cap leaves {free} free"
        msg = (
            f"Cannot fork session {source_id!r} into {n} branches: {why} beside the source. "
            "Fork into fewer branches, drop finished sessions, or raise `max_sessions`."
        )
        self._refuse(source_id, SessionAdmissionError(msg))

    def drop(self, session_id: Hashable, /) -> bool:
        """End ``session_id``: forget its record. Returns whether it was held.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState())
        >>> m.drop("a"), m.drop("a")
        (True, False)
        """
        check_session_id(session_id)
        with self._lock:
            return self._forget(session_id)

    def clear(self) -> None:
        """Drop every session (statistics are kept).

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.clear(); len(m)
        0
        """
        with self._lock:
            for session_id in list(self._table):
                self._forget(session_id)

    def stats(self) -> dict[str, int]:
        """Counters and bytes held, per device, deduplicated across all sessions.

        Keys: ``sessions``, ``max_sessions``, ``hits``, ``misses``, ``evictions``,
        ``total_nbytes``, and ``nbytes:<device>`` for each device holding bytes
        (``nbytes:cpu``, ``nbytes:cuda:0``). Device memory is the contended resource and host
        memory usually is not, so the per-device keys are the ones to watch. The byte keys count
        resident bytes only (a parked object's bytes are held by its tier).

        With a byte budget (``max_bytes``), also: ``max_bytes:<device>`` per budgeted device;
        and with a budget or once `park_until` parked anything: ``parked_sessions`` (sessions
        with a parked object), ``parks`` and ``unparks`` (times a session's objects were
        parked, and brought back), ``kv_parks`` and ``kv_unparks`` (those of them that moved
        a `KVHandle`'s blocks too), ``nbytes_parked:host`` and ``nbytes_parked:disk``
        (bytes the tiers hold), ``scheduled_prefetches`` (background restores `expect`
        started), ``reparks`` (parks that took a kept copy back, see
        ``keep_parked_copies``), ``nbytes_reparked`` (the bytes they did not copy), and
        ``nbytes_kept:host`` and ``nbytes_kept:disk`` (kept copies of resident sessions'
        objects). Always: ``forks`` (branches `fork` made) and ``shared_sessions`` (sessions
        holding a resident storage another session holds too: a family's members, forked or
        restored with `restore_many`, until they let its history go; counted once a family
        was made, 0 before, so records shared by hand before any are not counted).
        Engine-owned bytes (blocks of a `KVPool` reached through a `KVHandle`) are part of the
        per-device totals and also reported on their own as ``engine_nbytes:<device>``, each
        block once; parking an object moves its handles' blocks to the tier with it (the pool
        gets them back), and unparking takes fresh blocks from the same pool.

        >>> SessionStateManager(8).stats()  # doctest: +NORMALIZE_WHITESPACE
        {'sessions': 0, 'max_sessions': 8, 'hits': 0, 'misses': 0, 'evictions': 0,
         'total_nbytes': 0, 'forks': 0, 'shared_sessions': 0}
        """
        with self._lock:
            return self._stats_locked()[0]

    def _stats_locked(self) -> tuple[dict[str, int], dict[str, int]]:
        # `stats()`, and the parked sessions by tier from the same walk of the parked ones.
        out = {
            "sessions": len(self._table),
            "max_sessions": self._max_sessions,
            "hits": self._hits,
            "misses": self._misses,
            "evictions": self._evictions,
        }
        totals = self._ledger.totals()
        out["total_nbytes"] = sum(totals.values())
        for device, nbytes in totals.items():
            out[f"nbytes:{device}"] = nbytes
        for device, nbytes in self._ledger.engine_totals().items():
            out[f"engine_nbytes:{device}"] = nbytes
        out["forks"] = self._forks
        # The count walks every session's storages: done once a family was made (a fork,
        # a family restore), 0 before (a worker reads `stats()` at every step).
        out["shared_sessions"] = self._sharing_sessions() if self._families else 0
        if self._policy is not None:
            for device in sorted(self._policy.max_bytes):
                out[f"max_bytes:{device}"] = self._policy.max_bytes[device]
        by_tier: dict[str, int] = {}
        if self._policy is not None or self._parking.used:
            parking, by_tier = self._parking.summary()
            out.update(parking)
            out["scheduled_prefetches"] = self._scheduled_prefetches
        return out, by_tier

    def _sharing_sessions(self) -> int:
        # Sessions reaching a storage that other sessions reach too, from the ledger's
        # references (a storage a session reaches twice on its own is not shared).
        count = 0
        for session_id in self._table:
            own: dict[Hashable, int] = {}
            for entry in entries_of(self._ledger.held(session_id)):
                own[entry[1]] = own.get(entry[1], 0) + 1
            references = self._ledger.references
            count += any(references(identity) > n for identity, n in own.items())
        return count

    def session_stats(self, session_id: Hashable, /) -> dict[str, Any]:
        """One session's footprint, from what the manager keeps (no record is walked).

        Keys: ``resident`` (no object parked), ``parked`` (the parked objects' names),
        ``nbytes_parked`` (bytes its tiers hold, by tier), ``nbytes`` and ``engine_nbytes``
        (resident bytes by device, each storage the session reaches once; engine blocks also
        on their own), ``nbytes_by_kind`` (``nbytes`` split into ``engine`` blocks, state
        ``objects`` and ``attrs``, the attributes and a subclass's fields; a storage both an
        object and an attribute reach counts as the object's), ``nbytes_shared`` (the part of
        ``nbytes`` other sessions reach too: a
        fork's history; what the session holds alone is the difference) and ``shared_with``
        (those sessions, least recently used first), ``blocks`` (blocks held per pool the
        manager was given, by the pool's name), ``prefetching`` and ``lru_rank`` (0: the most
        recently used). It leaves the LRU order and the counters alone, as `peek` does.

        Raises:
            SessionStateLostError: if the manager does not hold ``session_id``.

        >>> import torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.zeros(4)})); m.put("b", SessionState())
        >>> s = m.session_stats("a")
        >>> s["resident"], s["nbytes"], s["lru_rank"]
        (True, {'cpu': 16}, 1)
        """
        check_session_id(session_id)
        with self._lock:
            state = self._table.get(session_id)
            if state is None:
                msg = _not_held(f"No stats for session {session_id!r}")
                raise SessionStateLostError(msg)
            seen = self._storages_of(session_id)
            own: dict[Hashable, int] = {}  # references from this session's own leaves
            kinds: dict[Hashable, str] = {}  # the kind of value that reaches it first
            for key, item in self._ledger.held(session_id).items():
                kind = "objects" if key[0] == "o" else "attrs"
                for entry in item.entries:
                    own[entry[1]] = own.get(entry[1], 0) + 1
                    kinds.setdefault(entry[1], kind)
            nbytes: dict[str, int] = {}
            engine: dict[str, int] = {}
            shared: dict[str, int] = {}
            by_kind: dict[str, dict[str, int]] = {"engine": {}, "objects": {}, "attrs": {}}
            shared_ids: set[Hashable] = set()
            for device, identity, _, size, _ in seen.values():
                nbytes[device] = nbytes.get(device, 0) + size
                kind = kinds[identity]
                if isinstance(identity, EngineBlock):
                    engine[device] = engine.get(device, 0) + size
                    kind = "engine"
                part = by_kind[kind]
                part[device] = part.get(device, 0) + size
                if self._ledger.references(identity) > own[identity]:  # another session's too
                    shared[device] = shared.get(device, 0) + size
                    shared_ids.add(identity)
            sharers = [
                other
                for other in self._table
                if other != session_id
                and shared_ids
                and not shared_ids.isdisjoint(self._storages_of(other))
            ]
            parking = self._parking
            parked_by_tier: dict[str, int] = {}
            if parking.is_parked(session_id):
                parked_by_tier = parking.parked_nbytes(session_id)
            order = list(self._table)
            return {
                "resident": not state.parked,
                "parked": sorted(state.parked),
                "nbytes_parked": parked_by_tier,
                "nbytes": {d: n for d, n in nbytes.items() if n},
                "nbytes_shared": {d: n for d, n in shared.items() if n},
                "shared_with": sharers,
                "engine_nbytes": {d: n for d, n in engine.items() if n},
                "nbytes_by_kind": {
                    kind: {d: n for d, n in part.items() if n} for kind, part in by_kind.items()
                },
                "blocks": {
                    pool.name: sum(map(pool.owns_entry, seen.values())) for pool in self._pools
                },
                "prefetching": parking.is_prefetched(session_id),
                "lru_rank": len(order) - 1 - order.index(session_id),
            }

    def metrics_snapshot(self) -> dict[str, Any]:
        """What a metrics collector reads, under the lock once and walking no record.

        ``stats`` (as `stats`), ``sessions`` by state (``resident``, ``parked:host``,
        ``parked:disk``, ``prefetching``), ``pools`` (per pool given: name, blocks, free
        blocks), ``events`` (counts by `SessionEvent` kind) and ``timings`` (park, unpark and
        migration seconds, as `Timings.snapshot` gives them).

        >>> SessionStateManager().metrics_snapshot()["sessions"]
        {'resident': 0, 'parked:host': 0, 'parked:disk': 0, 'prefetching': 0}
        """
        with self._lock:
            stats, parked = self._stats_locked()
            sessions = {
                "resident": len(self._table) - sum(parked.values()),
                "parked:host": parked.get("host", 0),
                "parked:disk": parked.get("disk", 0),
                "prefetching": self._parking.prefetching_sessions(),
            }
            pools = [(p.name, p.num_blocks, p.free_blocks) for p in self._pools]
            events = dict(self._reporter.counts)
        return {
            "stats": stats,
            "sessions": sessions,
            "pools": pools,
            "events": events,
            "timings": self._reporter.timings.snapshot(),
        }

    def report(self, event: SessionEvent, /) -> None:
        """Count, time, log and pass on ``event``, done to a session outside the manager.

        For what moves sessions beside the manager (a `SessionWorker`'s exports and imports
        are ``"migrate"`` events): the event reaches the log, the ``on_event`` callback and
        `metrics_snapshot` (counts and timings) as the manager's own do.

        >>> from sessionstate import SessionEvent
        >>> m = SessionStateManager()
        >>> m.report(SessionEvent("migrate", "a", 16, 0.002, direction="in"))
        >>> m.metrics_snapshot()["timings"]["migrate:in"][2]
        1
        """
        with self._lock:
            self._reporter.emit(event)

    def nbytes_by_session(self) -> dict[Hashable, dict[str, int]]:
        """Bytes per session and device; each session counted on its own (no cross-dedup).

        >>> import torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.zeros(2)}))
        >>> m.nbytes_by_session()
        {'a': {'cpu': 8}}
        """
        with self._lock:
            items = list(self._table.items())
        return {sid: state.nbytes_by_device() for sid, state in items}

    def prefetch(self, session_id: Hashable, /, *, make_room: bool = False) -> bool:
        """Start unparking ``session_id`` in the background; return whether it started.

        For a scheduler that knows which session steps next: the parked bytes are copied back
        on a worker thread (a side CUDA stream for CUDA storages) while the current step runs,
        and the session's next `get` waits only for what is left. The stored record stays
        parked until that `get`; a prefetch changes no output, only when the copy happens.

        The restored bytes are charged to the budget from now on (a reservation), so resident
        bytes never exceed ``max_bytes``: a prefetch starts only if the session's parked
        bytes fit beside everything charged, without parking anyone; one that does not fit
        is dropped (False, counted in ``prefetches_dropped``). With ``make_room=True`` the
        least recently used other sessions' parkable objects are parked first, as a `get`
        would (never evicting anyone). Under pressure later (a `get` or `put` that needs the
        room, or `park_until`), prefetches are dropped after the other sessions are parked
        and before anyone is evicted or refused. A prefetch whose background restore fails
        (a damaged spool file, a `KVPool` short of blocks) costs nothing but its work: the
        `get` restores in the foreground and raises its own error, if any.

        Returns False, changing nothing, for a session that is not held (an unknown id is
        not an error: the scheduler's guess was wrong) or not parked, and True for one
        already prefetched. ``prefetches`` and ``prefetch_hits`` (gets that took a prefetched
        restore) are in `stats()` with the other parking keys.

        Raises:
            TypeError: for an id that is not a valid session id (None, NaN, unhashable).

        >>> import torch
        >>> from sessionstate import SessionState, TensorCache
        >>> m = SessionStateManager(max_bytes={"cpu": 48})
        >>> def record(): return SessionState(objects={"c": TensorCache().allocate().commit(torch.zeros(8))})
        >>> m.put("a", record()); m.put("b", record())  # "a" is parked to fit "b"
        >>> m.prefetch("a"), m.prefetch("a", make_room=True), m.prefetch("nobody")
        (False, True, False)
        >>> _ = m.get("a"); s = m.stats()
        >>> s["prefetches"], s["prefetch_hits"], s["prefetches_dropped"]
        (1, 1, 1)
        """  # noqa: E501 - a doctest line
        check_session_id(session_id)
        if not isinstance(make_room, bool):
            msg = f"`make_room` must be a bool (True or False), got {make_room!r}."
            raise TypeError(msg)
        with self._lock:
            return self._start_prefetch(session_id, make_room)

    def _start_prefetch(
        self, session_id: Hashable, make_room: bool, sooner: Collection[Hashable] | None = None
    ) -> bool:
        # `prefetch`, under the lock. `sooner`: for `expect`'s plan, the sessions its room must
        # not park (those used no later); a plan's prefetch that does not fit is not a drop.
        parking = self._parking
        state = self._table.get(session_id)
        if state is None or not parking.is_parked(session_id):
            return False
        if parking.is_prefetched(session_id):
            return True
        need = parking.parked_need(session_id)
        if not self._prefetch_blocks(session_id, make_room, sooner or ()):
            if sooner is None:
                parking.count_dropped_prefetch()
            return False
        if self._policy is not None:
            reserved = parking.reserved()
            extra = {d: need.get(d, 0) + reserved.get(d, 0) for d in {*need, *reserved}}
            if make_room:
                self._park_others(session_id, extra, sooner or ())
            if self._policy.over(self._ledger, extra):
                if sooner is None:
                    parking.count_dropped_prefetch()
                return False
        parking.start_prefetch(session_id, need)
        return True

    def expect(self, session_ids: Sequence[Hashable], /, *, prefetch: bool = True) -> None:
        """Declare the order in which sessions will be used next (first = next).

        For a server that schedules its next ticks: it replaces any earlier schedule, and
        ``expect([])`` clears it. While a schedule is set, room-making (the byte budget's
        parking, and the room of ``pools`` made by `step`, `step_many` and `park_until`)
        parks first the sessions not in it, least recently used first, then the scheduled
        ones, furthest next use first (Belady): a session used sooner than another is never
        parked while the later one could go. An id scheduled twice counts at its first
        position. A session's use does not take it off the schedule; call ``expect`` again
        each tick. Eviction (``on_full="evict"``) stays least recently used first.

        With ``prefetch`` (default), the parked sessions of the schedule are prefetched in
        order (see `prefetch`, with ``make_room``), each making its room only by parking
        sessions whose next use is later (or unknown), never evicting; the first that does
        not fit stops the plan (not counted as dropped), and so does the first id not held
        (a new session needs room before the ones after it). ``scheduled_prefetches`` in
        `stats()` (with the other parking keys) counts the background restores it started.

        Unknown ids are not an error (a scheduler's guess, or a session about to start): they
        are kept in the order. Outputs are unchanged by a schedule; it decides only who is
        parked and when bytes move.

        Raises:
            TypeError: for ``session_ids`` that are not a sequence (a str, a set, a
                generator), an invalid id (None, unhashable), or a non-bool ``prefetch``.

        >>> import torch
        >>> from sessionstate import SessionState, TensorCache
        >>> m = SessionStateManager(max_bytes={"cpu": 64})
        >>> def record(): return SessionState(objects={"c": TensorCache().allocate().commit(torch.zeros(8))})
        >>> for sid in "abc": m.put(sid, record())  # "a" is parked to fit "c"
        >>> _ = m.get("b")  # least recently used first: "a", "c", "b"
        >>> m.expect(["a", "c", "b"])  # "a" next: prefetched, parking "b" (used last), not "c"
        >>> [bool(m.peek(sid).parked) for sid in "abc"], m.stats()["scheduled_prefetches"]
        ([True, True, False], 1)
        >>> _ = m.get("a"); m.stats()["prefetch_hits"]
        1
        """  # noqa: E501 - a doctest line
        ids = check_schedule(session_ids)
        check_bool(prefetch, "prefetch")
        with self._lock:
            self._schedule = ids
            if not prefetch:
                return
            parked = {sid for sid in ids if sid in self._table and self._parking.is_parked(sid)}
            for session_id, sooner in prefetch_plan(ids, parked, self._table):
                started = not self._parking.is_prefetched(session_id)
                if not self._start_prefetch(session_id, True, sooner):
                    return
                self._scheduled_prefetches += started

    def step(
        self,
        session_id: Hashable,
        fn: Callable[[SessionT], tuple[SessionT, OutT]],
        /,
        *,
        new: Callable[[], SessionT],
        begin: bool | None = None,
        lost: Callable[[Hashable], str] | None = None,
    ) -> OutT:
        """One step of ``session_id``: make its room, read it, ``fn(state) -> (state, out)``,
        and publish the new record only if the whole step succeeded; return ``out``.

        The room is made before the record is read: in each of the manager's ``pools`` the
        blocks a step of the session can take (`EnginePool.blocks_for_step`, less what it
        holds), parking the least recently used other sessions' objects holding the pool's
        blocks (then their prefetches); the byte budget makes its room as `get` and `put`
        do. ``fn`` runs inside every pool's ``transaction()`` (where a pool has one), so a
        step that fails gives back what it took and leaves the stored record, or its
        absence, exactly as it was, and the LRU order too (the session becomes the most
        recently used when the step publishes).

        Args:
            session_id: The session.
            fn: The pure step.
            new: Makes a new session's record.
            begin: None continues a held session or starts a new one; True starts anew (a
                held session is replaced when the step publishes); False continues only.
            lost: The message of a continuation (``begin=False``) of a session not held.

        Raises:
            SessionStateLostError: if ``begin`` is False and the session is not held.
            KVPoolExhaustedError: if a pool lacks the blocks the step can take with nothing
                left to park, naming the session, the blocks and bytes needed, free and held.

        >>> import torch
        >>> from sessionstate import KVCache, KVPool, SessionState
        >>> pool = KVPool(4, block_tokens=2, token_shape=(), step_tokens=2, window_tokens=2)
        >>> m = SessionStateManager(pools=(pool,))
        >>> def grow(s):
        ...     kv = s.object("kv", KVCache).append(pool, torch.ones(2), window=2)
        ...     return s.with_object("kv", kv), kv.view().tokens
        >>> def fresh(): return SessionState(objects={"kv": KVCache().allocate()})
        >>> [m.step(sid, grow, new=fresh) for sid in "aba"]  # a step can take all 4 blocks
        [2, 2, 2]
        >>> m.peek("b").parked, m.stats()["kv_parks"]  # "a", then "b", parked for the room
        (('kv',), 2)
        """
        check_session_id(session_id)
        try:
            self._make_step_room((session_id,))
            state = None if begin else self._read(session_id, touch=False)
            if state is None:
                if begin is False:
                    raise SessionStateLostError(
                        lost(session_id) if lost is not None else _lost(session_id)
                    )
                state = new()
            read = state
            with self._transactions(), span("sessionstate::step"):
                state, out = fn(state)
                # A step that wrote into the record it read is caught here, before `put`
                # records the versions anew (with `check_immutable`).
                self._verify_read(session_id, read)
                # Published only after the whole step succeeded.
                self.put(session_id, state)
        except KVPoolExhaustedError as exc:
            if not any(exc.pool is pool for pool in self._pools):
                raise
            raise self._step_shortfall((session_id,), exc.pool, exc.needed) from exc
        return out

    def step_many(
        self,
        session_ids: Sequence[Hashable],
        fn: Callable[[list[SessionT]], tuple[Sequence[SessionT], Sequence[OutT]]],
        /,
        *,
        new: Callable[[], SessionT],
        begin: bool | None = None,
        lost: Callable[[Hashable], str] | None = None,
    ) -> list[OutT]:
        """One batched step of ``session_ids``: make the batch's room, read every record,
        ``fn(states) -> (states, outs)`` once, and publish all of them only if it succeeded.

        `step` for a batch: the room for every session's step is made at once (in each pool,
        the blocks all their steps can take, parking least recently used sessions outside
        the batch; the byte budget as `get_many` and `put_many` make it), the records are
        read as `get_many` reads them (a session not held starts from ``new()``, unless
        ``begin`` is False), ``fn`` runs once inside every pool's transaction, and its records
        are stored with `put_many`, which makes them the most recently used. All or nothing: a
        step or a store that fails gives back what the step took and leaves every session of
        the batch as it was, and the LRU order too.

        Args:
            session_ids: The sessions, each once; ``fn`` gets their records in this order.
            fn: The pure batched step: a list of records in, as many records and outputs out.
            new: Makes a new session's record.
            begin: As `step`, for every session of the batch.
            lost: The message of a continuation of a session not held.

        Raises:
            ValueError: if no id is given, or one twice, or ``fn`` returns a different
                number of records or outputs than it was given.
            SessionStateLostError: if ``begin`` is False and a session is not held (nothing
                changes).
            KVPoolExhaustedError: if a pool lacks the blocks the batch's steps can take with
                nothing left to park: step a smaller batch.
            SessionAdmissionError: as `put_many`; nothing of the batch changes.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> def count(states):
        ...     new = [s.with_attrs(n=s.attrs.get("n", 0) + 1) for s in states]
        ...     return new, [s.attrs["n"] for s in new]
        >>> m.step_many(["a", "b"], count, new=SessionState), m.step_many(["b"], count, new=SessionState)
        ([1, 1], [2])
        """  # noqa: E501 - a doctest line
        ids = self._batch_ids(session_ids, "step_many")
        try:
            self._make_step_room(ids)
            with self._lock:
                held = [sid for sid in ids if sid in self._table] if not begin else []
            if begin is False and len(held) < len(ids):
                missing = next(sid for sid in ids if sid not in held)
                raise SessionStateLostError(lost(missing) if lost is not None else _lost(missing))
            read = self._read_many(held, touch=False) if held else []
            records = dict(zip(held, read, strict=True))
            states = [records[sid] if sid in records else new() for sid in ids]
            with self._transactions(), span("sessionstate::step_many"):
                stepped, outs = fn(states)
                stepped, outs = list(stepped), list(outs)
                if len(stepped) != len(ids) or len(outs) != len(ids):
                    msg = (
                        f"The batched step returned {len(stepped)} records and {len(outs)} "
                        f"outputs for {len(ids)} sessions; return one record and one output "
                        "per session, in the order given."
                    )
                    raise ValueError(msg)
                for session_id in records:
                    self._verify_read(session_id, records[session_id])
                # Published only after the whole batch succeeded.
                self.put_many(list(zip(ids, stepped, strict=True)))
        except KVPoolExhaustedError as exc:
            if not any(exc.pool is pool for pool in self._pools):
                raise
            raise self._step_shortfall(ids, exc.pool, exc.needed) from exc
        return outs

    def park_until(
        self,
        done: Callable[[], bool],
        /,
        *,
        frees: Callable[[StorageEntry], bool],
        keep: Collection[Hashable] = (),
    ) -> bool:
        """Park least recently used sessions until ``done()`` holds; return whether it holds.

        For memory outside the byte budget that parking gives back, such as the blocks of a
        `KVPool` the manager was not given (a pool given as ``pools=`` has its room made by
        `step`, `get` and `prefetch`): oldest first (under `expect`'s schedule, the furthest
        next use first) and never the sessions in ``keep``, each
        session's parkable objects holding a storage ``frees`` picks (a `StorageEntry`, as
        the accounting reports it: ``frees=pool.owns_entry``) are parked, and ``done`` asked
        again. A session
        whose objects hold no such storage is left alone; without a byte budget too. Parked
        sessions unpark on their next `get`, as under a budget. If parking is not enough,
        the prefetches of sessions not in ``keep`` are dropped (a running one waited for:
        what its restore took, such as a pool's blocks, is back) and ``done`` asked again.

        ``done`` runs under the manager's lock, before the first park and after each; it must
        not call the manager.

        Raises:
            ParkingError: if the tier cannot take a session's objects (that session stays
                resident and intact; those parked before it stay parked).

        >>> import torch
        >>> from sessionstate import KVPool, SessionState, TensorCache
        >>> pool = KVPool(2, block_tokens=1, token_shape=())
        >>> kv = TensorCache().allocate().commit(pool.append(pool.empty(), torch.ones(2)))
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(objects={"kv": kv})); del kv
        >>> m.park_until(lambda: pool.free_blocks >= 1, frees=pool.owns_entry)
        True
        >>> m.peek("a").parked, pool.free_blocks, m.stats()["kv_parks"]
        (('kv',), 2, 1)
        """
        with self._lock:
            if done():
                return True
            # A bound method (a pool's `owns_entry`) is the same predicate each time it is
            # read, so a session it picks nothing of is passed by until its record changes;
            # any other predicate may be a new closure per call, and is not remembered.
            idle = self._nothing_to_park
            remembered = frees if isinstance(frees, types.MethodType) else None
            for other in self._park_order():
                if other in keep:
                    continue
                if remembered is not None and remembered in idle.get(other, _NO_DEVICES):
                    continue
                names = objects_to_park(self._ledger.held(other), self._table[other].objects, frees)
                if not names:
                    if remembered is not None:
                        idle[other] = idle.get(other, _NO_DEVICES) | {remembered}
                elif self._park(other, names) and done():
                    return True
            # Prefetched restores may hold what `done` waits for (a pool's blocks): they go
            # before the caller has to give up.
            if self._parking.drop_prefetches(keep=keep):
                return done()
            return False

    def snapshot(
        self,
        session_id: Hashable,
        path: str | os.PathLike[str],
        /,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Write the latest record of ``session_id`` to ``path`` (see `save_state`).

        Like `peek`, it leaves the LRU order and the hit/miss counters alone: saving a session
        does not keep it resident. The session id is stored in the file's metadata as
        ``session_id``.

        Raises:
            SessionStateLostError: if the manager does not hold ``session_id``.

        >>> import os, tempfile, torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.ones(2)})); m.put("b", SessionState())
        >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        >>> m.snapshot("a", path)
        >>> m.session_ids(), m.stats()["hits"]
        (['a', 'b'], 0)
        """
        check_session_id(session_id)
        with recorded_devices():
            # A parked session is read into host memory under the lock (a concurrent `get`
            # that unparks it, releasing its parked bytes, cannot come in between), taking no
            # device memory or pool block; the file records the devices the bytes came from.
            # The table keeps the parked record: saving does not make a session resident.
            state = self.peek(session_id, on_host=True)
            if state is None:
                msg = _not_held(f"Cannot snapshot session {session_id!r}")
                raise SessionStateLostError(msg)
            # Metadata values are strings: a non-str id is stored as its repr.
            sid = session_id if isinstance(session_id, str) else repr(session_id)
            save_state(state, path, metadata={**(metadata or {}), "session_id": sid})

    def restore(
        self,
        session_id: Hashable,
        path: str | os.PathLike[str],
        /,
        *,
        device: torch.device | str | None = None,
    ) -> SessionT:
        """Load a snapshot (see `load_state`) and store it as ``session_id``, like `put`.

        The record is admitted like a `put` (a new session may evict the least recently used,
        or be refused with ``on_full="refuse"``); a file that fails to load changes nothing.
        The file's record class is the one saved (any `SessionState`); restore into a
        ``SessionStateManager[MySession]`` only files saved from ``MySession`` records.

        Returns:
            The restored record.

        Raises:
            SnapshotError: if the file cannot be loaded or does not hold a `SessionState`.
            SessionAdmissionError: as `put`.

        >>> import os, tempfile, torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.ones(2)}))
        >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        >>> m.snapshot("a", path)
        >>> other = SessionStateManager()
        >>> other.restore("a", path).attrs["x"]
        tensor([1., 1.])
        """
        check_session_id(session_id)
        # The record type parameter is not known at runtime: the file's class is trusted.
        state = cast(SessionT, load_state(path, device=device, expect=SessionState))
        self.put(session_id, state)
        return state

    def snapshot_many(
        self,
        session_ids: Sequence[Hashable],
        path: str | os.PathLike[str],
        /,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Write the latest records of ``session_ids`` to one file, each storage once.

        For a family of forks: what the sessions share (a history, KV blocks, parked bytes
        they hold together) is written once, and `restore_many` brings it back shared, so the
        file is about one session plus what each branch holds alone. The records are read
        under the lock, parked ones in host memory (as `snapshot` does: no device memory, no
        pool block), and the file lists the ids in the metadata's ``session_ids`` (a JSON
        list; a non-str id as its repr). LRU order and counters are left alone.

        Raises:
            SessionStateLostError: if a session is not held (nothing is written).
            ValueError: if no id is given, or one twice.

        >>> import os, tempfile, torch
        >>> from sessionstate import LatentBuffer, SessionState
        >>> m = SessionStateManager()
        >>> history = LatentBuffer(dim=0).allocate().commit(torch.zeros(1000))
        >>> m.put("a", SessionState(objects={"h": history})); m.fork("a", "b", "c")
        >>> path = os.path.join(tempfile.mkdtemp(), "family.safetensors")
        >>> m.snapshot_many(["a", "b", "c"], path)
        >>> restored = SessionStateManager().restore_many(path)
        >>> sorted(restored), len({id(r.object("h").view()[0]) for r in restored.values()})
        (['a', 'b', 'c'], 1)
        """
        ids = list(session_ids)
        for session_id in ids:
            check_session_id(session_id)
        if not ids or len(set(ids)) != len(ids):
            msg = (
                f"`snapshot_many` needs distinct session ids, got {ids!r}; name each session "
                "to save once."
            )
            raise ValueError(msg)
        names = [sid if isinstance(sid, str) else repr(sid) for sid in ids]
        if len(set(names)) != len(names):
            msg = (
                f"`snapshot_many` stores ids as text, and {ids!r} would store two as one "
                f"({names!r}); snapshot them to separate files, or use distinct str ids."
            )
            raise ValueError(msg)
        with recorded_devices():
            records = self._read_family(ids, "snapshot")
            save_state(
                records,
                path,
                metadata={**(metadata or {}), "session_ids": json.dumps(names)},
            )

    def peek_many(self, session_ids: Sequence[Hashable], /) -> list[SessionT]:
        """The latest records of ``session_ids``, readable, for moving a family elsewhere.

        As `peek` with ``on_host=True`` for each, read under the lock at once, except that
        parked bytes the sessions hold together are read once: the records share them as the
        stored ones do, so encoding the list (`dumps_parts`) holds each shared storage once.
        Read and encode within `recorded_devices` for the parts to record the devices parked
        bytes came from. The LRU order and the counters are left alone.

        Raises:
            SessionStateLostError: if a session is not held (nothing is read).
            ValueError: if no id is given, or one twice.

        >>> import torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.zeros(4)})); m.fork("a", "b")
        >>> a, b = m.peek_many(["a", "b"])
        >>> a is b, m.stats()["hits"]
        (True, 0)
        """
        ids = self._batch_ids(session_ids, "peek_many")
        return self._read_family(ids, "read")

    def _read_family(self, ids: list[Hashable], what: str) -> list[SessionT]:
        # The records of `ids` under the lock, parked ones read into host memory, a handle
        # they share read once (so are its bytes); `what` names the refused verb.
        records = []
        with self._lock:
            trees: dict[int, Any] = {}
            for session_id in ids:
                if session_id not in self._table:
                    done = "written" if what == "snapshot" else "read"
                    msg = _not_held(
                        f"Cannot {what} session {session_id!r}", then=f"Nothing was {done}."
                    )
                    raise SessionStateLostError(msg)
            for session_id in ids:
                state = self._table[session_id]
                self._verify(session_id, state)
                if state.parked:
                    state = self._read_parked(session_id, state, trees)
                records.append(state)
        return records

    def restore_many(
        self,
        path: str | os.PathLike[str],
        /,
        *,
        session_ids: Sequence[Hashable] | None = None,
        device: torch.device | str | None = None,
    ) -> dict[Hashable, SessionT]:
        """Load a `snapshot_many` file and store each record, sharing what they shared.

        The sessions keep the ids the file lists (``session_ids`` to give others, in the
        file's order). All or nothing: none of them may be held already, and a record the
        manager refuses (the cap, the budget) drops the ones stored before it.

        Returns:
            The restored records by session id.

        Raises:
            SnapshotError: if the file cannot be loaded or does not hold a list of records.
            ValueError: if an id is held already, or ``session_ids`` is not one per record.
            SessionAdmissionError: as `put`; nothing stays stored.
        """
        listed = inspect_snapshot(path)["metadata"].get("session_ids")
        records = load_state(path, device=device)
        if not isinstance(records, list) or not all(isinstance(r, SessionState) for r in records):
            msg = (
                f"{os.fspath(path)!r} does not hold a family of session records (a list, as "
                "`snapshot_many` writes); load a one-session file with `restore`."
            )
            raise SnapshotError(msg)
        ids: list[Hashable]
        if session_ids is not None:
            ids = list(session_ids)
        else:
            try:
                parsed = json.loads(listed or "[]")
            except ValueError:
                parsed = None
            if not isinstance(parsed, list) or not all(isinstance(i, str) for i in parsed):
                msg = (
                    f"{os.fspath(path)!r} lists its session ids as {listed!r}, not a JSON "
                    "list of strings as `snapshot_many` writes; pass `session_ids=`."
                )
                raise SnapshotError(msg)
            ids = list(parsed)
        if len(ids) != len(records):
            msg = (
                f"{os.fspath(path)!r} holds {len(records)} records but {len(ids)} session ids "
                "were given; pass one id per record, in the file's order."
            )
            raise ValueError(msg)
        for session_id in ids:
            check_session_id(session_id)
        with self._lock:
            held = [sid for sid in ids if sid in self._table]
            if held or len(set(ids)) != len(ids):
                msg = (
                    f"Cannot restore the family {ids!r}: {held or 'an id named twice'} "
                    "already held. Drop them first, or pass other `session_ids`."
                )
                raise ValueError(msg)
            if not self._batch_fits(ids):
                msg = (
                    f"Cannot restore the family {ids!r}: the cap (max_sessions="
                    f"{self._max_sessions}, `on_full={self._on_full!r}`, {len(self._table)} "
                    "held) cannot hold it. Drop finished sessions, or raise `max_sessions`."
                )
                self._refuse(ids[0], SessionAdmissionError(msg))
            pairs = [(sid, cast(SessionT, state)) for sid, state in zip(ids, records, strict=True)]
            self._store_batch(pairs, ids)
            self._families = True
        return {sid: cast(SessionT, state) for sid, state in zip(ids, records, strict=True)}

    # -- under the lock -------------------------------------------------------------------------

    def _put_locked(
        self,
        session_id: Hashable,
        state: SessionT,
        *,
        touch: bool,
        like: Hashable | None = None,
        keep: Collection[Hashable] = (),
        values: Values | None = None,
    ) -> None:
        # Nothing changes unless the whole put succeeds, except that other sessions may have
        # been parked (losslessly) or evicted to make room. `like`: a session whose stored
        # record `state` shares its values with (a fork's source, all but a split random key),
        # whose walked values are reused, not walked. `values`: the ledger's values for
        # `state`, walked already (a batch's budget check walked them).
        if values is None:
            values = self._ledger.values_for(session_id if like is None else like, state)
        grown = self._ledger.growth((values,))
        # Stored in the ledger first, so the budget reads what the record holds alone from the
        # per-session totals this put just moved (the cost of what changed, not a walk of the
        # record); a refusal moves the ledger back.
        previous = self._ledger.set(session_id, values)
        # Parked bytes this record holds are held from now on: a session evicted to admit it
        # (a caller's fork by hand: `put("b", m.peek("a"))`) does not release them.
        parked = parked_objects(state)
        storing = tuple(parked.values())
        self._parking.storing = storing
        try:
            if self._policy is not None:
                self._refuse(session_id, self._policy.refusal(session_id, self._ledger))
            if session_id in self._table:
                if touch:
                    self._table.move_to_end(session_id)
            else:
                self._admit(session_id, keep)
            self._make_room(session_id, {}, keep)
        except BaseException:
            self._ledger.set(session_id, previous)
            self._ledger.undo_growth(grown)
            self._parking.storing = ()
            self._parking.abandon(storing)
            raise
        self._parking.storing = ()
        self._set_record(session_id, state)
        self._parking.track(session_id, state, parked)
        self._record_versions(session_id, state)

    def _admit(self, session_id: Hashable, keep: Collection[Hashable] = ()) -> None:
        # `session_id` is new: at the cap, evict the least recently used (not in `keep`, a
        # batch being stored) or refuse.
        if len(self._table) < self._max_sessions:
            return
        if self._on_full == "refuse":
            msg = (
                f"Cannot admit session {session_id!r}: the manager holds "
                f"{self._max_sessions} sessions (its cap) and `on_full='refuse'`. Drop a "
                "finished session first, or raise `max_sessions`."
            )
            self._refuse(session_id, SessionAdmissionError(msg))
        # A batch no larger than the cap (`put_many` checks) leaves one outside it.
        evicted = next(sid for sid in self._table if sid not in keep)
        self._evict(evicted, f"the session cap (max_sessions={self._max_sessions})")

    def _evict(self, session_id: Hashable, by: str) -> None:
        nbytes = sum(entry[3] for entry in self._storages_of(session_id).values())
        if self._parking.is_parked(session_id):  # and what its tier held
            nbytes += sum(self._parking.parked_need(session_id).values())
        self._forget(session_id)
        self._evictions += 1
        first = not self._warned_eviction  # its warning is this eviction's WARNING line
        self._warn_evicted(session_id, by)
        event = SessionEvent("evict", session_id, nbytes, reason=f"evicted by {by}")
        self._reporter.emit(event, warned=first)

    def _refuse(self, session_id: Hashable, error: Exception | None) -> None:
        # Report and raise `error` (nothing when None). Callers pass it inline and it is not
        # kept in this frame: the traceback holds the frames it passes through, and a frame
        # holding the error would be a cycle keeping the caller's records (their KV blocks)
        # alive until the cyclic collector runs.
        if error is None:
            return
        self._reporter.emit(SessionEvent("refuse", session_id, reason=str(error)))
        try:
            raise error
        finally:
            del error

    def _warn_evicted(self, evicted: Hashable, by: str) -> None:
        # One warning per manager; `stats()` counts every eviction.
        if self._warned_eviction:
            return
        self._warned_eviction = True
        logger.warning(
            "Session %r was evicted by %s although nobody ended it; its state is lost. End "
            "finished sessions explicitly with `drop(session_id)` (`drop_session(session_id)` "
            "on a model pipeline), or raise the cap. Warned once per manager; "
            "`stats()['evictions']` counts every eviction.",
            evicted,
            by,
        )

    def _make_room(
        self, session_id: Hashable, extra: Mapping[str, int], keep: Collection[Hashable] = ()
    ) -> None:
        # Bring the ledger plus `extra` plus the other sessions' prefetches within the budget:
        # park the least recently used sessions' parkable objects, oldest first and never
        # `session_id`'s; then drop the prefetches; then apply `on_full`. The policy decides
        # each step; the loop acts.
        policy = self._policy
        if policy is None:
            return
        parking = self._parking

        def charged() -> dict[str, int]:
            reserved = parking.reserved(besides=session_id)
            return {d: extra.get(d, 0) + reserved.get(d, 0) for d in {*extra, *reserved}}

        kept = {session_id, *keep}  # a batch's other sessions are not parked for it
        over = self._park_others(session_id, charged(), kept)
        if not over:
            return
        if parking.drop_prefetches(keep=kept):
            over = policy.over(self._ledger, extra)
            if not over:
                return
        if self._on_full == "evict":
            for other in list(self._table):
                if other in kept or not policy.holds_on(self._ledger.held(other), over):
                    continue
                self._evict(other, "the byte budget (`max_bytes`)")
                over = policy.over(self._ledger, extra)
                if not over:
                    return
        self._refuse(
            session_id, policy.shortfall(session_id, self._ledger, extra, over, self._on_full)
        )

    def _park_others(
        self,
        session_id: Hashable,
        extra: Mapping[str, int],
        kept: Collection[Hashable] = (),
    ) -> list[str]:
        # Park the least recently used other sessions' parkable objects until the ledger plus
        # `extra` fits; return the devices still over (none: it fits).
        policy = self._policy
        assert policy is not None
        over = policy.over(self._ledger, extra)
        if not over:
            return over
        idle = self._nothing_to_park
        devices = frozenset(over)
        for other in self._park_order():
            if idle.get(other, _NO_DEVICES) >= devices:
                continue  # nothing of its record to park there
            if other == session_id or other in kept:
                continue
            names = policy.parkable(self._ledger.held(other), self._table[other].objects, over)
            if not names:
                idle[other] = idle.get(other, _NO_DEVICES) | devices
            elif self._park(other, names):
                over = policy.over(self._ledger, extra)
                if not over:
                    return over
                devices = frozenset(over)
        return over

    def _park_order(self) -> list[Hashable]:
        # The order room-making tries the sessions in: least recently used first, or under
        # `expect`'s schedule, Belady's (`park_order`).
        return park_order(list(self._table), self._schedule)

    def _park(self, session_id: Hashable, names: list[str]) -> bool:
        # Whether the objects were parked: a host pool that refuses them (with
        # `host_pool_full="refuse"`) leaves the session resident, as one with nothing
        # parkable; any other failure raises.
        try:
            new = self._parking.park(
                session_id, self._table[session_id], names, self._ledger.held(session_id)
            )
        except ParkingError as exc:
            if isinstance(exc.__cause__, HostPoolFullError):
                return False
            raise
        self._set_record(session_id, new)  # (it may hold some to park on other devices)
        self._ledger.set(session_id, self._ledger.values_for(session_id, new))
        self._record_versions(session_id, new)
        return True

    def _await_prefetch(self, *session_ids: Hashable) -> None:
        # Wait, outside the lock, for the sessions' background restores: other sessions'
        # calls go on meanwhile. Costs one lookup per session when nothing is prefetched.
        parking = self._parking
        with self._lock:
            pending = [handle for sid in session_ids for handle in parking.pending(sid)]
        for handle in pending:
            handle.wait_prefetch()

    def _resident(self, session_id: Hashable, state: SessionT) -> SessionT:
        # Check the parked bytes (host memory only), then make room for them, then unpark: a
        # device never holds more than its budget, and bytes that cannot come back (a damaged
        # spool file) cost no other session anything. Either failure leaves the session
        # parked (and a retry can succeed).
        parking = self._parking
        if not parking.is_parked(session_id):
            return state
        holders = self._holders(session_id)
        try:
            need = parking.check(session_id)
        except BaseException:
            parking.discard(session_id)  # a failed prefetch's charge goes too
            raise
        parking.unreserve(session_id)  # a prefetch's bytes: charged as the session's now
        try:
            self._make_room(session_id, need, holders)
            new = self._unpark(session_id, state)
        except BaseException:
            parking.discard(session_id)
            raise
        self._store_unparked(session_id, new)
        return new

    def _holders(self, session_id: Hashable) -> list[Hashable]:
        # The sessions holding the objects `session_id`'s unpark hands back (charged nothing
        # for them): kept resident while room is made for it, so the objects stay alive.
        back = {id(obj) for obj in self._parking.handed_back(session_id).values()}
        if not back:
            return []
        return [
            sid
            for sid, record in self._table.items()
            if sid != session_id and not back.isdisjoint(map(id, record.objects.values()))
        ]

    def _store_unparked(self, session_id: Hashable, state: SessionT) -> None:
        # ``state``, just unparked, stored for ``session_id``: the table, the ledger (its
        # walk of the restored objects is what parking reads their version counters from).
        self._set_record(session_id, state)
        self._ledger.set(session_id, self._ledger.values_for(session_id, state))
        self._parking.restored(session_id, self._ledger.held(session_id))
        self._record_versions(session_id, state)

    def _prefetch_blocks(
        self, session_id: Hashable, make_room: bool, sooner: Collection[Hashable] = ()
    ) -> bool:
        # Whether every pool has room for the restored session beside a step's (a background
        # restore takes its blocks while another session steps); with `make_room`, the least
        # recently used other resident sessions' blocks are parked until it has.
        for pool in self._pools:
            most = pool.session_blocks
            if most is None:
                continue
            need = most + pool.blocks_for_step(0)
            if pool.free_blocks >= need:
                continue
            if make_room:
                # Parked sessions have nothing to park; kept, their own prefetches stay.
                parked = (sid for sid in self._table if self._parking.is_parked(sid))
                keep = {session_id, *parked, *sooner}
                done = functools.partial(_has_free_blocks, pool, need)
                self.park_until(done, frees=pool.owns_entry, keep=keep)
            if pool.free_blocks < need:
                return False
        return True

    def _transactions(self) -> contextlib.AbstractContextManager[Any]:
        # Every pool's `transaction()`, where it has one (one pool: its own, the usual case).
        opened = [t for t in map(_transaction_of, self._pools) if t is not None]
        if not opened:
            return contextlib.nullcontext()
        if len(opened) == 1:
            only: contextlib.AbstractContextManager[Any] = opened[0]()
            return only
        return _entered(opened)

    def _storages_of(self, session_id: Hashable) -> dict[Hashable, StorageEntry]:
        # The storages the session's stored record holds resident, each once, by identity
        # (from the ledger: no record is walked).
        return {entry[1]: entry for entry in entries_of(self._ledger.held(session_id))}

    def _held_blocks(self, session_id: Hashable, pool: EnginePool) -> int:
        # The pool's blocks the session's stored record holds resident.
        return sum(map(pool.owns_entry, self._storages_of(session_id).values()))

    def _make_step_room(self, session_ids: Sequence[Hashable]) -> None:
        # Before a step (outside its transaction): while a pool lacks the blocks the steps
        # can take, park the least recently used sessions' objects holding its blocks (never
        # the stepping ones'). A pool with the room to spare costs two calls; only one under
        # pressure reads the sessions' entries.
        for pool in self._pools:
            most = pool.blocks_for_step(0)
            if most == 0:
                continue
            # Another session's prefetch takes its blocks when its background restore gets to
            # them, maybe while these steps run: count a whole handle for each, and under
            # pressure wait for them, so the free blocks counted are the ones the steps find.
            with self._lock:
                running = self._parking.pending_all(besides=session_ids)
            later = len({id(h) for h in running}) * (pool.session_blocks or 0)
            if pool.free_blocks >= most * len(session_ids) + later:
                continue
            for handle in running:
                handle.wait_prefetch()
            with self._lock:
                need = self._step_blocks(session_ids, pool)
                done = functools.partial(_has_free_blocks, pool, need)
                self.park_until(done, frees=pool.owns_entry, keep=session_ids)

    def _step_blocks(self, session_ids: Sequence[Hashable], pool: EnginePool) -> int:
        # The pool's blocks the sessions' steps can take, less what they hold.
        return sum(pool.blocks_for_step(self._held_blocks(sid, pool)) for sid in session_ids)

    def _step_shortfall(
        self, session_ids: Sequence[Hashable], pool: EnginePool, needed: int
    ) -> KVPoolExhaustedError:
        # `needed`: the blocks the append that failed asked for.
        with self._lock:
            need = self._step_blocks(session_ids, pool)
        named: object = session_ids[0]
        label, fix = "Session", ""
        if len(session_ids) > 1:
            named, label, fix = list(session_ids), "Batch", "step a smaller batch, or "
        if pool.blocks_for_step(0) == 0:  # the pool says nothing of a step: no room was made
            # The free blocks are counted after the step gave its own back: more than the
            # failing append found, so the message says when each was counted.
            blocks = "block" if needed == 1 else "blocks"
            build = "Step a smaller batch, or build" if len(session_ids) > 1 else "Build"
            msg = (
                f"{label} {named!r}: KV pool {pool.name!r} ran out of blocks during the step "
                f"(an append needed {needed} free {blocks} and found fewer; "
                f"{pool.free_blocks} free now that the step gave its blocks back). The pool "
                "declares no `step_tokens`, so the manager made no room before the step: it "
                "parks other sessions' KV only for a pool that says what a step takes. "
                f"{build} the pool with `step_tokens` (and `window_tokens` for a windowed "
                "cache), or with more blocks."
            )
            return KVPoolExhaustedError(msg, pool=pool, needed=needed)
        return kv_shortfall(
            pool,
            max(need, 1),
            named,
            label=label,
            fix=fix + "build the pool with at least {nbytes} bytes",
        )

    def _read_parked(
        self, session_id: Hashable, state: SessionT, trees: dict[int, Any] | None = None
    ) -> SessionT:
        # `trees`: what handles read already (by id), shared by the records read with it.
        try:
            if trees is None:
                return state.unpark_on_host()

            def read(handle: ParkedBytes) -> Any:
                tree = trees.get(id(handle))
                if tree is None:
                    tree = trees[id(handle)] = handle.read()
                return tree

            return state._rebuilt(read)
        except Exception as exc:
            held = [o for o in state.objects.values() if isinstance(o, ParkedObject)]
            tiers = " and ".join(sorted({o.handle.tier for o in held}))
            msg = (
                f"Cannot read parked session {session_id!r} (objects {list(state.parked)}) "
                f"from the {tiers} tier: {reason(exc)}. The session stays parked and intact; "
                "retry once the cause is fixed, or `drop` it."
            )
            raise ParkingError(msg) from exc

    def _unpark(
        self, session_id: Hashable, state: SessionT, keep: Collection[Hashable] = ()
    ) -> SessionT:
        # Unpark; a `KVPool` short of the blocks to take the session's KV back gets them from
        # the least recently used other sessions' parkable KV (then from their prefetches),
        # pool by pool, before the shortage is the caller's.
        tried: set[int] = set()
        while True:
            try:
                return self._parking.unpark(session_id, state)
            except KVPoolExhaustedError as exc:
                pool, needed = exc.pool, exc.needed
                if pool is None or id(pool) in tried:
                    raise
                tried.add(id(pool))
                done = functools.partial(_has_free_blocks, pool, needed)
                try:
                    made = self.park_until(done, frees=pool.owns_entry, keep=(session_id, *keep))
                except ParkingError as failed:
                    # Another session could not be parked for the room: the shortage is
                    # still this session's, and the failed park its cause.
                    raise exc from failed
                if not made:
                    raise

    def _set_record(self, session_id: Hashable, state: SessionT) -> None:
        # Every write of a held session's record goes through here: what a scan for room
        # noted of the record it replaces goes with it.
        self._table[session_id] = state
        self._nothing_to_park.pop(session_id, None)

    def _forget(self, session_id: Hashable) -> bool:
        state = self._table.pop(session_id, None)
        self._nothing_to_park.pop(session_id, None)
        if self._guard is not None:
            self._guard.forget(session_id)
        self._ledger.set(session_id, {})
        self._parking.untrack(session_id)
        return state is not None

    def _record_versions(self, session_id: Hashable, state: SessionState) -> None:
        if self._guard is not None:
            self._guard.record(session_id, state)

    def _verify(self, session_id: Hashable, state: SessionState) -> None:
        if self._guard is not None:
            self._guard.verify(session_id, state)

    def _verify_read(self, session_id: Hashable, state: SessionState) -> None:
        # A record a step read, checked before its successor is stored, if it is still the
        # stored one (a record replaced meanwhile had its versions recorded anew).
        if self._guard is not None:
            with self._lock:
                if self._table.get(session_id) is state:
                    self._guard.verify(session_id, state)


_NO_DEVICES: frozenset[Hashable] = frozenset()


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


def _not_held(subject: str, missing: object = None, *, then: str = "") -> str:
    """The one wording of "this manager does not hold it": ``subject``, why, ``then``, the fix.

    >>> _not_held("Cannot fork session 'x'")
    "Cannot fork session 'x': this manager does not hold it (never created, dropped, or evicted). `session_ids()` lists the held ones."
    """  # noqa: E501 - a doctest's expected output is one line
    what = "it" if missing is None else repr(missing)
    return (
        f"{subject}: this manager does not hold {what} (never created, dropped, or evicted). "
        + (f"{then} " if then else "")
        + "`session_ids()` lists the held ones."
    )


def _stores_parked(values: Values, state: SessionState) -> bool:
    # Whether `state`, whose session is resident (its stored record holds no parked object),
    # holds a parked object: of the values its walk found changed, when it knows them.
    parent = getattr(values, "parent", None)
    if parent is None:
        return bool(parked_objects(state))
    changed = values.changed  # type: ignore[attr-defined]
    return any(key[0] == "o" and isinstance(values[key].value, ParkedObject) for key in changed)


def _lost(session_id: Hashable) -> str:
    return (
        f"Cannot continue session {session_id!r}: the manager does not hold it (never "
        "started, dropped or evicted), so its state is lost. Start it again with "
        "`begin=True`, or raise the session cap."
    )


def _transaction_of(pool: EnginePool) -> Callable[[], Any] | None:
    transaction: Callable[[], Any] | None = getattr(pool, "transaction", None)
    return transaction


@contextlib.contextmanager
def _entered(opened: list[Callable[[], Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for transaction in opened:
            stack.enter_context(transaction())
        yield


def _has_free_blocks(pool: Any, needed: int) -> bool:
    return bool(pool.free_blocks >= needed)


def _check_pools(pools: object) -> tuple[EnginePool, ...]:
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


def _check_state(state: object, session_id: Hashable) -> None:
    if not isinstance(state, SessionState):
        msg = (
            f"Session {session_id!r}: the manager stores SessionState records, got "
            f"{type(state).__name__}; build one with `SessionState(objects=..., attrs=...)`."
        )
        raise TypeError(msg)


def _host_pool(
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


def _on_cpu(device: str) -> bool:
    return torch.device(device).type == "cpu"


def _budget_text(budget: Mapping[str, int]) -> str:
    """A budget as the text form ``max_bytes`` takes: ``"cpu=1048576"``."""
    return ",".join(f"{device}={nbytes}" for device, nbytes in budget.items())
