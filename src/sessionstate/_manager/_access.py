"""Reading and storing records: get, put and their batched and read-only forms.

A read of a parked session makes its room and unparks it (`resident`); a store admits the
session at the cap, charges the ledger and makes room for it, and changes nothing unless it
succeeds (`put_locked`); a batch is read and stored with one room check, all or nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Any

from sessionstate._accounting import count_entries
from sessionstate._checks import check_bool
from sessionstate._checks import check_session_id as check_session_id
from sessionstate._errors import (
    ParkingError,
    SessionAdmissionError,
    SessionStateLostError,
    reason,
)
from sessionstate._manager import _decide as decide
from sessionstate._manager._ledger import Values, entries_of
from sessionstate._manager._parking import parked_objects
from sessionstate._manager._room import holders_of, make_room, resident, store_unparked, unpark
from sessionstate._manager._table import SessionT, Table, batch_ids, not_held
from sessionstate._session import SessionState
from sessionstate._stateobject import ParkedObject
from sessionstate._storage import ParkedBytes

__all__ = [
    "batch_fits",
    "check_state",
    "get",
    "get_many",
    "get_or_create",
    "peek",
    "put",
    "put_locked",
    "put_many",
    "read",
    "read_many",
    "read_parked",
    "refuse_batch_over_budget",
    "require",
    "store_batch",
    "store_batch_by_one",
    "stores_parked",
]


def get(t: Table[SessionT], session_id: Hashable, /) -> SessionT | None:
    check_session_id(session_id)
    return read(t, session_id, touch=True)


def read(t: Table[SessionT], session_id: Hashable, *, touch: bool) -> SessionT | None:
    # `get`; `touch=False` leaves the LRU order alone (a step's read: its session becomes
    # the most recently used when the step publishes, and stays where it was if it fails).
    t.await_prefetch(session_id)
    with t.lock:
        state = t.records.get(session_id)
        if state is None:
            t.misses += 1
            return None
        t.verify(session_id, state)
        state = resident(t, session_id, state)
        t.hits += 1
        if touch:
            t.records.move_to_end(session_id)
        return state


def get_many(t: Table[SessionT], session_ids: Sequence[Hashable], /) -> list[SessionT]:
    return read_many(t, batch_ids(session_ids, "get_many"), touch=True)


def read_many(t: Table[SessionT], ids: list[Hashable], *, touch: bool) -> list[SessionT]:
    # `get_many` of checked ids; `touch=False` leaves the LRU order alone, as `read`.
    t.await_prefetch(*ids)
    with t.lock:
        missing = [sid for sid in ids if sid not in t.records]
        if missing:
            msg = not_held(f"Cannot get the batch {ids!r}", missing, then="Nothing changed.")
            raise SessionStateLostError(msg)
        for session_id in ids:  # every record, before anything is parked or unparked
            t.verify(session_id, t.records[session_id])
        parking = t.parking
        need: dict[str, int] = {}
        parked = [sid for sid in ids if parking.is_parked(sid)]
        counted: set[int] = set()  # parked bytes the batch brings back once, for all
        holders: list[Hashable] = []
        for session_id in parked:
            holders += holders_of(t, session_id)
            try:
                for device, nbytes in parking.check(session_id, counted).items():
                    need[device] = need.get(device, 0) + nbytes
            except BaseException:
                parking.discard(session_id)
                raise
            parking.unreserve(session_id)
        if parked:
            try:
                make_room(t, parked[0], need, keep=[*ids, *holders])
            except BaseException:
                for session_id in parked:  # what `check` read, and their prefetches, go
                    parking.discard(session_id)
                raise
        out: list[SessionT] = []
        for session_id in ids:
            state = t.records[session_id]
            if parking.is_parked(session_id):
                try:
                    state = unpark(t, session_id, state, keep=ids)
                except BaseException:
                    parking.discard(session_id)
                    raise
                store_unparked(t, session_id, state)
            out.append(state)
        t.hits += len(ids)
        if touch:
            for session_id in ids:
                t.records.move_to_end(session_id)
        return out


def get_or_create(
    t: Table[SessionT], session_id: Hashable, factory: Callable[[], SessionT], /
) -> SessionT:
    check_session_id(session_id)
    if not callable(factory):
        msg = (
            f"Session {session_id!r}: `factory` must be a callable that returns a new "
            f"SessionState, got {factory!r} ({type(factory).__name__}); pass the class "
            "itself (e.g. `SessionState`) or a function."
        )
        raise TypeError(msg)
    t.await_prefetch(session_id)
    with t.lock:
        state = t.records.get(session_id)
        if state is not None:
            t.verify(session_id, state)
            state = resident(t, session_id, state)
            t.hits += 1
            t.records.move_to_end(session_id)
            return state
        t.misses += 1
        if t.on_full == "refuse":
            t.admit(session_id)  # refuse before paying for the factory
        created = factory()
        check_state(created, session_id)
        # Evict only once the new record exists: a failing factory costs no resident. A
        # factory that stored this session itself (re-entrantly) made room already.
        put_locked(t, session_id, created, touch=False)
        return created


def require(t: Table[SessionT], session_id: Hashable, /) -> SessionT:
    state = get(t, session_id)
    if state is None:
        msg = (
            f"Session {session_id!r} is not held by this manager (never created, dropped, "
            "or evicted by the LRU cap); its state is lost. Start it again with "
            "`get_or_create`, or raise the cap."
        )
        raise SessionStateLostError(msg)
    return state


def peek(t: Table[SessionT], session_id: Hashable, /, *, on_host: bool = False) -> SessionT | None:
    check_session_id(session_id)
    check_bool(on_host, "on_host")
    with t.lock:
        state = t.records.get(session_id)
        if state is not None:
            t.verify(session_id, state)
            if on_host and state.parked:
                state = read_parked(t, session_id, state)
        return state


def read_parked(
    t: Table[SessionT], session_id: Hashable, state: SessionT, trees: dict[int, Any] | None = None
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


def put(t: Table[SessionT], session_id: Hashable, state: SessionT, /) -> None:
    check_session_id(session_id)
    check_state(state, session_id)
    with t.lock:
        put_locked(t, session_id, state, touch=True)


def put_locked(
    t: Table[SessionT],
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
        values = t.ledger.values_for(session_id if like is None else like, state)
    grown = t.ledger.growth((values,))
    # Stored in the ledger first, so the budget reads what the record holds alone from the
    # per-session totals this put just moved (the cost of what changed, not a walk of the
    # record); a refusal moves the ledger back.
    previous = t.ledger.set(session_id, values)
    # Parked bytes this record holds are held from now on: a session evicted to admit it
    # (a caller's fork by hand: `put("b", m.peek("a"))`) does not release them.
    parked = parked_objects(state)
    storing = tuple(parked.values())
    t.parking.storing = storing
    try:
        if t.policy is not None:
            t.refuse(session_id, t.policy.refusal(session_id, t.ledger))
        if session_id in t.records:
            if touch:
                t.records.move_to_end(session_id)
        else:
            t.admit(session_id, keep)
        make_room(t, session_id, {}, keep)
    except BaseException:
        t.ledger.set(session_id, previous)
        t.ledger.undo_growth(grown)
        t.parking.storing = ()
        t.parking.abandon(storing)
        raise
    t.parking.storing = ()
    t.set_record(session_id, state)
    t.parking.track(session_id, state, parked)
    t.record_versions(session_id, state)


def put_many(
    t: Table[SessionT], items: Mapping[Hashable, SessionT] | Sequence[tuple[Hashable, SessionT]], /
) -> None:
    pairs = list(items.items()) if isinstance(items, Mapping) else list(items)
    ids = batch_ids([sid for sid, _ in pairs], "put_many")
    for sid, record in pairs:  # every record checked before anything is stored
        check_state(record, sid)
    with t.lock:
        if not batch_fits(t, ids):
            fresh = sum(sid not in t.records for sid in ids)
            msg = (
                f"Cannot store the batch {ids!r}: {fresh} new sessions beside "
                f"{len(t.records)} held, and the cap (max_sessions="
                f"{t.max_sessions}, `on_full={t.on_full!r}`) cannot hold the batch. "
                "Store a smaller batch, drop finished sessions, or raise `max_sessions`."
            )
            t.refuse(ids[0], SessionAdmissionError(msg))
        store_batch(t, pairs, ids)


def batch_fits(t: Table[SessionT], ids: list[Hashable]) -> bool:
    # Whether the cap holds the batch: no larger than the cap, and with
    # `on_full="refuse"` no more new sessions than free places.
    fresh = sum(sid not in t.records for sid in ids)
    return decide.batch_fits(len(ids), fresh, len(t.records), t.max_sessions, t.on_full)


def store_batch(
    t: Table[SessionT], pairs: Sequence[tuple[Hashable, SessionT]], ids: list[Hashable]
) -> None:
    # Under the lock, once the batch fits the cap: each put, no member parked or evicted
    # for another; a refusal of any puts every member back as it was, and the LRU order.
    # A batch the budget cannot hold even alone is refused before anything is parked or
    # evicted for it.
    ledger, parking, table = t.ledger, t.parking, t.records
    walked = [ledger.values_for(session_id, state) for session_id, state in pairs]
    if any(sid not in table or parking.is_parked(sid) for sid in ids) or any(
        stores_parked(values, state) for values, (_, state) in zip(walked, pairs, strict=True)
    ):
        store_batch_by_one(t, pairs, ids, walked)
        return
    # Every member held and resident before and after (a batched step's records): the
    # ledger moved once for the batch, one room check, then the table.
    grown = ledger.growth(walked)
    replaced = ledger.set_many(zip(ids, walked, strict=True))
    try:
        policy = t.policy
        if policy is not None:
            # Over a budget, the batch alone may be (each member then fits alone: it
            # holds no more than the batch).
            if policy.over(ledger, {}):
                refuse_batch_over_budget(t, ids, walked)
            make_room(t, ids[0], {}, ids)
    except BaseException:
        ledger.set_many(zip(ids, replaced, strict=True))
        ledger.undo_growth(grown)
        raise
    for session_id, state in pairs:
        t.set_record(session_id, state)
        table.move_to_end(session_id)
        parking.track(session_id, state, {})
        t.record_versions(session_id, state)


def store_batch_by_one(
    t: Table[SessionT],
    pairs: Sequence[tuple[Hashable, SessionT]],
    ids: list[Hashable],
    walked: list[Values],
) -> None:
    # `_store_batch` when a member is new or holds parked objects: put by put.
    done: list[Hashable] = []
    try:
        olds = [t.ledger.held(sid) for sid in ids]
        refuse_batch_over_budget(t, ids, walked, olds)
    except BaseException:
        t.ledger.undo_growth(t.ledger.growth(walked))
        raise
    before = {sid: t.records.get(sid) for sid in ids}
    order = list(t.records)
    # The parked bytes of the records the batch replaces are held until it is stored
    # whole: a refusal puts those records back, and their bytes must still be there.
    parking = t.parking
    replaced = [obj for r in before.values() if r is not None for obj in parked_objects(r).values()]
    parking.replacing = tuple(replaced)
    try:
        for (session_id, state), values in zip(pairs, walked, strict=True):
            put_locked(t, session_id, state, touch=True, keep=ids, values=values)
            done.append(session_id)
    except BaseException:
        # (the failed put cut its own walk's extensions off; those never put, here)
        t.ledger.undo_growth(t.ledger.growth(walked[len(done) + 1 :]))
        for session_id in reversed(done):
            previous = before[session_id]
            if previous is None:
                t.forget(session_id)
            else:
                put_locked(t, session_id, previous, touch=False, keep=ids)
        for session_id in order:
            if session_id in t.records:
                t.records.move_to_end(session_id)
        raise
    finally:
        parking.replacing = ()
        parking.abandon(replaced)  # what no stored record holds any more


def refuse_batch_over_budget(
    t: Table[SessionT], ids: list[Hashable], walked: list[Values], olds: Sequence[Values] = ()
) -> None:
    # Refuse a batch whose records together (each storage once) exceed a device's whole
    # budget: storing it would evict or park every other session and still not fit.
    # `olds`: the records the members held (stored put by put: while a member is put, the
    # members after it still hold theirs), so a batch refused midway evicts no one.
    policy = t.policy
    if policy is None:
        return
    totals = count_entries(entry for values in walked for entry in entries_of(values))
    device = decide.over_whole_budget(totals, policy.max_bytes)
    if device is not None:
        msg = (
            f"Cannot store the batch {ids!r}: together it holds {totals[device]} "
            f"bytes on {device}, more than the whole budget of {policy.max_bytes[device]} "
            "bytes there (`max_bytes`); storing it would evict or park every other "
            "session and still not fit. Store a smaller batch, or raise the "
            f"budget for {device}."
        )
        t.refuse(ids[0], SessionAdmissionError(msg))
    for k in range(len(olds) - 1) if any(olds[1:]) else ():
        held = [*walked[: k + 1], *olds[k + 1 :]]
        peak = count_entries(entry for values in held for entry in entries_of(values))
        device = decide.over_whole_budget(peak, policy.max_bytes)
        if device is not None:
            msg = (
                f"Cannot store the batch {ids!r}: while {ids[k]!r} is stored, the "
                "batch's new records up to it and the records the members after it "
                f"still hold come to {peak[device]} bytes on {device}, more than the "
                f"whole budget of {policy.max_bytes[device]} bytes there (`max_bytes`); "
                "storing it would evict or park every other session and still not fit. "
                "List the sessions it replaces first, store a smaller batch, or raise the "
                f"budget for {device}."
            )
            t.refuse(ids[0], SessionAdmissionError(msg))


def check_state(state: object, session_id: Hashable) -> None:
    if not isinstance(state, SessionState):
        msg = (
            f"Session {session_id!r}: the manager stores SessionState records, got "
            f"{type(state).__name__}; build one with `SessionState(objects=..., attrs=...)`."
        )
        raise TypeError(msg)


def stores_parked(values: Values, state: SessionState) -> bool:
    # Whether `state`, whose session is resident (its stored record holds no parked object),
    # holds a parked object: of the values its walk found changed, when it knows them.
    parent = getattr(values, "parent", None)
    if parent is None:
        return bool(parked_objects(state))
    changed = values.changed  # type: ignore[attr-defined]
    return any(key[0] == "o" and isinstance(values[key].value, ParkedObject) for key in changed)
