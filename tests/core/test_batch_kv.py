"""Batches holding KV: `stack` gathers each session's blocks, `unstack` commits new tokens.

Each batched step is checked against the same sessions stepped one by one on a twin pool: the
KV reads `torch.equal`, the outputs too, and both pools have the same free blocks, which are
the pool's blocks less those the live handles hold. A commit that fails leaves the pool and
the records as they were.
"""

from __future__ import annotations

import gc
from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sessionstate as ss
from sessionstate._kv._cache import GatheredKV
from tests.support import handle_of, kv_of

TOKEN = (2,)


def _pool(blocks: int = 32, name: str = "kv") -> ss.KVPool:
    return ss.KVPool(blocks, block_tokens=2, token_shape=TOKEN, name=name)


def _record(pool: ss.KVPool, fill: float, tokens: int = 3) -> ss.SessionState:
    kv = torch.arange(tokens * 2.0).view(tokens, 2) + fill
    cache = ss.KVCache(name="kv").allocate().append(pool, kv)
    return ss.SessionState(objects={"kv": cache}, attrs={"x": torch.full((2,), fill)})


def _stepper(pool: ss.KVPool, window: int | None) -> Any:
    # A pure step: read the session's KV, append two tokens computed from it and the input.
    def step(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, torch.Tensor]:
        cache = state.object("kv", ss.KVCache)
        kv = cache.read()
        assert kv is not None
        out = kv.sum(dim=0) * x
        new = torch.stack([out, out + 1.0])
        state = state.with_object("kv", cache.append(pool, new, window=window))
        return state, out

    return step


def _live_blocks(records: list[ss.SessionState]) -> int:
    return len({b for r in records for b in handle_of(r).blocks})


def test_unstack_of_a_stack_gives_back_each_record_its_handle() -> None:
    pool = _pool()
    records = [_record(pool, float(10 * i)) for i in range(3)]
    free = pool.free_blocks
    batch = ss.stack(records)
    (kv,) = [x for x in batch.leaves if isinstance(x, GatheredKV)]
    assert kv.tokens.shape == (3, 3, *TOKEN)
    for i, r in enumerate(records):
        assert torch.equal(kv.tokens[i], kv_of(r))
    for copy in (True, False):
        back = ss.unstack(batch, copy=copy)
        for got, want in zip(back, records, strict=True):
            assert handle_of(got) is handle_of(want)
            assert ss.tree_equal(got, want)
    assert pool.free_blocks == free


@pytest.mark.parametrize("window", [None, 3, 0])
def test_a_vmapped_step_over_kv_is_each_session_stepped_with_the_pool(window: int | None) -> None:
    batched, alone = _pool(), _pool()
    step_b, step_a = _stepper(batched, window), _stepper(alone, window)
    records = [_record(batched, float(i)) for i in range(4)]
    singles = [_record(alone, float(i)) for i in range(4)]
    xs = torch.arange(8.0).view(4, 2) / 7.0
    for _ in range(3):
        batch, outs = ss.vmap(step_b)(ss.stack(records), xs)
        records = ss.unstack(batch)
        del batch
        stepped = [step_a(s, x) for s, x in zip(singles, xs, strict=True)]
        singles = [s for s, _ in stepped]
        for got, want, out, (_, expected) in zip(records, singles, outs, stepped, strict=True):
            assert torch.equal(kv_of(got), kv_of(want))
            assert handle_of(got).tokens == handle_of(want).tokens
            assert torch.equal(out, expected)
            assert torch.equal(got.attrs["x"], want.attrs["x"])
        gc.collect()
        assert batched.free_blocks == alone.free_blocks
        assert batched.free_blocks == batched.num_blocks - _live_blocks(records)
        xs = xs + 1.0


def test_forks_of_one_handle_are_read_once_and_branch_on_commit() -> None:
    batched, alone = _pool(), _pool()
    step_b, step_a = _stepper(batched, None), _stepper(alone, None)
    source, twin = _record(batched, 1.0), _record(alone, 1.0)
    batch = ss.stack([source] * 3)
    (kv,) = [x for x in batch.leaves if isinstance(x, GatheredKV)]
    assert kv.tokens.shape == (3, *TOKEN)  # one read, unbatched, as a shared tensor stays
    assert batch.shared == 2  # the KV and the attr every fork holds
    # Unstepped forks share their handle again.
    assert {id(handle_of(r)) for r in ss.unstack(batch)} == {id(handle_of(source))}
    xs = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    stepped, _ = ss.vmap(step_b)(batch, xs)
    forks = ss.unstack(stepped)
    del stepped
    wants = [step_a(twin, x)[0] for x in xs]
    for fork, want in zip(forks, wants, strict=True):
        assert torch.equal(kv_of(fork), kv_of(want))
    assert torch.equal(kv_of(source), kv_of(twin))  # the source still reads its own tokens
    gc.collect()
    assert batched.free_blocks == alone.free_blocks
    assert batched.free_blocks == batched.num_blocks - _live_blocks([source, *forks])


