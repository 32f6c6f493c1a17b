"""The engine-owned paged KV pool: handles, byte accounting, release and failure atomicity."""

from __future__ import annotations

import gc
import re

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import sessionstate as ss
from sessionstate import KVHandle, KVPool, KVPoolExhaustedError, SessionState, StaleKVHandleError


def _pool(blocks: int = 8, bt: int = 4, device: str = "cpu") -> KVPool:
    return KVPool(blocks, block_tokens=bt, token_shape=(2, 3), device=device, name="kv")


def _kv(n: int, start: float = 0.0, device: str = "cpu") -> torch.Tensor:
    return (torch.arange(n * 6, dtype=torch.float32) + start).reshape(n, 2, 3).to(device)


def _state(pool: KVPool) -> tuple[list[int], list[int], list[int]]:
    return sorted(pool._free), list(pool._refs), list(pool._filled)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_two_handles_sharing_k_blocks_count_each_block_once(device: str) -> None:
    pool = _pool(device=device)
    base = pool.append(pool.empty(), _kv(8, device=device))  # 2 full blocks, shared
    a = pool.append(base, _kv(4, 1, device))  # + 1 block: n1 = 3
    b = pool.append(base, _kv(6, 2, device))  # + 2 blocks: n2 = 4, k = 2
    n1, n2, k = len(a.blocks), len(b.blocks), len(set(a.blocks) & set(b.blocks))
    assert (n1, n2, k) == (3, 4, 2)
    expected = {device: (n1 + n2 - k) * pool.block_nbytes}
    assert ss.nbytes_by_device([a, b]) == expected
    manager = ss.SessionStateManager()
    manager.put("a", SessionState(attrs={"kv": a}))
    manager.put("b", SessionState(attrs={"kv": b}))
    stats = manager.stats()
    assert stats[f"nbytes:{device}"] == stats[f"engine_nbytes:{device}"] == expected[device]
    assert stats["total_nbytes"] == expected[device]
    assert manager.nbytes_by_session() == {
        "a": {device: n1 * pool.block_nbytes},
        "b": {device: n2 * pool.block_nbytes},
    }


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_view_of_the_pool_and_a_handle_to_its_blocks_count_once(device: str) -> None:
    pool = _pool(device=device)
    h = pool.append(pool.empty(), _kv(6, device=device))
    whole = pool.storage.untyped_storage().nbytes()
    # A view keeps the whole pool alive, so it reports all of it; the handle adds nothing.
    assert ss.nbytes_by_device([pool.storage[1:2], h]) == {device: whole}
    assert ss.nbytes_by_device([h, pool.storage[:1]]) == {device: whole}
    assert ss.nbytes_by_device([h, h]) == {device: 2 * pool.block_nbytes}
    manager = ss.SessionStateManager()
    manager.put("s", SessionState(attrs={"kv": h, "view": pool.storage[:1]}))
    stats = manager.stats()
    assert stats[f"nbytes:{device}"] == stats["total_nbytes"] == whole
    assert stats[f"engine_nbytes:{device}"] == 2 * pool.block_nbytes


def test_free_blocks_belong_to_nobody_and_nbytes_by_value_lists_the_handle() -> None:
    pool = _pool()
    h = pool.append(pool.empty(), _kv(5))
    state = SessionState(attrs={"kv": h, "x": torch.zeros(2)})
    assert state.nbytes_by_value() == {"kv": {"cpu": 2 * pool.block_nbytes}, "x": {"cpu": 8}}
    assert ss.nbytes_by_device(pool.empty()) == {}
    assert pool.free_blocks == 6


def test_older_handles_keep_their_prefix_and_branches_copy_on_write() -> None:
    pool = _pool()
    base = pool.append(pool.empty(), _kv(5))
    first = pool.append(base, _kv(2, 100))
    second = pool.append(base, _kv(2, 200))  # the shared last block was written past base
    assert torch.equal(base.read(), _kv(5))
    assert torch.equal(first.read(), torch.cat([_kv(5), _kv(2, 100)]))
    assert torch.equal(second.read(), torch.cat([_kv(5), _kv(2, 200)]))
    assert first.blocks[0] == second.blocks[0]
    assert first.blocks[1] != second.blocks[1]


