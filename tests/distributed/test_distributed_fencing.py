"""Fenced ownership: late messages for an earlier owner or an earlier life are never applied.

Each test sends a worker the message a slow network, a retry or a previous owner would: a
worker operation carrying the session's epoch from before a migration or a restore. One local
Ray cluster for the module, one shared two-worker router, and one router whose worker dies.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from sessionstate._storage import SnapshotParts  # noqa: E402
from sessionstate.distributed import (  # noqa: E402
    MigrationRecord,
    Router,
    SessionRestoredError,
    SessionWorker,
    StaleEpochError,
)
from tests.ray_support import CounterPipeline  # noqa: E402
from tests.ray_support import get as _get  # noqa: E402
from tests.ray_support import kill as _kill  # noqa: E402
from tests.ray_support import other as _other  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LaggingWorker(SessionWorker):
    """A slow export, or a source whose drop never arrives (its copy stays, handed off)."""

    fault: str | None = None

    def arm(self, fault: str | None) -> None:
        self.fault = fault

    def export_session(self, session_id: str, **fence: Any) -> tuple[SnapshotParts, str]:
        if self.fault == "slow-export":
            time.sleep(1.0)
        return super().export_session(session_id, **fence)

    def drop_session(self, session_id: str, **fence: Any) -> bool:
        if self.fault == "lose-drops":
            return False
        return super().drop_session(session_id, **fence)


@pytest.fixture(scope="module")
def cluster(ray_cluster: None) -> None:
    """The run's one local cluster (`ray_cluster` in conftest)."""


@pytest.fixture(scope="module")
def toy(cluster: None) -> Iterator[Router]:
    router = Router(CounterPipeline, workers=2, worker_class=LaggingWorker, timeout=60)
    yield router
    router.shutdown()


def _refusal(worker: str, operation: str, sid: str, sent: int, why: str) -> str:
    return (
        f"Worker {worker!r} refused `{operation}` for session {sid!r} at epoch {sent}: {why}, "
        "so nothing was applied. Send calls through the router, which knows each session's "
        "owner and current epoch."
    )


def test_a_late_step_to_the_old_owner_after_a_migration_is_refused_and_changes_nothing(
    toy: Router,
) -> None:
    sid = "moved"
    toy.step(sid, 8)
    toy.step(sid, 8)
    source, destination, old = toy.owner(sid), _other(toy, sid), toy.epoch(sid)
    _get(toy.handle(source).arm.remote("lose-drops"))  # the source keeps its copy
    try:
        toy.migrate(sid, destination)
    finally:
        _get(toy.handle(source).arm.remote(None))
    new = toy.epoch(sid)
    assert new != old
    served = {name: s.steps for name, s in toy.stats().items()}

    handed_off = (
        "it exported the session at that epoch to a migration and holds the record only until "
        "the migration ends"
    )
    with pytest.raises(
        StaleEpochError, match=re.escape(_refusal(source, "step", sid, old, handed_off))
    ):
        _get(toy.handle(source).step.remote(sid, 8, epoch=old, create=False))
    moved_on = (
        f"it holds the session at epoch {new} (the session began, moved or was restored since "
        "the call was sent)"
    )
    with pytest.raises(
        StaleEpochError, match=re.escape(_refusal(destination, "step", sid, old, moved_on))
    ) as info:
        _get(toy.handle(destination).step.remote(sid, 8, epoch=old, create=False))
    assert (info.value.sent, info.value.held) == (old, new)

    assert {name: s.steps for name, s in toy.stats().items()} == served  # nothing ran
    assert toy.step(sid, 8) == 3  # the record holds exactly the routed steps
    assert _get(toy.handle(source).drop_session.remote(sid, epoch=old))  # the late cleanup
    toy.drop(sid)


def test_a_step_racing_a_migration_is_applied_before_the_export_or_refused(
    toy: Router,
) -> None:
    sid = "racing"
    toy.step(sid, 8)
    toy.step(sid, 8)
    source, destination, epoch = toy.owner(sid), _other(toy, sid), toy.epoch(sid)
    handle = toy.handle(source)
    done: list[MigrationRecord] = []
    _get(handle.arm.remote("slow-export"))
    try:
        early = handle.step.remote(sid, 8, epoch=epoch, create=False)  # sent before the export
        mover = threading.Thread(target=lambda: done.append(toy.migrate(sid, destination)))
        mover.start()
        time.sleep(0.3)  # the export is running; these queue behind it
        racing = []
        for _ in range(3):
            racing.append(handle.step.remote(sid, 8, epoch=epoch, create=False))
            time.sleep(0.05)
        mover.join(timeout=60)
    finally:
        _get(handle.arm.remote(None))
    assert done
    assert done[0].destination == destination
    assert _get(early).output == 3
    applied, refused = 0, 0
    for ref in racing:
        try:
            _get(ref)
        except StaleEpochError:
            refused += 1
        else:
            assert refused == 0  # the accepted ones all ran before the export
            applied += 1
    assert refused >= 1
    # Every step applied on the source is in the migrated record, once.
    assert toy.step(sid, 8) == 3 + applied + 1
    toy.drop(sid)


def test_a_late_drop_after_a_restore_drops_nothing(cluster: None) -> None:
    router = Router(CounterPipeline, workers=2, timeout=60)
    try:
        sid = "phoenix"
        router.set_snapshot_every(sid, 1)
        for _ in range(3):
            router.step(sid, 8)
        old = router.epoch(sid)
        _kill(router, router.owner(sid))
        with pytest.raises(SessionRestoredError) as notice:
            router.step(sid, 8)
        home, new = notice.value.restored_on, router.epoch(sid)
        assert new != old
        moved_on = (
            f"it holds the session at epoch {new} (the session began, moved or was restored "
            "since the call was sent)"
        )
        with pytest.raises(
            StaleEpochError, match=re.escape(_refusal(home, "drop_session", sid, old, moved_on))
        ):
            _get(router.handle(home).drop_session.remote(sid, epoch=old))
        assert sid in router.stats()[home].nbytes_by_session
        assert router.step(sid, 8) == notice.value.steps_kept + 1 == 4
    finally:
        router.shutdown()
