"""Observation: counters, bytes held, one session's footprint and the metrics snapshot.

Everything here reads what the table, the ledger and parking keep, under the lock, walking no
record (`nbytes_by_session` excepted), and changes nothing but the event counts `report` adds.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from sessionstate._checks import check_session_id as check_session_id
from sessionstate._errors import SessionStateLostError
from sessionstate._manager import _decide as decide
from sessionstate._manager._events import SessionEvent
from sessionstate._manager._ledger import entries_of
from sessionstate._manager._table import SessionT, Table, not_held

__all__ = [
    "metrics_snapshot",
    "nbytes_by_session",
    "report",
    "session_stats",
    "sharing_sessions",
    "stats",
    "stats_locked",
]


def stats(t: Table[SessionT]) -> dict[str, int]:
    with t.lock:
        return stats_locked(t)[0]


def stats_locked(t: Table[SessionT]) -> tuple[dict[str, int], dict[str, int]]:
    # `stats()`, and the parked sessions by tier from the same walk of the parked ones.
    out = {
        "sessions": len(t.records),
        "max_sessions": t.max_sessions,
        "hits": t.hits,
        "misses": t.misses,
        "evictions": t.evictions,
    }
    totals = t.ledger.totals()
    out["total_nbytes"] = sum(totals.values())
    for device, nbytes in totals.items():
        out[f"nbytes:{device}"] = nbytes
    for device, nbytes in t.ledger.engine_totals().items():
        out[f"engine_nbytes:{device}"] = nbytes
    out["forks"] = t.forks
    # The count walks every session's storages: done once a family was made (a fork,
    # a family restore), 0 before (a worker reads `stats()` at every step).
    out["shared_sessions"] = sharing_sessions(t) if t.families else 0
    if t.policy is not None:
        for device in sorted(t.policy.max_bytes):
            out[f"max_bytes:{device}"] = t.policy.max_bytes[device]
    by_tier: dict[str, int] = {}
    if t.policy is not None or t.parking.used:
        parking, by_tier = t.parking.summary()
        out.update(parking)
        out["scheduled_prefetches"] = t.scheduled_prefetches
    return out, by_tier


def sharing_sessions(t: Table[SessionT]) -> int:
    # Sessions reaching a storage that other sessions reach too, from the ledger's
    # references (a storage a session reaches twice on its own is not shared).
    count = 0
    for session_id in t.records:
        own: dict[Hashable, int] = {}
        for entry in entries_of(t.ledger.held(session_id)):
            own[entry[1]] = own.get(entry[1], 0) + 1
        references = t.ledger.references
        count += decide.shares(own, {identity: references(identity) for identity in own})
    return count


def session_stats(t: Table[SessionT], session_id: Hashable, /) -> dict[str, Any]:
    check_session_id(session_id)
    with t.lock:
        state = t.records.get(session_id)
        if state is None:
            msg = not_held(f"No stats for session {session_id!r}")
            raise SessionStateLostError(msg)
        seen = t.storages_of(session_id)
        values = [
            ("objects" if key[0] == "o" else "attrs", item.entries)
            for key, item in t.ledger.held(session_id).items()
        ]
        references = {identity: t.ledger.references(identity) for identity in seen}
        nbytes, engine, shared, by_kind, shared_ids = decide.footprint(values, references)
        sharers = [
            other
            for other in t.records
            if other != session_id
            and shared_ids
            and not shared_ids.isdisjoint(t.storages_of(other))
        ]
        parking = t.parking
        parked_by_tier: dict[str, int] = {}
        if parking.is_parked(session_id):
            parked_by_tier = parking.parked_nbytes(session_id)
        order = list(t.records)
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
            "blocks": {pool.name: sum(map(pool.owns_entry, seen.values())) for pool in t.pools},
            "prefetching": parking.is_prefetched(session_id),
            "lru_rank": len(order) - 1 - order.index(session_id),
        }


def metrics_snapshot(t: Table[SessionT]) -> dict[str, Any]:
    with t.lock:
        stats, parked = stats_locked(t)
        sessions = {
            "resident": len(t.records) - sum(parked.values()),
            "parked:host": parked.get("host", 0),
            "parked:disk": parked.get("disk", 0),
            "prefetching": t.parking.prefetching_sessions(),
        }
        pools = [(p.name, p.num_blocks, p.free_blocks) for p in t.pools]
        events = dict(t.reporter.counts)
    return {
        "stats": stats,
        "sessions": sessions,
        "pools": pools,
        "events": events,
        "timings": t.reporter.timings.snapshot(),
    }


def report(t: Table[SessionT], event: SessionEvent, /) -> None:
    with t.lock:
        t.reporter.emit(event)


def nbytes_by_session(t: Table[SessionT]) -> dict[Hashable, dict[str, int]]:
    with t.lock:
        items = list(t.records.items())
    return {sid: state.nbytes_by_device() for sid, state in items}
