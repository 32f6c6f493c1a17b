"""Reading parked state needs no device room: `get` makes the KV room itself, and `snapshot`,
`peek(on_host=True)` and a worker's `export_session` read a parked session in host memory.

A plain manager (no byte budget) holds sessions whose KV fills a `KVPool`; one of them is
parked. Its `get` parks the least recently used other sessions' KV until the pool has the
blocks; saving or exporting it takes no block at all, leaves it parked, and writes the record
the session held.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import sessionstate._kv._pool as pool_module
from sessionstate import (
    KVCache,
    KVPool,
    KVPoolExhaustedError,
    ParkingError,
    SessionState,
    SessionStateManager,
    TensorCache,
    load_state,
    loads_state,
    tree_equal,
)
from sessionstate._storage import dumps_state, record_device, recorded_devices

TIERS = ["host", "disk"]


def _record(pool: KVPool, seed: int) -> SessionState:
    g = torch.Generator().manual_seed(seed)
    kv = KVCache().allocate().append(pool, torch.randn(3, 2, generator=g))  # 2 blocks
    feat = TensorCache().allocate().commit(torch.randn(6, generator=g))
    return SessionState(objects={"kv": kv, "feat": feat}, attrs={"seed": seed})


def _copy(state: SessionState) -> SessionState:
    """What the record reads, held apart from the pool (a standalone snapshot round trip)."""
    return loads_state(dumps_state(state))


def _full(tier: str, tmp_path: Path) -> tuple[SessionStateManager, KVPool, dict[str, SessionState]]:
    """A manager holding "a" (parked) and "b", "c" whose KV fills the pool's 4 blocks."""
    pool = KVPool(4, block_tokens=2, token_shape=(2,), name="kv")
    m = SessionStateManager(park_tier=tier, spool_dir=tmp_path)  # type: ignore[arg-type]
    want = {}
    m.put("a", _record(pool, 1))
    want["a"] = _copy(m.peek("a"))  # type: ignore[arg-type]
    assert m.park_until(lambda: pool.free_blocks == 4, frees=pool.owns_entry)
    for seed, sid in enumerate("bc", start=2):
        m.put(sid, _record(pool, seed))
        want[sid] = _copy(m.peek(sid))  # type: ignore[arg-type]
    assert m.peek("a").parked == ("kv",)  # type: ignore[union-attr]
    assert pool.free_blocks == 0
    return m, pool, want


@pytest.mark.parametrize("tier", TIERS)
def test_get_of_a_parked_kv_session_parks_the_least_recently_used_others_kv(
    tier: str, tmp_path: Path
) -> None:
    m, pool, want = _full(tier, tmp_path)
    a = m.get("a")
    assert a is not None
    assert tree_equal(_copy(a), want["a"])
    assert pool.free_blocks == 0  # "a" holds the blocks "b" gave back
    assert m.peek("b").parked == ("kv",)  # type: ignore[union-attr]  # the oldest
    assert m.peek("c").parked == ()  # type: ignore[union-attr]  # enough: left resident
    assert m.stats()["evictions"] == 0
    del a  # a record the caller keeps keeps its blocks
    for sid in "bca":
        got = m.get(sid)
        assert got is not None
        assert tree_equal(_copy(got), want[sid]), sid
        del got


def test_get_of_a_parked_kv_session_with_no_kv_left_to_park_names_the_session() -> None:
    pool = KVPool(4, block_tokens=2, token_shape=(2,), name="kv")
    m = SessionStateManager()
    m.put("a", _record(pool, 1))
    assert m.park_until(lambda: pool.free_blocks == 4, frees=pool.owns_entry)
    hog = pool.append(pool.empty(), torch.zeros(8, 2))  # held outside the manager
    msg = "Cannot unpark session 'a' (objects ['kv']) from the host tier: KV pool 'kv'"
    with pytest.raises(KVPoolExhaustedError, match=re.escape(msg)) as info:
        m.get("a")
    assert info.value.pool is pool
    assert info.value.needed == 2
    assert m.peek("a").parked == ("kv",)  # type: ignore[union-attr]  # intact
    del hog
    assert m.get("a") is not None


