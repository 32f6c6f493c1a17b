"""Randomised fault fuzzing: a hypothesis state machine over a managed DreamZero pipeline.

The machine drives a managed tiny DreamZero pipeline (three sessions, a cap of two, the
immutability guard on) with forward steps on observations drawn from a pre-generated pool,
and with manager operations (`drop`, `get`, `require`, `stats`). Some steps run with an
injected exception: the k-th call of the observation transform, the VAE encode, the
denoiser, a `LatentBuffer.commit` or `DreamZeroSession.with_attrs` raises.

The model is a shadow pipeline without faults that is advanced only when the faulted step
succeeded (and, when it failed, performs only the lookup the failed step made). After every
rule, the faulted pipeline's manager must hold the same sessions in the same LRU order as the
shadow's, each record bit-identical to the shadow's; every successful step must return the
shadow's outputs; and a failed step must leave the stored record the very same object,
bit-identical to a clone taken before it.

The shadow's pure steps are memoised by each session's history of observations (records are
immutable, so a memoised record is as good as a recomputed one); that keeps the whole machine
within a few seconds per example.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import sessionstate.models.dreamzero._managed as managed_module
from sessionstate import (
    LatentBuffer,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
    tree_equal,
)
from sessionstate.models.dreamzero import (
    DreamZeroConfig,
    DreamZeroOutput,
    DreamZeroPipeline,
    DreamZeroSession,
    Observation,
    stitch_views,
)
from sessionstate.models.dreamzero.episode import PROMPTS, scripted_episode
from sessionstate.testing import recount_nbytes_by_device
from tests.support import clone_tree, same_output, torch_threads

CFG = DreamZeroConfig.preset("tiny")
CAP = 2
SESSION_IDS = ("a", "b", "c")
CALLS_PER_STEP = {"stitch_views": 1, "encode_chunk": 4, "diffuse": 1, "commit": 3, "with_attrs": 6}
"""The most calls one tiny DreamZero step makes of each fault point."""
FAULTS = st.sampled_from(sorted(CALLS_PER_STEP)).flatmap(
    # One past the maximum: an armed fault that the step never reaches.
    lambda point: st.tuples(st.just(point), st.integers(1, CALLS_PER_STEP[point] + 1))
)


def _pool() -> tuple[Observation, ...]:
    steps = [obs for _, obs in scripted_episode(CFG, steps=3, sessions=1, seed=21)]
    # A fourth observation with another prompt: stepping it resets the session.
    return (*steps, attrs.evolve(steps[0], prompt=PROMPTS[1]))


POOL = _pool()


class InjectedFaultError(RuntimeError):
    """The exception the machine injects."""


@attrs.define
class Fault:
    target: str
    k: int
    calls: int = 0
    fired: bool = False

    def tick(self, target: str) -> None:
        if target != self.target:
            return
        self.calls += 1
        if self.calls == self.k:
            self.fired = True
            raise InjectedFaultError(f"injected fault on call {self.k} of {target}")


@functools.cache
def _pipelines() -> tuple[DreamZeroPipeline, DreamZeroPipeline]:
    # Built once; each example gets fresh managers. The networks are pure and shared safely.
    env = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
    return DreamZeroPipeline(CFG, environ=env), DreamZeroPipeline(CFG, environ=env)


_SHADOW_STEPS: dict[tuple[int, ...], tuple[SessionState, DreamZeroOutput]] = {}
"""Memoised shadow steps: a session's observation history -> (record, output)."""


def peek(manager: SessionStateManager | None, sid: str) -> SessionState | None:
    # The stored record, without touching LRU order, the counters or the guard.
    assert manager is not None
    return manager.peek(sid)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def _fail(state: SessionState) -> tuple[SessionState, None]:
    msg = "the shadow's stand-in for the injected fault"
    raise InjectedFaultError(msg)


