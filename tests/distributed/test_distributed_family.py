"""Families on Ray: forks on the owning worker, and a family migrated as one payload.

One local Ray cluster for the whole run (`ray_cluster` in conftest); every `ray.get` has a
timeout (the router's, or `tests.ray_support.get`'s).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

from sessionstate import RandomKey, SessionStateLostError  # noqa: E402
from sessionstate._storage import SnapshotParts  # noqa: E402
from sessionstate.distributed import (  # noqa: E402
    DreamZeroFactory,
    MigrationError,
    Router,
    SessionWorker,
    StaleEpochError,
)
from sessionstate.models.dreamzero import DreamZeroConfig  # noqa: E402
from sessionstate.models.dreamzero.episode import scripted_episode  # noqa: E402
from tests.ray_support import CounterPipeline  # noqa: E402
from tests.ray_support import get as _get  # noqa: E402
from tests.ray_support import kill as _kill  # noqa: E402
from tests.ray_support import other as _other  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FlakyFamilyWorker(SessionWorker):
    """Fails the named stage of a family migration while a failure is armed."""

    fail: str | None = None

    def arm(self, stage: str | None) -> None:
        self.fail = stage

    def export_family(self, session_ids: Any, *, epochs: Any) -> tuple[SnapshotParts, str]:
        if self.fail == "export":
            msg = "export failed"
            raise RuntimeError(msg)
        return super().export_family(session_ids, epochs=epochs)

    def import_family(self, session_ids: Any, data: SnapshotParts, *, epochs: Any) -> Any:
        ack = super().import_family(session_ids, data, epochs=epochs)  # stored, then it fails
        if self.fail == "import":
            msg = "import failed"
            raise RuntimeError(msg)
        if self.fail == "die":
            sys.exit(1)  # the actor's process ends: the router sees a lost worker
        return ack


@pytest.fixture(scope="module")
def cluster(ray_cluster: None) -> None:
    """The run's one local cluster (`ray_cluster` in conftest)."""


@pytest.fixture(scope="module")
def toy(cluster: None) -> Iterator[Router]:
    router = Router(CounterPipeline, workers=2, worker_class=FlakyFamilyWorker, timeout=60)
    yield router
    router.shutdown()


def _held(router: Router) -> dict[str, set[Any]]:
    return {name: set(s.nbytes_by_session) for name, s in router.stats().items()}


def test_a_dreamzero_family_migrates_as_one_payload_and_keeps_its_sharing(
    cluster: None,
) -> None:
    cfg = DreamZeroConfig.preset("tiny")
    episode = [obs for _, obs in scripted_episode(cfg, steps=8, sessions=1, seed=5)]
    ids = ["src", "b1", "b2", "b3"]
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers (num_threads=1): bit for bit
    try:
        # The control: the same calls on one pipeline in this process, never migrated.
        pipe = DreamZeroFactory(preset="tiny")()
        for obs in episode[:4]:
            pipe.forward(obs, "src")
        pipe.fork("src", *ids[1:])
        pipe.forward(episode[4], "b1")
        pipe.forward(episode[5], "b2")
        expected = {sid: [pipe.forward(obs, sid) for obs in episode[6:]] for sid in ids}
    finally:
        torch.set_num_threads(previous)

    router = Router(DreamZeroFactory(preset="tiny"), workers=2, timeout=120)
    try:
        for obs in episode[:4]:
            router.step("src", obs)
        router.fork("src", *ids[1:])
        source = router.owner("src")
        assert {router.owner(sid) for sid in ids} == {source}
        assert len({router.epoch(sid) for sid in ids}) == len(ids)
        assert router.steps("b3") == 4  # a branch holds the source's steps
        router.step("b1", episode[4])
        router.step("b2", episode[5])
        handle = router.handle(source)
        before = {sid: _get(handle.session_stats.remote(sid)) for sid in ids}
        held = router.stats()[source].total_nbytes  # the family's bytes, each storage once
        # What the family holds: one session, plus what each branch holds alone.
        own = sum(
            before[sid]["nbytes"]["cpu"] - before[sid]["nbytes_shared"].get("cpu", 0)
            for sid in ids[1:]
        )
        assert held == before["src"]["nbytes"]["cpu"] + own
        alone = sum(before[sid]["nbytes"]["cpu"] for sid in ids)  # what 4 `migrate`s ship
        assert held <= alone - before["b3"]["nbytes"]["cpu"]

        destination = _other(router, "src")
        record = router.migrate_many(ids, destination)
        assert (record.session_id, record.source, record.destination) == (
            tuple(ids),
            source,
            destination,
        )
        assert router.migrations[-1] is record
        # One payload: every storage once (the family's bytes) and the header.
        assert held <= record.nbytes < held + 256 * 1024
        assert {router.owner(sid) for sid in ids} == {destination}
        assert _held(router)[source].isdisjoint(ids)  # the source let its copies go
        after = {sid: _get(router.handle(destination).session_stats.remote(sid)) for sid in ids}
        for sid in ids:
            assert after[sid]["nbytes"] == before[sid]["nbytes"]
            assert after[sid]["nbytes_shared"] == before[sid]["nbytes_shared"]
            assert after[sid]["nbytes_shared"]["cpu"] > 0
            assert set(after[sid]["shared_with"]) == set(ids) - {sid}
        # Never stepped: all shared but its own random key (a fork splits it: 16 bytes).
        own = after["b3"]["nbytes"]["cpu"] - after["b3"]["nbytes_shared"]["cpu"]
        assert own == RandomKey.seeded(0).nbytes_by_device()["cpu"]
        assert router.stats()[destination].total_nbytes == held

        for sid in ids:
            for i, (obs, want) in enumerate(zip(episode[6:], expected[sid], strict=True)):
                got = router.step(sid, obs)
                assert torch.equal(got.actions, want.actions), (sid, i)
                assert torch.equal(got.video_latents, want.video_latents), (sid, i)
    finally:
        router.shutdown()


