"""A machine over step / migrate / kill / restore / drop / late messages, against a model.

The model is a dict: each session's step count, whether it snapshots every step, and whether
it is lost or has a restore notice pending. Late messages (a step or a drop carrying an epoch
the session held before a migration or a restore) go straight to a worker, as a slow network
would deliver them; each must be refused and change nothing. After every rule, each live
session is held by exactly its owner. One router of three workers per example: kills are
permanent, so examples are few and short.
"""

from __future__ import annotations

import sys

import attrs
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

ray = pytest.importorskip("ray")

from sessionstate import SessionStateLostError  # noqa: E402
from sessionstate.distributed import (  # noqa: E402
    Router,
    SessionRestoredError,
    StaleEpochError,
)
from tests.ray_support import CounterPipeline  # noqa: E402
from tests.ray_support import get as _get  # noqa: E402
from tests.ray_support import kill as _kill  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SESSIONS = ("snap-a", "plain-b", "snap-c")


@attrs.define
class _Model:
    count: int = 0
    lost: bool = False
    notice: bool = False
    old_epochs: list[int] = attrs.field(factory=list)


class RouterMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router(CounterPipeline, workers=3, timeout=60)
        self.model: dict[str, _Model] = {}

    def teardown(self) -> None:
        self.router.shutdown()

    def _live(self, sid: str) -> bool:
        m = self.model.get(sid)
        return m is not None and not m.lost

    @rule(sid=st.sampled_from(SESSIONS))
    def step(self, sid: str) -> None:
        m = self.model.get(sid)
        if m is None:
            if sid.startswith("snap"):
                self.router.set_snapshot_every(sid, 1)
            m = self.model[sid] = _Model()
        if m.lost:
            with pytest.raises(SessionStateLostError):
                self.router.step(sid, 4)
        elif m.notice:
            with pytest.raises(SessionRestoredError) as info:
                self.router.step(sid, 4)
            assert (info.value.steps_kept, info.value.steps_lost) == (m.count, 0)
            m.notice = False
        else:
            assert self.router.step(sid, 4) == m.count + 1
            m.count += 1

    @rule(sid=st.sampled_from(SESSIONS), pick=st.integers(0, 2))
    def migrate(self, sid: str, pick: int) -> None:
        if not self._live(sid) or len(self.router.workers) < 2:
            return
        owner = self.router.owner(sid)
        others = [w for w in self.router.workers if w != owner]
        epoch = self.router.epoch(sid)
        record = self.router.migrate(sid, others[pick % len(others)])
        assert self.router.owner(sid) == record.destination
        self.model[sid].old_epochs.append(epoch)

    @precondition(lambda self: len(self.router.workers) >= 2)
    @rule(pick=st.integers(0, 2))
    def kill(self, pick: int) -> None:
        live = self.router.workers
        victim = live[pick % len(live)]
        for sid, m in self.model.items():
            if not m.lost and self.router.owner(sid) == victim:
                m.old_epochs.append(self.router.epoch(sid))
                if sid.startswith("snap"):
                    m.notice = True  # restored from the snapshot of its last step
                else:
                    m.lost = True
        _kill(self.router, victim)
        self.router.stats()  # the router finds the loss and restores what it can

    @rule(sid=st.sampled_from(SESSIONS), pick=st.integers(0, 2), drop=st.booleans())
    def late_message(self, sid: str, pick: int, drop: bool) -> None:
        m = self.model.get(sid)
        if m is None or not m.old_epochs:
            return
        live = self.router.workers
        handle = self.router.handle(live[pick % len(live)])
        old = m.old_epochs[pick % len(m.old_epochs)]
        if drop:
            try:
                dropped = _get(handle.drop_session.remote(sid, epoch=old))
            except StaleEpochError:
                dropped = False
            assert not dropped
        else:
            with pytest.raises((StaleEpochError, SessionStateLostError)):
                _get(handle.step.remote(sid, 4, epoch=old, create=False))

    @rule(sid=st.sampled_from(SESSIONS))
    def drop(self, sid: str) -> None:
        assert self.router.drop(sid) == (sid in self.model)
        self.model.pop(sid, None)

    @invariant()
    def each_live_session_is_held_by_exactly_its_owner(self) -> None:
        held: dict[str, list[str]] = {}
        for name, s in self.router.stats().items():
            for sid in s.nbytes_by_session:
                held.setdefault(str(sid), []).append(name)
        live = {sid for sid in self.model if self._live(sid)}
        assert {sid: [self.router.owner(sid)] for sid in live} == held
        assert set(self.router.owners()) == live


@pytest.fixture(scope="module")
def cluster(ray_cluster: None) -> None:
    """The run's one local cluster (`ray_cluster` in conftest)."""


def test_router_machine(cluster: None) -> None:
    run_state_machine_as_test(
        RouterMachine,
        settings=settings(max_examples=2, stateful_step_count=20, deadline=None),
    )
