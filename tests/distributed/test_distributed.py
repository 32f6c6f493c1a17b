"""Ray scale-out: affinity, migration both ways, failures mid-migration, worker loss.

One local Ray cluster for the whole run (`ray_cluster` in conftest, shut down at the end); every
`ray.get` has a timeout (the router's). Routers are few and shared where a test leaves
them as it found them: each one starts worker processes that import torch.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from sessionstate import SessionStateLostError, SessionStateManager  # noqa: E402
from sessionstate._storage import SnapshotParts  # noqa: E402
from sessionstate.cli import main  # noqa: E402
from sessionstate.distributed import (  # noqa: E402
    DreamZeroFactory,
    MigrationError,
    Router,
    SessionRestoredError,
    SessionWorker,
)
from sessionstate.models.dreamzero import DreamZeroConfig  # noqa: E402
from sessionstate.models.dreamzero.episode import scripted_episode  # noqa: E402
from tests.ray_support import CounterPipeline  # noqa: E402
from tests.ray_support import get as _get  # noqa: E402
from tests.ray_support import kill as _kill  # noqa: E402
from tests.ray_support import other as _other  # noqa: E402

# The flaky worker is defined here (the toy pipeline in ray_support); workers receive both by
# value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FlakyWorker(SessionWorker):
    """Fails the named migration stage while a failure is armed."""

    fail: str | None = None

    def arm(self, stage: str | None) -> None:
        self.fail = stage

    def export_session(self, session_id: str, *, epoch: int) -> tuple[SnapshotParts, str]:
        if self.fail == "export":
            msg = "export failed"
            raise RuntimeError(msg)
        return super().export_session(session_id, epoch=epoch)

    def import_session(self, session_id: str, data: SnapshotParts, *, epoch: int) -> Any:
        ack = super().import_session(session_id, data, epoch=epoch)  # stored, then it fails
        if self.fail == "import":
            msg = "import failed"
            raise RuntimeError(msg)
        return ack


@pytest.fixture(scope="module")
def cluster(ray_cluster: None) -> None:
    """The run's one local cluster (`ray_cluster` in conftest)."""


@pytest.fixture(scope="module")
def toy(cluster: None) -> Iterator[Router]:
    router = Router(CounterPipeline, workers=2, worker_class=FlakyWorker, timeout=60)
    yield router
    router.shutdown()


def test_new_sessions_go_to_the_worker_with_the_fewest_resident_bytes(toy: Router) -> None:
    assert toy.step("place-a", 4096) == 1  # both empty: the lower index
    assert toy.owner("place-a") == "worker-0"
    assert toy.step("place-b", 16) == 1
    assert toy.owner("place-b") == "worker-1"
    assert toy.step("place-c", 16) == 1  # worker-1 holds fewer bytes
    assert toy.owner("place-c") == "worker-1"
    for sid in ("place-a", "place-b", "place-c"):
        assert toy.drop(sid)


def test_a_thousand_routed_calls_across_migrations_reach_only_owners(toy: Router) -> None:
    sessions = [f"affine-{i}" for i in range(8)]
    calls = dict.fromkeys(sessions, 0)
    before = {name: s.steps for name, s in toy.stats().items()}
    for i in range(1000):
        sid = sessions[(i * 5) % len(sessions)]
        calls[sid] += 1
        # Each reply is the count the session's record holds: only its owner has it.
        assert toy.step(sid, 8) == calls[sid]
        if i % 10 == 9:
            toy.migrate(sid, _other(toy, sid))
    stats = toy.stats()
    assert sum(s.steps - before[name] for name, s in stats.items()) == 1000
    assert all(s.not_held == 0 for s in stats.values())
    held = {sid: name for name, s in stats.items() for sid in s.nbytes_by_session}
    assert all(held[sid] == toy.owner(sid) for sid in sessions)
    assert len(toy.migrations) >= 100
    for sid in sessions:
        toy.drop(sid)


@pytest.mark.parametrize("stage", ["export", "import"])
def test_a_failed_migration_leaves_the_source_owner_with_its_record(
    toy: Router, stage: str
) -> None:
    sid = f"flaky-{stage}"
    for i in range(3):
        assert toy.step(sid, 64) == i + 1
    source, destination = toy.owner(sid), _other(toy, sid)
    failing = source if stage == "export" else destination
    _get(toy.handle(failing).arm.remote(stage))
    try:
        with pytest.raises(MigrationError) as info:
            toy.migrate(sid, destination)
    finally:
        _get(toy.handle(failing).arm.remote(None))
    assert str(info.value) == (
        f"Migrating session {sid!r} from {source!r} to {destination!r} failed at the {stage} "
        f"stage (RuntimeError: {stage} failed); the session stays on "
        f"{source!r} with its record intact. Retry, or pick another destination."
    )
    assert toy.owner(sid) == source
    stats = toy.stats()
    assert sid in stats[source].nbytes_by_session
    assert sid not in stats[destination].nbytes_by_session  # the import was undone
    assert toy.step(sid, 64) == 4  # the record is intact
    toy.migrate(sid, destination)  # and the session still moves once nothing fails
    assert toy.step(sid, 64) == 5
    toy.drop(sid)


