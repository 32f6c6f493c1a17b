"""The manager hands out and takes back a batch: `get_many` and `put_many`.

One room check for the whole batch (no session of the batch parked to make room for
another), all or nothing on the way back; with `stack`, `vmap` and `unstack` a batch of
sessions steps in one forward and is stored as if each had stepped alone.
"""

from __future__ import annotations

from pathlib import Path

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


def _small(fill: float) -> SessionState:
    cache = TensorCache(name="cache").allocate().commit(torch.full((25,), fill))
    return SessionState(objects={"cache": cache})


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("path", ["put_many", "step_many"])
def test_a_refused_batch_keeps_a_parked_members_bytes(tier: str, path: str, tmp_path: Path) -> None:
    # "A" is parked; the batch replaces it with a new record, then the budget refuses "N".
    # Storing A's new record let go of its parked bytes, and the rollback put back a parked
    # record whose bytes were gone.
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 300},
        on_full="refuse",
        park_tier=tier,  # type: ignore[arg-type]
        spool_dir=tmp_path,
    )
    m.put("X", SessionState(attrs={"x": torch.zeros(37)}))  # 148 bytes nothing can park
    m.put("A", _small(1.0))
    m.put("C", _small(3.0))  # parks "A"
    parked = m.peek("A")
    assert parked.parked == ("cache",)
    order = m.session_ids()

    def store() -> None:
        if path == "put_many":
            m.put_many([("A", _small(2.0)), ("N", _small(4.0))])
        else:
            m.step_many(
                ["A", "N"],
                lambda states: ([_small(2.0), _small(4.0)], [None, None]),
                new=SessionState,
                begin=True,
            )

    with pytest.raises(SessionAdmissionError, match="Cannot make room for session 'N'"):
        store()
    assert m.peek("A") is parked
    assert m.session_ids() == order
    assert "N" not in m
    assert tree_equal(m.require("A"), _small(1.0))  # its parked bytes are still there
    assert_stats_equal_a_recount(m)
    m.drop("X")
    m.put_many([("A", _small(2.0)), ("N", _small(4.0))])  # stored, A's old bytes released
    s = m.stats()
    assert m.peek("C").parked == ("cache",)  # parked for A's unpark: the tier holds it alone
    assert (s[f"nbytes_parked:{tier}"], s[f"nbytes_kept:{tier}"]) == (100, 0)
    assert_stats_equal_a_recount(m)


def test_a_refused_get_many_drops_a_prefetched_restore() -> None:
    # As a refused `get` does: what the background restore took (pool blocks, bytes) goes
    # with the reservation, so nothing is held that nobody is charged for.
    pool = ss.KVPool(32, block_tokens=2, token_shape=(3,))

    def record(seed: int) -> SessionState:
        g = torch.Generator().manual_seed(seed)
        kv = ss.KVCache().allocate().append(pool, torch.randn(5, 3, generator=g))
        feat = TensorCache().allocate().commit(torch.randn(64, generator=g))
        return SessionState(objects={"kv": kv, "feat": feat})

    one = 64 * 4 + 3 * 2 * 3 * 4  # the features and three blocks of two tokens
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": one + one // 2}, on_full="refuse"
    )
    m.put("a", record(1))
    m.put("b", record(2))  # parks "a"
    assert m.prefetch("a", make_room=True)  # parks "b"
    with pytest.raises(SessionAdmissionError, match="Cannot make room for session 'a'"):
        m.get_many(["a", "b"])  # both cannot fit
    assert pool.free_blocks == pool.num_blocks  # both parked, no restore holds a block
    assert not m.session_stats("a")["prefetching"]
    a = m.require("a")
    assert torch.equal(a.object("feat", TensorCache).view(), record(1).object("feat").view())
    assert_stats_equal_a_recount(m)


def test_get_many_counts_the_parked_bytes_a_family_shares_once(tmp_path: Path) -> None:
    # Three forks holding 400 parked bytes together and 8 bytes each: the batch needs 424
    # bytes, not three times the history (1,224), and gets them by parking the other session.
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 500}, park_tier="disk", spool_dir=tmp_path
    )
    m.put("a", _record(1.0).with_attrs(n=torch.zeros(2)))
    m.fork("a", "b", "c")
    for sid in ("b", "c"):
        m.put(sid, m.require(sid).with_attrs(n=torch.ones(2)))
    m.put("x", _small(2.0))  # parks the family's history
    assert all(m.peek(sid).parked == ("cache",) for sid in "abc")
    records = m.get_many(["a", "b", "c"])
    assert len({id(r.object("cache")) for r in records}) == 1  # back shared
    assert m.peek("x").parked == ("cache",)
    s = m.stats()
    assert s["nbytes:cpu"] == 424
    assert s["evictions"] == 0
    assert_stats_equal_a_recount(m)


@pytest.mark.parametrize("budget", [None, 10_000])
def test_put_many_of_held_sessions_makes_them_the_most_recently_used(budget: int | None) -> None:
    # As `put` does, in the order given: the batch of held, resident sessions is stored in
    # one move of the ledger, and a member parked (under the budget, "b") put by put.
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes=None if budget is None else {"cpu": budget}
    )
    for sid in "abcd":
        m.put(sid, _record(float(ord(sid))))
    m.put_many([("b", _record(1.0)), ("a", _record(2.0))])
    assert m.session_ids() == ["c", "d", "b", "a"]
    m.put_many({"c": _record(3.0)})
    assert m.session_ids() == ["d", "b", "a", "c"]


def test_a_batch_refused_midway_by_the_budget_evicts_nobody() -> None:
    # Put by put, "n" is stored while "r" still holds its old 400 bytes: 900 bytes at the
    # peak, over the whole budget of 800 whoever is evicted. Refused before "o" is evicted;
    # listing "r" first brings the peak down to the batch itself.
    m: SessionStateManager[SessionState] = SessionStateManager(max_bytes={"cpu": 800})
    m.put("o", SessionState(attrs={"x": torch.zeros(25)}))
    m.put("r", SessionState(attrs={"x": torch.zeros(100)}))
    before = m.peek("r")
    with pytest.raises(SessionAdmissionError, match="while 'n' is stored"):
        m.put_many([("n", SessionState(attrs={"x": torch.zeros(125)})), ("r", _small(1.0))])
    assert m.session_ids() == ["o", "r"]
    assert m.peek("r") is before
    assert m.stats()["evictions"] == 0
    m.put_many([("r", _small(1.0)), ("n", SessionState(attrs={"x": torch.zeros(125)}))])
    assert m.session_ids() == ["o", "r", "n"]
    assert m.stats()["evictions"] == 0
    assert_stats_equal_a_recount(m)
