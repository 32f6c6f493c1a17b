"""Ray scale-out under faults: timeouts at every stage, corrupt bytes, a lying acknowledgement,
dead sources, and losing the last worker.

One local Ray cluster for the module; one shared two-worker router for the tests that leave it
as they found it, and one three-worker router that the worker-loss test kills one by one. A
fault is armed on one worker (a delay longer than the router's timeout, or a corruption) and
disarmed by a call queued behind it, so every test ends with its faults finished.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import attrs
import pytest

ray = pytest.importorskip("ray")

# The pipeline and the worker are defined here; workers receive them by value.
from sessionstate import (  # noqa: E402
    SessionStateLostError,
    SnapshotError,
)
from sessionstate._storage import SnapshotParts  # noqa: E402
from sessionstate.distributed import (  # noqa: E402
    MigrationError,
    Router,
    SessionRestoredError,
    SessionWorker,
    WorkerTimeoutError,
)
from tests.ray_support import CounterPipeline  # noqa: E402
from tests.ray_support import get as _get  # noqa: E402
from tests.ray_support import kill as _kill  # noqa: E402
from tests.ray_support import other as _other  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DELAY = 2.5  # seconds an armed stage sleeps on its worker
SHORT = 1.0  # the router's timeout while a delay is armed: unarmed calls finish within it


def _flip_last_storage_byte(parts: SnapshotParts) -> SnapshotParts:
    # A copy: the exported arrays are views of the source's record, which must stay intact.
    last = parts.storages[-1].copy()
    last[-1] ^= 0xFF
    return attrs.evolve(parts, storages=(*parts.storages[:-1], last))


def _shorten_last_storage(parts: SnapshotParts) -> SnapshotParts:
    return attrs.evolve(parts, storages=(*parts.storages[:-1], parts.storages[-1][:-8]))


def _flip_document_byte(parts: SnapshotParts) -> SnapshotParts:
    # The first character of the torch version: the document stays JSON, its checksum fails.
    header = bytearray(parts.header)
    at = header.index(b"torch_version") + len(b'torch_version\\":\\"')  # JSON inside JSON
    header[at] = ord("0") if header[at] != ord("0") else ord("1")
    return attrs.evolve(parts, header=bytes(header))


_IN_TRANSIT = {
    "corrupt": _flip_last_storage_byte,
    "shorten": _shorten_last_storage,
    "corrupt-document": _flip_document_byte,
}


class FaultyWorker(SessionWorker):
    """Sleeps at, corrupts, dies at, or kills another worker at the armed stage (the fence
    arguments pass through untouched)."""

    fault: str | None = None
    delay: float = 0.0
    victim: Any = None

    def arm(self, fault: str | None, delay: float = 0.0, victim: Any = None) -> None:
        self.fault, self.delay, self.victim = fault, delay, victim

    def _pause(self, stage: str) -> None:
        if self.fault == stage:
            time.sleep(self.delay)
        elif self.fault == f"die-{stage}":
            sys.exit(1)  # the actor's process ends: the router sees a lost worker
        elif self.fault == f"kill-{stage}":  # another worker dies first (`victim`, by `arm`)
            ray.kill(self.victim)
            for _ in range(200):
                try:
                    ray.get(self.victim.stats.remote(), timeout=60)
                except ray.exceptions.RayActorError:
                    return
                time.sleep(0.05)

    def step(self, session_id: str, inputs: Any, **fence: Any) -> Any:
        self._pause("step")
        return super().step(session_id, inputs, **fence)

    def export_session(self, session_id: str, **fence: Any) -> tuple[SnapshotParts, str]:
        self._pause("export")
        data, sha = super().export_session(session_id, **fence)
        if self.fault in _IN_TRANSIT:  # the digest is the exported header's, as sent
            data = _IN_TRANSIT[self.fault](data)
        return data, sha

    def import_session(self, session_id: str, data: SnapshotParts, **fence: Any) -> Any:
        self._pause("import")
        ack = super().import_session(session_id, data, **fence)
        self._pause("acknowledge")  # stored; the acknowledgement is late
        if self.fault == "wrong-digest":
            ack = attrs.evolve(ack, digest="0" * 64)
        return ack

    def drop_session(self, session_id: str, **fence: Any) -> bool:
        self._pause("drop")
        return super().drop_session(session_id, **fence)

    def export_family(self, session_ids: Any, **fence: Any) -> tuple[SnapshotParts, str]:
        self._pause("export")
        return super().export_family(session_ids, **fence)

    def import_family(self, session_ids: Any, data: SnapshotParts, **fence: Any) -> Any:
        self._pause("import")
        ack = super().import_family(session_ids, data, **fence)
        self._pause("acknowledge")  # stored; the acknowledgement is late
        return ack


@pytest.fixture(scope="module")
def cluster(ray_cluster: None) -> None:
    """The run's one local cluster (`ray_cluster` in conftest)."""


