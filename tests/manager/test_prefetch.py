"""Prefetch: a parked session unparked in the background changes no bit, only when the copy runs.

Prefetch then `get` equals `get` alone (host and disk tiers, with KV blocks); a prefetch that
does not fit is dropped; dropping or evicting a prefetched session gives everything back (the
pool's blocks, the host pool's bytes); a background restore that fails falls back to the
foreground; several threads prefetching and reading stay consistent.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from sessionstate import (
    KVCache,
    KVHandle,
    KVPool,
    ParkingError,
    SessionState,
    SessionStateManager,
    TensorCache,
    tree_equal,
)
from sessionstate._storage import park_tree


def _record(pool: KVPool, seed: int, n: int = 64) -> SessionState:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    kv = KVCache().allocate().append(pool, torch.randn(5, 3, generator=g))
    feat = TensorCache().allocate().commit((x, x[3:]))
    return SessionState(objects={"feat": feat, "kv": kv}, attrs={"seed": seed})


def _view(state: SessionState) -> tuple[torch.Tensor, ...]:
    feat = state.object("feat", TensorCache).view()
    return (*feat, state.object("kv", KVCache).read())


def _manager(tier: str, tmp_path: Path, budget: int, **kw: object) -> SessionStateManager:
    return SessionStateManager(
        max_bytes={"cpu": budget},
        park_tier=tier,  # type: ignore[arg-type]
        spool_dir=tmp_path,
        **kw,  # type: ignore[arg-type]
    )


def _one_session_bytes(pool: KVPool) -> int:
    m = SessionStateManager()
    m.put("x", _record(pool, 0))
    nbytes = m.stats()["nbytes:cpu"]
    m.drop("x")
    return nbytes


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_prefetch_then_get_is_bit_identical(tier: str, tmp_path: Path) -> None:
    pool = KVPool(32, block_tokens=2, token_shape=(3,))
    one = _one_session_bytes(pool)
    plain = _manager(tier, tmp_path / "plain", one + one // 2)
    fetched = _manager(tier, tmp_path / "fetched", one + one // 2)
    for m in (plain, fetched):
        for sid in ("a", "b"):
            m.put(sid, _record(pool, hash(sid) % 100))
        assert m.peek("a").parked  # type: ignore[union-attr]
    start = pool.free_blocks
    assert fetched.prefetch("a", make_room=True)
    assert fetched.prefetch("a")  # already prefetched: started once
    a_plain, a_fetched = plain.get("a"), fetched.get("a")
    assert a_plain is not None
    assert a_fetched is not None
    assert all(torch.equal(x, y) for x, y in zip(_view(a_plain), _view(a_fetched), strict=True))
    assert tree_equal(a_plain.attrs, a_fetched.attrs)
    s = fetched.stats()
    assert (s["prefetches"], s["prefetch_hits"], s["prefetches_dropped"]) == (1, 1, 0)
    assert s["nbytes:cpu"] <= one + one // 2  # the reservation kept the budget
    del a_plain, a_fetched
    plain.clear()
    fetched.clear()
    assert pool.free_blocks == pool.num_blocks > start


def test_prefetch_that_does_not_fit_is_dropped(tmp_path: Path) -> None:
    pool = KVPool(32, block_tokens=2, token_shape=(3,))
    one = _one_session_bytes(pool)
    m = _manager("host", tmp_path, one + one // 2)
    m.put("a", _record(pool, 1))
    m.put("b", _record(pool, 2))
    assert m.prefetch("a") is False  # "b" is resident: "a" does not fit beside it
    s = m.stats()
    assert (s["prefetches"], s["prefetches_dropped"]) == (0, 1)
    assert m.prefetch("b") is False  # resident: nothing to prefetch, nothing counted
    assert m.prefetch("nobody") is False
    assert m.stats()["prefetches_dropped"] == 1
    with pytest.raises(TypeError):
        m.prefetch(None)
    with pytest.raises(TypeError, match="make_room"):
        m.prefetch("a", make_room=1)  # type: ignore[arg-type]


def test_a_put_that_needs_the_room_drops_the_prefetch_before_evicting(tmp_path: Path) -> None:
    pool = KVPool(64, block_tokens=2, token_shape=(3,))
    one = _one_session_bytes(pool)
    m = _manager("host", tmp_path, 2 * one + one // 2)
    for sid in ("a", "b", "c"):
        m.put(sid, _record(pool, ord(sid)))
    assert m.peek("a").parked  # type: ignore[union-attr]
    assert m.prefetch("a", make_room=True)  # parks "b" to fit
    # A record of unparkable bytes needs the room: "c" is parked first, then "a"'s prefetch
    # goes; nobody is evicted.
    m.put("d", SessionState(attrs={"big": torch.zeros(2 * one // 4)}))
    assert m.peek("c").parked  # type: ignore[union-attr]
    s = m.stats()
    assert s["evictions"] == 0
    assert s["prefetches_dropped"] == 1
    assert s["nbytes:cpu"] <= 2 * one + one // 2
    a = m.get("a")
    assert a is not None
    assert a.attrs["seed"] == ord("a")


@pytest.mark.parametrize("end", ["drop", "evict", "replace"])
def test_prefetch_then_drop_or_evict_gives_everything_back(end: str, tmp_path: Path) -> None:
    pool = KVPool(32, block_tokens=2, token_shape=(3,))
    one = _one_session_bytes(pool)
    m = SessionStateManager(
        2 if end == "evict" else 64,
        max_bytes={"cpu": one + one // 2},
        host_pool_bytes=8 * one,
    )
    host = m.host_pool
    assert host is not None
    free_host = host.stats()["free"]
    m.put("a", _record(pool, 1))
    m.put("b", _record(pool, 2))
    assert m.prefetch("a", make_room=True)
    m._table.parking.pending("a")[0].wait_prefetch()  # the background restore took its blocks
    if end == "drop":
        assert m.drop("a")
    elif end == "replace":
        m.put("a", SessionState())
    else:
        m.put("c", SessionState())  # the cap: "a" is the least recently used
        assert "a" not in m
    m.clear()
    assert pool.free_blocks == pool.num_blocks
    assert host.stats()["free"] == free_host
    assert m.stats()["prefetches_dropped"] == 1


@pytest.mark.parametrize("end", ["drop", "evict", "replace"])
def test_ending_a_session_while_its_background_restore_runs_gives_its_blocks_back_at_once(
    end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The background restore is held after it took the pool's blocks; the session is then
    # dropped, evicted or replaced. When that call returns, the blocks are back.
    pool = KVPool(16, block_tokens=2, token_shape=(3,))
    m = SessionStateManager(2 if end == "evict" else 64, host_pool_bytes=1 << 16)
    host = m.host_pool
    assert host is not None
    free_host = host.stats()["free"]
    m.put("a", _record(pool, 1))
    assert m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
    took, release = threading.Event(), threading.Event()
    reload = KVHandle.__dict__["__sessionstate_reload__"].__func__

    def held_reload(cls: type, payload: object) -> object:
        handles = reload(cls, payload)
        took.set()
        release.wait(timeout=30)
        return handles

    monkeypatch.setattr(KVHandle, "__sessionstate_reload__", classmethod(held_reload))
    assert m.prefetch("a")
    assert took.wait(timeout=30)
    assert pool.free_blocks < pool.num_blocks  # held by the running restore
    opener = threading.Timer(0.2, release.set)  # lets the restore finish while `end` waits
    opener.start()
    try:
        if end == "drop":
            assert m.drop("a")
        elif end == "replace":
            m.put("a", SessionState())
        else:
            m.put("b", SessionState())
            m.put("c", SessionState())  # the cap: "a" is the least recently used
            assert "a" not in m
        assert pool.free_blocks == pool.num_blocks
        assert host.stats()["free"] == free_host
    finally:
        release.set()
        opener.join()
    assert m.stats()["prefetches_dropped"] == 1


def test_a_prefetch_whose_restore_fails_keeps_no_charge(tmp_path: Path) -> None:
    # The background restore fails on a damaged spool file, the `get` raises: the prefetch is
    # dropped with it, its bytes no longer charged, so another session's prefetch fits.
    pool = KVPool(32, block_tokens=2, token_shape=(3,))
    one = _one_session_bytes(pool)
    m = _manager("disk", tmp_path, 3 * one + one // 2)
    for sid in "abcd":
        m.put(sid, _record(pool, ord(sid)))
    assert m.peek("a").parked  # type: ignore[union-attr]
    for path in tmp_path.rglob("*.safetensors"):  # a's K/V and its other objects: apart
        path.write_bytes(b"garbage")
    assert m.prefetch("a", make_room=True)  # parks "b" for its room
    assert m.peek("b").parked  # type: ignore[union-attr]
    with pytest.raises(ParkingError):
        m.get("a")
    s = m.stats()
    assert (s["prefetches"], s["prefetches_dropped"], s["prefetch_hits"]) == (1, 1, 0)
    assert m.prefetch("b")  # fits only if "a"'s prefetch no longer holds its charge
    b = m.get("b")
    assert b is not None
    assert b.attrs["seed"] == ord("b")
    assert m.stats()["prefetch_hits"] == 1


def test_a_failed_background_restore_falls_back_to_the_foreground(tmp_path: Path) -> None:
    pool = KVPool(8, block_tokens=2, token_shape=(3,))
    x = torch.arange(6.0)
    handle = park_tree({"x": x, "kv": pool.append(pool.empty(), torch.ones(5, 3))}, "host")
    hog = [pool.append(pool.empty(), torch.zeros(2, 3)) for _ in range(pool.free_blocks)]
    handle.start_prefetch()
    handle.prefetch()  # waits; the failure (no free blocks) is not the check's
    assert handle.prefetching is False  # the failed one is dropped
    del hog
    handle.start_prefetch()
    tree = handle.restore()
    assert torch.equal(tree["x"], x)
    assert torch.equal(tree["kv"].read(), torch.ones(5, 3))
    del tree  # (while it lives, a restore would take its blocks back: the same content)
    hog = [pool.append(pool.empty(), torch.zeros(2, 3)) for _ in range(pool.free_blocks)]
    handle.start_prefetch()
    with pytest.raises(Exception, match="bytes"):  # the foreground's own KVPoolExhaustedError
        handle.restore()
    del hog
    handle.release()


def test_a_damaged_spool_file_fails_the_get_not_the_prefetch(tmp_path: Path) -> None:
    pool = KVPool(32, block_tokens=2, token_shape=(3,))
    one = _one_session_bytes(pool)
    m = _manager("disk", tmp_path, one + one // 2)
    m.put("a", _record(pool, 1))
    m.put("b", _record(pool, 2))
    for path in tmp_path.rglob("*.safetensors"):  # a's K/V and its other objects: apart
        path.write_bytes(b"garbage")
    assert m.prefetch("a", make_room=True)  # started; it fails in the background
    from sessionstate import ParkingError

    with pytest.raises(ParkingError):
        m.get("a")
    assert m.peek("a").parked  # type: ignore[union-attr]
    assert m.stats()["prefetch_hits"] == 0


def test_threads_prefetching_and_reading_stay_consistent(tmp_path: Path) -> None:
    pool = KVPool(256, block_tokens=2, token_shape=(3,))
    one = _one_session_bytes(pool)
    m = _manager("host", tmp_path, 3 * one)
    sids = [f"s{i}" for i in range(6)]
    for i, sid in enumerate(sids):
        m.put(sid, _record(pool, i))
    expected = {sid: _view(_record(pool, i)) for i, sid in enumerate(sids)}
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for k in range(30):
                nxt = sids[(k + offset + 1) % len(sids)]
                m.prefetch(nxt, make_room=k % 2 == 0)
                state = m.get(sids[(k + offset) % len(sids)])
                assert state is not None
                got = _view(state)
                want = expected[sids[(k + offset) % len(sids)]]
                assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
                assert m.stats().get("nbytes:cpu", 0) <= 3 * one
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    s = m.stats()
    assert s["prefetches"] > 0
    assert s["evictions"] == 0
    expected.clear()
    m.clear()
    assert pool.free_blocks == pool.num_blocks
