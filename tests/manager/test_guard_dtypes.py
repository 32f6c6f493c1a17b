"""The immutability guard watches every dtype: int64 and bool leaves too (issue 21)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from sessionstate import (
    ImmutabilityViolationError,
    LatentBuffer,
    SessionState,
    SessionStateManager,
    tree_equal,
)

WRITES: list[tuple[str, Callable[[SessionState], object]]] = [
    ("int64 add_", lambda s: s.attrs["steps"].add_(1)),
    ("int64 through a view", lambda s: s.attrs["steps"][1:].fill_(7)),
    ("bool logical_not_", lambda s: s.attrs["done"].logical_not_()),
    ("bool setitem", lambda s: s.attrs["done"].__setitem__(0, True)),
    ("int64 chunk of a ring", lambda s: s.object("ids").view()[0].mul_(3)),
]

KEYS = {
    "int64 add_": "attrs['steps']",
    "int64 through a view": "attrs['steps']",
    "bool logical_not_": "attrs['done']",
    "bool setitem": "attrs['done']",
    "int64 chunk of a ring": "objects['ids'].chunks[0]",
}


def _record() -> SessionState:
    ids = LatentBuffer(name="ids", dim=0).allocate().commit(torch.arange(3, dtype=torch.int64))
    return SessionState(
        objects={"ids": ids},
        attrs={
            "steps": torch.arange(4, dtype=torch.int64),
            "done": torch.zeros(2, dtype=torch.bool),
        },
    )


@pytest.mark.parametrize(("name", "write"), WRITES, ids=[n for n, _ in WRITES])
def test_in_place_writes_into_int64_and_bool_leaves_are_caught(
    name: str, write: Callable[[SessionState], object]
) -> None:
    m = SessionStateManager(check_immutable=True)
    state = _record()
    m.put("a", state)
    write(state)
    key = KEYS[name]
    msg = (
        f"Session 'a': the tensor at `{key}` was modified in place after the record was stored "
        "(version 0 -> 1). Records are immutable: build new tensors (`t = t + x`, not "
        "`t += x` or `t.copy_(...)`), then `drop('a')` this corrupted session."
    )
    with pytest.raises(ImmutabilityViolationError, match=re.escape(msg)):
        m.get("a")
    # A fresh record replaces the corrupted one, and the session goes on.
    fresh = _record()
    m.put("a", fresh)
    got = m.get("a")
    assert got is not None
    assert tree_equal(got, _record())