@pytest.fixture(scope="module")
def toy(cluster: None) -> Iterator[Router]:
    router = Router(CounterPipeline, workers=2, worker_class=FaultyWorker, timeout=60)
    yield router
    router.shutdown()


@contextmanager
def armed(
    router: Router, worker: str, fault: str, *, delay: float = 0.0, timeout: float | None = None
) -> Iterator[None]:
    _get(router.handle(worker).arm.remote(fault, delay))
    previous = router.timeout
    if timeout is not None:
        router.timeout = timeout
    try:
        yield
    finally:
        router.timeout = previous
        _get(router.handle(worker).arm.remote(None))  # runs after the armed call finished


def _holders(router: Router, session_id: str) -> list[str]:
    return [name for name, s in router.stats().items() if session_id in s.nbytes_by_session]


def _intact(sid: str, source: str, destination: str, stage: str, what: str) -> str:
    return (
        f"Migrating session {sid!r} from {source!r} to {destination!r} failed at the {stage} "
        f"stage ({what}); the session stays on {source!r} with its record intact. Retry, or "
        "pick another destination."
    )


@pytest.mark.parametrize("stage", ["export", "import", "acknowledge", "drop"])
def test_a_migration_timing_out_at_any_stage_leaves_exactly_one_owner_with_its_record(
    toy: Router, stage: str
) -> None:
    sid = f"slow-{stage}"
    for i in range(3):
        assert toy.step(sid, 64) == i + 1
    source, destination = toy.owner(sid), _other(toy, sid)
    slow = source if stage in ("export", "drop") else destination
    with armed(toy, slow, stage, delay=DELAY, timeout=SHORT):
        if stage == "drop":
            # The acknowledgement was terminal: the migration completed, the source's late
            # drop of its copy is not a failure.
            assert toy.migrate(sid, destination).destination == destination
        else:
            operation = "export_session" if stage == "export" else "import_session"
            what = f"{slow!r} did not answer `{operation}` within {SHORT:g} s"
            shown = "export" if stage == "export" else "import"
            with pytest.raises(
                MigrationError, match=re.escape(_intact(sid, source, destination, shown, what))
            ):
                toy.migrate(sid, destination)
    owner = destination if stage == "drop" else source
    assert toy.owner(sid) == owner
    assert toy.step(sid, 64) == 4  # the record is intact and the session usable
    assert _holders(toy, sid) == [owner]
    assert toy.drop(sid)
    assert _holders(toy, sid) == []


def _forked(router: Router, name: str, size: int) -> list[str]:
    # A source stepped three times and one branch: a family of two sharing the payload.
    ids = [name, f"{name}-b"]
    for i in range(3):
        assert router.step(ids[0], size) == i + 1
    router.fork(ids[0], ids[1])
    return ids


def _whole_on(router: Router, ids: list[str], owner: str, size: int) -> None:
    # Each member is held by `owner` alone, at the router's epoch (the other workers hold
    # it at none), and shares the payload with the other member.
    held = {name: set(s.nbytes_by_session) for name, s in router.stats().items()}
    assert [name for name in held if not held[name].isdisjoint(ids)] == [owner]
    assert set(ids) <= held[owner]
    for sid in ids:
        assert router.owner(sid) == owner
        for name in router.workers:
            epoch = _get(router.handle(name).epoch.remote(sid))
            assert epoch == (router.epoch(sid) if name == owner else None), (sid, name)
        stats = _get(router.handle(owner).session_stats.remote(sid))
        assert stats["shared_with"] == [m for m in ids if m != sid]
        assert stats["nbytes_shared"]["cpu"] >= 4 * size  # the float32 payload, once


