"""`SessionStateManager.expect`: a schedule of next use makes the manager park by Belady's rule
and prefetch the sessions that run next, within the budget, changing no output.

Sessions here hold one 32-byte `TensorCache` under a budget of two (64 bytes); the decisions
themselves are tested without a manager in test_schedule.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable, Sequence

import pytest
import torch

from sessionstate import (
    KVCache,
    KVPool,
    OmniDiffusionConfig,
    SessionState,
    SessionStateManager,
    TensorCache,
)

ONE = 32  # bytes of one session's record
SESSIONS = [f"s{i}" for i in range(6)]


def _record(value: float = 0.0) -> SessionState:
    return SessionState(objects={"c": TensorCache().allocate().commit(torch.full((8,), value))})


def _count(state: SessionState) -> tuple[SessionState, float]:
    x = state.object("c", TensorCache).view()
    return state.with_object("c", TensorCache().allocate().commit(x + 1)), float(x[0])


def _parked(m: SessionStateManager, *ids: Hashable) -> list[bool]:
    return [bool(m.peek(sid).parked) for sid in ids]  # type: ignore[union-attr]


def _charged(m: SessionStateManager) -> int:
    # Resident bytes plus what the background restores will make resident.
    prefetching = sum(m.session_stats(sid)["prefetching"] for sid in m.session_ids())
    return m.stats().get("nbytes:cpu", 0) + ONE * prefetching


def _round_robin(
    m: SessionStateManager, rounds: int, *, schedule: bool, prefetch: bool = False
) -> list[float]:
    requests = SESSIONS * rounds
    budget = m.max_bytes["cpu"] if m.max_bytes else float("inf")
    outs = []
    for i, sid in enumerate(requests):
        if schedule:
            m.expect(requests[i : i + len(SESSIONS)], prefetch=prefetch)
            assert _charged(m) <= budget
        outs.append(m.step(sid, _count, new=_record))
        assert _charged(m) <= budget
    return outs


def test_belady_parks_fewer_times_than_lru_on_a_round_robin() -> None:
    lru = SessionStateManager(max_bytes={"cpu": 2 * ONE})
    belady = SessionStateManager(max_bytes={"cpu": 2 * ONE})
    assert _round_robin(lru, 5, schedule=False) == _round_robin(belady, 5, schedule=True)
    # LRU parks the session that runs next at every step after the first two; Belady keeps
    # one session for five steps and misses 25 of 30 (test_schedule.py's model), less the
    # two that filled the budget.
    assert lru.stats()["parks"] == 28
    assert belady.stats()["parks"] == 23
    assert lru.stats()["evictions"] == belady.stats()["evictions"] == 0


def test_expect_with_prefetch_makes_the_next_get_a_prefetch_hit() -> None:
    m = SessionStateManager(max_bytes={"cpu": 2 * ONE})
    for sid in "abc":
        m.put(sid, _record())
    assert m.get("b") is not None  # least recently used first: a (parked), c, b
    m.expect(["a", "c", "b"])  # "a" next: its room is "b"'s, used last, not "c"'s
    assert _parked(m, "a", "b", "c") == [True, True, False]
    assert m.session_stats("a")["prefetching"]
    s = m.stats()
    assert (s["scheduled_prefetches"], s["prefetches"], s["prefetches_dropped"]) == (1, 1, 0)
    m.expect(["a", "c", "b"])  # already prefetched: not started again
    assert m.stats()["scheduled_prefetches"] == 1
    assert m.get("a") is not None
    s = m.stats()
    assert (s["prefetch_hits"], s["unparks"]) == (1, 1)
    assert _charged(m) <= 2 * ONE


def test_a_scheduled_prefetch_never_parks_a_session_needed_sooner() -> None:
    m = SessionStateManager(max_bytes={"cpu": 2 * ONE})
    for sid in "cdab":
        m.put(sid, _record())
    assert _parked(m, "a", "b", "c", "d") == [False, False, True, True]
    # "c" may take the room of "b" (used after it); "d" would need "a" or "c", both used
    # sooner: the plan stops there, and a plan's stop is not a dropped prefetch.
    m.expect(["a", "c", "b", "d"])
    assert _parked(m, "a", "b", "c", "d") == [False, True, True, True]
    assert [m.session_stats(sid)["prefetching"] for sid in "abcd"] == [False, False, True, False]
    s = m.stats()
    assert (s["scheduled_prefetches"], s["prefetches_dropped"], s["evictions"]) == (1, 0, 0)
    assert _charged(m) <= 2 * ONE


def test_a_round_robin_under_expect_and_prefetch_keeps_the_budget() -> None:
    plain = SessionStateManager()
    fetched = SessionStateManager(max_bytes={"cpu": 2 * ONE})
    want = _round_robin(plain, 4, schedule=False)
    assert _round_robin(fetched, 4, schedule=True, prefetch=True) == want  # checks the budget
    s = fetched.stats()
    assert s["evictions"] == 0
    assert s["scheduled_prefetches"] == s["prefetch_hits"] > 0


def test_the_pools_room_parks_the_session_used_last() -> None:
    def grow(state: SessionState) -> tuple[SessionState, None]:
        kv = state.object("kv", KVCache).append(pool, torch.ones(2), window=2)
        return state.with_object("kv", kv), None

    def fresh() -> SessionState:
        return SessionState(objects={"kv": KVCache().allocate()})

    parked = {}
    for schedule in ([], ["a", "b", "c", "d"]):
        pool = KVPool(6, block_tokens=2, token_shape=(), step_tokens=2, window_tokens=2)
        m = SessionStateManager(pools=(pool,))
        for sid in "abcd":
            m.step(sid, grow, new=fresh)  # "a" parked for "d"
        m.expect(schedule, prefetch=False)
        m.step("a", grow, new=fresh)
        parked[tuple(schedule)] = _parked(m, "a", "b", "c", "d")
    assert parked[()] == [False, True, False, False]  # least recently used: "b"
    assert parked[("a", "b", "c", "d")] == [False, False, False, True]  # used last: "d"


def test_expect_replaces_and_clears_and_ignores_unknown_ids() -> None:
    m = SessionStateManager(max_bytes={"cpu": 2 * ONE})
    for sid in "ab":
        m.put(sid, _record())
    m.expect(["nobody", ("x", 1), "b", "a"])  # unknown ids: kept in the order, nothing else
    m.expect(["a", "b"], prefetch=False)  # replaces it: "b" is used last
    m.put("c", _record())
    assert _parked(m, "a", "b", "c") == [False, True, False]
    m.expect([])  # cleared: least recently used first ("a")
    m.put("d", _record())
    assert _parked(m, "a", "b", "c", "d") == [True, True, False, False]
    assert m.stats()["scheduled_prefetches"] == 0


@pytest.mark.parametrize("bad", [["a", None], ["a", ["b"]], "ab", {"a"}, iter(["a"])])
def test_expect_refuses_what_is_not_a_schedule(bad: object) -> None:
    m = SessionStateManager(max_bytes={"cpu": 2 * ONE})
    m.put("a", _record())
    m.expect(["a"])
    with pytest.raises(TypeError):
        m.expect(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        m.expect(["a"], prefetch=1)  # type: ignore[arg-type]
    assert m.stats()["scheduled_prefetches"] == 0


def test_a_dreamzero_round_robin_under_expect_and_prefetch_equals_an_unbudgeted_run() -> None:
    from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    from sessionstate.models.dreamzero.episode import scripted_episode

    # Three sessions: each one's first step encodes an image, the run's main cost.
    episode = list(scripted_episode(DreamZeroConfig.preset("tiny"), steps=3, sessions=3, seed=2))

    def pipeline(max_bytes: int | None) -> DreamZeroPipeline:
        config = OmniDiffusionConfig(
            enable_session_state_manager=True,
            model={"preset": "tiny"},
            session_state_max_bytes=max_bytes,
            session_state_park_tier="host",
        )
        with warnings.catch_warnings():  # a host tier under a cpu budget warns
            warnings.simplefilter("ignore")
            return DreamZeroPipeline(config, environ={})

    def run(pipe: DreamZeroPipeline, schedule: Sequence[Hashable] | None) -> list[torch.Tensor]:
        outs = []
        for i, (sid, obs) in enumerate(episode):
            if schedule is not None:  # the next three steps' sessions, this one first
                pipe._managed.manager.expect(schedule[i : i + 3])  # type: ignore[union-attr]
            out = pipe.forward(obs, sid)
            outs += [out.actions, out.video_latents]
        return outs

    plain = pipeline(None)
    want = run(plain, None)
    manager = plain._managed.manager  # type: ignore[union-attr]
    largest = max(manager.session_stats(sid)["nbytes"]["cpu"] for sid in manager.session_ids())
    budget = 2 * largest + largest // 4
    fetched = pipeline(budget)
    got = run(fetched, [sid for sid, _ in episode])
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    s = fetched.stats()
    assert s["evictions"] == 0
    assert s["nbytes:cpu"] <= budget
    assert s["prefetch_hits"] > 0
    assert s["scheduled_prefetches"] > 0