class FaultFuzzMachine(RuleBasedStateMachine):
    """A faulted managed pipeline against an unfaulted shadow advanced on success only."""

    def __init__(self) -> None:
        super().__init__()
        self.pipe, self.shadow = _pipelines()
        self.pipe.manager = SessionStateManager(CAP, check_immutable=True)
        self.shadow.manager = SessionStateManager(CAP)
        self.history: dict[str, tuple[int, ...]] = {}
        self.fault: Fault | None = None
        self.outcomes = {"ok": 0, "failed": 0}
        self._patches = pytest.MonkeyPatch()
        self._install_fault_points()

    def _install_fault_points(self) -> None:
        def point(target: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if self.fault is not None:  # armed only inside the faulted pipeline's step
                    self.fault.tick(target)
                return fn(*args, **kwargs)

            return wrapper

        mp, nets = self._patches, self.pipe.nets
        mp.setattr(f"{managed_module.__name__}.stitch_views", point("stitch_views", stitch_views))
        mp.setattr(nets, "encode_chunk", point("encode_chunk", nets.encode_chunk))
        mp.setattr(nets, "diffuse", point("diffuse", nets.diffuse))
        mp.setattr(LatentBuffer, "commit", point("commit", LatentBuffer.commit))
        mp.setattr(DreamZeroSession, "with_attrs", point("with_attrs", DreamZeroSession.with_attrs))

    def teardown(self) -> None:
        self._patches.undo()
        assert self.pipe.manager is not None
        event(f"evictions: {min(self.pipe.manager.stats()['evictions'], 3)}+")

    # -- the shadow ------------------------------------------------------------------------------

    def _shadow_forward(self, sid: str, index: int) -> DreamZeroOutput:
        manager = self.shadow.manager
        assert manager is not None
        previous = manager.get(sid)
        history = () if previous is None else self.history[sid]
        if previous is not None:
            assert previous is _SHADOW_STEPS[history][0]
        history = (*history, index)
        if history not in _SHADOW_STEPS:
            start = previous if previous is not None else self.shadow.new_session()
            assert isinstance(start, DreamZeroSession)
            _SHADOW_STEPS[history] = self.shadow.step(start, POOL[index])
        state, out = _SHADOW_STEPS[history]
        manager.put(sid, state)
        self.history[sid] = history
        return out

    # -- rules ------------------------------------------------------------------------------------

    def _forward(self, sid: str, index: int, fault: Fault | None) -> None:
        manager = self.pipe.manager
        before = peek(manager, sid)
        clone = clone_tree(before)
        self.fault = fault
        try:
            out = self.pipe.forward(POOL[index], sid)
        except InjectedFaultError:
            assert fault is not None
            assert fault.fired
            self.outcomes["failed"] += 1
            event(f"step failed in {fault.target}")
            # Nothing was published: the same object, bit-identical, or still nothing.
            assert peek(manager, sid) is before
            assert tree_equal(before, clone)
            # The model: the failed step made only its lookup (a hit or a miss), and left the
            # LRU order as it was, as a step that fails does on the shadow manager too.
            assert self.shadow.manager is not None
            with contextlib.suppress(InjectedFaultError):
                self.shadow.manager.step(sid, _fail, new=SessionState)
            return
        finally:
            self.fault = None
        self.outcomes["ok"] += 1
        event("step succeeded" + (" (fault armed, not reached)" if fault else ""))
        assert same_output(out, self._shadow_forward(sid, index))

    @rule(sid=st.sampled_from(SESSION_IDS), index=st.integers(0, len(POOL) - 1))
    def forward(self, sid: str, index: int) -> None:
        self._forward(sid, index, None)

    @rule(
        sid=st.sampled_from(SESSION_IDS),
        index=st.integers(0, len(POOL) - 1),
        fault=FAULTS,
    )
    def forward_with_fault(self, sid: str, index: int, fault: tuple[str, int]) -> None:
        """Arm a fault on the k-th call of a point; a step that makes fewer calls succeeds."""
        self._forward(sid, index, Fault(*fault))

    @rule(sid=st.sampled_from(SESSION_IDS))
    def drop(self, sid: str) -> None:
        assert self.pipe.manager is not None
        assert self.shadow.manager is not None
        assert self.pipe.manager.drop(sid) == self.shadow.manager.drop(sid)

    @rule(sid=st.sampled_from(SESSION_IDS))
    def get(self, sid: str) -> None:
        assert self.pipe.manager is not None
        assert self.shadow.manager is not None
        got, expected = self.pipe.manager.get(sid), self.shadow.manager.get(sid)
        assert (got is None) == (expected is None)
        assert tree_equal(got, expected)

    @rule(sid=st.sampled_from(SESSION_IDS))
    def require(self, sid: str) -> None:
        assert self.pipe.manager is not None
        assert self.shadow.manager is not None
        results: list[SessionState | None] = []
        for manager in (self.pipe.manager, self.shadow.manager):
            try:
                results.append(manager.require(sid))
            except SessionStateLostError:
                results.append(None)
        assert tree_equal(results[0], results[1])

    @rule()
    def stats(self) -> None:
        assert self.pipe.manager is not None
        assert self.shadow.manager is not None
        got, expected = self.pipe.manager.stats(), self.shadow.manager.stats()
        counters = ("sessions", "max_sessions", "hits", "misses", "evictions")
        assert {k: got[k] for k in counters} == {k: expected[k] for k in counters}
        assert self.pipe.manager.nbytes_by_session() == self.shadow.manager.nbytes_by_session()
        records = [peek(self.pipe.manager, sid) for sid in self.pipe.manager.session_ids()]
        recount = recount_nbytes_by_device(records)
        assert got["total_nbytes"] == sum(recount.values())
        assert {k[len("nbytes:") :]: v for k, v in got.items() if k.startswith("nbytes:")} == (
            recount
        )

    # -- the invariant ----------------------------------------------------------------------------

    @invariant()
    def records_match_the_shadow(self) -> None:
        assert self.pipe.manager is not None
        assert self.shadow.manager is not None
        ids = self.pipe.manager.session_ids()
        assert ids == self.shadow.manager.session_ids()
        assert len(ids) <= CAP
        for sid in ids:
            assert tree_equal(peek(self.pipe.manager, sid), peek(self.shadow.manager, sid))


def fault_fuzz_settings(profile: settings) -> settings:
    """The loaded profile's budget, scaled down: each example drives a whole pipeline."""
    return settings(
        profile,
        max_examples=max(1, profile.max_examples // 4),
        stateful_step_count=max(1, profile.stateful_step_count // 2),
        deadline=None,
        suppress_health_check=[*profile.suppress_health_check, HealthCheck.too_slow],
    )


TestFaultFuzz = FaultFuzzMachine.TestCase
TestFaultFuzz.settings = fault_fuzz_settings(settings.default)
