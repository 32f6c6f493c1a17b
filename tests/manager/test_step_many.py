"""`SessionStateManager.step_many`: one batched step, its room made at once, all or nothing."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import sessionstate as ss
from sessionstate import KVCache, KVPool, SessionState, SessionStateManager
from tests.support import assert_stats_equal_a_recount


def _pool(blocks: int) -> KVPool:
    # A step appends 2 tokens; a window of 4 tokens: a session holds at most 2 blocks, and
    # a step can take 3 (its largest handle and a copied partial block).
    return KVPool(blocks, block_tokens=2, token_shape=(), step_tokens=2, window_tokens=4)


def _fresh() -> SessionState:
    return SessionState(objects={"kv": KVCache().allocate()}, attrs={"n": 0})


def _grow(pool: KVPool) -> Any:
    def step(states: list[SessionState]) -> tuple[list[SessionState], list[int]]:
        out = []
        for s in states:
            kv = s.object("kv", KVCache).append(
                pool, torch.full((2,), 1.0 + s.attrs["n"]), window=4
            )
            out.append(s.with_values({"kv": kv}, n=s.attrs["n"] + 1))
        return out, [s.attrs["n"] for s in out]

    return step


def test_a_batch_steps_every_session_and_keeps_the_order_given() -> None:
    pool = _pool(16)
    m = SessionStateManager(pools=(pool,))
    assert m.step_many(["a", "b"], _grow(pool), new=_fresh) == [1, 1]
    assert m.step_many(["c", "a"], _grow(pool), new=_fresh) == [1, 2]
    assert m.session_ids() == ["b", "c", "a"]
    assert m.step_many(["b"], _grow(pool), new=_fresh, begin=True) == [1]
    assert_stats_equal_a_recount(m)


def test_a_batch_makes_its_room_by_parking_sessions_outside_it() -> None:
    pool = _pool(6)  # two sessions' steps at once, not three
    m = SessionStateManager(pools=(pool,))
    for sid in "abc":
        m.step_many([sid], _grow(pool), new=_fresh)
    m.step_many(["a", "b"], _grow(pool), new=_fresh)
    assert m.peek("c").parked == ("kv",)
    assert not m.peek("a").parked
    assert not m.peek("b").parked
    assert m.stats()["kv_parks"] >= 1
    # "c" comes back with its KV as it was.
    m.step_many(["c", "a"], _grow(pool), new=_fresh)
    view = m.peek("c").object("kv", KVCache).view()
    assert torch.equal(view.read(), torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert_stats_equal_a_recount(m)


def test_a_batch_the_pool_cannot_hold_is_refused_naming_the_batch() -> None:
    pool = _pool(2)  # three new sessions take a block each
    # Each can take its largest handle (4 blocks) and a copied partial block: 3 x 5 blocks.
    assert pool.blocks_for_step(0) == 5
    m = SessionStateManager(pools=(pool,))
    before = pool.free_blocks
    msg = (
        "Batch ['a', 'b', 'c']: a step can need 15 KV blocks (120 bytes) of pool 'kv_pool', "
        "which has 2 free (16 bytes); live handles hold the other 0 bytes, and no other "
        "session's KV the manager holds is left to park (records kept outside the manager "
        "hold their blocks). Drop finished sessions, or step a smaller batch, or build the "
        "pool with at least 120 bytes."
    )
    with pytest.raises(ss.KVPoolExhaustedError, match="^" + re.escape(msg) + "$"):
        m.step_many(["a", "b", "c"], _grow(pool), new=_fresh)
    assert m.session_ids() == []
    assert pool.free_blocks == before


def test_a_failed_batch_leaves_every_session_and_the_pool_as_they_were() -> None:
    pool = _pool(16)
    m = SessionStateManager(pools=(pool,))
    m.step_many(["a", "b"], _grow(pool), new=_fresh)
    before = {sid: m.peek(sid) for sid in "ab"}
    free = pool.free_blocks

    def fails(states: list[SessionState]) -> tuple[list[SessionState], list[int]]:
        _grow(pool)(states)  # takes blocks, then fails
        raise RuntimeError("the networks failed")

    with pytest.raises(RuntimeError, match="the networks failed"):
        m.step_many(["a", "b", "c"], fails, new=_fresh)
    assert {sid: m.peek(sid) for sid in m.session_ids()} == before
    assert pool.free_blocks == free
    msg = (
        "The batched step returned 1 records and 2 outputs for 2 sessions; return one record "
        "and one output per session, in the order given."
    )

    def short(states: list[SessionState]) -> tuple[list[SessionState], list[int]]:
        new, outs = _grow(pool)(states)
        return new[:1], outs

    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        m.step_many(["a", "b"], short, new=_fresh)
    assert {sid: m.peek(sid) for sid in m.session_ids()} == before
    assert pool.free_blocks == free
    assert_stats_equal_a_recount(m)


def test_a_continuation_of_a_session_not_held_changes_nothing() -> None:
    pool = _pool(16)
    m = SessionStateManager(pools=(pool,))
    m.step_many(["a"], _grow(pool), new=_fresh)
    with pytest.raises(ss.SessionStateLostError, match="'b'"):
        m.step_many(["a", "b"], _grow(pool), new=_fresh, begin=False)
    with pytest.raises(ss.SessionStateLostError, match=r"^lost b$"):
        m.step_many(["a", "b"], _grow(pool), new=_fresh, begin=False, lost=lambda s: f"lost {s}")
    assert m.session_ids() == ["a"]
    assert m.peek("a").attrs["n"] == 1
    with pytest.raises(ValueError, match="distinct session ids"):
        m.step_many(["a", "a"], _grow(pool), new=_fresh)
    with pytest.raises(ValueError, match="distinct session ids"):
        m.step_many([], _grow(pool), new=_fresh)


def test_a_batch_over_the_byte_budget_is_refused_whole() -> None:
    m = SessionStateManager(max_bytes={"cpu": 100}, on_full="refuse")

    def big(states: list[SessionState]) -> tuple[list[SessionState], list[None]]:
        return [s.with_attrs(x=torch.zeros(16)) for s in states], [None] * len(states)

    m.step_many(["a"], big, new=SessionState)
    with pytest.raises(ss.SessionAdmissionError):
        m.step_many(["b", "c"], big, new=SessionState)
    assert m.session_ids() == ["a"]
    assert_stats_equal_a_recount(m)


def test_a_failed_or_refused_step_leaves_the_lru_order_as_it_was() -> None:
    # The `docs/batches.md` example: a failed batch left "a" the most recently used.
    m = SessionStateManager(max_bytes={"cpu": 100}, on_full="refuse")

    def count(states: list[SessionState]) -> tuple[list[SessionState], list[int]]:
        new = [s.with_attrs(n=s.attrs.get("n", 0) + 1) for s in states]
        return new, [s.attrs["n"] for s in new]

    def fails(states: list[SessionState]) -> Any:
        raise ZeroDivisionError

    def big(states: list[SessionState]) -> tuple[list[SessionState], list[None]]:
        return [s.with_attrs(x=torch.zeros(50)) for s in states], [None] * len(states)

    assert m.step_many(["a", "b"], count, new=SessionState) == [1, 1]
    with pytest.raises(ZeroDivisionError):
        m.step_many(["a", "c"], fails, new=SessionState)
    assert m.session_ids() == ["a", "b"]
    with pytest.raises(ZeroDivisionError):
        m.step("a", fails, new=SessionState)
    assert m.session_ids() == ["a", "b"]
    with pytest.raises(ss.SessionAdmissionError):
        m.step_many(["a"], big, new=SessionState)  # 200 bytes: over the budget
    assert m.session_ids() == ["a", "b"]
    assert m.peek("a").attrs["n"] == 1
    assert m.step("a", lambda s: (s, None), new=SessionState) is None
    assert m.session_ids() == ["b", "a"]  # a step that publishes touches its session
    assert m.step_many(["b"], count, new=SessionState) == [2]
    assert m.session_ids() == ["a", "b"]


def test_a_failed_step_gives_back_what_it_took_from_every_pool() -> None:
    # Two pools, a cache in each; in the second, each step appends one token into a block of
    # two. A failed step's append filled the partial block in place: given back, the next
    # step fills it again in place, where a block left filled would be copied (one more).
    pools = (_pool(16), KVPool(16, block_tokens=2, token_shape=(), name="second"))
    m = SessionStateManager(pools=pools)

    def fresh() -> SessionState:
        return SessionState(objects={"kv": KVCache().allocate(), "kv2": KVCache().allocate()})

    def grow(states: list[SessionState]) -> tuple[list[SessionState], list[None]]:
        out = []
        for s in states:
            kv = s.object("kv", KVCache).append(pools[0], torch.ones(2), window=4)
            kv2 = s.object("kv2", KVCache).append(pools[1], torch.ones(1))
            out.append(s.with_values({"kv": kv, "kv2": kv2}))
        return out, [None] * len(states)

    def fails(states: list[SessionState]) -> Any:
        grow(states)  # takes blocks of both pools, fills the second's in place, then fails
        raise RuntimeError("the networks failed")

    m.step_many(["a", "b"], grow, new=fresh)
    before = {sid: m.peek(sid) for sid in "ab"}  # holding the records the steps continue
    free = [pool.free_blocks for pool in pools]
    for step in (
        lambda: m.step_many(["a", "b", "c"], fails, new=fresh),
        lambda: m.step("a", lambda s: fails([s]), new=fresh),
    ):
        with pytest.raises(RuntimeError, match="the networks failed"):
            step()
        assert [pool.free_blocks for pool in pools] == free
        assert {sid: m.peek(sid) for sid in m.session_ids()} == before
    m.step_many(["a", "b"], grow, new=fresh)
    assert pools[1].free_blocks == free[1]  # both filled their own block in place
    for sid in "ab":
        assert m.peek(sid).object("kv2", KVCache).read().tolist() == [1.0, 1.0]
    assert_stats_equal_a_recount(m)