def test_a_step_that_leaves_kv_unchanged_keeps_the_handles() -> None:
    pool = _pool()
    records = [_record(pool, float(i)) for i in range(3)]

    def bump(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, torch.Tensor]:
        return state.with_attrs(x=state.attrs["x"] + x), x

    batch, _ = ss.vmap(bump)(ss.stack(records), torch.ones(3, 2))
    back = ss.unstack(batch)
    assert all(handle_of(b) is handle_of(r) for b, r in zip(back, records, strict=True))


def test_gathered_kv_counts_as_tensor_bytes_while_batched() -> None:
    pool = _pool()
    records = [_record(pool, float(i)) for i in range(4)]
    held = ss.nbytes_by_device(records)["cpu"]
    batch = ss.stack(records)
    (kv,) = [x for x in batch.leaves if isinstance(x, GatheredKV)]
    attrs = 4 * 2 * 4  # the stacked attr `x`
    assert ss.nbytes_by_device(list(batch.leaves)) == {"cpu": 4 * 3 * 2 * 4 + attrs}
    assert kv.tokens.untyped_storage().nbytes() == 4 * 3 * 2 * 4  # exactly the tokens
    assert ss.nbytes_by_device(records)["cpu"] == held  # the pool's blocks, still held


def test_handles_of_different_lengths_or_pools_are_refused_naming_the_path() -> None:
    pool, other = _pool(), _pool(name="other")
    short, long = _record(pool, 0.0, tokens=3), _record(pool, 0.0, tokens=5)
    free = pool.free_blocks
    path = r"objects\['kv'\]\.handle: record 0 holds 3 tokens but record 1 holds 5"
    with pytest.raises(ValueError, match=path):
        ss.stack([short, long])
    with pytest.raises(ValueError, match=r"pool 'kv' but record 1's is in pool 'other'"):
        ss.stack([short, _record(other, 0.0)])
    assert pool.free_blocks == free


def test_a_commit_the_pool_cannot_hold_leaves_pool_and_records_as_before() -> None:
    pool = _pool(blocks=7)
    records = [_record(pool, float(i)) for i in range(3)]  # 6 blocks held, 1 free
    before = [kv_of(r).clone() for r in records]
    filled = list(pool._filled)
    step = _stepper(pool, None)
    # Each session's two new tokens need one block past its partial one: three, one free.
    batch, _ = ss.vmap(step)(ss.stack(records), torch.ones(3, 2))
    with pytest.raises(ss.KVPoolExhaustedError):
        ss.unstack(batch)
    gc.collect()
    assert pool.free_blocks == 1
    assert pool._filled == filled
    for r, kv in zip(records, before, strict=True):
        assert torch.equal(kv_of(r), kv)
    # The records step on as before: one at a time, the pool holds each step.
    del batch
    state, _ = step(records[0], torch.ones(2))
    assert handle_of(state).tokens == 5


@pytest.mark.parametrize("change", ["shrink", "rewrite"])
def test_a_step_that_rewrites_or_drops_kv_is_refused_naming_the_path(change: str) -> None:
    pool = _pool()
    records = [_record(pool, float(i)) for i in range(2)]
    free = pool.free_blocks

    def bad(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, torch.Tensor]:
        cache = state.object("kv", ss.KVCache)
        kv = cache.view()
        assert isinstance(kv, GatheredKV)
        tokens = kv.tokens[1:] if change == "shrink" else kv.tokens * x
        moved = attrs.evolve(kv, tokens=tokens)
        return state.with_object("kv", ss.KVCache(name="kv", handle=moved, allocated=True)), x

    batch, _ = ss.vmap(bad)(ss.stack(records), torch.full((2, 2), 2.0))
    with pytest.raises(ValueError, match=r"KV at .*\['kv'\].* of record 0: its"):
        ss.unstack(batch)
    assert pool.free_blocks == free