def test_blocks_return_when_the_last_handle_goes() -> None:
    pool = _pool()
    manager = ss.SessionStateManager(max_sessions=1)
    manager.put("a", SessionState(attrs={"kv": pool.append(pool.empty(), _kv(9))}))
    held = manager.get("a")
    manager.put("b", SessionState(attrs={"kv": pool.append(pool.empty(), _kv(1))}))  # evicts a
    assert pool.free_blocks == 8 - 3 - 1  # the holder keeps a's blocks alive
    assert held is not None
    assert torch.equal(held.attrs["kv"].read(), _kv(9))
    del held
    assert pool.free_blocks == 8 - 1
    manager.drop("b")
    assert pool.free_blocks == 8


def test_a_failed_transaction_leaves_the_pool_as_before() -> None:
    pool = _pool()
    kept = pool.append(pool.empty(), _kv(5))
    before = _state(pool)
    made: list[ss.KVHandle] = []

    def failing_step() -> None:
        with pool.transaction():
            made.append(pool.append(kept, _kv(9, 7)))
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        failing_step()
    grown = made.pop()
    assert _state(pool) == before
    assert torch.equal(kept.read(), _kv(5))
    assert not grown.alive
    assert ss.nbytes_by_device(grown) == {}
    msg = (
        f"Cannot read {grown!r}: it was made by a step that failed and was rolled back, and "
        "its blocks went back to KV pool 'kv'. Use the handle of the session's stored record."
    )
    with pytest.raises(StaleKVHandleError, match=re.escape(msg)):
        grown.read()
    msg = msg.replace("Cannot read", "Cannot append to")
    with pytest.raises(StaleKVHandleError, match=re.escape(msg)):
        pool.append(grown, _kv(1))
    assert _state(pool) == before  # the refused append took nothing
    del grown
    gc.collect()
    assert _state(pool) == before


