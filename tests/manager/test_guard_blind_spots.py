"""What the immutability guard cannot see, shown, so the list in the docs stays true.

The guard compares each stored tensor's version counter on the next access. Writes that
bypass the counter change the stored record without a word; `docs/guarantees.md` lists each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from sessionstate import ImmutabilityViolationError, SessionState, SessionStateManager, tree_equal
from tests.support import ROOT, clone_tree

GUARANTEES = ROOT / "docs" / "guarantees.md"

BLIND_SPOTS: list[Any] = [
    pytest.param(lambda t: t.numpy().__setitem__(0, 5.0), "`tensor.numpy()`", id="numpy"),
    pytest.param(lambda t: t.data.add_(5.0), "`tensor.data`", id="data"),
    pytest.param(
        lambda t: t.untyped_storage().fill_(1), "`tensor.untyped_storage()`", id="untyped_storage"
    ),
]


def _guarded() -> tuple[SessionStateManager, SessionState, torch.Tensor]:
    manager = SessionStateManager(check_immutable=True)
    x = torch.zeros(4)
    state = SessionState(attrs={"x": x, "step": 1})
    manager.put("s", state)
    return manager, state, x


@pytest.mark.parametrize(("write", "listed"), BLIND_SPOTS)
def test_guard_does_not_see_writes_that_bypass_the_version_counter(
    write: Callable[[torch.Tensor], object], listed: str
) -> None:
    manager, state, x = _guarded()
    clone = clone_tree(state)
    write(x)
    assert not tree_equal(state, clone)  # the stored record did change...
    assert manager.get("s") is state  # ...and the guard let the access through
    row = next(line for line in GUARANTEES.read_text().splitlines() if "cannot see" in line)
    assert listed in row  # ...as the docs say


def test_the_same_write_through_the_tensor_is_seen() -> None:
    manager, _, x = _guarded()
    x.add_(5.0)
    with pytest.raises(ImmutabilityViolationError, match=r"attrs\['x'\]"):
        manager.get("s")
