"""The public face of the manager: `SessionStateManager`; every method delegates.

The class keeps the manager's whole public API and its docstrings; each method is a short
delegation to the room that does the job, over the one `Table` it holds: `_table` (records,
LRU order, the cap, the lock, the parts), `_room` (making room), `_access` (get and put,
single and batched), `_family` (forks, family snapshots), `_stepping` (steps), `_observe`
(stats, metrics, events) and `_prefetch`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any, Generic

import torch
from typing_extensions import TypeVar

import sessionstate._manager._access as _access
import sessionstate._manager._family as _family
import sessionstate._manager._observe as _observe
import sessionstate._manager._prefetch as _prefetch
import sessionstate._manager._room as _room
import sessionstate._manager._stepping as _stepping
from sessionstate._manager._events import EventHook, SessionEvent
from sessionstate._manager._parking import HostPoolFull
from sessionstate._manager._policy import OnFull
from sessionstate._manager._table import DEFAULT_MAX_SESSIONS, SessionT, Table
from sessionstate._protocols import EnginePool, StorageEntry
from sessionstate._storage import HostBufferPool, Tier

__all__ = ["SessionStateManager"]

OutT = TypeVar("OutT")


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
        self._table: Table[SessionT] = Table(
            max_sessions,
            on_full=on_full,
            check_immutable=check_immutable,
            max_bytes=max_bytes,
            park_tier=park_tier,
            spool_dir=spool_dir,
            host_pool_bytes=host_pool_bytes,
            host_pool_full=host_pool_full,
            keep_parked_copies=keep_parked_copies,
            pools=pools,
            on_event=on_event,
        )

    @property
    def max_sessions(self) -> int:
        """The cap on retained sessions.

        >>> SessionStateManager(3).max_sessions
        3
        """
        return self._table.max_sessions

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
        return self._table.raise_max_sessions(n)

    @property
    def check_immutable(self) -> bool:
        """Whether stored tensors are checked for in-place writes on each access.

        >>> SessionStateManager(check_immutable=True).check_immutable
        True
        """
        return self._table.check_immutable

    @property
    def max_bytes(self) -> dict[str, int] | None:
        """The byte budget per device, or None when only the session cap applies.

        >>> SessionStateManager(max_bytes={"cpu": "1KiB"}).max_bytes
        {'cpu': 1024}
        """
        policy = self._table.policy
        return None if policy is None else dict(policy.max_bytes)

    @property
    def host_pool(self) -> HostBufferPool | None:
        """The host tier's buffer pool (``host_pool_bytes``), or None.

        >>> SessionStateManager(host_pool_bytes="4KiB").host_pool.total
        4096
        """
        return self._table.parking.host_pool

    @property
    def keep_parked_copies(self) -> bool:
        """Whether an unpark keeps the tier's copy of what it restored (see the argument).

        >>> SessionStateManager(keep_parked_copies=False).keep_parked_copies
        False
        """
        return self._table.parking.keep_copies

    @property
    def park_tier(self) -> Tier:
        """Where the budget parks objects: ``"host"`` or ``"disk"``.

        >>> SessionStateManager().park_tier
        'host'
        """
        return self._table.parking.tier

    @property
    def on_full(self) -> OnFull:
        """What a new session does at the cap: ``"evict"`` or ``"refuse"``.

        >>> SessionStateManager().on_full
        'evict'
        """
        return self._table.on_full

    def __contains__(self, session_id: object) -> bool:
        with self._table.lock:
            return session_id in self._table.records

    def __len__(self) -> int:
        with self._table.lock:
            return len(self._table.records)

    def __repr__(self) -> str:
        return (
            f"SessionStateManager(sessions={len(self)}, max_sessions={self._table.max_sessions}, "
            f"on_full={self._table.on_full!r})"
        )

    def session_ids(self) -> list[Hashable]:
        """Ids of the retained sessions, least recently used first.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.put("b", SessionState()); _ = m.get("a")
        >>> m.session_ids()
        ['b', 'a']
        """
        with self._table.lock:
            return list(self._table.records)

    def get(self, session_id: Hashable, /) -> SessionT | None:
        """The latest record of ``session_id``, or None (counted as a miss).

        >>> SessionStateManager().get("nobody") is None
        True
        """
        return _access.get(self._table, session_id)

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
        return _access.get_many(self._table, session_ids)

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
        _access.put_many(self._table, items)

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
        return _access.peek(self._table, session_id, on_host=on_host)

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
        return _access.require(self._table, session_id)

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
        return _access.get_or_create(self._table, session_id, factory)

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
        _access.put(self._table, session_id, state)

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
        _family.fork(self._table, source_id, *branch_ids, share_random=share_random)

    def drop(self, session_id: Hashable, /) -> bool:
        """End ``session_id``: forget its record. Returns whether it was held.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState())
        >>> m.drop("a"), m.drop("a")
        (True, False)
        """
        return self._table.drop(session_id)

    def clear(self) -> None:
        """Drop every session (statistics are kept).

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.clear(); len(m)
        0
        """
        self._table.clear()

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
        return _observe.stats(self._table)

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
        return _observe.session_stats(self._table, session_id)

    def metrics_snapshot(self) -> dict[str, Any]:
        """What a metrics collector reads, under the lock once and walking no record.

        ``stats`` (as `stats`), ``sessions`` by state (``resident``, ``parked:host``,
        ``parked:disk``, ``prefetching``), ``pools`` (per pool given: name, blocks, free
        blocks), ``events`` (counts by `SessionEvent` kind) and ``timings`` (park, unpark and
        migration seconds, as `Timings.snapshot` gives them).

        >>> SessionStateManager().metrics_snapshot()["sessions"]
        {'resident': 0, 'parked:host': 0, 'parked:disk': 0, 'prefetching': 0}
        """
        return _observe.metrics_snapshot(self._table)

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
        _observe.report(self._table, event)

    def nbytes_by_session(self) -> dict[Hashable, dict[str, int]]:
        """Bytes per session and device; each session counted on its own (no cross-dedup).

        >>> import torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.zeros(2)}))
        >>> m.nbytes_by_session()
        {'a': {'cpu': 8}}
        """
        return _observe.nbytes_by_session(self._table)

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
        return _prefetch.prefetch(self._table, session_id, make_room=make_room)

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
        _prefetch.expect(self._table, session_ids, prefetch=prefetch)

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
        return _stepping.step(self._table, session_id, fn, new=new, begin=begin, lost=lost)

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
        return _stepping.step_many(self._table, session_ids, fn, new=new, begin=begin, lost=lost)

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
        return _room.park_until(self._table, done, frees=frees, keep=keep)

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
        _family.snapshot(self._table, session_id, path, metadata=metadata)

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
        return _family.restore(self._table, session_id, path, device=device)

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
        _family.snapshot_many(self._table, session_ids, path, metadata=metadata)

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
        return _family.peek_many(self._table, session_ids)

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
        return _family.restore_many(self._table, path, session_ids=session_ids, device=device)