def _family(toy: Router, name: str) -> list[str]:
    ids = [f"{name}-src", f"{name}-b1", f"{name}-b2"]
    for _ in range(3):
        toy.step(ids[0], 512)
    toy.fork(ids[0], *ids[1:])
    return ids


@pytest.mark.parametrize("stage", ["export", "import"])
def test_a_failed_family_migration_leaves_every_session_on_the_source(
    toy: Router, stage: str
) -> None:
    ids = _family(toy, f"flaky-{stage}")
    source, destination = toy.owner(ids[0]), _other(toy, ids[0])
    epochs = [toy.epoch(sid) for sid in ids]
    failing = source if stage == "export" else destination
    _get(toy.handle(failing).arm.remote(stage))
    try:
        with pytest.raises(MigrationError) as info:
            toy.migrate_many(ids, destination)
    finally:
        _get(toy.handle(failing).arm.remote(None))
    assert str(info.value) == (
        f"Migrating the family {ids!r} from {source!r} to {destination!r} failed at the "
        f"{stage} stage (RuntimeError: {stage} failed); the sessions stay on {source!r} with "
        "their records intact. Retry, or pick another destination."
    )
    assert [toy.owner(sid) for sid in ids] == [source] * 3
    assert [toy.epoch(sid) for sid in ids] == epochs
    held = _held(toy)
    assert set(ids) <= held[source]
    assert held[destination].isdisjoint(ids)  # the import was undone, all of it
    assert [toy.step(sid, 512) for sid in ids] == [4, 4, 4]  # each record intact
    toy.migrate_many(ids, destination)  # and the family moves once nothing fails
    assert [toy.step(sid, 512) for sid in ids] == [5, 5, 5]
    for sid in ids:
        toy.drop(sid)


def test_late_calls_for_a_migrated_family_are_refused(toy: Router) -> None:
    ids = _family(toy, "fenced")
    source, destination = toy.owner(ids[0]), _other(toy, ids[0])
    old = {sid: toy.epoch(sid) for sid in ids}
    toy.migrate_many(ids, destination)
    for sid in ids:
        assert toy.epoch(sid) != old[sid]
        with pytest.raises(StaleEpochError) as info:
            _get(toy.handle(destination).step.remote(sid, 8, epoch=old[sid], create=False))
        assert (info.value.sent, info.value.held) == (old[sid], toy.epoch(sid))
        with pytest.raises(SessionStateLostError):  # the source dropped its copy
            _get(toy.handle(source).step.remote(sid, 8, epoch=old[sid], create=False))
    assert [toy.step(sid, 8) for sid in ids] == [4, 4, 4]
    for sid in ids:
        toy.drop(sid)