@pytest.mark.parametrize("stage", ["export", "import", "acknowledge", "drop"])
def test_a_family_migration_timing_out_at_any_stage_leaves_it_whole_on_one_side(
    toy: Router, stage: str
) -> None:
    ids = _forked(toy, f"family-slow-{stage}", 64)
    source, destination = toy.owner(ids[0]), _other(toy, ids[0])
    epochs = [toy.epoch(sid) for sid in ids]
    slow = source if stage in ("export", "drop") else destination
    with armed(toy, slow, stage, delay=DELAY, timeout=SHORT):
        if stage == "drop":
            # The acknowledgement was terminal: the source's late drops are no failure.
            assert toy.migrate_many(ids, destination).destination == destination
        else:
            operation = "export_family" if stage == "export" else "import_family"
            shown = "export" if stage == "export" else "import"
            msg = (
                f"Migrating the family {ids!r} from {source!r} to {destination!r} failed at "
                f"the {shown} stage ({slow!r} did not answer `{operation}` within {SHORT:g} "
                f"s); the sessions stay on {source!r} with their records intact. Retry, or "
                "pick another destination."
            )
            with pytest.raises(MigrationError, match=re.escape(msg)):
                toy.migrate_many(ids, destination)
    owner = destination if stage == "drop" else source
    _whole_on(toy, ids, owner, 64)
    now = [toy.epoch(sid) for sid in ids]
    if stage == "drop":  # each moved to an epoch of its own, never one used before
        assert len(set(now)) == len(ids)
        assert set(now).isdisjoint(epochs)
    else:
        assert now == epochs
    assert [toy.step(sid, 64) for sid in ids] == [4, 4]  # each record intact and usable
    for sid in ids:
        assert toy.drop(sid)
    assert not any(set(ids) & set(s.nbytes_by_session) for s in toy.stats().values())


def test_a_timed_out_step_raises_a_library_error_and_is_counted_when_it_completes(
    toy: Router,
) -> None:
    sid = "slow-step"
    toy.step(sid, 8)
    toy.step(sid, 8)
    owner = toy.owner(sid)
    with (
        armed(toy, owner, "step", delay=DELAY, timeout=SHORT),
        pytest.raises(WorkerTimeoutError) as info,
    ):
        toy.step(sid, 8)
    assert not isinstance(info.value, ray.exceptions.GetTimeoutError)
    assert str(info.value) == (
        f"Worker {owner!r} did not answer `step` for 'slow-step' within 1 s (the router's "
        "`timeout`); the call may still be running there. A step is counted only if it "
        "completes: the next call for the session waits for it first, and `Router.steps` "
        "reports the steps applied. Raise `timeout` if calls take this long."
    )
    assert (info.value.session_id, info.value.worker, info.value.operation) == (
        sid,
        owner,
        "step",
    )
    assert toy.steps(sid) == 3  # it completed on the worker, and the router counted it
    assert toy.step(sid, 8) == 4
    assert toy.steps(sid) == 4
    toy.drop(sid)


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        ("corrupt", "is corrupt: storage 0 (256 bytes) fails its xxh3-64 check"),
        ("shorten", "its header places storage 0 (256 bytes) at offset 0, but part 0 is 248"),
        ("corrupt-document", "is corrupt: its JSON document fails its xxh3-64 check"),
    ],
)
def test_parts_corrupted_in_transit_fail_the_import_with_snapshot_error(
    toy: Router, fault: str, cause: str
) -> None:
    sid = f"in-transit-{fault}"
    toy.step(sid, 64)
    toy.step(sid, 64)
    source, destination = toy.owner(sid), _other(toy, sid)
    head = (
        f"Migrating session {sid!r} from {source!r} to {destination!r} failed at the import "
        "stage (SnapshotError: "
    )
    tail = f"); the session stays on {source!r} with its record intact. Retry, or pick another "
    tail += "destination."
    with (
        armed(toy, source, fault),
        pytest.raises(MigrationError, match=re.escape(head) + ".*" + re.escape(tail)) as info,
    ):
        toy.migrate(sid, destination)
    assert isinstance(info.value.__cause__, SnapshotError)
    assert cause in str(info.value.__cause__)
    assert toy.owner(sid) == source
    assert _holders(toy, sid) == [source]  # nothing was stored at the destination
    assert toy.step(sid, 64) == 3  # the source's record is intact and steps again
    toy.drop(sid)