@pytest.mark.parametrize("tier", TIERS)
def test_snapshot_of_a_parked_kv_session_takes_no_block_and_leaves_it_parked(
    tier: str, tmp_path: Path
) -> None:
    m, pool, want = _full(tier, tmp_path)
    path = tmp_path / "a.safetensors"
    m.snapshot("a", path)
    assert pool.free_blocks == 0
    assert m.peek("a").parked == ("kv",)  # type: ignore[union-attr]
    assert m.session_ids() == ["a", "b", "c"]  # the LRU order untouched
    assert tree_equal(load_state(path), want["a"])
    restored = SessionStateManager().restore("a", path)
    assert tree_equal(restored, want["a"])


@pytest.mark.parametrize("tier", TIERS)
def test_peek_on_host_reads_a_parked_session_and_leaves_it_parked(
    tier: str, tmp_path: Path
) -> None:
    m, pool, want = _full(tier, tmp_path)
    read = m.peek("a", on_host=True)
    assert read is not None
    assert read.parked == ()
    assert tree_equal(_copy(read), want["a"])
    assert read.object("kv", KVCache).view().pool is not pool  # type: ignore[union-attr]
    assert pool.free_blocks == 0
    assert m.peek("a").parked == ("kv",)  # type: ignore[union-attr]
    assert m.stats()["unparks"] == 0
    assert m.peek("b", on_host=True) is m.peek("b")  # a resident session: its own record
    with pytest.raises(TypeError, match="on_host"):
        m.peek("a", on_host=1)  # type: ignore[arg-type]


def test_export_of_a_parked_kv_session_takes_no_block() -> None:
    pytest.importorskip("ray")
    from sessionstate.distributed import SessionWorker, decode_record

    pool = KVPool(4, block_tokens=2, token_shape=(2,), name="kv")

    class Pipeline:
        def __init__(self) -> None:
            self.manager = SessionStateManager()

        def forward(self, seed: int, session_id: str) -> None:
            self.manager.put(session_id, _record(pool, seed))

    worker = SessionWorker("w0", Pipeline)
    worker.step("a", 1, epoch=1, create=True)
    want = _copy(worker.manager.peek("a"))  # type: ignore[arg-type]
    assert worker.manager.park_until(lambda: pool.free_blocks == 4, frees=pool.owns_entry)
    worker.step("b", 2, epoch=1, create=True)
    worker.step("c", 3, epoch=1, create=True)
    assert pool.free_blocks == 0
    data, _ = worker.export_session("a", epoch=1)
    assert pool.free_blocks == 0
    assert worker.manager.peek("a").parked == ("kv",)  # type: ignore[union-attr]
    assert tree_equal(decode_record(data), want)


