"""Parking under faults and misuse (issue 20): engine handles, failed unparks, spool files,
snapshots racing a `get`, and every read of a parked object."""

from __future__ import annotations

import gc
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import sessionstate._storage._park as park_module
from sessionstate import (
    EncodeOnceKV,
    KVHandle,
    KVPool,
    LatentBuffer,
    ParkedError,
    ParkingError,
    SessionAdmissionError,
    SessionState,
    SessionStateManager,
    TensorCache,
    load_state,
    nbytes_by_device,
    tree_equal,
)
from sessionstate.testing import recount_nbytes_by_device
from tests.support import ROOT, parkable_record

TIERS = ["host", "disk"]
SRC = ROOT / "src"


def _size() -> int:
    return nbytes_by_device(parkable_record())["cpu"]


def _stats_match_recount(m: SessionStateManager) -> None:
    held = [m.peek(sid) for sid in m.session_ids()]
    recount = recount_nbytes_by_device(held)
    stats = m.stats()
    assert {k: v for k, v in stats.items() if k.startswith("nbytes:")} == {
        f"nbytes:{d}": n for d, n in recount.items()
    }
    assert stats["total_nbytes"] == sum(recount.values())


# -- item 7: an engine handle inside a parkable object -------------------------------------------


def _kv_session(pool: KVPool, fill: float) -> tuple[SessionState, KVHandle]:
    handle = pool.append(pool.empty(), torch.full((3, 2), fill))
    cache = TensorCache(name="kv").allocate().commit({"kv": handle, "x": torch.full((8,), fill)})
    return SessionState(objects={"kv": cache}), handle


def _held_engine_bytes(pool: KVPool) -> int:
    return (pool.num_blocks - pool.free_blocks) * pool.block_nbytes


@pytest.mark.parametrize("tier", TIERS)
def test_parking_moves_engine_handles_and_gives_their_blocks_back(
    tier: str, tmp_path: Path
) -> None:
    pool = KVPool(8, block_tokens=2, token_shape=(2,))
    a, handle = _kv_session(pool, 1.0)
    b, _ = _kv_session(pool, 2.0)
    want = handle.read()
    engine = _held_engine_bytes(pool)
    assert engine == 2 * 2 * pool.block_nbytes  # two blocks per session
    one = nbytes_by_device(b)["cpu"]  # a whole session, its blocks included
    m = SessionStateManager(max_bytes={"cpu": one}, park_tier=tier, spool_dir=tmp_path)  # type: ignore[arg-type]
    m.put("a", a)
    del a, handle
    m.put("b", b)
    assert m.peek("a").parked == ("kv",)  # type: ignore[union-attr]
    stats = m.stats()
    # The parked session's blocks went to the tier, and back to the pool.
    assert stats["engine_nbytes:cpu"] == engine // 2 == _held_engine_bytes(pool)
    assert stats["nbytes:cpu"] == one <= m.max_bytes["cpu"]  # type: ignore[index]
    assert stats[f"nbytes_parked:{tier}"] == one
    assert (stats["kv_parks"], stats["kv_unparks"]) == (1, 0)
    _stats_match_recount(m)
    got = m.get("a")
    assert got is not None
    back = got.object("kv").view()["kv"]
    assert back.pool is pool  # fresh blocks of the same pool
    assert torch.equal(back.read(), want)
    grown = pool.append(back, torch.full((1, 2), 9.0))
    assert torch.equal(grown.read(), torch.cat([want, torch.full((1, 2), 9.0)]))
    assert m.stats()["kv_unparks"] == 1
    _stats_match_recount(m)


class _Blocks:
    """An engine leaf without the offload protocol: parking leaves it in place."""

    def __init__(self, block: torch.Tensor) -> None:
        self.block = block

    def __sessionstate_storage_entries__(self) -> list[Any]:
        s = self.block.untyped_storage()
        return [("cpu", s._cdata, s.data_ptr(), s.nbytes(), s)]


@pytest.mark.parametrize("tier", TIERS)
def test_an_engine_leaf_without_the_offload_protocol_stays_in_place(
    tier: str, tmp_path: Path
) -> None:
    leaf = _Blocks(torch.ones(4))
    cache = TensorCache(name="kv").allocate().commit({"kv": leaf, "x": torch.zeros(2)})
    parked = cache.park(tier, spool_dir=tmp_path)  # type: ignore[arg-type]
    assert parked.engine == (leaf,)
    assert nbytes_by_device(parked) == {"cpu": 16}
    back = parked.unpark()
    assert back.view()["kv"] is leaf
    assert tree_equal(back, cache)