def test_a_wrong_digest_fails_the_migration_at_the_acknowledge_stage(toy: Router) -> None:
    sid = "liar"
    toy.step(sid, 64)
    source, destination = toy.owner(sid), _other(toy, sid)
    head = (
        f"Migrating session {sid!r} from {source!r} to {destination!r} failed at the "
        f"acknowledge stage ({destination!r} acknowledged digest 000000000000, {source!r} "
        "exported "
    )
    tail = f"); the session stays on {source!r} with its record intact. Retry, or pick another "
    tail += "destination."
    with (
        armed(toy, destination, "wrong-digest"),
        pytest.raises(MigrationError, match=re.escape(head) + "[0-9a-f]{12}" + re.escape(tail)),
    ):
        toy.migrate(sid, destination)
    assert toy.owner(sid) == source
    assert _holders(toy, sid) == [source]  # the destination's copy was dropped
    assert toy.step(sid, 64) == 2
    toy.drop(sid)


def test_drops_reach_the_owner_and_leave_no_worker_holding_the_sessions(toy: Router) -> None:
    sids = [f"drop-{i}" for i in range(6)]
    for i, sid in enumerate(sids):
        toy.step(sid, 16 * (i + 1))
    assert {toy.owner(sid) for sid in sids} == set(toy.workers)  # both workers hold some
    toy.migrate(sids[0], _other(toy, sids[0]))  # and one moved before its drop
    for sid in sids:
        assert toy.drop(sid)
    held = {sid for s in toy.stats().values() for sid in s.nbytes_by_session}
    assert held.isdisjoint(sids)
    assert set(toy.owners()).isdisjoint(sids)
    assert not toy.drop(sids[0])  # already gone


def test_dead_sources_and_the_last_worker_lost_never_claim_an_intact_record(
    cluster: None,
) -> None:
    router = Router(CounterPipeline, workers=3, worker_class=FaultyWorker, timeout=60)
    try:
        homes = {"snap": "worker-0", "plain": "worker-1", "late": "worker-2", "late2": "worker-2"}
        sizes = {"snap": 16, "plain": 1 << 16, "late": 16, "late2": 16}
        for sid in ("snap", "late", "late2"):
            router.set_snapshot_every(sid, 1)
        for sid, home in homes.items():
            router.step(sid, sizes[sid])
            if router.owner(sid) != home:
                router.migrate(sid, home)
            router.step(sid, sizes[sid])  # its worker reports its bytes: placement sees them

        # A step that times out but completes is counted: steps_kept stays exact.
        with (
            armed(router, "worker-0", "step", delay=DELAY, timeout=SHORT),
            pytest.raises(WorkerTimeoutError),
        ):
            router.step("snap", 16)
        assert router.step("snap", 16) == 4

        _kill(router, "worker-0")
        restored = (
            "Migrating session 'snap' from 'worker-0' to 'worker-1' failed at the export stage "
            "(worker 'worker-0' died); 'worker-0' was lost, and the session was restored on "
            "'worker-2' from its snapshot after step 4; the next call for it raises "
            "`SessionRestoredError`."
        )
        with pytest.raises(MigrationError, match=re.escape(restored)):
            router.migrate("snap", "worker-1")
        with pytest.raises(SessionRestoredError) as notice:
            router.step("snap", 16)
        assert (notice.value.steps_kept, notice.value.steps_lost) == (4, 0)
        assert router.step("snap", 16) == notice.value.steps_kept + 1  # no step applied twice

        _kill(router, "worker-1")
        lost = (
            "Migrating session 'plain' from 'worker-1' to 'worker-2' failed at the export stage "
            "(worker 'worker-1' died); 'worker-1' was lost, and the session with it; the next "
            "call for it raises `SessionStateLostError`, saying why. Call `drop` on the router "
            "to start it again, or set `set_snapshot_every` to survive a worker loss."
        )
        with pytest.raises(MigrationError, match=re.escape(lost)):
            router.migrate("plain", "worker-2")
        with pytest.raises(SessionStateLostError, match=re.escape("Session 'plain' was lost")):
            router.step("plain", 16)

        _kill(router, "worker-2")  # the last live worker, holding three snapshots
        for sid in ("late", "snap", "late2"):
            gone = (
                f"Session {sid!r} was lost with worker 'worker-2' (the worker died, and no live "
                "worker was left to restore its snapshot on); its state is gone. Every worker "
                "of this router is lost: start a new `Router`."
            )
            with pytest.raises(SessionStateLostError, match=re.escape(gone)):
                router.step(sid, 16)
        assert router.owners() == {}
        assert router.workers == []
    finally:
        router.shutdown()


