"""The host buffer pool: its allocator, limits and threads, and the host tier parking into it."""

from __future__ import annotations

import gc
import itertools
import random
import threading
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sessionstate as ss
from sessionstate import LatentBuffer, TensorCache, nbytes_by_device, tree_equal
from sessionstate._storage import HostBufferPool, HostPoolFullError, park_tree
from sessionstate._storage._park import copy_storages_to_devices, copy_storages_to_host
from tests.support import alias_graph


def _pool(nbytes: int = 4096, **kwargs: Any) -> HostBufferPool:
    return HostBufferPool(nbytes, pin_memory=False, **kwargs)


def _runs(pool: HostBufferPool) -> list[tuple[int, int]]:
    pool.stats()  # applies queued returns
    return list(zip(pool._free_offsets, pool._free_sizes, strict=True))


# -- the allocator -------------------------------------------------------------------------------


def test_allocate_free_and_coalesce() -> None:
    pool = _pool(1024, alignment=64)
    a, b, c = pool.allocate(100), pool.allocate(64), pool.allocate(1)
    assert [pool.offset_of(t) for t in (a, b, c)] == [0, 128, 192]
    assert [t.numel() for t in (a, b, c)] == [100, 64, 1]
    assert pool.stats() == {
        "total": 1024,
        "free": 1024 - 256,
        "used": 256,
        "largest_free": 1024 - 256,
        "allocations": 3,
        "refusals": 0,
        "pinned": 0,
        "pinned_nbytes": 0,
    }
    pool.free(b)
    assert _runs(pool) == [(128, 64), (256, 768)]
    pool.free(a)  # joins the run after it
    assert _runs(pool) == [(0, 192), (256, 768)]
    pool.free(c)  # joins both sides: one run again
    assert _runs(pool) == [(0, 1024)]
    assert pool.stats()["allocations"] == 0


def test_first_fit_reuses_a_freed_hole() -> None:
    pool = _pool(1024, alignment=64)
    a, _b = pool.allocate(128), pool.allocate(128)
    pool.free(a)
    assert pool.offset_of(pool.allocate(64)) == 0  # the first run that fits
    assert pool.offset_of(pool.allocate(128)) == 256  # the hole left (64 bytes) is too small


def test_ranges_are_views_of_one_pretouched_buffer() -> None:
    pool = _pool(1 << 16, alignment=4096)
    assert pool.total == 1 << 16
    assert pool.buffer.numel() == pool.total
    assert int(pool.buffer.count_nonzero()) == 0  # written once: every page faulted in
    a = pool.allocate(10)
    a.fill_(7)
    assert a.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()
    assert int(pool.buffer[:10].sum()) == 70
    assert pool.offset_of(pool.allocate(1)) == 4096
    assert HostBufferPool(100, pin_memory=False, alignment=64).total == 128  # rounded up


def test_exhaustion_is_none_or_an_error_naming_the_bytes() -> None:
    pool = _pool(1024)
    held = pool.allocate(900)
    assert pool.try_allocate(200) is None
    with pytest.raises(HostPoolFullError) as err:
        pool.allocate(200, what="object `cache`")
    text = str(err.value)
    assert "object `cache`" in text
    assert "200 bytes asked" in text
    assert "64 of 1024 bytes free" in text
    assert "largest free run 64" in text
    assert "larger" in text
    assert "disk tier" in text
    assert isinstance(err.value, MemoryError)
    assert pool.stats()["refusals"] == 2
    pool.free(held)
    assert pool.allocate(1024).numel() == 1024


def test_zero_bytes_hold_no_range() -> None:
    pool = _pool(64)
    empty = pool.allocate(0)
    assert empty.numel() == 0
    assert pool.stats()["allocations"] == 0
    pool.free(empty)
    assert pool.allocate(64).numel() == 64


