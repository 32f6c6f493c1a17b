"""The manager hands out and takes back a batch: `get_many` and `put_many`.

One room check for the whole batch (no session of the batch parked to make room for
another), all or nothing on the way back; with `stack`, `vmap` and `unstack` a batch of
sessions steps in one forward and is stored as if each had stepped alone.
"""

from __future__ import annotations

import pytest
import torch

import sessionstate as ss
from sessionstate import (
    SessionAdmissionError,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
    TensorCache,
    tree_equal,
)
from tests.support import assert_stats_equal_a_recount


def _record(fill: float) -> SessionState:
    cache = TensorCache(name="cache").allocate().commit(torch.full((100,), fill))
    return SessionState(objects={"cache": cache})


def _manager(sessions: int, room_for: int) -> SessionStateManager[SessionState]:
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": room_for * 400 + 50}, park_tier="disk"
    )
    for i in range(sessions):
        m.put(f"s{i}", _record(float(i)))
    return m


def test_get_many_makes_room_once_and_parks_no_member_for_another() -> None:
    m = _manager(4, room_for=2)  # s0 and s1 parked, s2 and s3 resident
    assert [bool(m.session_stats(f"s{i}")["parked"]) for i in range(4)] == [
        True,
        True,
        False,
        False,
    ]
    # A batch of a parked session and the least recently used resident one: one at a time,
    # bringing s0 back would park s2 (the oldest resident).
    records = m.get_many(["s0", "s2"])
    assert [r.object("cache", TensorCache).view()[0].item() for r in records] == [0.0, 2.0]
    assert not m.session_stats("s0")["parked"]
    assert not m.session_stats("s2")["parked"]
    assert m.session_stats("s3")["parked"]
    assert m.session_ids()[-2:] == ["s0", "s2"]
    assert m.stats()["hits"] == 2
    assert_stats_equal_a_recount(m)


def test_a_batch_the_budget_cannot_hold_is_refused_and_loses_nothing() -> None:
    m = _manager(4, room_for=2)
    with pytest.raises(SessionAdmissionError, match="Cannot make room"):
        m.get_many(["s0", "s1", "s2"])
    for i in range(4):
        assert tree_equal(m.peek(f"s{i}", on_host=True), _record(float(i)))
    assert m.stats()["evictions"] == 0
    assert_stats_equal_a_recount(m)


def test_get_many_of_a_missing_session_changes_nothing() -> None:
    m = _manager(3, room_for=3)
    order = m.session_ids()
    with pytest.raises(SessionStateLostError, match=r"does not hold \['nobody'\]"):
        m.get_many(["s0", "nobody"])
    with pytest.raises(ValueError, match="distinct session ids"):
        m.get_many(["s0", "s0"])
    assert m.session_ids() == order
    assert m.stats()["hits"] == 0


def test_put_many_is_all_or_nothing() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(max_sessions=3, on_full="refuse")
    m.put("a", _record(1.0))
    m.put("b", _record(2.0))
    before = {sid: m.peek(sid) for sid in ("a", "b")}
    with pytest.raises(SessionAdmissionError):
        m.put_many({"a": _record(10.0), "c": _record(3.0), "d": _record(4.0)})
    assert m.session_ids() == ["a", "b"]
    for sid, record in before.items():
        assert m.peek(sid) is record
    assert_stats_equal_a_recount(m)
    m.put_many([("b", _record(20.0)), ("c", _record(3.0))])
    assert m.session_ids() == ["a", "b", "c"]


def test_put_many_evicts_no_member_of_its_batch() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(max_sessions=2)
    m.put("a", _record(1.0))
    # A batch larger than the cap is refused before anything is evicted.
    with pytest.raises(SessionAdmissionError, match=r"cannot hold the batch"):
        m.put_many({"b": _record(2.0), "c": _record(3.0), "d": _record(4.0)})
    assert m.session_ids() == ["a"]
    m.put_many({"b": _record(2.0), "c": _record(3.0)})  # evicts "a", never "b"
    assert m.session_ids() == ["b", "c"]
    assert m.stats()["evictions"] == 1


def test_a_batch_steps_in_one_forward_and_is_stored_as_if_each_stepped_alone() -> None:
    def step(state: SessionState, x: torch.Tensor) -> tuple[SessionState, torch.Tensor]:
        state = state.update_object("cache", lambda c: c.commit(c.view() * 0.5 + x))
        return state, state.object("cache", TensorCache).view().sum()

    batched = _manager(6, room_for=4)
    alone = _manager(6, room_for=4)
    ids = ["s1", "s3", "s4"]
    xs = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        records = batched.get_many(ids)
        batch, outs = ss.vmap(step)(ss.stack(records), xs)
        batched.put_many(dict(zip(ids, ss.unstack(batch), strict=True)))
        for i, sid in enumerate(ids):
            state = alone.get(sid)
            assert state is not None
            state, out = step(state, xs[i])
            alone.put(sid, state)
            assert torch.equal(outs[i], out)
    for sid in batched.session_ids():
        assert tree_equal(batched.peek(sid, on_host=True), alone.peek(sid, on_host=True))
    assert_stats_equal_a_recount(batched)


def test_a_batch_of_held_sessions_over_the_budget_is_refused_whole() -> None:
    # Every member held and resident: the ledger moves once for the batch, and a batch over
    # the whole budget puts every member back, the ledger with them.
    m: SessionStateManager[SessionState] = SessionStateManager(max_bytes={"cpu": 2_000})
    m.put_many({"a": _record(1.0), "b": _record(2.0)})
    before = {sid: m.peek(sid) for sid in ("a", "b")}
    order = m.session_ids()
    huge = SessionState(
        objects={"cache": TensorCache(name="cache").allocate().commit(torch.zeros(1000))}
    )
    with pytest.raises(
        SessionAdmissionError, match=r"Cannot store the batch \['a', 'b'\]: together"
    ):
        m.put_many({"a": _record(3.0), "b": huge})
    assert m.session_ids() == order
    for sid, record in before.items():
        assert m.peek(sid) is record
    assert_stats_equal_a_recount(m)
    m.put_many({"a": _record(3.0), "b": _record(4.0)})
    assert_stats_equal_a_recount(m)