def test_a_batched_append_to_another_pool_or_of_another_dtype_is_refused() -> None:
    pool, other = _pool(), _pool(name="other")
    record = _record(pool, 0.0)
    cache = ss.stack([record, record]).leaves
    (kv,) = [x for x in cache if isinstance(x, GatheredKV)]
    with pytest.raises(ValueError, match="gathered from pool 'kv' with pool 'other'"):
        kv.append(other, torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"dtype torch\.float64"):
        kv.append(pool, torch.zeros(1, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match="`window` must be a non-negative int"):
        kv.append(pool, torch.zeros(1, 2), window=-1)


@settings(max_examples=15, deadline=None)
@given(
    block_tokens=st.integers(1, 3),
    tokens=st.integers(0, 5),
    forks=st.lists(st.booleans(), min_size=1, max_size=4),
    window=st.one_of(st.none(), st.integers(0, 4)),
    appends=st.lists(st.integers(0, 3), min_size=1, max_size=3),
)
def test_batched_kv_steps_as_the_pool_does_for_any_layout(
    block_tokens: int, tokens: int, forks: list[bool], window: int | None, appends: list[int]
) -> None:
    # Records that fork one handle or hold their own, stepped round after round (each round
    # appending its number of tokens), batched and one by one on a twin pool.
    pools = [ss.KVPool(64, block_tokens=block_tokens, token_shape=TOKEN) for _ in range(2)]

    def family(pool: ss.KVPool) -> list[ss.SessionState]:
        source = pool.append(pool.empty(), torch.arange(tokens * 2.0).view(tokens, 2))
        own = [
            pool.append(pool.empty(), torch.full((tokens, 2), float(i))) for i in range(len(forks))
        ]
        caches = [source if fork else mine for fork, mine in zip(forks, own, strict=True)]
        return [
            ss.SessionState(objects={"kv": ss.KVCache(name="kv").allocate().commit(h)})
            for h in caches
        ]

    def step_for(pool: ss.KVPool, k: int) -> Any:
        def step(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, Any]:
            cache = state.object("kv", ss.KVCache)
            kv = cache.read()
            assert kv is not None
            new = x.expand(k, 2) + kv.sum()
            return state.with_object("kv", cache.append(pool, new, window=window)), kv.sum()

        return step

    batched, singles = family(pools[0]), family(pools[1])
    for r, k in enumerate(appends):
        xs = torch.arange(len(forks) * 2.0).view(-1, 2) + r
        batch, outs = ss.vmap(step_for(pools[0], k))(ss.stack(batched), xs)
        batched = ss.unstack(batch)
        del batch
        stepped = [step_for(pools[1], k)(s, x) for s, x in zip(singles, xs, strict=True)]
        singles = [s for s, _ in stepped]
        for got, want, out, (_, expected) in zip(batched, singles, outs, stepped, strict=True):
            assert torch.equal(kv_of(got), kv_of(want))
            assert torch.equal(out, expected)
        gc.collect()
        assert pools[0].free_blocks == pools[1].free_blocks
        assert pools[0].free_blocks == 64 - _live_blocks(batched)


def test_a_managers_batched_step_stacks_and_unstacks_kv_all_or_nothing() -> None:
    # `step_many` runs the vmapped step inside the pool's transaction (unstack's nests in it):
    # a step that fails after unstack committed gives every new block back.
    pool = _pool(blocks=16)
    step = _stepper(pool, None)
    m: ss.SessionStateManager[ss.SessionState] = ss.SessionStateManager(pools=(pool,))
    ids = ["a", "b", "c"]
    for i, sid in enumerate(ids):
        m.put(sid, _record(pool, float(i)))
    xs = torch.ones(3, 2)

    def batched(states: list[ss.SessionState]) -> tuple[list[ss.SessionState], list[Any]]:
        batch, outs = ss.vmap(step)(ss.stack(states), xs)
        return ss.unstack(batch), list(outs)

    def failing(states: list[ss.SessionState]) -> tuple[list[ss.SessionState], list[Any]]:
        batched(states)
        raise RuntimeError("the step failed after its commit")

    before = [kv_of(m.peek(sid)).clone() for sid in ids]
    free = pool.free_blocks
    with pytest.raises(RuntimeError, match="after its commit"):
        m.step_many(ids, failing, new=ss.SessionState)
    gc.collect()
    assert pool.free_blocks == free
    expected = [step(m.peek(sid), x)[0] for sid, x in zip(ids, xs, strict=True)]
    m.step_many(ids, batched, new=ss.SessionState)
    for sid, kv, want in zip(ids, before, expected, strict=True):
        assert torch.equal(kv_of(m.peek(sid))[:3], kv)
        assert torch.equal(kv_of(m.peek(sid)), kv_of(want))
