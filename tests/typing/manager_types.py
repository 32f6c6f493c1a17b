"""The manager's public typing, checked by mypy (listed in ``[tool.mypy] files``).

Each ``assert_type`` states what a type checker infers for a caller; a wrong inference is a
mypy error in ``make typecheck``. Nothing here runs at import.
"""

from __future__ import annotations

from typing import assert_type

import torch

from sessionstate import SessionAttr, SessionState, SessionStateManager


class Counter(SessionState):
    """A session type of a downstream model."""

    steps = SessionAttr(0, coerce=int)


def _new_counter() -> Counter:
    return Counter()


def typed_manager_returns_the_session_type() -> None:
    manager = SessionStateManager[Counter](max_sessions=4)
    assert_type(manager.get_or_create("a", Counter), Counter)
    assert_type(manager.get_or_create("a", _new_counter), Counter)
    assert_type(manager.get("a"), Counter | None)
    assert_type(manager.peek("a"), Counter | None)
    assert_type(manager.require("a"), Counter)
    assert_type(manager.restore("a", "a.safetensors"), Counter)
    assert_type(manager.require("a").steps, int)
    manager.put("a", manager.require("a").with_attrs(steps=1))


def plain_manager_holds_any_session_state() -> None:
    manager = SessionStateManager()
    assert_type(manager, SessionStateManager[SessionState])
    assert_type(manager.get_or_create("a", SessionState), SessionState)
    assert_type(manager.get("a"), SessionState | None)
    assert_type(manager.require("a"), SessionState)
    manager.put("b", SessionState(attrs={"x": torch.zeros(2)}))
    manager.put("c", Counter())  # a subclass is a SessionState


def a_typed_manager_refuses_other_records() -> None:
    manager = SessionStateManager[Counter]()
    manager.put("a", SessionState())  # type: ignore[arg-type]
    manager.get_or_create("a", SessionState)  # type: ignore[arg-type]
