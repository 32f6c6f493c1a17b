"""Batches holding KV, attacked from outside: windows, forks sharing a handle, empty caches,
block sizes and dtypes, exhaustion in the middle of a commit, unstacking twice, stale
handles, and a manager's batched step under a budget that parks. Each batched step is checked
against the same sessions stepped one by one on the pool, and the pool's free blocks are its
blocks less those the live handles hold.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

import sessionstate as ss
from tests.support import assert_stats_equal_a_recount, handle_of, kv_of

TOKEN = (2,)


def _record(
    pool: ss.KVPool, fill: float, tokens: int, window: int | None = None
) -> ss.SessionState:
    kv = (torch.arange(tokens * 2.0).view(tokens, 2) + fill).to(pool.storage.dtype)
    cache = ss.KVCache(name="kv").allocate().append(pool, kv, window=window)
    return ss.SessionState(objects={"kv": cache})


def _stepper(pool: ss.KVPool, window: int | None, n_new: int) -> Any:
    dtype = pool.storage.dtype

    def step(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, torch.Tensor]:
        cache = state.object("kv", ss.KVCache)
        kv = cache.read()
        assert kv is not None
        out = kv.float().sum(dim=0) * x
        new = out.to(dtype)[None].expand(n_new, 2) + torch.arange(n_new, dtype=dtype)[:, None]
        return state.with_object("kv", cache.append(pool, new.contiguous(), window=window)), out

    return step


def _free_is_total_less_live(pool: ss.KVPool, records: list[ss.SessionState]) -> None:
    gc.collect()
    live = {b for r in records for b in handle_of(r).blocks}
    assert pool.free_blocks == pool.num_blocks - len(live)


@pytest.mark.parametrize("block_tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [0, 5])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("n_new", [0, 3])
@pytest.mark.parametrize("fork", [False, True])
def test_a_batched_step_is_each_session_stepped_on_the_pool(
    block_tokens: int, dtype: torch.dtype, tokens: int, window: int | None, n_new: int, fork: bool
) -> None:
    pool = ss.KVPool(64, block_tokens=block_tokens, token_shape=TOKEN, dtype=dtype, name="kv")
    setup = 2 if fork else None  # handles a window trimmed, or not
    records = [_record(pool, 0.0, tokens, window=setup), _record(pool, 100.0, tokens, window=setup)]
    if fork:  # a handle two records hold, beside one of its own
        records = [records[0], *records]
    step = _stepper(pool, window, n_new)
    xs = torch.arange(len(records) * 2.0).view(len(records), 2)
    batch, outs = ss.vmap(step)(ss.stack(records), xs)
    stepped = ss.unstack(batch)
    del batch
    alone = [step(r, x) for r, x in zip(records, xs, strict=True)]
    for got, out, (want, want_out) in zip(stepped, outs, alone, strict=True):
        assert torch.equal(kv_of(got), kv_of(want))
        assert handle_of(got).tokens == handle_of(want).tokens
        assert torch.equal(out, want_out)
    _free_is_total_less_live(pool, records + stepped + [r for r, _ in alone])


def test_unstacking_twice_gives_two_sets_of_handles_reading_alike() -> None:
    pool = ss.KVPool(16, block_tokens=2, token_shape=TOKEN, name="kv")
    records = [_record(pool, float(i), 3) for i in range(2)]
    batch, _ = ss.vmap(_stepper(pool, None, 1))(ss.stack(records), torch.ones(2, 2))
    first, second = ss.unstack(batch), ss.unstack(batch)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(kv_of(a), kv_of(b))
        assert handle_of(a).blocks != handle_of(b).blocks  # each commit is its own
    del batch
    _free_is_total_less_live(pool, records + first + second)


def test_a_batch_of_handles_a_rolled_back_step_made_is_refused_as_stale() -> None:
    pool = ss.KVPool(16, block_tokens=2, token_shape=TOKEN, name="kv")
    made: list[Any] = []

    def rolled_back() -> None:
        with pool.transaction():
            record = _record(pool, 1.0, 3)
            made.extend([record, ss.stack([record, record])])
            raise RuntimeError("the step was rolled back")

    with pytest.raises(RuntimeError, match="rolled back"):
        rolled_back()
    record, batch = made
    free = pool.free_blocks
    with pytest.raises(ss.StaleKVHandleError):
        ss.stack([record, record])
    with pytest.raises(ss.StaleKVHandleError):
        ss.unstack(batch)
    assert pool.free_blocks == free == pool.num_blocks


def test_empty_handles_stack_step_and_commit() -> None:
    pool = ss.KVPool(8, block_tokens=2, token_shape=TOKEN, name="kv")
    records = [
        ss.SessionState(objects={"kv": ss.KVCache(name="kv").allocate().commit(pool.empty())})
        for _ in range(2)
    ]
    step = _stepper(pool, None, 2)
    batch, _ = ss.vmap(step)(ss.stack(records), torch.ones(2, 2))
    stepped = ss.unstack(batch)
    del batch
    for got, record in zip(stepped, records, strict=True):
        assert torch.equal(kv_of(got), kv_of(step(record, torch.ones(2))[0]))
    _free_is_total_less_live(pool, stepped + records)


def test_exhausting_the_second_pool_in_a_commit_gives_the_first_its_blocks_back() -> None:
    big = ss.KVPool(16, block_tokens=2, token_shape=TOKEN, name="big")
    small = ss.KVPool(3, block_tokens=2, token_shape=TOKEN, name="small")

    def record(fill: float) -> ss.SessionState:
        a = ss.KVCache(name="a").allocate().append(big, torch.full((2, 2), fill))
        b = ss.KVCache(name="b").allocate().append(small, torch.full((1, 2), fill))
        return ss.SessionState(objects={"a": a, "b": b})

    def step(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, torch.Tensor]:
        a, b = state.object("a", ss.KVCache), state.object("b", ss.KVCache)
        state = state.with_object("a", a.append(big, x[None]))
        return state.with_object("b", b.append(small, torch.stack([x, x, x]))), x

    records = [record(1.0), record(2.0)]
    free = big.free_blocks, small.free_blocks
    batch, _ = ss.vmap(step)(ss.stack(records), torch.ones(2, 2))
    with pytest.raises(ss.KVPoolExhaustedError):
        ss.unstack(batch)
    del batch
    gc.collect()
    assert (big.free_blocks, small.free_blocks) == free
    assert [
        torch.equal(kv_of(r, "a"), torch.full((2, 2), f))
        for r, f in zip(records, (1.0, 2.0), strict=True)
    ] == [True, True]


def test_a_managers_batched_step_under_a_budget_that_parks_keeps_the_pool_and_stats_exact() -> None:
    # The pool holds the batch's steps only if sessions outside it are parked.
    pool = ss.KVPool(
        16, block_tokens=2, token_shape=TOKEN, name="kv", step_tokens=2, window_tokens=6
    )
    m: ss.SessionStateManager[ss.SessionState] = ss.SessionStateManager(
        pools=(pool,), max_bytes={"cpu": 2000}, park_tier="disk"
    )
    for i in range(5):
        m.put(f"s{i}", _record(pool, float(10 * i), 4))
    step = _stepper(pool, 6, 2)
    twin = ss.KVPool(64, block_tokens=2, token_shape=TOKEN, name="kv")
    twin_step = _stepper(twin, 6, 2)

    def batched(states: list[ss.SessionState]) -> tuple[list[ss.SessionState], list[Any]]:
        batch, outs = ss.vmap(step)(ss.stack(states), torch.ones(len(states), 2))
        return ss.unstack(batch), list(outs)

    rounds = (
        ["s0", "s1", "s2"],
        ["s3", "s4"],
        ["s2", "s0", "s1"],
        ["s4", "s3"],
        ["s0", "s3", "s1"],
    )
    for ids in rounds:  # sessions of one length per batch
        before = {sid: kv_of(m.require(sid)) for sid in ids}
        m.step_many(ids, batched, new=ss.SessionState)
        for sid in ids:  # the same step, alone, on a twin pool
            cache = ss.KVCache(name="kv").allocate().append(twin, before[sid])
            want = twin_step(ss.SessionState(objects={"kv": cache}), torch.ones(2))[0]
            assert torch.equal(kv_of(m.require(sid)), kv_of(want))
        assert_stats_equal_a_recount(m)
        resident = [
            r
            for r in (m.peek(sid) for sid in m.session_ids())
            if r is not None and isinstance(r.object("kv"), ss.KVCache)
        ]
        _free_is_total_less_live(pool, resident)
        del resident  # records kept outside the manager would hold their blocks
    assert m.stats()["kv_parks"] > 0
