"""Parking moves a `KVHandle`'s blocks: the offload protocol, `park_tree`, the manager, the planner.

The pool offloads only the tokens the handles hold (shared blocks once) and reloads them on
fresh blocks of the same pool, all or nothing; parking a session gives its blocks back to the
pool; `park_until` parks the least recently used sessions' KV until a predicate holds.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from sessionstate import (
    KVCache,
    KVHandle,
    KVPool,
    KVPoolExhaustedError,
    OffloadsStorages,
    SessionState,
    SessionStateManager,
    StateObject,
    TensorCache,
    tree_equal,
)
from sessionstate._kv._pool import offload_payload, reload_handles
from sessionstate._storage import park_tree
from sessionstate.testing import recount_nbytes_by_device

TIERS = ["host", "disk"]


def _branches(pool: KVPool) -> tuple[KVHandle, KVHandle, KVHandle]:
    """A prefix of 5 tokens and two branches of it: one in place, one copied on write (7 blocks)."""
    g = torch.Generator().manual_seed(0)
    prefix = pool.append(pool.empty(), torch.randn(5, 2, generator=g))
    left = pool.append(prefix, torch.randn(4, 2, generator=g))
    right = pool.append(prefix, torch.randn(2, 2, generator=g))  # block 2 copied
    return prefix, left, right


def test_kvhandle_implements_the_offload_protocol() -> None:
    assert issubclass(KVHandle, OffloadsStorages)


def test_offload_and_reload_round_trip_keeps_reads_and_sharing_and_frees_the_pool() -> None:
    pool = KVPool(12, block_tokens=2, token_shape=(2,))
    start = pool.free_blocks
    handles = _branches(pool)
    reads = [h.read() for h in handles]
    held = pool.num_blocks - pool.free_blocks
    payload = offload_payload([(str(i), h) for i, h in enumerate(handles)])
    # Each shared block once: exactly the blocks the handles hold.
    assert payload["pools"][0]["blocks"].shape[0] == held
    del handles
    assert pool.free_blocks == start
    back = reload_handles(payload)
    assert [torch.equal(h.read(), r) for h, r in zip(back, reads, strict=True)] == [True] * 3
    assert all(h.pool is pool for h in back)
    prefix, left, right = back
    assert left.blocks[:2] == prefix.blocks[:2] == right.blocks[:2]  # shared again
    assert left.blocks[2] == prefix.blocks[2] != right.blocks[2]  # the copy stays a copy
    assert pool.num_blocks - pool.free_blocks == held
    # Appending past a branch's end still copies on write: the others read what they read.
    grown = pool.append(prefix, torch.full((1, 2), 7.0))
    assert torch.equal(left.read(), reads[1])
    assert torch.equal(grown.read()[:-1], reads[0])
    del back, prefix, left, right, grown
    assert pool.free_blocks == start
    # A payload may be reloaded again (each time on fresh blocks).
    again = reload_handles(payload)
    assert torch.equal(again[1].read(), reads[1])
    del again
    assert pool.free_blocks == start


def test_reload_into_a_pool_lacking_blocks_raises_with_the_bytes_and_takes_nothing() -> None:
    pool = KVPool(8, block_tokens=2, token_shape=(2,), name="kv")
    payload = offload_payload([(str(i), h) for i, h in enumerate(_branches(pool))])
    filler = pool.append(pool.empty(), torch.zeros(8, 2))  # 4 of 8 blocks: 4 free, 7 needed
    free = pool.free_blocks
    with pytest.raises(KVPoolExhaustedError) as info:
        reload_handles(payload)
    message = str(info.value)
    assert f"{7 * pool.block_nbytes} bytes" in message
    assert f"{free * pool.block_nbytes} bytes" in message
    assert "'kv'" in message
    assert pool.free_blocks == free
    del filler
    assert len(reload_handles(payload)) == 3


def test_a_reload_over_two_pools_is_all_or_nothing() -> None:
    roomy = KVPool(8, block_tokens=2, token_shape=(2,))
    tight = KVPool(4, block_tokens=2, token_shape=(2,))
    a = roomy.append(roomy.empty(), torch.ones(4, 2))
    b = tight.append(tight.empty(), torch.ones(4, 2))
    payload = offload_payload([("a", a), ("b", b)])
    del a, b
    hog = tight.append(tight.empty(), torch.zeros(6, 2))  # 1 block left, 2 needed
    with pytest.raises(KVPoolExhaustedError):
        reload_handles(payload)
    assert (roomy.free_blocks, tight.free_blocks) == (8, 1)  # the roomy pool gave its back
    del hog


def test_a_reload_whose_second_pool_fails_gives_the_first_pools_blocks_back_once() -> None:
    # A copy into the second pool fails (as a device allocation can) after the first pool's
    # blocks were taken and filled: they go back once, and its next append gets distinct blocks.
    p1 = KVPool(4, block_tokens=2, token_shape=(2,), name="p1")
    p2 = KVPool(4, block_tokens=2, token_shape=(2,), name="p2")
    both = {
        "a": p1.append(p1.empty(), torch.ones(3, 2)),
        "b": p2.append(p2.empty(), torch.ones(3, 2)),
    }
    parked = SessionState(objects={"kv": TensorCache().allocate().commit(both)}).park("host")
    del both
    assert (p1.free_blocks, p2.free_blocks) == (4, 4)

    def failing_copy(*args: object, **kwargs: object) -> None:
        raise RuntimeError("device allocation failed")

    p2._fill = failing_copy  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device allocation failed"):
        parked.unpark()
    assert (p1.free_blocks, p2.free_blocks) == (4, 4)
    filler = p1.append(p1.empty(), torch.arange(16.0).reshape(8, 2))
    assert sorted(filler.blocks) == [0, 1, 2, 3]  # each block handed out once
    assert torch.equal(filler.read(), torch.arange(16.0).reshape(8, 2))
    assert p1.free_blocks == 0
    del filler, p2._fill
    back = parked.unpark().object("kv", TensorCache).view()  # the session stayed parked
    assert torch.equal(back["a"].read(), torch.ones(3, 2))  # type: ignore[index]
    assert torch.equal(back["b"].read(), torch.ones(3, 2))  # type: ignore[index]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_a_reload_of_handles_in_any_order_reads_back_bit_identical(order: tuple[int, ...]) -> None:
    # The prefix and its in-place branch share a block the branch fills further: whichever is
    # listed last, the reloaded block holds the longest fill.
    pool = KVPool(12, block_tokens=2, token_shape=(2,))
    branches = _branches(pool)
    handles = [branches[i] for i in order]
    del branches
    reads = [h.read() for h in handles]
    record = SessionState(objects={"kv": TensorCache().allocate().commit(handles)})
    del handles
    parked = record.park("host")
    del record
    back = parked.unpark().object("kv", TensorCache).view()
    assert [torch.equal(h.read(), r) for h, r in zip(back, reads, strict=True)] == [True] * 3  # type: ignore[arg-type]


def test_an_append_after_a_reload_fills_the_handles_own_last_block_in_place() -> None:
    pool = KVPool(8, block_tokens=2, token_shape=(2,))
    record = SessionState(objects={"kv": KVCache().allocate().append(pool, torch.ones(3, 2))})
    back = record.park("host").unpark().object("kv", KVCache)
    del record
    handle = back.view()
    assert handle is not None
    free = pool.free_blocks
    grown = pool.append(handle, torch.zeros(1, 2))  # block 2 of 2 is the handle's alone
    assert (grown.blocks, pool.free_blocks) == (handle.blocks, free)
    assert torch.equal(grown.read(), torch.cat([torch.ones(3, 2), torch.zeros(1, 2)]))


def test_reloaded_handles_survive_a_step_that_rolls_back() -> None:
    pool = KVPool(8, block_tokens=2, token_shape=(2,))
    handle = pool.append(pool.empty(), torch.ones(3, 2))
    payload = offload_payload([("kv", handle)])
    del handle
    with pytest.raises(RuntimeError), pool.transaction():  # noqa: PT012
        (back,) = reload_handles(payload)
        pool.append(back, torch.zeros(2, 2))
        raise RuntimeError("the step failed")
    assert back.alive  # an unparked record's handle is no step's to take back
    assert torch.equal(back.read(), torch.ones(3, 2))
    assert pool.free_blocks == 8 - 2


@pytest.mark.parametrize("tier", TIERS)
def test_park_tree_moves_handles_and_gives_the_blocks_back(tier: str, tmp_path: Path) -> None:
    pool = KVPool(12, block_tokens=2, token_shape=(2,))
    handles = _branches(pool)
    reads = [h.read() for h in handles]
    x = torch.arange(4.0)
    tree = {"kv": list(handles), "x": x, "view": x[1:]}
    parked = park_tree(tree, tier, spool_dir=tmp_path)
    assert parked.engine == {}
    assert parked.nbytes_by_device == {"cpu": 7 * pool.block_nbytes + 16}
    del tree, handles
    assert pool.free_blocks == 12
    back = parked.restore()
    assert [torch.equal(h.read(), r) for h, r in zip(back["kv"], reads, strict=True)] == [True] * 3
    assert back["kv"][0].blocks[:2] == back["kv"][1].blocks[:2]
    assert back["x"].untyped_storage().data_ptr() == back["view"].untyped_storage().data_ptr()
    assert pool.free_blocks == 12 - 7
    parked.release()


def test_parking_a_rolled_back_handle_is_refused_by_name() -> None:
    pool = KVPool(4, block_tokens=2, token_shape=(2,))
    with pytest.raises(RuntimeError), pool.transaction():  # noqa: PT012
        dead = pool.append(pool.empty(), torch.ones(1, 2))
        raise RuntimeError("the step failed")
    with pytest.raises(Exception, match=r"Cannot park the leaf at `\['kv'\]`"):
        park_tree({"kv": dead})


def test_kvcache_is_a_parkable_state_object() -> None:
    pool = KVPool(4, block_tokens=2, token_shape=())
    cache = KVCache(name="kv").allocate()
    assert isinstance(cache, StateObject)
    assert cache.parkable
    assert cache.view() is None
    assert cache.read() is None
    cache = cache.append(pool, torch.arange(3.0), window=None)
    assert torch.equal(cache.read(), torch.arange(3.0))  # type: ignore[arg-type]
    other = KVPool(4, block_tokens=2, token_shape=())
    moved = cache.append(other, torch.ones(1))  # adopted into the other pool first
    assert moved.view().pool is other  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="holds a KVHandle"):
        cache.commit(torch.zeros(1))  # type: ignore[arg-type]
    assert cache.reset().view() is None
    assert not cache.evict().is_allocated


@pytest.mark.parametrize("tier", TIERS)
def test_the_manager_parks_a_session_with_its_kv(tier: str, tmp_path: Path) -> None:
    pool = KVPool(16, block_tokens=2, token_shape=(4,))
    records = {}
    for i, sid in enumerate("abc"):
        cache = KVCache().allocate().append(pool, torch.full((5, 4), float(i)))
        feat = TensorCache().allocate().commit(torch.full((8,), float(i)))
        records[sid] = SessionState(objects={"kv": cache, "feat": feat})
    del cache
    one = records["a"].nbytes_by_device()["cpu"]
    want = {sid: r.object("kv", KVCache).read() for sid, r in records.items()}
    m = SessionStateManager(max_bytes={"cpu": 2 * one}, park_tier=tier, spool_dir=tmp_path)  # type: ignore[arg-type]
    for sid in "abc":
        m.put(sid, records.pop(sid))
    stats = m.stats()
    assert m.peek("a").parked == ("kv", "feat")  # type: ignore[union-attr]
    assert (stats["kv_parks"], stats["evictions"]) == (1, 0)
    assert pool.free_blocks == 16 - 2 * 3  # a's blocks went back to the pool
    assert stats["engine_nbytes:cpu"] == 2 * 3 * pool.block_nbytes
    assert stats["nbytes:cpu"] == 2 * one
    assert stats[f"nbytes_parked:{tier}"] == one
    for sid in "abc":
        got = m.get(sid)
        assert got is not None
        assert torch.equal(got.object("kv", KVCache).read(), want[sid])  # type: ignore[arg-type]
    stats = m.stats()
    assert stats["kv_unparks"] >= 1
    held = [m.peek(sid) for sid in m.session_ids()]
    assert {k: v for k, v in stats.items() if k.startswith("nbytes:")} == {
        f"nbytes:{d}": n for d, n in recount_nbytes_by_device(held).items()
    }
    m.clear()
    del got, held
    assert pool.free_blocks == 16


def test_park_until_parks_the_least_recently_used_kv_never_the_kept_session() -> None:
    pool = KVPool(6, block_tokens=2, token_shape=())
    m = SessionStateManager()
    for sid in "abc":
        cache = KVCache().allocate().append(pool, torch.ones(4))
        feat = TensorCache().allocate().commit(torch.ones(2))
        m.put(sid, SessionState(objects={"kv": cache, "feat": feat}))
        del cache
    assert pool.free_blocks == 0
    assert m.park_until(lambda: pool.free_blocks >= 2, frees=pool.owns_entry, keep=("a",))
    # `a` is kept, `b` (the least recently used of the others) gives its KV, only its KV.
    assert [m.peek(s).parked for s in "abc"] == [(), ("kv",), ()]  # type: ignore[union-attr]
    assert pool.free_blocks == 2
    assert m.stats()["kv_parks"] == 1
    # Nothing else to park for the pool: it says so, and parks nothing that frees nothing.
    assert not m.park_until(lambda: pool.free_blocks >= 6, frees=pool.owns_entry, keep=("a",))
    assert [m.peek(s).parked for s in "abc"] == [(), ("kv",), ("kv",)]  # type: ignore[union-attr]
    other = KVPool(2, block_tokens=2, token_shape=())
    assert not m.park_until(lambda: False, frees=other.owns_entry)
    assert m.peek("a").parked == ()  # type: ignore[union-attr]
    got = m.get("b")
    assert got is not None
    assert torch.equal(got.object("kv", KVCache).read(), torch.ones(4))  # type: ignore[arg-type]
    assert tree_equal(got.object("feat"), TensorCache().allocate().commit(torch.ones(2)))
