"""Every user-facing message of `sessionstate.distributed` that needs no running cluster."""

from __future__ import annotations

import re

import pytest

ray = pytest.importorskip("ray")

from sessionstate import SessionState, SessionStateLostError, SessionStateManager  # noqa: E402
from sessionstate.distributed import (  # noqa: E402
    Router,
    SessionWorker,
    StaleEpochError,
    decode_family,
    encode_family,
    encode_record,
)


class _Counter:
    def __init__(self) -> None:
        self.manager = SessionStateManager()

    def forward(self, inputs: object, session_id: str) -> None:
        self.manager.put(session_id, SessionState())


class _Bespoke:
    manager = None

    def forward(self, inputs: object, session_id: str) -> None:
        return None


def test_worker_without_a_manager() -> None:
    msg = (
        f"Worker 'w0': the pipeline built by {_Bespoke!r} has no session-state manager "
        "(`manager` is None, NoneType); a worker can only hold and move sessions kept by a "
        "`SessionStateManager`. Build the pipeline with the manager enabled "
        "(OMNI_DIFFUSION_SESSION_STATE_MANAGER=1)."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        SessionWorker("w0", _Bespoke)


def test_worker_continuation_it_does_not_hold() -> None:
    worker = SessionWorker("w0", _Counter)
    msg = (
        "Worker 'w0' does not hold session 's' (evicted by its session cap, or routed here by "
        "mistake); its state is lost on this worker. Drop the session at the router and start "
        "it again."
    )
    with pytest.raises(SessionStateLostError, match=re.escape(msg)):
        worker.step("s", None, epoch=1, create=False)
    assert worker.stats().not_held == 1
    worker.step("s", None, epoch=1, create=True)
    assert worker.stats().steps == 1


def test_worker_export_of_a_session_it_does_not_hold() -> None:
    msg = (
        "Worker 'w0' cannot export session 's': it does not hold it. Ask the router which "
        "worker owns the session."
    )
    with pytest.raises(SessionStateLostError, match=re.escape(msg)):
        SessionWorker("w0", _Counter).export_session("s", epoch=1)


def test_worker_import_never_overwrites() -> None:
    worker = SessionWorker("w0", _Counter)
    worker.step("s", None, epoch=1, create=True)
    msg = (
        "Worker 'w0' already holds session 's'; an import never overwrites a live record. "
        "Drop it there first, or migrate to another worker."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        worker.import_session("s", encode_record(SessionState(attrs={"x": 1})), epoch=2)
    assert worker.manager.peek("s").attrs == {}  # type: ignore[union-attr]


def test_worker_family_messages() -> None:
    from sessionstate import SnapshotError

    worker = SessionWorker("w0", _Counter)
    msg = (
        "Worker 'w0' cannot export session 's': it does not hold it. Ask the router which "
        "worker owns the session."
    )
    with pytest.raises(SessionStateLostError, match=re.escape(msg)):
        worker.export_family(["s"], epochs=[1])
    worker.step("s", None, epoch=1, create=True)
    family = encode_family([SessionState(), SessionState()])
    msg = (
        "Worker 'w0' already holds sessions ['s']; an import never overwrites a live record. "
        "Drop them there first, or migrate to another worker."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        worker.import_family(["t", "s"], family, epochs=[2, 3])
    msg = (
        "Worker 'w0': the family holds 2 records, and 3 ids with 3 epochs were given; pass "
        "one id and one epoch per record."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        worker.import_family(["a", "b", "c"], family, epochs=[2, 3, 4])
    msg = "Worker 'w0': `fork_session` got 2 branches and 1 epochs; pass one epoch per branch."
    with pytest.raises(ValueError, match=re.escape(msg)):
        worker.fork_session("s", ["a", "b"], epoch=1, epochs=[2])
    assert worker.manager.session_ids() == ["s"]  # nothing was stored
    msg = (
        "The parts hold a SessionState, not a family of session records (a list, as "
        "`encode_family` makes); decode one session's parts with `decode_record`."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        decode_family(encode_record(SessionState()))


def test_manager_peek_many_of_a_session_it_does_not_hold() -> None:
    manager = SessionStateManager()
    manager.put("a", SessionState())
    msg = (
        "Cannot read session 'x': this manager does not hold it (never created, dropped, or "
        "evicted). Nothing was read. `session_ids()` lists the held ones."
    )
    with pytest.raises(SessionStateLostError, match=re.escape(msg)):
        manager.peek_many(["a", "x"])


def test_router_worker_count() -> None:
    msg = "`workers` must be a positive int, got 0 (int)."
    with pytest.raises(ValueError, match=re.escape(msg)):
        Router(_Counter, workers=0)


def test_router_needs_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    msg = (
        "Ray is not initialised; call `sessionstate.distributed.init_local_ray()` for a local "
        "cluster, or `ray.init(address=...)` to join one, before `Router`."
    )
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        Router(_Counter)


def _refused(operation: str, sent: int, why: str) -> str:
    return (
        f"Worker 'w0' refused `{operation}` for session 's' at epoch {sent}: {why}, so nothing "
        "was applied. Send calls through the router, which knows each session's owner and "
        "current epoch."
    )


def test_worker_refuses_a_stale_epoch() -> None:
    worker = SessionWorker("w0", _Counter)
    worker.import_session("s", encode_record(SessionState(attrs={"x": 1})), epoch=7)
    moved = (
        "it holds the session at epoch 7 (the session began, moved or was restored since the "
        "call was sent)"
    )
    with pytest.raises(StaleEpochError, match=re.escape(_refused("step", 3, moved))) as info:
        worker.step("s", None, epoch=3, create=False)
    assert (info.value.session_id, info.value.worker, info.value.sent, info.value.held) == (
        "s",
        "w0",
        3,
        7,
    )
    with pytest.raises(StaleEpochError, match=re.escape(_refused("step", 3, moved))):
        worker.step("s", None, epoch=3, create=True)  # a late begin restarts nothing
    with pytest.raises(StaleEpochError, match=re.escape(_refused("export_session", 3, moved))):
        worker.export_session("s", epoch=3)
    with pytest.raises(StaleEpochError, match=re.escape(_refused("drop_session", 3, moved))):
        worker.drop_session("s", epoch=3)
    assert not worker.reclaim_session("s", epoch=3)
    assert worker.manager.peek("s").attrs == {"x": 1}  # type: ignore[union-attr]
    assert worker.stats().steps == 0


def test_worker_refuses_steps_for_a_session_it_handed_off() -> None:
    worker = SessionWorker("w0", _Counter)
    worker.step("s", None, epoch=1, create=True)
    worker.export_session("s", epoch=1)
    handed_off = (
        "it exported the session at that epoch to a migration and holds the record only until "
        "the migration ends"
    )
    with pytest.raises(StaleEpochError, match=re.escape(_refused("step", 1, handed_off))):
        worker.step("s", None, epoch=1, create=False)
    assert worker.reclaim_session("s", epoch=1)  # the migration failed: steps run again
    worker.step("s", None, epoch=1, create=False)
    assert worker.stats().steps == 2
    assert worker.drop_session("s", epoch=1)
    assert worker.epoch("s") is None


def test_worker_refuses_a_session_stored_outside_the_router() -> None:
    worker = SessionWorker("w0", _Counter)
    worker.manager.put("s", SessionState())
    outside = "it holds the session at no epoch (it was stored here outside the router)"
    with pytest.raises(StaleEpochError, match=re.escape(_refused("step", 1, outside))):
        worker.step("s", None, epoch=1, create=False)
