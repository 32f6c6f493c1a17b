"""Every user-facing message of `sessionstate.distributed` that needs no running cluster."""

from __future__ import annotations

import re

import pytest

ray = pytest.importorskip("ray")

from sessionstate import SessionState, SessionStateLostError, SessionStateManager  # noqa: E402
from sessionstate.distributed import Router, SessionWorker, encode_record  # noqa: E402


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
