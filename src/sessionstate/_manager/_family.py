"""Families: forks, and the records of sessions that share storages read and written together.

A fork stores the source's record under new ids (its random keys split); `snapshot_many` and
`peek_many` read a family's parked bytes once, so what the sessions share stays shared in the
file; `restore_many` stores a family back, all or nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, cast

import torch

from sessionstate._checks import check_bool
from sessionstate._checks import check_session_id as check_session_id
from sessionstate._errors import (
    SessionAdmissionError,
    SessionStateLostError,
    SnapshotError,
)
from sessionstate._manager import _decide as decide
from sessionstate._manager._access import (
    batch_fits,
    peek,
    put,
    put_locked,
    read_parked,
    store_batch,
)
from sessionstate._manager._events import SessionEvent
from sessionstate._manager._room import make_room
from sessionstate._manager._table import SessionT, Table, batch_ids, not_held
from sessionstate._session import SessionState
from sessionstate._storage import (
    inspect_snapshot,
    load_state,
    recorded_devices,
    save_state,
)

__all__ = [
    "admit_branches",
    "fork",
    "peek_many",
    "read_family",
    "restore",
    "restore_many",
    "snapshot",
    "snapshot_many",
]


def fork(
    t: Table[SessionT], source_id: Hashable, /, *branch_ids: Hashable, share_random: bool = False
) -> None:
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
    t.await_prefetch(source_id)
    with t.lock:
        state = t.records.get(source_id)
        if state is None:
            msg = not_held(f"Cannot fork session {source_id!r}")
            raise SessionStateLostError(msg)
        seen: set[Hashable] = set()
        for branch_id in branch_ids:
            if branch_id in t.records or branch_id in seen:
                held = "the source" if branch_id == source_id else "a held session"
                if branch_id in seen:
                    held = "named twice"
                msg = (
                    f"Cannot fork session {source_id!r} into {branch_id!r}: that id is "
                    f"{held}. Name new ids (drop a session to reuse its id)."
                )
                raise ValueError(msg)
            seen.add(branch_id)
        admit_branches(t, source_id, len(branch_ids))
        # The source's record with its keys split, then one per branch (the same record
        # n + 1 times when it holds no key, or the key is shared).
        n = len(branch_ids) + 1
        records = (state,) * n if share_random else state.split_random(n)
        t.records.move_to_end(source_id)
        added: list[Hashable] = []
        try:
            for branch_id, record in zip(branch_ids, records[1:], strict=True):
                put_locked(t, branch_id, record, touch=True, like=source_id)
                t.parking.forked(source_id, branch_id)
                added.append(branch_id)
                t.reporter.emit(SessionEvent("fork", branch_id, 0, reason=f"of {source_id!r}"))
            if records[0] is not state:
                # The source's record with its own split key: only the key changed, but
                # its new key is held alone (the old one may be a branch's now), so its
                # room is made as a put's, never parking a branch; nothing of the source
                # is parked and a prefetch of it stays reserved.
                values = t.ledger.values_for(source_id, records[0])
                grown = t.ledger.growth((values,))
                previous = t.ledger.set(source_id, values)
                try:
                    make_room(t, source_id, {}, added)
                except BaseException:
                    t.ledger.set(source_id, previous)
                    t.ledger.undo_growth(grown)
                    raise
                t.set_record(source_id, records[0])
                t.record_versions(source_id, records[0])
        except BaseException:
            for branch_id in added:
                t.forget(branch_id)
            raise
        t.forks += len(added)
        t.families = True


def admit_branches(t: Table[SessionT], source_id: Hashable, n: int) -> None:
    # A fork's room in the cap, checked before anything changes.
    why = decide.fork_refusal(n, len(t.records), t.max_sessions, t.on_full)
    if why is None:
        return
    msg = (
        f"Cannot fork session {source_id!r} into {n} branches: {why} beside the source. "
        "Fork into fewer branches, drop finished sessions, or raise `max_sessions`."
    )
    t.refuse(source_id, SessionAdmissionError(msg))


def snapshot(
    t: Table[SessionT],
    session_id: Hashable,
    path: str | os.PathLike[str],
    /,
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    check_session_id(session_id)
    with recorded_devices():
        # A parked session is read into host memory under the lock (a concurrent `get`
        # that unparks it, releasing its parked bytes, cannot come in between), taking no
        # device memory or pool block; the file records the devices the bytes came from.
        # The table keeps the parked record: saving does not make a session resident.
        state = peek(t, session_id, on_host=True)
        if state is None:
            msg = not_held(f"Cannot snapshot session {session_id!r}")
            raise SessionStateLostError(msg)
        # Metadata values are strings: a non-str id is stored as its repr.
        sid = session_id if isinstance(session_id, str) else repr(session_id)
        save_state(state, path, metadata={**(metadata or {}), "session_id": sid})


def restore(
    t: Table[SessionT],
    session_id: Hashable,
    path: str | os.PathLike[str],
    /,
    *,
    device: torch.device | str | None = None,
) -> SessionT:
    check_session_id(session_id)
    # The record type parameter is not known at runtime: the file's class is trusted.
    state = cast(SessionT, load_state(path, device=device, expect=SessionState))
    put(t, session_id, state)
    return state


def snapshot_many(
    t: Table[SessionT],
    session_ids: Sequence[Hashable],
    path: str | os.PathLike[str],
    /,
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
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
        records = read_family(t, ids, "snapshot")
        save_state(
            records,
            path,
            metadata={**(metadata or {}), "session_ids": json.dumps(names)},
        )


def peek_many(t: Table[SessionT], session_ids: Sequence[Hashable], /) -> list[SessionT]:
    ids = batch_ids(session_ids, "peek_many")
    return read_family(t, ids, "read")


def read_family(t: Table[SessionT], ids: list[Hashable], what: str) -> list[SessionT]:
    # The records of `ids` under the lock, parked ones read into host memory, a handle
    # they share read once (so are its bytes); `what` names the refused verb.
    records = []
    with t.lock:
        trees: dict[int, Any] = {}
        for session_id in ids:
            if session_id not in t.records:
                done = "written" if what == "snapshot" else "read"
                msg = not_held(f"Cannot {what} session {session_id!r}", then=f"Nothing was {done}.")
                raise SessionStateLostError(msg)
        for session_id in ids:
            state = t.records[session_id]
            t.verify(session_id, state)
            if state.parked:
                state = read_parked(t, session_id, state, trees)
            records.append(state)
    return records


def restore_many(
    t: Table[SessionT],
    path: str | os.PathLike[str],
    /,
    *,
    session_ids: Sequence[Hashable] | None = None,
    device: torch.device | str | None = None,
) -> dict[Hashable, SessionT]:
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
    with t.lock:
        held = [sid for sid in ids if sid in t.records]
        if held or len(set(ids)) != len(ids):
            msg = (
                f"Cannot restore the family {ids!r}: {held or 'an id named twice'} "
                "already held. Drop them first, or pass other `session_ids`."
            )
            raise ValueError(msg)
        if not batch_fits(t, ids):
            msg = (
                f"Cannot restore the family {ids!r}: the cap (max_sessions="
                f"{t.max_sessions}, `on_full={t.on_full!r}`, {len(t.records)} "
                "held) cannot hold it. Drop finished sessions, or raise `max_sessions`."
            )
            t.refuse(ids[0], SessionAdmissionError(msg))
        pairs = [(sid, cast(SessionT, state)) for sid, state in zip(ids, records, strict=True)]
        store_batch(t, pairs, ids)
        t.families = True
    return {sid: cast(SessionT, state) for sid, state in zip(ids, records, strict=True)}
