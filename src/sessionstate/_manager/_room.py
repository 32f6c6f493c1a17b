"""Making room: the byte budget's and the engine pools' one loop, and unparking into it.

Over a budget, the least recently used other sessions' parkable objects are parked (oldest
first, never the session the room is for, nor a batch's others), then prefetches are dropped,
then ``on_full`` evicts or refuses (`make_room`). A pool short of the blocks a step can take
parks the objects holding its blocks the same way (`park_until`, `make_step_room`), as does an
unpark whose K/V needs blocks (`unpark`). The policy decides what each session can give; these
functions act, under the table's lock.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

from sessionstate._checks import check_session_id as check_session_id
from sessionstate._errors import (
    KVPoolExhaustedError,
    ParkingError,
)
from sessionstate._manager import _decide as decide
from sessionstate._manager._policy import objects_to_park
from sessionstate._manager._schedule import park_order
from sessionstate._manager._table import NO_DEVICES, SessionT, Table
from sessionstate._protocols import EnginePool, StorageEntry
from sessionstate._storage import HostPoolFullError

__all__ = [
    "has_free_blocks",
    "holders_of",
    "make_room",
    "make_step_room",
    "park",
    "park_others",
    "park_until",
    "resident",
    "room_order",
    "step_blocks",
    "store_unparked",
    "unpark",
]


def make_room(
    t: Table[SessionT],
    session_id: Hashable,
    extra: Mapping[str, int],
    keep: Collection[Hashable] = (),
) -> None:
    # Bring the ledger plus `extra` plus the other sessions' prefetches within the budget:
    # park the least recently used sessions' parkable objects, oldest first and never
    # `session_id`'s; then drop the prefetches; then apply `on_full`. The policy decides
    # each step; the loop acts.
    policy = t.policy
    if policy is None:
        return
    parking = t.parking

    def charged() -> dict[str, int]:
        reserved = parking.reserved(besides=session_id)
        return {d: extra.get(d, 0) + reserved.get(d, 0) for d in {*extra, *reserved}}

    kept = {session_id, *keep}  # a batch's other sessions are not parked for it
    over = park_others(t, session_id, charged(), kept)
    if not over:
        return
    if parking.drop_prefetches(keep=kept):
        over = policy.over(t.ledger, extra)
        if not over:
            return
    if t.on_full == "evict":
        for other in list(t.records):
            if other in kept or not policy.holds_on(t.ledger.held(other), over):
                continue
            t.evict(other, "the byte budget (`max_bytes`)")
            over = policy.over(t.ledger, extra)
            if not over:
                return
    t.refuse(session_id, policy.shortfall(session_id, t.ledger, extra, over, t.on_full))


def park_others(
    t: Table[SessionT],
    session_id: Hashable,
    extra: Mapping[str, int],
    kept: Collection[Hashable] = (),
) -> list[str]:
    # Park the least recently used other sessions' parkable objects until the ledger plus
    # `extra` fits; return the devices still over (none: it fits).
    policy = t.policy
    assert policy is not None
    over = policy.over(t.ledger, extra)
    if not over:
        return over
    idle = t.nothing_to_park
    devices = frozenset(over)
    for other in room_order(t):
        if idle.get(other, NO_DEVICES) >= devices:
            continue  # nothing of its record to park there
        if other == session_id or other in kept:
            continue
        names = policy.parkable(t.ledger.held(other), t.records[other].objects, over)
        if not names:
            idle[other] = idle.get(other, NO_DEVICES) | devices
        elif park(t, other, names):
            over = policy.over(t.ledger, extra)
            if not over:
                return over
            devices = frozenset(over)
    return over


def room_order(t: Table[SessionT]) -> list[Hashable]:
    # The order room-making tries the sessions in: least recently used first, or under
    # `expect`'s schedule, Belady's (`park_order`).
    return park_order(list(t.records), t.schedule)


def park(t: Table[SessionT], session_id: Hashable, names: list[str]) -> bool:
    # Whether the objects were parked: a host pool that refuses them (with
    # `host_pool_full="refuse"`) leaves the session resident, as one with nothing
    # parkable; any other failure raises.
    try:
        new = t.parking.park(session_id, t.records[session_id], names, t.ledger.held(session_id))
    except ParkingError as exc:
        if isinstance(exc.__cause__, HostPoolFullError):
            return False
        raise
    t.set_record(session_id, new)  # (it may hold some to park on other devices)
    t.ledger.set(session_id, t.ledger.values_for(session_id, new))
    t.record_versions(session_id, new)
    return True


def park_until(
    t: Table[SessionT],
    done: Callable[[], bool],
    /,
    *,
    frees: Callable[[StorageEntry], bool],
    keep: Collection[Hashable] = (),
) -> bool:
    with t.lock:
        if done():
            return True
        # A bound method (a pool's `owns_entry`) is the same predicate each time it is
        # read, so a session it picks nothing of is passed by until its record changes;
        # any other predicate may be a new closure per call, and is not remembered.
        idle = t.nothing_to_park
        remembered = frees if isinstance(frees, types.MethodType) else None
        for other in room_order(t):
            if other in keep:
                continue
            if remembered is not None and remembered in idle.get(other, NO_DEVICES):
                continue
            names = objects_to_park(t.ledger.held(other), t.records[other].objects, frees)
            if not names:
                if remembered is not None:
                    idle[other] = idle.get(other, NO_DEVICES) | {remembered}
            elif park(t, other, names) and done():
                return True
        # Prefetched restores may hold what `done` waits for (a pool's blocks): they go
        # before the caller has to give up.
        if t.parking.drop_prefetches(keep=keep):
            return done()
        return False


def resident(t: Table[SessionT], session_id: Hashable, state: SessionT) -> SessionT:
    # Check the parked bytes (host memory only), then make room for them, then unpark: a
    # device never holds more than its budget, and bytes that cannot come back (a damaged
    # spool file) cost no other session anything. Either failure leaves the session
    # parked (and a retry can succeed).
    parking = t.parking
    if not parking.is_parked(session_id):
        return state
    holders = holders_of(t, session_id)
    try:
        need = parking.check(session_id)
    except BaseException:
        parking.discard(session_id)  # a failed prefetch's charge goes too
        raise
    parking.unreserve(session_id)  # a prefetch's bytes: charged as the session's now
    try:
        make_room(t, session_id, need, holders)
        new = unpark(t, session_id, state)
    except BaseException:
        parking.discard(session_id)
        raise
    store_unparked(t, session_id, new)
    return new


def holders_of(t: Table[SessionT], session_id: Hashable) -> list[Hashable]:
    # The sessions holding the objects `session_id`'s unpark hands back (charged nothing
    # for them): kept resident while room is made for it, so the objects stay alive.
    back = {id(obj) for obj in t.parking.handed_back(session_id).values()}
    if not back:
        return []
    return [
        sid
        for sid, record in t.records.items()
        if sid != session_id and not back.isdisjoint(map(id, record.objects.values()))
    ]


def store_unparked(t: Table[SessionT], session_id: Hashable, state: SessionT) -> None:
    # ``state``, just unparked, stored for ``session_id``: the table, the ledger (its
    # walk of the restored objects is what parking reads their version counters from).
    t.set_record(session_id, state)
    t.ledger.set(session_id, t.ledger.values_for(session_id, state))
    t.parking.restored(session_id, t.ledger.held(session_id))
    t.record_versions(session_id, state)


def unpark(
    t: Table[SessionT], session_id: Hashable, state: SessionT, keep: Collection[Hashable] = ()
) -> SessionT:
    # Unpark; a `KVPool` short of the blocks to take the session's KV back gets them from
    # the least recently used other sessions' parkable KV (then from their prefetches),
    # pool by pool, before the shortage is the caller's.
    tried: set[int] = set()
    while True:
        try:
            return t.parking.unpark(session_id, state)
        except KVPoolExhaustedError as exc:
            pool, needed = exc.pool, exc.needed
            if pool is None or id(pool) in tried:
                raise
            tried.add(id(pool))
            done = functools.partial(has_free_blocks, pool, needed)
            try:
                made = park_until(t, done, frees=pool.owns_entry, keep=(session_id, *keep))
            except ParkingError as failed:
                # Another session could not be parked for the room: the shortage is
                # still this session's, and the failed park its cause.
                raise exc from failed
            if not made:
                raise


def make_step_room(t: Table[SessionT], session_ids: Sequence[Hashable]) -> None:
    # Before a step (outside its transaction): while a pool lacks the blocks the steps
    # can take, park the least recently used sessions' objects holding its blocks (never
    # the stepping ones'). A pool with the room to spare costs two calls; only one under
    # pressure reads the sessions' entries.
    for pool in t.pools:
        most = pool.blocks_for_step(0)
        if most == 0:
            continue
        # Another session's prefetch takes its blocks when its background restore gets to
        # them, maybe while these steps run: count a whole handle for each, and under
        # pressure wait for them, so the free blocks counted are the ones the steps find.
        with t.lock:
            running = t.parking.pending_all(besides=session_ids)
        prefetching = len({id(h) for h in running})
        if decide.step_room_ready(
            pool.free_blocks, most, len(session_ids), prefetching, pool.session_blocks
        ):
            continue
        for handle in running:
            handle.wait_prefetch()
        with t.lock:
            need = step_blocks(t, session_ids, pool)
            done = functools.partial(has_free_blocks, pool, need)
            park_until(t, done, frees=pool.owns_entry, keep=session_ids)


def step_blocks(t: Table[SessionT], session_ids: Sequence[Hashable], pool: EnginePool) -> int:
    # The pool's blocks the sessions' steps can take, less what they hold.
    return sum(pool.blocks_for_step(t.held_blocks(sid, pool)) for sid in session_ids)


def has_free_blocks(pool: Any, needed: int) -> bool:
    return bool(pool.free_blocks >= needed)
