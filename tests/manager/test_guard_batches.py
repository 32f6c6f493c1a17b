"""The immutability guard checks every record a batch or a family read hands out.

`get_many`, `peek_many` (which migration reads with) and `snapshot_many` check each record
before anything is read, parked or unparked for it, as `get`, `peek` and `snapshot` do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from sessionstate import (
    ImmutabilityViolationError,
    SessionState,
    SessionStateManager,
    TensorCache,
)


def _cache(fill: float) -> SessionState:
    cache = TensorCache(name="cache").allocate().commit(torch.full((25,), fill))
    return SessionState(objects={"cache": cache})


@pytest.mark.parametrize("read", ["get_many", "peek_many", "snapshot_many"])
@pytest.mark.parametrize("budget", [None, 250])
def test_a_record_written_in_place_is_caught_by_every_batch_read(
    read: str, budget: int | None, tmp_path: Path
) -> None:
    # With the budget, "a" is parked, "b" and "c" resident; "b" is written in place.
    m: SessionStateManager[SessionState] = SessionStateManager(
        check_immutable=True, max_bytes=None if budget is None else {"cpu": budget}
    )
    m.put("a", _cache(1.0))
    b = _cache(2.0)
    m.put("b", b)
    m.put("c", _cache(3.0))
    parked = m.peek("a").parked
    assert parked == (() if budget is None else ("cache",))
    reads: dict[str, Callable[[], Any]] = {
        "get_many": lambda: m.get_many(["a", "b"]),
        "peek_many": lambda: m.peek_many(["a", "b"]),
        "snapshot_many": lambda: m.snapshot_many(["a", "b"], tmp_path / "f.safetensors"),
    }
    b.object("cache", TensorCache).view().add_(1)
    with pytest.raises(ImmutabilityViolationError, match=r"^Session 'b': the tensor at"):
        reads[read]()
    assert m.peek("a").parked == parked  # nothing unparked for a corrupted batch
    assert m.stats()["hits"] == 0
    assert not (tmp_path / "f.safetensors").exists()
    m.put("b", _cache(3.0))  # the recovery: a new record
    reads[read]()
