"""A byte budget naming two devices: each device is held to its own budget (issue 21)."""

from __future__ import annotations

import re

import pytest
import torch

from sessionstate import (
    LatentBuffer,
    SessionAdmissionError,
    SessionState,
    SessionStateManager,
    TensorCache,
    nbytes_by_device,
    tree_equal,
)
from sessionstate.testing import recount_nbytes_by_device


def _record(fill: float) -> SessionState:
    cache = TensorCache(name="cache").allocate().commit(torch.full((16,), fill))
    ring = LatentBuffer(name="ring", dim=0).allocate().commit(torch.arange(4.0) + fill)
    return SessionState(
        objects={"cache": cache, "ring": ring}, attrs={"m": torch.empty(4, device="meta")}
    )


CPU = nbytes_by_device(_record(0.0))["cpu"]
META = nbytes_by_device(_record(0.0))["meta"]


def _check_recount(m: SessionStateManager) -> None:
    recount = recount_nbytes_by_device([m.peek(sid) for sid in m.session_ids()])
    stats = m.stats()
    assert {k: v for k, v in stats.items() if k.startswith("nbytes:")} == {
        f"nbytes:{d}": n for d, n in recount.items()
    }


def test_only_the_second_device_over_budget_parks() -> None:
    m = SessionStateManager(max_bytes={"meta": 2**30, "cpu": 2 * CPU})
    records = {sid: _record(float(i)) for i, sid in enumerate("abc")}
    for sid, record in records.items():
        m.put(sid, record)
        stats = m.stats()
        assert stats["nbytes:cpu"] <= 2 * CPU
        _check_recount(m)
    stats = m.stats()
    assert stats["parks"] == 1
    assert stats["evictions"] == 0
    assert m.peek("a").parked == ("cache", "ring")  # type: ignore[union-attr]
    assert stats["nbytes:meta"] == 3 * META  # meta is within its budget: nothing moved
    got = m.get("a")  # unparking `a` parks `b`, the least recently used now
    assert got is not None
    assert tree_equal(got, records["a"])
    assert m.stats()["nbytes:cpu"] <= 2 * CPU
    assert m.peek("b").parked == ("cache", "ring")  # type: ignore[union-attr]
    _check_recount(m)


def test_only_the_second_device_over_budget_evicts() -> None:
    # Meta bytes sit in an attribute, which is never parked: the budget evicts.
    m = SessionStateManager(max_bytes={"cpu": 2**30, "meta": 2 * META})
    for i, sid in enumerate("abc"):
        m.put(sid, _record(float(i)))
        assert m.stats()["nbytes:meta"] <= 2 * META
        _check_recount(m)
    assert m.session_ids() == ["b", "c"]
    assert m.stats()["evictions"] == 1


def test_a_record_over_the_second_devices_whole_budget_is_refused() -> None:
    m = SessionStateManager(max_bytes={"meta": 2**30, "cpu": CPU - 1})
    m.put("small", SessionState(attrs={"x": torch.zeros(1)}))
    msg = (
        f"Cannot store session 'a': its record holds {CPU} bytes on cpu, more than the whole "
        f"budget of {CPU - 1} bytes there (`max_bytes`). Raise the budget for cpu, or keep less "
        "of the session on that device."
    )
    with pytest.raises(SessionAdmissionError, match=re.escape(msg)):
        m.put("a", _record(1.0))
    assert m.session_ids() == ["small"]
    assert torch.equal(m.get("small").attrs["x"], torch.zeros(1))  # type: ignore[union-attr]
    _check_recount(m)
