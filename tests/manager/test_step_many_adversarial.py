"""Probes that try to break `SessionStateManager.step_many`'s promises.

Each compares a batch against the same sessions stepped one by one (`step`) on a twin
manager, or a failed batch against the state before it: records (`tree_equal`), the pool's
free blocks, the byte ledger (a recount) and the LRU order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch

import sessionstate as ss
from sessionstate import KVCache, KVPool, SessionState, SessionStateManager
from tests.support import assert_stats_equal_a_recount

# Block 2 tokens, a step 3 tokens (a partial block after every odd step), a window of 4.
STEP, WINDOW = 3, 4


def _pool(blocks: int) -> KVPool:
    return KVPool(blocks, block_tokens=2, token_shape=(), step_tokens=STEP, window_tokens=WINDOW)


def _fresh() -> SessionState:
    return SessionState(objects={"kv": KVCache().allocate()}, attrs={"n": 0})


def _one(pool: KVPool, s: SessionState, x: float) -> tuple[SessionState, torch.Tensor]:
    kv = s.object("kv", KVCache).append(pool, torch.full((STEP,), x), window=WINDOW)
    view = kv.view()
    assert view is not None
    out = view.read().clone()
    return s.with_values({"kv": kv}, n=s.attrs["n"] + 1), out


def _batch(pool: KVPool, xs: list[float]) -> Callable[[list[SessionState]], Any]:
    def fn(states: list[SessionState]) -> tuple[list[SessionState], list[torch.Tensor]]:
        done = [_one(pool, s, x) for s, x in zip(states, xs, strict=True)]
        return [d[0] for d in done], [d[1] for d in done]

    return fn


def _single(pool: KVPool, x: float) -> Callable[[SessionState], Any]:
    return lambda s: _one(pool, s, x)


def _kv(m: SessionStateManager, sid: Hashable) -> torch.Tensor:
    record = m.peek(sid, on_host=True)
    assert record is not None
    view = record.object("kv", KVCache).view()
    assert view is not None
    return view.read()


def _same_sessions(a: SessionStateManager, b: SessionStateManager) -> None:
    assert a.session_ids() == b.session_ids()
    for sid in a.session_ids():
        assert torch.equal(_kv(a, sid), _kv(b, sid)), sid
        assert a.peek(sid).attrs["n"] == b.peek(sid).attrs["n"], sid  # type: ignore[union-attr]


def _snapshot(m: SessionStateManager, pool: KVPool) -> tuple[Any, ...]:
    # The records, the pool's free blocks and the ledger. Not the LRU order: as `step`
    # does, a batch's read marks its members most recently used before the step runs.
    ids = sorted(m.session_ids(), key=str)
    return (ids, {sid: m.peek(sid) for sid in ids}, pool.free_blocks, m.stats()["total_nbytes"])


def test_ids_equal_by_hash_count_as_one_and_unhashable_ids_are_refused() -> None:
    pool = _pool(32)
    m = SessionStateManager(pools=(pool,))
    free = pool.free_blocks
    for ids in ([1, 1.0], [1, True], ["a", "b", "a"]):
        with pytest.raises(ValueError, match="distinct session ids"):
            m.step_many(ids, _batch(pool, [1.0] * len(ids)), new=_fresh)
    with pytest.raises(TypeError):
        m.step_many(["a", ["b"]], _batch(pool, [1.0, 2.0]), new=_fresh)  # type: ignore[list-item]
    assert m.session_ids() == []
    assert pool.free_blocks == free


@pytest.mark.parametrize("begin", [None, True])
def test_a_batch_of_new_and_held_sessions_is_its_sessions_stepped_one_by_one(
    begin: bool | None,
) -> None:
    pools = _pool(64), _pool(64)
    batched, single = (SessionStateManager(pools=(p,)) for p in pools)
    for m, pool in zip((batched, single), pools, strict=True):
        for i, sid in enumerate("abc"):
            for k in range(i + 1):  # sessions at different places in their window
                m.step(sid, _single(pool, 10.0 * i + k), new=_fresh)
    ids, xs = ["c", "new", "a", "b"], [7.0, 8.0, 9.0, 10.0]
    outs = batched.step_many(ids, _batch(pools[0], xs), new=_fresh, begin=begin)
    for sid, x, out in zip(ids, xs, outs, strict=True):
        assert torch.equal(single.step(sid, _single(pools[1], x), new=_fresh, begin=begin), out)
    _same_sessions(batched, single)
    assert pools[0].free_blocks == pools[1].free_blocks
    assert_stats_equal_a_recount(batched)


def test_begin_true_over_parked_sessions_replaces_them_and_keeps_the_ledger() -> None:
    pool = _pool(32)
    m = SessionStateManager(pools=(pool,))
    for sid in "abcd":
        m.step(sid, _single(pool, 1.0), new=_fresh)
        m.step(sid, _single(pool, 2.0), new=_fresh)
    m.park_until(lambda: False, frees=pool.owns_entry, keep=("d",))
    batch = ["a", "c", "d"]  # two parked, one resident
    assert [bool(m.peek(sid).parked) for sid in batch] == [True, True, False]  # type: ignore[union-attr]
    m.prefetch("c")
    m.step_many(batch, _batch(pool, [5.0, 6.0, 7.0]), new=_fresh, begin=True)
    for sid, x in zip(batch, [5.0, 6.0, 7.0], strict=True):
        assert torch.equal(_kv(m, sid), torch.full((STEP,), x))
        assert m.peek(sid).attrs["n"] == 1  # type: ignore[union-attr]
    assert_stats_equal_a_recount(m)
    # Nothing parked of theirs lingers: the pool's blocks are all accounted for.
    m.clear()
    assert pool.free_blocks == pool.num_blocks


def test_branches_writing_one_shared_partial_block_in_one_batch() -> None:
    pools = _pool(64), _pool(64)
    batched, single = (SessionStateManager(pools=(p,)) for p in pools)
    for m, pool in zip((batched, single), pools, strict=True):
        m.step("src", _single(pool, 1.0), new=_fresh)  # 3 tokens: a partial second block
        m.fork("src", "b1", "b2")
    ids, xs = ["b1", "b2", "src"], [2.0, 3.0, 4.0]
    outs = batched.step_many(ids, _batch(pools[0], xs), new=_fresh)
    for sid, x, out in zip(ids, xs, outs, strict=True):
        assert torch.equal(single.step(sid, _single(pools[1], x), new=_fresh), out), sid
    _same_sessions(batched, single)
    assert torch.equal(_kv(batched, "b1")[-STEP:], torch.full((STEP,), 2.0))
    assert torch.equal(_kv(batched, "b2")[-STEP:], torch.full((STEP,), 3.0))
    assert pools[0].free_blocks == pools[1].free_blocks
    assert_stats_equal_a_recount(batched)


def test_a_batch_of_parked_sessions_under_pressure_with_prefetches() -> None:
    # A pool for three sessions' steps; six sessions, so most are parked; a prefetch of a
    # batch member and one of a session outside the batch are running as the batch steps.
    pools = _pool(15), _pool(15)
    batched, single = (SessionStateManager(pools=(p,)) for p in pools)
    for m, pool in zip((batched, single), pools, strict=True):
        for sid in "abcdef":
            m.step(sid, _single(pool, float(ord(sid))), new=_fresh)
    for k in range(3):
        for batch in (["a", "b"], ["c", "d"], ["e", "f"]):
            # Prefetch one member (the first, if parked) and one outsider.
            outside = next(s for s in "abcdef" if s not in batch)
            batched.prefetch(batch[0], make_room=True)
            batched.prefetch(outside, make_room=True)
            xs = [float(k * 10 + i) for i in range(len(batch))]
            outs = batched.step_many(batch, _batch(pools[0], xs), new=_fresh)
            for sid, x, out in zip(batch, xs, outs, strict=True):
                assert torch.equal(single.step(sid, _single(pools[1], x), new=_fresh), out)
            assert_stats_equal_a_recount(batched)
    _same_sessions(batched, single)
    assert batched.stats()["kv_parks"] > 0


def test_a_batch_failing_midway_leaves_sessions_pool_and_ledger_as_they_were() -> None:
    pool = _pool(64)
    m = SessionStateManager(pools=(pool,), max_bytes={"cpu": 1 << 20})
    for sid in "abc":
        m.step(sid, _single(pool, 1.0), new=_fresh)
    m.fork("a", "a2")
    before = _snapshot(m, pool)
    stats = m.stats()
    calls = 0

    def fails(states: list[SessionState]) -> Any:
        nonlocal calls
        out = []
        for s in states:
            calls += 1
            if calls == 3:  # after two sessions appended KV (one a branch's shared block)
                raise RuntimeError("the networks failed")
            out.append(_one(pool, s, 5.0)[0])
        return out, out

    with pytest.raises(RuntimeError, match="the networks failed"):
        m.step_many(["a", "a2", "new", "b"], fails, new=_fresh)
    assert _snapshot(m, pool) == before
    after = m.stats()
    assert {k: v for k, v in after.items() if k != "hits"} == {
        k: v for k, v in stats.items() if k != "hits"
    }
    assert_stats_equal_a_recount(m)


def test_a_batch_whose_store_is_refused_by_the_cap_gives_back_its_blocks() -> None:
    pool = _pool(64)
    m = SessionStateManager(pools=(pool,), max_sessions=3, on_full="refuse")
    for sid in "ab":
        m.step(sid, _single(pool, 1.0), new=_fresh)
    before = _snapshot(m, pool)
    with pytest.raises(ss.SessionAdmissionError):
        m.step_many(["a", "x", "y"], _batch(pool, [1.0, 2.0, 3.0]), new=_fresh)
    assert _snapshot(m, pool) == before
    assert_stats_equal_a_recount(m)


def test_another_thread_dropping_a_member_while_the_batch_steps() -> None:
    # `step` semantics: a step publishes what it computed; a drop it raced with is undone
    # by that publish (as for `step`), and the ledger stays a recount of what is held.
    pool = _pool(64)
    m = SessionStateManager(pools=(pool,))
    for sid in "abc":
        m.step(sid, _single(pool, 1.0), new=_fresh)
    inside, dropped = threading.Event(), threading.Event()

    def slow(states: list[SessionState]) -> Any:
        inside.set()
        assert dropped.wait(10)
        return _batch(pool, [2.0, 3.0])(states)

    def dropper() -> None:
        assert inside.wait(10)
        m.drop("b")
        m.drop("c")  # not a member
        dropped.set()

    t = threading.Thread(target=dropper)
    t.start()
    m.step_many(["a", "b"], slow, new=_fresh)
    t.join()
    assert sorted(m.session_ids(), key=str) == ["a", "b"]
    assert_stats_equal_a_recount(m)
    m.clear()
    assert pool.free_blocks == pool.num_blocks


def test_check_immutable_sees_a_batched_step_that_wrote_into_a_stored_record() -> None:
    m = SessionStateManager(check_immutable=True)
    m.put("a", SessionState(attrs={"x": torch.zeros(4)}))
    m.put("b", SessionState(attrs={"x": torch.zeros(4)}))

    def writes(states: list[SessionState]) -> Any:
        states[1].attrs["x"].add_(1)  # in place, into b's stored tensor
        return list(states), [None, None]

    # Caught in the step, before `put_many` records the versions anew; the record stays
    # reported as corrupted.
    with pytest.raises(ss.ImmutabilityViolationError, match="'b'"):
        m.step_many(["a", "b"], writes, new=SessionState)
    with pytest.raises(ss.ImmutabilityViolationError):
        m.get("b")


def test_check_immutable_sees_a_step_that_wrote_into_its_stored_record() -> None:
    m = SessionStateManager(check_immutable=True)
    m.put("a", SessionState(attrs={"x": torch.zeros(4)}))

    def writes(state: SessionState) -> Any:
        state.attrs["x"].add_(1)
        return state, None

    with pytest.raises(ss.ImmutabilityViolationError, match="'a'"):
        m.step("a", writes, new=SessionState)
    with pytest.raises(ss.ImmutabilityViolationError):
        m.get("a")
