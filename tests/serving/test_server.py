"""The simulated clock against a hand computation; determinism; Belady against LRU."""

from __future__ import annotations

import attrs
import pytest

from sessionstate.serving import (
    LINGBOT,
    Arrival,
    DeployShape,
    Load,
    SimulatedServer,
    arrivals,
    serve_loop,
    simulate,
)

MIB = 2**20

# Two sessions fit the device; a swap is 1 s each way; a step 0.5 s; chunks play 4 s.
TOY = DeployShape(
    "toy",
    {"kv": 10 * MIB},
    reserved_nbytes=0,
    device_nbytes=20 * MIB,
    host_nbytes=100 * MIB,
    bandwidth=10 * MIB,
    step_s=(0.5,),
    chunk_period_s=4.0,
    ttfc_s=3.0,
)
SESSIONS = [Arrival("a", 0.0, 2), Arrival("b", 0.0, 2), Arrival("c", 0.25, 1)]


def _run(policy: str) -> tuple[list[tuple[str, int, float, float, float, float]], dict]:
    server = SimulatedServer(TOY, policy)  # type: ignore[arg-type]
    run = serve_loop(
        server,
        SESSIONS,
        chunk_period_s=TOY.chunk_period_s,
        ttfc_s=TOY.ttfc_s,
        limit=TOY.resident_capacity if policy == "fixed" else None,
    )
    rows = [(c.session_id, c.index, c.release, c.start, c.done, c.due) for c in run.chunks]
    return rows, run.metrics()


def test_three_sessions_under_a_budget_of_two_match_the_hand_computation() -> None:
    # t=0: a and b admitted, both resident; EDF (both due at 3.0, a first): a's chunk 0 runs
    #   0 -> 0.5; a plays from 0.5, its chunk 1 released at 0.5, due 4.5.
    # t=0.5: c (arrived 0.25) admitted: the budget parks b, the least recently used (d2h
    #   0.5 -> 1.5). EDF: b (due 3.0), c (3.25), a (4.5). b is parked: its get parks a, now the
    #   least recently used (d2h 1.5 -> 2.5), then restores b once that room is free (h2d 2.5 ->
    #   3.5, after b's own park ended at 1.5): b's chunk 0 runs 3.5 -> 4.0 (late: due 3.0).
    # t=4.0: c (due 3.25) runs 4.0 -> 4.5 (late), its only chunk: dropped.
    # t=4.5: a (due 4.5) is parked; b alone is resident, so a fits: h2d 4.5 -> 5.5, a's
    #   chunk 1 runs 5.5 -> 6.0 (late). t=6.0: b's chunk 1 (released 4.0, due 8.0) runs
    #   6.0 -> 6.5, on time.
    rows, m = _run("lru")
    assert rows == [
        ("a", 0, 0.0, 0.0, 0.5, 3.0),
        ("b", 0, 0.0, 3.5, 4.0, 3.0),
        ("c", 0, 0.25, 4.0, 4.5, 3.25),
        ("a", 1, 0.5, 5.5, 6.0, 4.5),
        ("b", 1, 4.0, 6.0, 6.5, 8.0),
    ]
    assert m["attainment"] == 2 / 5
    assert (m["ttfc_p50_s"], m["ttfc_p99_s"]) == (4.0, 4.25)
    assert (m["chunk_latency_p50_s"], m["chunk_latency_p99_s"]) == (2.5, 5.5)
    assert (m["parks"], m["unparks"], m["prefetch_hits"]) == (2, 2, 0)
    assert m["bytes_moved"] == 4 * 10 * MIB
    assert (m["refused_sessions"], m["active_max"]) == (0, 3)


def test_a_fixed_capacity_refuses_the_third_session_and_meets_every_deadline() -> None:
    # a: 0 -> 0.5; b: 0.5 -> 1.0 (due 3.0); c refused at 0.5 (two held); a's chunk 1
    # (released 0.5) 1.0 -> 1.5; b's chunk 1 (released 1.0) 1.5 -> 2.0.
    rows, m = _run("fixed")
    assert rows == [
        ("a", 0, 0.0, 0.0, 0.5, 3.0),
        ("b", 0, 0.0, 0.5, 1.0, 3.0),
        ("a", 1, 0.5, 1.0, 1.5, 4.5),
        ("b", 1, 1.0, 1.5, 2.0, 5.0),
    ]
    assert (m["attainment"], m["refused_sessions"], m["parks"]) == (1.0, 1, 0)


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    load = Load(rate=0.3, mean_chunks=10, duration_s=60, seed=3)
    first = simulate(LINGBOT, load, "schedule")
    assert simulate(LINGBOT, load, "schedule") == first
    other = Load(rate=0.3, mean_chunks=10, duration_s=60, seed=4)
    assert arrivals(other) != arrivals(load)
    assert simulate(LINGBOT, other, "schedule")["metrics"] != first["metrics"]