def test_bad_frees_and_arguments_are_refused() -> None:
    pool = _pool(1024)
    a = pool.allocate(8)
    pool.free(a)
    with pytest.raises(ValueError, match="freed already"):
        pool.free(a)
    with pytest.raises(ValueError, match="does not lie in this host buffer pool"):
        pool.free(torch.zeros(4, dtype=torch.uint8))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="nbytes"):
            HostBufferPool(bad, pin_memory=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="power of two"):
        HostBufferPool(64, pin_memory=False, alignment=48)
    with pytest.raises(ValueError, match="non-negative"):
        pool.try_allocate(-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            HostBufferPool(64, pin_memory=True)
        assert HostBufferPool(64).pinned is False


def test_returns_from_a_finalizer_under_the_lock_are_queued() -> None:
    pool = _pool(1024)
    a = pool.allocate(512)
    with pool._lock:  # as if the garbage collector ran a finalizer inside an allocation
        pool.give_back_later([pool.offset_of(a)])
        assert pool._live  # not applied under the lock
    assert pool.stats()["free"] == 1024  # the next call that takes the lock applies it


def test_threads_never_share_a_range() -> None:
    pool = _pool(1 << 16, alignment=64)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        held: list[tuple[torch.Tensor, int]] = []
        for _ in range(300):
            if held and (rng.random() < 0.5 or len(held) > 8):
                view, mark = held.pop(rng.randrange(len(held)))
                if not bool((view == mark).all()):
                    errors.append(f"thread {seed}: a range it held was overwritten")
                pool.free(view)
            else:
                view = pool.try_allocate(rng.randrange(1, 2048))
                if view is not None:
                    view.fill_(seed)
                    held.append((view, seed))
        for view, _ in held:
            pool.free(view)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert _runs(pool) == [(0, pool.total)]


@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(0, 700)),
            st.tuples(st.just("free"), st.integers(0, 50)),
        ),
        max_size=60,
    )
)
def test_random_sequences_keep_ranges_apart_and_bytes_whole(ops: list[tuple[str, int]]) -> None:
    pool = _pool(4096, alignment=64)
    live: list[tuple[torch.Tensor, int, int]] = []  # (view, offset, size asked)
    for op, n in ops:
        if op == "alloc":
            view = pool.try_allocate(n)
            if view is None:
                assert pool.stats()["largest_free"] < n
            elif n:
                live.append((view, pool.offset_of(view), n))
        elif live:
            view, _, _ = live.pop(n % len(live))
            pool.free(view)
        spans = sorted((off, off + -(-size // 64) * 64) for _, off, size in live)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start  # live ranges never overlap
        assert all(off % 64 == 0 and off + size <= pool.total for _, off, size in live)
        stats = pool.stats()
        assert stats["free"] + sum(e - s for s, e in spans) == stats["total"]
        assert stats["allocations"] == len(live)
        runs = _runs(pool)
        for (off, size), (nxt, _) in itertools.pairwise(runs):
            assert off + size < nxt  # free runs are coalesced and sorted
    for view, _, _ in live:
        pool.free(view)
    assert _runs(pool) == [(0, pool.total)]


# -- the host tier through a pool ------------------------------------------------------------------


def _tree() -> dict[str, Any]:
    base = torch.arange(40.0)
    half = torch.arange(12, dtype=torch.bfloat16) / 3
    cache = TensorCache(name="c").allocate().commit((base, base[3:].view(37, 1), half, half[1::2]))
    ring = LatentBuffer(name="r", dim=0).allocate(maxlen=2).commit(torch.ones(1, 5))
    return {"cache": cache, "ring": ring, "shared": base[10:20]}


def test_park_through_a_pool_is_bit_identical_and_gives_back_on_release() -> None:
    pool = _pool(1 << 16)
    tree = _tree()
    handle = park_tree(tree, "host", pool=pool)
    stats = pool.stats()
    assert stats["allocations"] == 1  # one slot for the three storages (base, half, ring's)
    assert stats["used"] >= handle.nbytes
    assert handle.nbytes_by_device == nbytes_by_device(tree)
    for _ in range(2):  # restore may run again until release
        back = handle.restore()
        assert tree_equal(back, tree)
        assert alias_graph(back) == alias_graph(tree)
        assert nbytes_by_device(back) == nbytes_by_device(tree)
        assert back["cache"].contents[2].dtype == torch.bfloat16
        for x in ss.tree_leaves(back):  # fresh memory, not the pool's
            if isinstance(x, torch.Tensor):
                assert not 0 <= x.data_ptr() - pool.buffer.data_ptr() < pool.total
    handle.release()
    assert pool.stats()["free"] == pool.total
    handle.release()  # twice: nothing more
    assert pool.stats()["allocations"] == 0
    with pytest.raises(RuntimeError, match="released"):
        handle.restore()


def test_a_collected_handle_gives_its_ranges_back() -> None:
    pool = _pool(1 << 16)
    handle = park_tree(_tree(), "host", pool=pool)
    assert pool.stats()["allocations"] == 1
    del handle
    gc.collect()
    assert pool.stats()["free"] == pool.total


def test_a_park_that_does_not_fit_takes_nothing() -> None:
    pool = _pool(256)
    tree = _tree()
    with pytest.raises(HostPoolFullError, match=r"objects \(3 storages\): \d+ bytes asked"):
        park_tree(tree, "host", label="objects", pool=pool)
    assert pool.stats()["free"] == pool.total
    assert pool.stats()["allocations"] == 0
    small = park_tree(torch.ones(8), "host", pool=pool)
    assert torch.equal(small.restore(), torch.ones(8))


def test_copy_functions_take_a_pool() -> None:
    pool = _pool(1024)
    x = torch.arange(10, dtype=torch.int16)
    (buffer,) = copy_storages_to_host([x.untyped_storage()], pool=pool)
    assert pool.offset_of(buffer) == 0
    assert buffer.numel() == 20
    (storage,) = copy_storages_to_devices([buffer], [torch.device("cpu")], pool=pool)
    assert storage.nbytes() == 20
    assert storage.data_ptr() != buffer.data_ptr()


def test_cpu_restores_land_in_the_pool_until_freed() -> None:
    pool = _pool(1 << 16, cpu_restores=True)
    tree = _tree()
    handle = park_tree(tree, "host", pool=pool)
    parked = pool.stats()["used"]
    back = handle.restore()
    assert tree_equal(back, tree)
    assert alias_graph(back) == alias_graph(tree)
    assert nbytes_by_device(back) == nbytes_by_device(tree)  # each storage its own size
    base = back["cache"].contents[0]
    assert 0 <= base.data_ptr() - pool.buffer.data_ptr() < pool.total
    assert pool.stats()["allocations"] == 4  # the parked slot, three restored storages
    handle.release()
    assert pool.stats()["used"] < parked * 2  # the restored tree still holds its ranges
    del back, base
    gc.collect()
    assert pool.stats()["free"] == pool.total
    # A restore that does not fit the pool gets a fresh allocation.
    tight = _pool(1024, cpu_restores=True)
    x = torch.arange(200.0)  # 800 bytes: parks, but the restore finds no room
    again = park_tree(x, "host", pool=tight).restore()
    assert torch.equal(again, x)
    assert not 0 <= again.data_ptr() - tight.buffer.data_ptr() < tight.total


class _FakeCudart:
    """Records the host registrations a pool asks CUDA for."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registered[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_a_pinned_pool_pins_exactly_its_bytes_and_unpins_them_when_collected(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not `torch.empty(pin_memory=True)`, whose caching host allocator rounds a block up to a
    # power of two: pageable memory, registered with CUDA for exactly the pool's bytes.
    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    nbytes = 3 * 2**20 + 64  # a power of two would round it to 4 MiB
    pool = HostBufferPool(nbytes, pin_memory=True)
    ptr = pool.buffer.data_ptr()
    assert fake.registered == {ptr: nbytes}
    assert (pool.pinned, pool.pinned_nbytes) == (True, nbytes)
    assert (pool.stats()["pinned"], pool.stats()["pinned_nbytes"]) == (1, nbytes)
    assert pool.allocate(0).numel() == 0  # an empty range pins nothing
    del pool
    gc.collect()
    assert fake.unregistered == [ptr]


def test_a_failed_registration_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeCudart()
    fake.cudaHostRegister = lambda ptr, nbytes, flags: 2  # type: ignore[method-assign]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister returned 2.*ulimit -l"):
        HostBufferPool(4096, pin_memory=True)
