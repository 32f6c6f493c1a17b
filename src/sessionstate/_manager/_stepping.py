"""Stepping: one session's or one batch's step, made room for, run in the pools' transactions.

A step makes its pools' room, reads the record(s), runs the pure step inside every pool's
``transaction()`` and publishes only if the whole step succeeded, after checking the record it
read was not written into (the read check).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

from typing_extensions import TypeVar

from sessionstate._checks import check_session_id as check_session_id
from sessionstate._errors import (
    KVPoolExhaustedError,
    SessionStateLostError,
)
from sessionstate._kv._pool import kv_shortfall
from sessionstate._manager._access import put, put_many, read_many
from sessionstate._manager._access import read as read_one
from sessionstate._manager._events import span
from sessionstate._manager._room import make_step_room, step_blocks
from sessionstate._manager._table import SessionT, Table, batch_ids
from sessionstate._protocols import EnginePool

__all__ = [
    "entered",
    "lost_message",
    "step",
    "step_many",
    "step_shortfall",
    "transaction_of",
    "transactions",
]

OutT = TypeVar("OutT")


def step(
    t: Table[SessionT],
    session_id: Hashable,
    fn: Callable[[SessionT], tuple[SessionT, OutT]],
    /,
    *,
    new: Callable[[], SessionT],
    begin: bool | None = None,
    lost: Callable[[Hashable], str] | None = None,
) -> OutT:
    check_session_id(session_id)
    try:
        make_step_room(t, (session_id,))
        state = None if begin else read_one(t, session_id, touch=False)
        if state is None:
            if begin is False:
                raise SessionStateLostError(
                    lost(session_id) if lost is not None else lost_message(session_id)
                )
            state = new()
        read = state
        with transactions(t), span("sessionstate::step"):
            state, out = fn(state)
            # A step that wrote into the record it read is caught here, before `put`
            # records the versions anew (with `check_immutable`).
            t.verify_read(session_id, read)
            # Published only after the whole step succeeded.
            put(t, session_id, state)
    except KVPoolExhaustedError as exc:
        if not any(exc.pool is pool for pool in t.pools):
            raise
        raise step_shortfall(t, (session_id,), exc.pool, exc.needed) from exc
    return out


def step_many(
    t: Table[SessionT],
    session_ids: Sequence[Hashable],
    fn: Callable[[list[SessionT]], tuple[Sequence[SessionT], Sequence[OutT]]],
    /,
    *,
    new: Callable[[], SessionT],
    begin: bool | None = None,
    lost: Callable[[Hashable], str] | None = None,
) -> list[OutT]:
    ids = batch_ids(session_ids, "step_many")
    try:
        make_step_room(t, ids)
        with t.lock:
            held = [sid for sid in ids if sid in t.records] if not begin else []
        if begin is False and len(held) < len(ids):
            missing = next(sid for sid in ids if sid not in held)
            raise SessionStateLostError(
                lost(missing) if lost is not None else lost_message(missing)
            )
        read = read_many(t, held, touch=False) if held else []
        records = dict(zip(held, read, strict=True))
        states = [records[sid] if sid in records else new() for sid in ids]
        with transactions(t), span("sessionstate::step_many"):
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
                t.verify_read(session_id, records[session_id])
            # Published only after the whole batch succeeded.
            put_many(t, list(zip(ids, stepped, strict=True)))
    except KVPoolExhaustedError as exc:
        if not any(exc.pool is pool for pool in t.pools):
            raise
        raise step_shortfall(t, ids, exc.pool, exc.needed) from exc
    return outs


def transactions(t: Table[SessionT]) -> contextlib.AbstractContextManager[Any]:
    # Every pool's `transaction()`, where it has one (one pool: its own, the usual case).
    opened = [t for t in map(transaction_of, t.pools) if t is not None]
    if not opened:
        return contextlib.nullcontext()
    if len(opened) == 1:
        only: contextlib.AbstractContextManager[Any] = opened[0]()
        return only
    return entered(opened)


def step_shortfall(
    t: Table[SessionT], session_ids: Sequence[Hashable], pool: EnginePool, needed: int
) -> KVPoolExhaustedError:
    # `needed`: the blocks the append that failed asked for.
    with t.lock:
        need = step_blocks(t, session_ids, pool)
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


def lost_message(session_id: Hashable) -> str:
    return (
        f"Cannot continue session {session_id!r}: the manager does not hold it (never "
        "started, dropped or evicted), so its state is lost. Start it again with "
        "`begin=True`, or raise the session cap."
    )


def transaction_of(pool: EnginePool) -> Callable[[], Any] | None:
    transaction: Callable[[], Any] | None = getattr(pool, "transaction", None)
    return transaction


@contextlib.contextmanager
def entered(opened: list[Callable[[], Any]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for transaction in opened:
            stack.enter_context(transaction())
        yield