def test_exhaustion_and_misuse_messages() -> None:
    pool = _pool(blocks=2)
    msg = (
        "KV pool 'kv' has no free block: all 2 blocks of 4 tokens are held by live handles. "
        "Drop finished sessions (or records you keep), or build the pool with more blocks."
    )
    with pytest.raises(KVPoolExhaustedError, match=re.escape(msg)):
        pool.append(pool.empty(), _kv(9))
    assert pool.free_blocks == 2  # nothing leaked by the failed append
    other = _pool()
    h = other.append(other.empty(), _kv(1))
    msg = (
        f"Cannot append to {h!r} (KVHandle) with KV pool 'kv': it is not a handle of this "
        "pool. Use the handle stored in this pipeline's session record."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        pool.append(h, _kv(1))
    msg = (
        "KV pool 'kv' stores tokens of shape (2, 3), got a `kv` of shape (1, 3); pass a "
        "tensor of shape (n, *(2, 3))."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        pool.append(pool.empty(), torch.zeros(1, 3))
    with pytest.raises(
        ValueError, match=re.escape("`num_blocks` must be a non-negative int, got -1 (int).")
    ):
        KVPool(-1, block_tokens=1, token_shape=())
    with pytest.raises(
        ValueError, match=re.escape("`block_tokens` must be a positive int, got 0 (int).")
    ):
        KVPool(1, block_tokens=0, token_shape=())


def test_a_pool_of_no_blocks_has_a_block_size_and_refuses_an_append() -> None:
    pool = KVPool(0, block_tokens=4, token_shape=(2,), name="none")
    assert (pool.num_blocks, pool.free_blocks, pool.block_nbytes) == (0, 0, 4 * 2 * 4)
    assert pool.empty().read().shape == (0, 2)
    with pytest.raises(KVPoolExhaustedError):
        pool.append(pool.empty(), torch.zeros(1, 2))
    assert pool.free_blocks == 0


def test_a_saved_empty_pool_restores_as_a_pool_of_no_blocks() -> None:
    pool = KVPool(4, block_tokens=2, token_shape=(3,), name="kv")
    (back,) = KVHandle.__sessionstate_restore__(
        KVHandle.__sessionstate_snapshot__([("kv", pool.empty())])
    )
    assert back.pool.num_blocks == 0
    assert back.pool.block_tokens == 2
    assert back.pool.block_nbytes == pool.block_nbytes
    assert back.tokens == 0
    assert torch.equal(back.read(), pool.empty().read())


class PoolMachine(RuleBasedStateMachine):
    """Sessions step, reset, drop and get evicted under a random cap; a model tracks the KV."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = _pool(blocks=64, bt=3)
        self.initial = self.pool.free_blocks
        self.manager: ss.SessionStateManager | None = None
        self.model: dict[str, torch.Tensor] = {}
        self.counter = 0

    @rule(cap=st.integers(1, 4))
    @precondition(lambda self: self.manager is None)
    def start(self, cap: int) -> None:
        self.manager = ss.SessionStateManager(max_sessions=cap)

    @rule(sid=st.sampled_from("abcde"), n=st.integers(1, 5), fail=st.booleans())
    @precondition(lambda self: self.manager is not None)
    def step(self, sid: str, n: int, fail: bool) -> None:
        assert self.manager is not None
        state = self.manager.get(sid)
        handle = self.pool.empty() if state is None else state.attrs["kv"]
        self.counter += 1
        kv = _kv(n, 1000.0 * self.counter)
        before = _state(self.pool)
        try:
            with self.pool.transaction():
                new = self.pool.append(handle, kv, window=7)
                if fail:
                    raise RuntimeError("injected")
                self.manager.put(sid, SessionState(attrs={"kv": new}))
        except RuntimeError:
            assert _state(self.pool) == before
            return
        previous = self.model.get(sid, torch.zeros(0, 2, 3)) if state is not None else None
        tokens = torch.cat([previous, kv]) if previous is not None else kv
        drop = 0
        while tokens.shape[0] - drop - 3 >= 7:
            drop += 3
        self.model[sid] = tokens[drop:]
        for gone in set(self.model) - set(self.manager.session_ids()):
            del self.model[gone]

    @rule(sid=st.sampled_from("abcde"))
    @precondition(lambda self: self.manager is not None)
    def reset(self, sid: str) -> None:
        assert self.manager is not None
        if self.manager.peek(sid) is not None:
            self.manager.put(sid, SessionState(attrs={"kv": self.pool.empty()}))
            self.model[sid] = torch.zeros(0, 2, 3)

    @rule(sid=st.sampled_from("abcde"))
    @precondition(lambda self: self.manager is not None)
    def drop(self, sid: str) -> None:
        assert self.manager is not None
        self.manager.drop(sid)
        self.model.pop(sid, None)

    @invariant()
    def reads_match_the_model_and_bytes_match_the_blocks(self) -> None:
        if self.manager is None:
            return
        held: set[int] = set()
        for sid in self.manager.session_ids():
            state = self.manager.peek(sid)
            assert state is not None
            handle = state.attrs["kv"]
            assert torch.equal(handle.read(), self.model[sid])
            held.update(handle.blocks)
        assert self.pool.free_blocks == self.initial - len(held)
        engine = self.manager.stats().get("engine_nbytes:cpu", 0)
        assert engine == len(held) * self.pool.block_nbytes

    def teardown(self) -> None:
        if self.manager is not None:
            self.manager.clear()
        self.model.clear()
        assert self.pool.free_blocks == self.initial


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)


# -- refused arguments: a negative window, a dtype conversion (issue 20, item 20) ---------------


@pytest.mark.parametrize("window", [-1, -3])
def test_a_negative_window_is_refused_and_the_pool_is_unchanged(window: int) -> None:
    pool = KVPool(4, block_tokens=2, token_shape=())
    first = pool.append(pool.empty(), torch.arange(3.0))
    msg = (
        f"`window` must be a non-negative int (the newest tokens to keep), got {window}; pass "
        "None to keep every token."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        pool.append(first, torch.arange(2.0), window=window)
    assert pool.free_blocks == 2
    assert torch.equal(first.read(), torch.arange(3.0))


@pytest.mark.parametrize("window", [1.5, True, "2"])
def test_a_window_that_is_not_an_int_is_refused(window: object) -> None:
    pool = KVPool(2, block_tokens=2, token_shape=())
    msg = (
        f"`window` must be an int (the newest tokens to keep) or None, got {window!r} "
        f"({type(window).__name__})."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        pool.append(pool.empty(), torch.arange(2.0), window=window)  # type: ignore[arg-type]
    assert pool.free_blocks == 2


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64])
def test_append_never_converts_a_dtype(dtype: torch.dtype) -> None:
    pool = KVPool(2, block_tokens=2, token_shape=())
    name = str(dtype).removeprefix("torch.")
    msg = (
        f"KV pool 'kv_pool' stores float32 tokens, got a `kv` of dtype {name}; the pool never "
        f"converts dtypes. Cast it first (`kv.to(torch.float32)`), or build the pool with "
        f"`dtype={dtype}`."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        pool.append(pool.empty(), torch.ones(2, dtype=dtype))
    assert pool.free_blocks == 2


def test_adopt_never_converts_a_dtype() -> None:
    wide = KVPool(2, block_tokens=2, token_shape=(), dtype=torch.float64, name="wide")
    narrow = KVPool(2, block_tokens=2, token_shape=(), name="narrow")
    handle = wide.append(wide.empty(), torch.tensor([0.1, 0.2], dtype=torch.float64))
    msg = (
        "Cannot adopt a handle of KV pool 'wide' (float64 tokens) into KV pool 'narrow' "
        "(float32 tokens): the pool never converts dtypes. Continue the record on a pool of its "
        "dtype."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        narrow.adopt(handle)
    assert narrow.free_blocks == 2
    same = KVPool(2, block_tokens=2, token_shape=(), dtype=torch.float64)
    assert torch.equal(same.adopt(handle).read(), handle.read())


def test_read_many_gathers_every_handle_in_one_copy_of_exactly_its_tokens() -> None:
    from sessionstate._kv._pool import read_many

    pool = _pool(blocks=12)
    a = pool.append(pool.empty(), _kv(6))
    b = pool.append(pool.append(pool.empty(), _kv(2, 100.0)), _kv(4, 200.0))  # two appends
    c = pool.append(pool.append(pool.empty(), _kv(9, 50.0)), _kv(1), window=6)  # windowed
    assert c.tokens == 6
    before = _state(pool)
    got = read_many([a, b, c, a])
    assert got.shape == (4, 6, 2, 3)
    for row, handle in zip(got, [a, b, c, a], strict=True):
        assert torch.equal(row, handle.read())
    assert got.is_contiguous()
    assert got.untyped_storage().nbytes() == 4 * 6 * 6 * 4  # the tokens, not whole blocks
    assert _state(pool) == before  # a read takes and writes nothing
    assert read_many([pool.empty()]).shape == (1, 0, 2, 3)


def test_read_many_refuses_a_stale_handle() -> None:
    from sessionstate._kv._pool import read_many

    pool = _pool()
    kept = pool.append(pool.empty(), _kv(2))
    made: list[KVHandle] = []

    def failing_step() -> None:
        with pool.transaction():
            made.append(pool.append(pool.empty(), _kv(2)))
            raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError):
        failing_step()
    (dead,) = made
    with pytest.raises(StaleKVHandleError):
        read_many([kept, dead])
