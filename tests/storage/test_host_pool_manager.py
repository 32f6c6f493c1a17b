"""The manager's host buffer pool: parks land in it, spill or refuse when it is full, and its
bytes come back on unpark, drop and eviction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessionstate import (
    SessionState,
    SessionStateManager,
    TensorCache,
    resolve_session_state_config,
)
from sessionstate.models._kit import build_manager

_N = 256  # floats per record: 1 KiB


def _record(seed: int) -> SessionState:
    x = torch.full((_N,), float(seed))
    return SessionState(objects={"c": TensorCache().allocate().commit((x,))})


def _manager(pool_bytes: int, full: str = "disk", **kw: object) -> SessionStateManager:
    return SessionStateManager(
        max_bytes={"cpu": 4 * _N + 4 * _N // 2},  # one record and a half
        host_pool_bytes=pool_bytes,
        host_pool_full=full,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def test_parks_land_in_the_pool_and_come_back_on_unpark_drop_and_evict() -> None:
    m = _manager(16 * 4 * _N, max_sessions=3)
    pool = m.host_pool
    assert pool is not None
    assert not pool.pinned
    total = pool.stats()["free"]
    m.put("a", _record(1))
    m.put("b", _record(2))  # parks "a" into the pool
    s = m.stats()
    assert s["host_pool_nbytes"] == total
    assert s["host_pool_free_nbytes"] == total - 4 * _N
    assert s["host_pool_spills"] == 0
    a = m.get("a")  # unparked ("b" is parked into the pool instead); "a"'s copy is kept
    assert a is not None
    assert torch.equal(a.object("c", TensorCache).view()[0], torch.ones(_N))
    s = m.stats()
    assert s["host_pool_free_nbytes"] == total - 8 * _N
    assert s["nbytes_kept:host"] == 4 * _N
    m.put("a", _record(5))  # "a" holds another object: its kept copy goes once it is freed
    del a
    assert m.stats()["host_pool_free_nbytes"] == total - 4 * _N
    assert m.stats()["nbytes_kept:host"] == 0
    assert m.drop("b")  # "b"'s range goes back
    assert m.stats()["host_pool_free_nbytes"] == total
    for sid in ("c", "d", "e"):  # the cap evicts parked sessions: their ranges come back
        m.put(sid, _record(3))
    assert m.stats()["evictions"] >= 1
    m.clear()
    assert pool.stats()["free"] == total
    assert pool.stats()["allocations"] == 0


def test_a_full_pool_spills_to_disk(tmp_path: Path) -> None:
    m = _manager(4 * _N, "disk", spool_dir=tmp_path)  # room for one parked record
    for sid in ("a", "b", "c"):
        m.put(sid, _record(ord(sid)))
    s = m.stats()
    assert s["host_pool_spills"] == 1
    assert s["nbytes_parked:host"] == 4 * _N
    assert s["nbytes_parked:disk"] == 4 * _N
    assert list(tmp_path.rglob("*.safetensors"))
    for sid in ("a", "b", "c"):
        state = m.get(sid)
        assert state is not None
        assert torch.equal(state.object("c", TensorCache).view()[0], torch.full((_N,), ord(sid)))
    m.clear()
    assert not list(tmp_path.rglob("*.safetensors"))
    assert m.host_pool is not None
    assert m.host_pool.stats()["allocations"] == 0


def test_a_full_pool_that_refuses_leaves_the_session_resident() -> None:
    m = _manager(4 * _N, "refuse", max_sessions=8)
    m.put("a", _record(1))
    m.put("b", _record(2))  # "a" parks into the pool
    m.put("c", _record(3))  # "b" cannot park: the pool is full, so "b" is evicted
    s = m.stats()
    assert s["host_pool_spills"] == 0
    assert s["evictions"] == 1
    assert "b" not in m
    assert m.peek("a").parked
    refusing = SessionStateManager(
        max_bytes={"cpu": 4 * _N + 4 * _N // 2},
        host_pool_bytes=4 * _N,
        host_pool_full="refuse",
        on_full="refuse",
    )
    refusing.put("a", _record(1))
    refusing.put("b", _record(2))
    from sessionstate import SessionAdmissionError

    with pytest.raises(SessionAdmissionError, match="budget"):
        refusing.put("c", _record(3))
    assert refusing.peek("b") is not None
    assert not refusing.peek("b").parked


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"host_pool_bytes": 0}, "host_pool_bytes.*positive"),
        ({"host_pool_bytes": "lots"}, "host_pool_bytes"),
        ({"host_pool_bytes": -1}, "host_pool_bytes"),
        ({"host_pool_full": "spill"}, "host_pool_full.*'disk'"),
    ],
)
def test_bad_pool_arguments_name_the_value_and_the_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SessionStateManager(**kwargs)


def test_the_disk_tier_needs_no_pool_and_settings_reach_the_manager() -> None:
    assert SessionStateManager(park_tier="disk", host_pool_bytes="1KiB").host_pool is None
    settings = resolve_session_state_config(
        None,
        {
            "OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES": "1MiB",
            "OMNI_DIFFUSION_SESSION_STATE_MANAGER_HOST_POOL_BYTES": "64KiB",
        },
    )
    m = build_manager(SessionState, settings, torch.device("cpu"))
    assert m.host_pool is not None
    assert m.host_pool.total == 64 * 1024
    assert m.stats()["host_pool_nbytes"] == 64 * 1024