def test_a_family_whose_source_dies_mid_migration_is_on_the_destination_or_said_lost(
    cluster: None,
) -> None:
    router = Router(CounterPipeline, workers=4, worker_class=FaultyWorker, timeout=60)
    try:
        destination = "worker-3"
        families = {}
        for stage, home in (("export", "worker-0"), ("import", "worker-1"), ("drop", "worker-2")):
            sid = f"gone-{stage}"
            if stage == "export":
                router.set_snapshot_every(sid, 1)  # the source restores; its branch has none
            families[stage] = ids = _forked(router, sid, 16)
            if router.owner(sid) != home:
                router.migrate_many(ids, home)

        # The source dies exporting: nothing reached the destination, and the message says
        # what became of each member (no "records intact").
        # A second branch, stepped once: it has a snapshot of its own, the first has none.
        ids = [*families["export"], "gone-export-c"]
        router.fork(ids[0], ids[2])
        assert router.step(ids[2], 16) == 4
        restored, lost = [ids[0], ids[2]], [ids[1]]
        assert {frozenset(f) for f in router.families()} >= {frozenset(ids)}
        _get(router.handle("worker-0").arm.remote("die-export"))
        msg = (
            f"Migrating the family {ids!r} from 'worker-0' to {destination!r} failed at the "
            f"export stage (worker 'worker-0' died); 'worker-0' was lost: {restored!r} were "
            "restored from their snapshots (the next call for each raises "
            f"`SessionRestoredError`); {lost!r} were lost with it (the next call for each "
            "raises `SessionStateLostError`; call `drop` on the router to start them again)."
        )
        with pytest.raises(MigrationError, match=re.escape(msg)):
            router.migrate_many(ids, destination)
        assert "worker-0" not in router.workers
        # Each was restored alone, from its own snapshot: they share nothing, and are no
        # longer a family (a family shares its storages on one worker).
        assert all(set(f).isdisjoint(ids) for f in router.families())
        for sid, kept in zip(restored, (3, 4), strict=True):
            with pytest.raises(SessionRestoredError) as notice:
                router.step(sid, 16)
            assert (notice.value.steps_kept, notice.value.steps_lost) == (kept, 0)
            assert router.step(sid, 16) == kept + 1  # no step applied twice
        with pytest.raises(
            SessionStateLostError, match=re.escape(f"Session {ids[1]!r} was lost with worker")
        ):
            router.step(ids[1], 16)
        for sid in ids:
            assert router.drop(sid)

        # The source dies once its export is sent, before the import (the destination kills
        # it first), or while it drops its copies: the family is the destination's, whole.
        for stage, source, armed_on in (
            ("import", "worker-1", destination),
            ("drop", "worker-2", "worker-2"),
        ):
            ids = families[stage]
            epochs = [router.epoch(sid) for sid in ids]
            fault, victim = (
                ("kill-import", router.handle(source)) if stage == "import" else ("die-drop", None)
            )
            _get(router.handle(armed_on).arm.remote(fault, 0.0, victim))
            record = router.migrate_many(ids, destination)
            if armed_on == destination:
                _get(router.handle(destination).arm.remote(None))
            assert (record.source, record.destination) == (source, destination)
            assert source not in router.workers
            _whole_on(router, ids, destination, 16)
            assert set(router.epoch(sid) for sid in ids).isdisjoint(epochs)
            assert [router.step(sid, 16) for sid in ids] == [4, 4]
        assert router.workers == [destination]
    finally:
        router.shutdown()