def test_family_and_fork_refusals(toy: Router) -> None:
    ids = _family(toy, "refused")
    here, there = toy.owner(ids[0]), _other(toy, ids[0])
    cases: list[tuple[type[Exception], str, Any]] = [
        (
            ValueError,
            f"Cannot fork session {ids[0]!r} into ['x', {ids[1]!r}]: [{ids[1]!r}] already "
            "known to this router. Name new ids (`drop` a session to reuse its id).",
            lambda: toy.fork(ids[0], "x", ids[1]),
        ),
        (
            ValueError,
            "`fork('refused-src')` names no branch; pass the new ids: `fork(source, 'b1')`.",
            lambda: toy.fork(ids[0]),
        ),
        (
            ValueError,
            f"`migrate_many` needs distinct session ids, got {[ids[0], ids[0]]!r}; name each "
            "session once.",
            lambda: toy.migrate_many([ids[0], ids[0]], there),
        ),
        (
            ValueError,
            f"Sessions {ids!r} are already on {here!r}; pick another destination among "
            f"{toy.workers}.",
            lambda: toy.migrate_many(ids, here),
        ),
    ]
    for cls, msg, call in cases:
        with pytest.raises(cls, match=re.escape(msg)):
            call()
    toy.migrate(ids[2], there)
    owners = {sid: toy.owner(sid) for sid in ids}
    msg = (
        f"Cannot migrate {ids!r} together: they are on several workers ({owners!r}). Migrate a "
        "family from the one worker that holds it."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        toy.migrate_many(ids, there)
    assert [toy.step(sid, 8) for sid in ids] == [4, 4, 4]  # nothing changed
    for sid in ids:
        toy.drop(sid)


def test_a_destination_lost_mid_import_leaves_the_family_on_the_source(cluster: None) -> None:
    router = Router(CounterPipeline, workers=3, worker_class=FlakyFamilyWorker, timeout=60)
    try:
        ids = _family(router, "lost")
        source = router.owner(ids[0])
        destination = next(w for w in router.workers if w != source)
        _get(router.handle(destination).arm.remote("die"))
        with pytest.raises(MigrationError) as info:
            router.migrate_many(ids, destination)
        assert f"failed at the import stage (worker {destination!r} died)" in str(info.value)
        assert "the sessions stay on" in str(info.value)
        assert destination not in router.workers
        assert [router.owner(sid) for sid in ids] == [source] * 3
        assert [router.step(sid, 512) for sid in ids] == [4, 4, 4]
        _kill(router, source)  # and losing the source loses the family: none had a snapshot
        for sid in ids:
            with pytest.raises(
                SessionStateLostError, match=re.escape(f"lost with worker {source!r}")
            ):
                router.step(sid, 512)
    finally:
        router.shutdown()


def test_rebalance_moves_a_family_whole_or_not_at_all(cluster: None) -> None:
    cfg = DreamZeroConfig.preset("tiny")
    episode = [obs for _, obs in scripted_episode(cfg, steps=6, sessions=1, seed=9)]
    router = Router(DreamZeroFactory(preset="tiny"), workers=2, timeout=120)
    try:
        for obs in episode[:4]:
            router.step("src", obs)
        router.fork("src", "b1", "b2")
        router.step("b1", episode[4])
        assert router.families() == [{"src", "b1", "b2"}]
        home = router.owner("src")
        # The family is all one worker holds: moving it whole cannot narrow the gap, and
        # moving one member alone (each holds nearly all of it) would part it from what it
        # shares; so nothing moves.
        assert router.rebalance(tolerance=0.0) == []
        assert {router.owner(sid) for sid in ("src", "b1", "b2")} == {home}
        # Beside a small session on the same worker, the family moves whole, sharing kept.
        router.step("solo", episode[0])
        if router.owner("solo") != home:
            router.migrate("solo", home)
        moved = router.rebalance(tolerance=0.0)
        owners = {router.owner(sid) for sid in ("src", "b1", "b2")}
        assert len(owners) == 1
        assert router.families() == [{"src", "b1", "b2"}]
        if owners != {home}:
            (record,) = [r for r in moved if isinstance(r.session_id, tuple)]
            assert set(record.session_id) == {"src", "b1", "b2"}
            stats = _get(router.handle(record.destination).session_stats.remote("b2"))
            assert stats["nbytes_shared"]["cpu"] > 0
        # A member migrated alone leaves its family; dropped, it is gone from it.
        away = _other(router, "b2")
        router.migrate("b2", away)
        assert router.families() == [{"src", "b1"}]
        router.drop("b1")
        assert router.families() == []
    finally:
        router.shutdown()
