"""The router's own surface: per-worker byte statistics, and placement that respects each
worker's room (its session cap and byte budget). One local Ray cluster, one router.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")

from sessionstate import SessionStateManager  # noqa: E402
from sessionstate.distributed import Router  # noqa: E402
from tests.ray_support import CounterPipeline  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class CappedPipeline(CounterPipeline):
    """Two sessions per worker at most, a 64 KiB cpu budget; a session holds a payload."""

    def __init__(self) -> None:
        self.manager = SessionStateManager(2, max_bytes={"cpu": 1 << 16})


@pytest.fixture(scope="module")
def capped(ray_cluster: None) -> Iterator[Router]:
    router = Router(CappedPipeline, workers=2, timeout=60)
    yield router
    router.shutdown()


def test_stats_report_each_workers_bytes_room_and_budget(capped: Router) -> None:
    capped.step("stats-a", 256)  # 1 KiB on worker-0
    stats = capped.stats()
    w0, w1 = stats["worker-0"], stats["worker-1"]
    assert w0.nbytes_by_session == {"stats-a": 1024}
    assert (w0.total_nbytes, w0.nbytes_by_device) == (1024, {"cpu": 1024})
    assert (w0.sessions, w0.max_sessions, w0.max_bytes) == (1, 2, {"cpu": 1 << 16})
    assert (w0.parked_nbytes, w0.engine_nbytes) == (0, 0)
    assert w0.room
    assert (w1.sessions, w1.total_nbytes, w1.nbytes_by_device, w1.room) == (0, 0, {}, True)
    assert capped.drop("stats-a")


def test_placement_passes_over_a_worker_without_room(capped: Router) -> None:
    capped.stats()  # placement goes by the bytes last reported: both workers are empty
    capped.step("tiny-0", 16)  # both empty: worker-0
    capped.step("big", 8192)  # worker-1: 32 KiB
    capped.step("tiny-1", 16)  # worker-0 holds fewer bytes; now at its cap of two
    assert [capped.owner(s) for s in ("tiny-0", "big", "tiny-1")] == [
        "worker-0",
        "worker-1",
        "worker-0",
    ]
    capped.step("next", 16)  # worker-0 still holds fewer bytes, but has no room
    assert capped.owner("next") == "worker-1"
    # Nothing was evicted to make room: every session keeps its record.
    for sid in ("tiny-0", "big", "tiny-1", "next"):
        assert capped.step(sid, 16) == 2
    stats = capped.stats()
    assert not stats["worker-0"].room
    assert not stats["worker-1"].room
    assert sum(s.sessions for s in stats.values()) == 4
    for sid in ("tiny-0", "big", "tiny-1", "next"):
        assert capped.drop(sid)
    assert all(s.room for s in capped.stats().values())