def _devices(data: bytes) -> list[str]:
    """The device each storage of a snapshot's bytes is recorded on."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    document = json.loads(header["__metadata__"]["sessionstate"])
    return [s["device"] for s in document["storages"]]


def test_a_storage_read_on_host_is_saved_as_one_of_the_device_it_came_from() -> None:
    x = torch.arange(4.0)
    with recorded_devices():
        record_device(x.untyped_storage(), "cuda:3")
        inside = dumps_state({"x": x})
    record_device(x.untyped_storage(), "cuda:3")  # outside: nothing is recorded
    outside = dumps_state({"x": x})
    assert _devices(inside) == ["cuda:3"]
    assert _devices(outside) == ["cpu"]


def test_a_get_whose_room_making_cannot_park_another_session_names_this_one(
    tmp_path: Path,
) -> None:
    # The host pool cannot hold "b" and the spill directory is a file: parking "b" for a's
    # blocks fails. The error is a's shortage, caused by the failed park; "a" stays parked.
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the spool directory should be")
    pool = KVPool(4, block_tokens=2, token_shape=(2,), name="kv")
    m = SessionStateManager(host_pool_bytes=64, host_pool_full="disk", spool_dir=blocked)
    m.put("a", SessionState(objects={"kv": KVCache().allocate().append(pool, torch.ones(3, 2))}))
    assert m.park_until(lambda: pool.free_blocks == 4, frees=pool.owns_entry)
    m.put("b", SessionState(objects={"kv": KVCache().allocate().append(pool, torch.ones(5, 2))}))
    hog = pool.append(pool.empty(), torch.zeros(1, 2))
    with pytest.raises(KVPoolExhaustedError, match=re.escape("Cannot unpark session 'a'")) as info:
        m.get("a")
    assert "Cannot park session 'b'" in str(info.value.__cause__)
    assert m.peek("a").parked == ("kv",)  # type: ignore[union-attr]
    assert m.peek("b").parked == ()  # type: ignore[union-attr]
    del hog


def test_a_failed_multi_handle_unpark_gives_the_first_handles_blocks_back_at_once() -> None:
    # Two objects parked apart (two handles), the second's pool short: the first's blocks are
    # back when `get` raises, even while the caller keeps the error.
    a_pool = KVPool(4, block_tokens=2, token_shape=(2,), name="A")
    b_pool = KVPool(4, block_tokens=2, token_shape=(2,), name="B")
    m = SessionStateManager()
    m.put(
        "s",
        SessionState(
            objects={
                "a": KVCache().allocate().append(a_pool, torch.ones(5, 2)),
                "b": KVCache().allocate().append(b_pool, torch.ones(5, 2)),
            }
        ),
    )
    assert m.park_until(lambda: a_pool.free_blocks == 4, frees=a_pool.owns_entry)
    assert m.park_until(lambda: b_pool.free_blocks == 4, frees=b_pool.owns_entry)
    hog = b_pool.append(b_pool.empty(), torch.zeros(4, 2))
    with pytest.raises(KVPoolExhaustedError) as info:
        m.get("s")
    assert info.value is not None  # the error is kept ...
    assert a_pool.free_blocks == 4  # ... and holds no block
    del hog
    s = m.get("s")
    assert s is not None
    assert torch.equal(s.object("b", KVCache).read(), torch.ones(5, 2))  # type: ignore[arg-type]


def test_a_damaged_spool_file_fails_a_read_naming_the_session(tmp_path: Path) -> None:
    m, pool, _ = _full("disk", tmp_path)
    (path,) = [p for p in tmp_path.rglob("*.safetensors")]
    path.write_bytes(b"garbage")
    msg = "Cannot read parked session 'a' (objects ['kv']) from the disk tier: "
    with pytest.raises(ParkingError, match=re.escape(msg)):
        m.peek("a", on_host=True)
    with pytest.raises(ParkingError, match=re.escape(msg)):
        m.snapshot("a", tmp_path / "a.safetensors")
    assert m.peek("a").parked == ("kv",)  # type: ignore[union-attr]
    assert pool.free_blocks == 0


def test_a_recorded_device_is_never_given_to_a_later_storage_at_the_same_address() -> None:
    with recorded_devices():
        t = torch.ones(3)
        record_device(t.untyped_storage(), "cuda:0")
        key = t.untyped_storage()._cdata
        del t  # the record holds the storage: its address cannot go to another
        u = torch.arange(4.0)
        assert u.untyped_storage()._cdata != key
        data = dumps_state({"u": u})
    assert _devices(data) == ["cpu"]


def test_a_standalone_pool_records_its_home_only_within_the_read_that_made_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = KVPool(4, block_tokens=2, token_shape=(2,), name="kv")
    kv = KVCache().allocate().append(pool, torch.ones(3, 2))
    parked = SessionState(objects={"kv": kv}).park("host")
    with recorded_devices():
        read = parked.unpark_on_host()
    marked: list[tuple[object, ...]] = []
    monkeypatch.setattr(pool_module, "record_device", lambda *args: marked.append(args))
    with recorded_devices():  # a later block: the read's pool is a plain CPU pool here
        dumps_state(read)
    assert marked == []
    with recorded_devices():
        dumps_state(parked.unpark_on_host())  # its own block: its pool's device is noted
    assert len(marked) == 1
