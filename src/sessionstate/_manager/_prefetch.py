"""Prefetch: start unparking a session in the background, if its room is there (or made).

The restored bytes are charged to the budget from the start (a reservation) and every pool
must have room for the restored session beside a step's; the next `get` takes the restore.
`expect` sets a schedule of next use (which room-making reads, `_schedule.park_order`) and
prefetches its parked sessions in order, each making room only from sessions used later.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Hashable, Sequence

from sessionstate._checks import check_bool
from sessionstate._checks import check_session_id as check_session_id
from sessionstate._manager._room import has_free_blocks, park_others, park_until
from sessionstate._manager._schedule import check_schedule, prefetch_plan
from sessionstate._manager._table import SessionT, Table

__all__ = ["expect", "prefetch", "prefetch_blocks", "start_prefetch"]


def prefetch(t: Table[SessionT], session_id: Hashable, /, *, make_room: bool = False) -> bool:
    check_session_id(session_id)
    if not isinstance(make_room, bool):
        msg = f"`make_room` must be a bool (True or False), got {make_room!r}."
        raise TypeError(msg)
    with t.lock:
        return start_prefetch(t, session_id, make_room)


def start_prefetch(
    t: Table[SessionT],
    session_id: Hashable,
    make_room: bool,
    sooner: Collection[Hashable] | None = None,
) -> bool:
    # `prefetch`, under the lock. `sooner`: for `expect`'s plan, the sessions its room must
    # not park (those used no later); a plan's prefetch that does not fit is not a drop.
    parking = t.parking
    state = t.records.get(session_id)
    if state is None or not parking.is_parked(session_id):
        return False
    if parking.is_prefetched(session_id):
        return True
    need = parking.parked_need(session_id)
    if not prefetch_blocks(t, session_id, make_room, sooner or ()):
        if sooner is None:
            parking.count_dropped_prefetch()
        return False
    if t.policy is not None:
        reserved = parking.reserved()
        extra = {d: need.get(d, 0) + reserved.get(d, 0) for d in {*need, *reserved}}
        if make_room:
            park_others(t, session_id, extra, sooner or ())
        if t.policy.over(t.ledger, extra):
            if sooner is None:
                parking.count_dropped_prefetch()
            return False
    parking.start_prefetch(session_id, need)
    return True


def expect(
    t: Table[SessionT], session_ids: Sequence[Hashable], /, *, prefetch: bool = True
) -> None:
    ids = check_schedule(session_ids)
    check_bool(prefetch, "prefetch")
    with t.lock:
        t.schedule = ids
        if not prefetch:
            return
        parked = {sid for sid in ids if sid in t.records and t.parking.is_parked(sid)}
        for session_id, sooner in prefetch_plan(ids, parked, t.records):
            started = not t.parking.is_prefetched(session_id)
            if not start_prefetch(t, session_id, True, sooner):
                return
            t.scheduled_prefetches += started


def prefetch_blocks(
    t: Table[SessionT], session_id: Hashable, make_room: bool, sooner: Collection[Hashable] = ()
) -> bool:
    # Whether every pool has room for the restored session beside a step's (a background
    # restore takes its blocks while another session steps); with `make_room`, the least
    # recently used other resident sessions' blocks are parked until it has.
    for pool in t.pools:
        most = pool.session_blocks
        if most is None:
            continue
        need = most + pool.blocks_for_step(0)
        if pool.free_blocks >= need:
            continue
        if make_room:
            # Parked sessions have nothing to park; kept, their own prefetches stay.
            parked = (sid for sid in t.records if t.parking.is_parked(sid))
            keep = {session_id, *parked, *sooner}
            done = functools.partial(has_free_blocks, pool, need)
            park_until(t, done, frees=pool.owns_entry, keep=keep)
        if pool.free_blocks < need:
            return False
    return True