def test_calls_for_other_sessions_run_during_a_migration(toy: Router) -> None:
    moving, others = "moving", ["busy-0", "busy-1", "busy-2"]
    counts = dict.fromkeys([moving, *others], 0)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def caller(sid: str, n: int) -> None:
        try:
            for _ in range(n):
                with lock:
                    counts[sid] += 1
                toy.step(sid, 32)
        except BaseException as exc:  # reported below
            errors.append(exc)

    toy.step(moving, 1 << 16)
    counts[moving] += 1
    threads = [threading.Thread(target=caller, args=(sid, 40)) for sid in [moving, *others]]
    for t in threads:
        t.start()
    for _ in range(10):
        toy.migrate(moving, _other(toy, moving))
    for t in threads:
        t.join(timeout=120)
    assert not errors
    # No step ran during a migration: none was lost on the source or run twice.
    for sid, n in counts.items():
        assert toy.step(sid, 32) == n + 1
        toy.drop(sid)
    assert all(s.not_held == 0 for s in toy.stats().values())


def test_rebalance_brings_workers_within_the_stated_tolerance(toy: Router) -> None:
    sizes = {"heavy-0": 40_000, "heavy-1": 30_000, "heavy-2": 20_000, "heavy-3": 10_000}
    for sid, n in sizes.items():
        toy.step(sid, n)
        if toy.owner(sid) != "worker-0":
            toy.migrate(sid, "worker-0")
    moved = toy.rebalance(tolerance=0.0)
    assert moved
    stats = toy.stats()
    totals = {name: s.total_nbytes for name, s in stats.items()}
    heavy = max(totals, key=totals.__getitem__)
    spread = max(totals.values()) - min(totals.values())
    assert spread <= min(stats[heavy].nbytes_by_session.values())
    assert spread <= 4 * 10_000  # payloads are float32
    for sid in sizes:
        assert toy.step(sid, 1) == 2
        toy.drop(sid)


def test_dreamzero_sessions_migrate_both_ways_bit_identically(cluster: None) -> None:
    cfg = DreamZeroConfig.preset("tiny")
    episode = list(scripted_episode(cfg, steps=4, sessions=2, seed=11))
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = DreamZeroFactory(preset="tiny")()
        expected = [pipe.forward(obs, sid) for sid, obs in episode]
    finally:
        torch.set_num_threads(previous)
    router = Router(DreamZeroFactory(preset="tiny"), workers=2, timeout=120)
    try:
        homes: dict[str, str] = {}
        for i, ((sid, obs), want) in enumerate(zip(episode, expected, strict=True)):
            got = router.step(sid, obs)
            assert torch.equal(got.actions, want.actions), (i, sid)
            assert torch.equal(got.video_latents, want.video_latents), (i, sid)
            assert got.reset == want.reset
            homes.setdefault(sid, router.owner(sid))
            if i in (3, 6):  # away mid-episode, then back
                away = _other(router, "session-0")
                router.migrate("session-0", away)
                assert router.owner("session-0") == away
        assert router.owner("session-0") == homes["session-0"]
        assert [m.session_id for m in router.migrations] == ["session-0", "session-0"]
        assert router.migrations[0].source == router.migrations[1].destination
    finally:
        router.shutdown()


class PooledPipeline:
    """A pool of 4 KV blocks its manager governs (``pools=``); ``"fill"`` holds every free
    block outside the manager, ``"free"`` reports the free blocks, a number steps a session."""

    def __init__(self) -> None:
        from sessionstate import KVPool

        self.pool = KVPool(4, block_tokens=2, token_shape=(), step_tokens=2, window_tokens=4)
        self.manager = SessionStateManager(pools=(self.pool,))
        self.hog: Any = None

    def forward(self, inputs: Any, session_id: str) -> Any:
        from sessionstate import KVCache, SessionState

        if inputs == "fill":
            self.hog = self.pool.append(self.pool.empty(), torch.zeros(2 * self.pool.free_blocks))
            return self.pool.free_blocks
        if inputs == "free":
            return self.pool.free_blocks

        def step(state: SessionState) -> tuple[SessionState, Any]:
            kv = state.object("kv", KVCache).append(
                self.pool, torch.full((2,), float(inputs)), window=4
            )
            return state.with_object("kv", kv), kv.read()

        return self.manager.step(
            session_id, step, new=lambda: SessionState(objects={"kv": KVCache().allocate()})
        )