def test_lengths_are_geometric_with_the_mean_asked_for() -> None:
    sessions = arrivals(Load(rate=50, mean_chunks=8, duration_s=200, seed=0))
    mean = sum(a.chunks for a in sessions) / len(sessions)
    assert min(a.chunks for a in sessions) == 1
    assert mean == pytest.approx(8, rel=0.05)
    assert len(sessions) / 200 == pytest.approx(50, rel=0.05)


def test_a_known_schedule_parks_fewer_times_than_lru_on_the_same_round_robin() -> None:
    # Five sessions through four slots, long enough for a steady round robin: Belady
    # misses on a quarter of the steps, LRU on every one.
    shape = DeployShape(
        "rr",
        {"kv": 10 * MIB},
        reserved_nbytes=0,
        device_nbytes=40 * MIB,
        host_nbytes=100 * MIB,
        bandwidth=1000 * MIB,
        step_s=(0.01,),
        chunk_period_s=1.0,
        ttfc_s=1.0,
    )
    sessions = [Arrival(f"s{i}", 0.01 * i, 40) for i in range(5)]
    parks = {}
    for policy in ("lru", "schedule"):
        server = SimulatedServer(shape, policy)  # type: ignore[arg-type]
        run = serve_loop(server, sessions, chunk_period_s=1.0, ttfc_s=1.0)
        parks[policy] = run.metrics()["parks"]
        assert len(run.chunks) == 200
    assert parks["lru"] >= 180  # all but the first round's and the last's
    assert parks["schedule"] <= 55  # a quarter of 200, and the edges


class _Scripted:
    """A backend whose steps take the given seconds, in turn; no memory."""

    def __init__(self, seconds: list[float]) -> None:
        self.seconds = iter(seconds)

    def admit(self, session_id: str, now: float, /) -> None:
        pass

    def step(self, ids: object, now: float, schedule: object, /) -> tuple[float, float]:
        return now, now + next(self.seconds)

    def finish(self, session_id: str, now: float, /) -> None:
        pass

    def counters(self) -> dict[str, float]:
        return {}


def test_a_late_chunk_leaves_the_next_deadline_where_it_was() -> None:
    # Chunk 0: 0 -> 0.1 (playout from 0.1). Chunk 1: released 0.1, 0.1 -> 1.1, due 0.6: late.
    # Chunk 2: released at 1.1 (chunk 1 done), 1.1 -> 1.2, due 0.1 + 2 * 0.5 = 1.1: late too.
    run = serve_loop(
        _Scripted([0.1, 1.0, 0.1]), [Arrival("a", 0.0, 3)], chunk_period_s=0.5, ttfc_s=1.0
    )
    assert [(c.release, c.done, c.due) for c in run.chunks] == [
        (0.0, 0.1, 1.0),
        (0.1, 1.1, 0.6),
        (1.1, 1.2000000000000002, 1.1),
    ]
    assert run.metrics()["attainment"] == 1 / 3


def test_a_session_the_manager_cannot_bring_back_fails_and_its_chunks_count_as_missed() -> None:
    # The host holds one parked session: c's admission parks b there; b's turn needs a parked
    # too, which the full host refuses. b fails with its two chunks unserved, counted missed.
    shape = attrs.evolve(TOY, host_nbytes=10 * MIB)
    server = SimulatedServer(shape, "lru")
    run = serve_loop(server, SESSIONS, chunk_period_s=4.0, ttfc_s=3.0)
    m = run.metrics()
    assert [f[:3] for f in run.failed] == [("b", 0.5, 2)]
    assert "over its budget" in run.failed[0][3]
    assert (m["failed_sessions"], m["chunks_lost"], m["chunks"]) == (1, 2, 3)
    assert m["attainment"] == sum(c.on_time for c in run.chunks) / 5
    assert "b" not in server.manager.session_ids()  # type: ignore[union-attr]