@pytest.mark.parametrize("tier", TIERS)
def test_an_object_parked_alone_moves_its_engine_handle(tier: str, tmp_path: Path) -> None:
    pool = KVPool(4, block_tokens=2, token_shape=(2,))
    handle = pool.append(pool.empty(), torch.ones(3, 2))
    cache = TensorCache(name="kv").allocate().commit({"kv": handle, "x": torch.zeros(2)})
    parked = cache.park(tier, spool_dir=tmp_path)  # type: ignore[arg-type]
    assert parked.engine == ()
    assert nbytes_by_device(parked) == {}
    assert parked.nbytes_unparked == {"cpu": 2 * pool.block_nbytes + 8}
    back = parked.unpark()
    assert back.view()["kv"] is not handle
    assert tree_equal(back, cache)


# -- item 8: a failed unpark evicts nothing ------------------------------------------------------


def test_a_failed_unpark_evicts_nobody_and_a_repaired_file_unparks(tmp_path: Path) -> None:
    size = _size()
    m = SessionStateManager(max_bytes={"cpu": 2 * size}, park_tier="disk", spool_dir=tmp_path)
    a = parkable_record(fill=1)
    m.put("a", a)
    # b and c hold their bytes in attributes: making room for `a` could only evict them.
    for sid, fill in (("b", 2.0), ("c", 3.0)):
        m.put(sid, SessionState(attrs={"x": torch.full((size // 4,), fill)}))
    parked = m.peek("a")
    assert parked is not None
    assert parked.parked == ("cache", "ring")
    path = parked.object("cache").handle.path  # type: ignore[attr-defined]
    good = path.read_bytes()
    path.write_bytes(good[:-4] + b"\xff\xff\xff\xff")  # a damaged spool file
    msg = "Cannot unpark session 'a' (objects ['cache', 'ring']) from the disk tier: "
    with pytest.raises(ParkingError, match=re.escape(msg)) as info:
        m.get("a")
    assert "The session stays parked and intact" in str(info.value)
    assert m.session_ids() == ["a", "b", "c"]
    assert m.stats()["evictions"] == 0
    assert m.peek("a").parked == ("cache", "ring")  # type: ignore[union-attr]
    _stats_match_recount(m)
    path.write_bytes(good)  # the cause fixed, a retry succeeds
    got = m.get("a")
    assert got is not None
    assert tree_equal(got, a)
    assert m.stats()["evictions"] == 1  # room is made once the unpark has succeeded
    _stats_match_recount(m)


@pytest.mark.parametrize("tier", TIERS)
def test_an_unpark_makes_room_before_its_bytes_come_back(
    tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The budget holds two records; a third put parks `a`, and `get("a")` must park or evict
    # another session before `a`'s bytes are allocated again, never after.
    size = _size()
    budget = 2 * size
    m = SessionStateManager(max_bytes={"cpu": budget}, park_tier=tier, spool_dir=tmp_path)
    a = parkable_record(fill=1)
    m.put("a", a)
    for sid, fill in (("b", 2.0), ("c", 3.0)):
        m.put(sid, SessionState(attrs={"x": torch.full((size // 4,), fill)}))
    assert m.peek("a").parked == ("cache", "ring")  # type: ignore[union-attr]
    held_at_restore: list[int] = []
    restore = park_module.ParkedBytes.restore

    def watched(self: park_module.ParkedBytes) -> Any:
        held_at_restore.append(m.stats().get("nbytes:cpu", 0) + self.nbytes_by_device["cpu"])
        return restore(self)

    monkeypatch.setattr(park_module.ParkedBytes, "restore", watched)
    got = m.get("a")
    assert got is not None
    assert tree_equal(got, a)
    assert held_at_restore
    assert all(held <= budget for held in held_at_restore)
    assert m.stats()["evictions"] == 1
    _stats_match_recount(m)


@pytest.mark.parametrize("tier", TIERS)
def test_a_refused_unpark_leaves_the_session_parked_and_restorable(
    tier: str, tmp_path: Path
) -> None:
    size = _size()
    m = SessionStateManager(
        max_bytes={"cpu": 2 * size}, park_tier=tier, spool_dir=tmp_path, on_full="refuse"
    )
    a = parkable_record(fill=1)
    m.put("a", a)
    for sid, fill in (("b", 2.0), ("c", 3.0)):
        m.put(sid, SessionState(attrs={"x": torch.full((size // 4,), fill)}))
    with pytest.raises(SessionAdmissionError, match=re.escape("Cannot make room for session 'a'")):
        m.get("a")
    assert m.peek("a").parked == ("cache", "ring")  # type: ignore[union-attr]
    _stats_match_recount(m)
    m.drop("c")
    got = m.get("a")
    assert got is not None
    assert tree_equal(got, a)
    _stats_match_recount(m)


# -- item 9: spool files --------------------------------------------------------------------------


_CHILD = """
import os, sys, time
sys.path.insert(0, {src!r})
import torch
import sessionstate._storage._park as park
from sessionstate import LatentBuffer, SessionState, SessionStateManager, TensorCache

real = park.write_snapshot

def stalled(tree, path, **kwargs):
    real(tree, path, **kwargs)
    print("parked", flush=True)
    time.sleep(120)  # killed here, mid park

def record(fill):
    base = torch.full((4096,), float(fill))
    return SessionState(objects={{"cache": TensorCache(name="cache").allocate().commit(base)}})

m = SessionStateManager(max_bytes={{"cpu": 4096 * 4}}, park_tier="disk", spool_dir={root!r})
m.put("a", record(1))
park.write_snapshot = stalled
m.put("b", record(2))
"""


def test_the_next_manager_reclaims_what_a_killed_process_left(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    live = SessionStateManager(max_bytes={"cpu": _size()}, park_tier="disk", spool_dir=root)
    live_a = parkable_record(fill=1)
    live.put("a", live_a)
    live.put("b", parkable_record(fill=2))  # parks `a` into the live manager's spool directory
    code = textwrap.dedent(_CHILD.format(src=str(SRC), root=str(root)))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "parked"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    left = [p for p in root.iterdir() if p.name.startswith(f"sessionstate-spool-{child.pid}-")]
    assert len(left) == 1
    assert any(left[0].glob("parked-*.safetensors"))
    SessionStateManager(max_bytes={"cpu": _size()}, park_tier="disk", spool_dir=root)
    assert not left[0].exists()
    # The live manager's directory is kept, and its parked session unparks.
    assert [p.name.split("-")[2] for p in root.iterdir()] == [str(os.getpid())]
    got = live.get("a")
    assert got is not None
    assert tree_equal(got, live_a)


def test_an_object_parked_to_disk_outside_a_manager_owns_its_file(tmp_path: Path) -> None:
    cache = TensorCache(name="c").allocate().commit(torch.ones(3))
    parked = cache.park("disk", spool_dir=tmp_path)
    (path,) = tmp_path.iterdir()
    assert tree_equal(parked.unpark(), cache)
    del parked
    gc.collect()
    assert not path.exists()


def test_the_default_spool_is_one_directory_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(park_module, "_default_spools", {}, raising=False)
    cache = TensorCache(name="c").allocate().commit(torch.ones(3))
    parked = [cache.park("disk") for _ in range(3)]
    (spool,) = tmp_path.iterdir()
    assert spool.name.startswith(f"sessionstate-spool-{os.getpid()}-")
    assert len(list(spool.glob("parked-*.safetensors"))) == 3
    assert all(tree_equal(p.unpark(), cache) for p in parked)
    del parked
    gc.collect()
    assert list(spool.glob("parked-*")) == []
    m = SessionStateManager(max_bytes={"cpu": _size()}, park_tier="disk")
    m.put("a", parkable_record(fill=1))
    m.put("b", parkable_record(fill=2))
    assert {p.name.split("-")[2] for p in tmp_path.iterdir()} == {str(os.getpid())}
    del m
    gc.collect()
    assert list(tmp_path.iterdir()) == [spool]


def test_a_user_parked_record_put_into_a_manager_leaves_no_file(tmp_path: Path) -> None:
    user = tmp_path / "user"
    a = parkable_record(fill=1)
    m = SessionStateManager()
    m.put("a", a.park("disk", spool_dir=user))
    assert len(list(user.iterdir())) == 1
    got = m.get("a")  # the manager unparks it; nobody else holds the parked record
    assert got is not None
    assert tree_equal(got, a)
    assert m.drop("a")
    gc.collect()
    assert list(user.iterdir()) == []
    # A caller that keeps the parked record keeps its file until it lets go.
    kept = a.park("disk", spool_dir=user)
    m.put("b", kept)
    assert m.get("b") is not None
    m.drop("b")
    assert len(list(user.iterdir())) == 1
    assert tree_equal(kept.unpark(), a)
    del kept
    gc.collect()
    assert list(user.iterdir()) == []


# -- item 18: a snapshot of a parked session against a concurrent get ----------------------------


def test_snapshot_of_a_parked_session_under_a_concurrent_get(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = SessionStateManager(max_bytes={"cpu": _size()})
    a = parkable_record(fill=1)
    m.put("a", a)
    m.put("b", parkable_record(fill=2))
    assert m.peek("a").parked  # type: ignore[union-attr]
    real = SessionState.unpark_on_host
    snapshotter = threading.get_ident()
    racer: dict[str, Any] = {}

    def get_a() -> None:
        racer["got"] = m.get("a")

    def read_while_a_get_runs(self: SessionState) -> SessionState:
        # The snapshot's read lets a concurrent `get` run first, unless the lock holds it.
        if threading.get_ident() == snapshotter and "thread" not in racer:
            racer["thread"] = threading.Thread(target=get_a)
            racer["thread"].start()
            racer["thread"].join(timeout=0.5)
        return real(self)

    monkeypatch.setattr(SessionState, "unpark_on_host", read_while_a_get_runs)
    m.snapshot("a", tmp_path / "a.safetensors")
    racer["thread"].join()
    assert tree_equal(load_state(tmp_path / "a.safetensors"), a)
    assert tree_equal(racer["got"], a)
    assert m.peek("a").parked == ()  # type: ignore[union-attr]


# -- item 19: every read of a parked object -------------------------------------------------------


def _refusal(action: str, kind: str, name: str) -> str:
    return (
        f"Cannot {action} {kind} `{name}`: it is parked on the host tier and not resident. "
        "Call `.unpark()` first (a manager does so on `get`, `get_or_create` and `require`)."
    )


def test_every_read_and_staged_operation_of_a_parked_object_raises_parked_error() -> None:
    kv = EncodeOnceKV().allocate(num_layers=1, branches=("cond",))
    kv = kv.stage({"cond": [(torch.zeros(2), torch.ones(2))]})
    parked = kv.park("host", name="kv")
    staged: list[tuple[str, Any]] = [
        ("use `stage` of", lambda: parked.stage({"cond": [(torch.zeros(2), torch.zeros(2))]})),
        ("use `discard` of", lambda: parked.discard()),
        ("use `has_staged` of", lambda: parked.has_staged),
        ("use `layer` of", lambda: parked.layer("cond", 0)),
        ("commit to", lambda: parked.commit()),
        ("view", lambda: parked.view(include_staged=True)),
    ]
    for action, call in staged:
        with pytest.raises(ParkedError, match=re.escape(_refusal(action, "EncodeOnceKV", "kv"))):
            call()
    ring = LatentBuffer(name="ring", dim=0).allocate().commit(torch.arange(3.0))
    parked_ring = ring.park("host")
    reads: list[tuple[str, Any]] = [
        ("use `concat` of", lambda: parked_ring.concat()),
        ("take the length of", lambda: len(parked_ring)),
        ("view", lambda: parked_ring.view(last=1)),
    ]
    for action, call in reads:
        with pytest.raises(ParkedError, match=re.escape(_refusal(action, "LatentBuffer", "ring"))):
            call()
    assert bool(parked_ring)
    assert not hasattr(parked_ring, "_private_probe")
    # Nothing was lost: both come back as they were.
    assert tree_equal(parked.unpark(), kv)
    assert tree_equal(parked_ring.unpark(), ring)
    assert torch.equal(parked_ring.unpark().concat(), torch.arange(3.0))  # type: ignore[attr-defined]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_that_drops_its_copy_leaves_the_parents_spool_files(
    tmp_path: Path,
) -> None:
    m = SessionStateManager(max_bytes={"cpu": _size()}, park_tier="disk", spool_dir=tmp_path)
    a = parkable_record(fill=1)
    m.put("a", a)
    m.put("b", parkable_record(fill=2))
    (spool,) = tmp_path.iterdir()
    files = sorted(spool.glob("parked-*.safetensors"))
    assert len(files) == 1
    pid = os.fork()
    if pid == 0:  # the child's copy of the manager releases everything, then goes
        code = 0
        try:
            m.clear()
            del m
            gc.collect()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert sorted(spool.glob("parked-*.safetensors")) == files
    got = m.get("a")
    assert got is not None
    assert tree_equal(got, a)