def test_a_parked_kv_session_migrates_from_a_full_pool(cluster: None) -> None:
    # Exporting a parked session reads its parked bytes where they are: the source's pool,
    # full, gives no block, and the destination continues the session bit-identically.
    router = Router(PooledPipeline, workers=2, timeout=60)
    try:
        router.step("a", 1.0)
        source = router.owner("a")
        _get(router.handle(source).step.remote("b", 2.0, epoch=1, create=True))
        fill = router.handle(source).step.remote("b", "fill", epoch=1, create=False)
        assert _get(fill).output == 0  # the source's pool is full; "a" is parked there
        router.migrate("a", _other(router, "a"))
        free = router.handle(source).step.remote("b", "free", epoch=1, create=False)
        assert _get(free).output == 0
        assert torch.equal(router.step("a", 3.0), torch.tensor([1.0, 1.0, 3.0, 3.0]))
    finally:
        router.shutdown()


def test_a_killed_worker_loses_or_restores_its_sessions(cluster: None) -> None:
    router = Router(CounterPipeline, workers=2, timeout=60)
    try:
        router.set_snapshot_every("snap-1", 1)
        router.set_snapshot_every("snap-3", 3)
        for sid in ("plain", "snap-1", "snap-3", "elsewhere"):
            for _ in range(4):
                router.step(sid, 16)
            target = "worker-1" if sid == "elsewhere" else "worker-0"
            if router.owner(sid) != target:
                router.migrate(sid, target)
        _kill(router, "worker-0")

        with pytest.raises(SessionStateLostError) as lost:
            router.step("plain", 16)
        assert str(lost.value) == (
            "Session 'plain' was lost with worker 'worker-0' (the worker died and the session "
            "had no snapshot); its state is gone. Call `drop` on the router to start it again, "
            "or set `set_snapshot_every` to survive a worker loss."
        )
        with pytest.raises(SessionRestoredError) as every_step:
            router.step("snap-1", 16)
        assert every_step.value.steps_lost == 0
        assert every_step.value.restored_on == "worker-1"
        restored = (
            "Session 'snap-3' was lost with worker 'worker-0' and restored on 'worker-1' from "
            "its snapshot after step 3; 1 steps were lost. This call did not run: resend the "
            "inputs from step 4 on."
        )
        with pytest.raises(SessionRestoredError, match=re.escape(restored)) as late:
            router.step("snap-3", 16)
        assert (late.value.steps_lost, late.value.steps_kept) == (1, 3)

        assert router.step("snap-1", 16) == 5  # restored from after its 4th step
        assert router.step("snap-3", 16) == 4  # restored from after its 3rd step
        assert router.step("elsewhere", 16) == 5  # sessions on live workers are untouched
        assert router.workers == ["worker-1"]
        with pytest.raises(SessionStateLostError):
            router.step("plain", 16)  # lost stays lost until dropped
        assert router.drop("plain")
        assert router.step("plain", 16) == 1
    finally:
        router.shutdown()


def test_router_messages(toy: Router) -> None:
    toy.step("msg", 4)
    owner = toy.owner("msg")
    same = (
        f"Session 'msg' is already on {owner!r}; pick another destination among "
        "['worker-0', 'worker-1']."
    )
    with pytest.raises(ValueError, match=re.escape(same)):
        toy.migrate("msg", owner)
    unknown = (
        "'worker-9' (str) is not a live worker of this router; the live workers are "
        "['worker-0', 'worker-1']."
    )
    with pytest.raises(ValueError, match=re.escape(unknown)):
        toy.migrate("msg", "worker-9")
    every = "`every` must be a positive int or None, got 0 (int) for session 'msg'."
    with pytest.raises(ValueError, match=re.escape(every)):
        toy.set_snapshot_every("msg", 0)
    tolerance = "`tolerance` must be a non-negative fraction of the mean, got -0.5."
    with pytest.raises(ValueError, match=re.escape(tolerance)):
        toy.rebalance(tolerance=-0.5)
    nobody = "Session 'nobody' is not known to this router; start it with `step`. Known sessions:"
    with pytest.raises(SessionStateLostError, match=re.escape(nobody)):
        toy.owner("nobody")
    assert toy.owner("msg") == owner  # a refused migration moves nothing
    toy.drop("msg")


def test_cluster_command_reports_an_identical_episode(
    cluster: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["cluster", "--sessions", "1", "--steps", "2", "--migrate-every", "1", "--seed", "7"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is True
    assert report["first_mismatch"] is None
    assert report["outputs_compared"] == 3 * 2  # actions, video latents, reset per call
    assert report["migrations"] == 2
    assert sorted(report["workers"]) == ["worker-0", "worker-1"]
    assert sum(w["steps"] for w in report["workers"].values()) == 2
    assert ray.is_initialized()  # the command left the test's cluster running
