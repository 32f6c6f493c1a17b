"""A hypothesis machine over forks under a byte budget that parks.

Random sequences of create / fork / step / get / drop / prefetch / family snapshot, against
a model that holds each session's expected values as host tensors (the deep-copy way). After
every operation: every session reads back as the model says (bitwise, parked ones in host
memory), the byte counts equal a recount, the budget holds, and the tier holds no more than
one copy of each parked object.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from sessionstate import (
    LatentBuffer,
    SessionState,
    SessionStateManager,
    TensorCache,
)
from tests.support import assert_stats_equal_a_recount

CACHE = 64  # floats: 256 bytes
BUDGET = 3 * (CACHE * 4 + 4 * 16) + 32


def _values(state: SessionState) -> dict[str, torch.Tensor]:
    history = state.object("history", LatentBuffer)
    return {
        "cache": state.object("cache", TensorCache).view().clone(),
        "history": history.concat().clone() if len(history) else torch.zeros(0),
    }


class ForkMachine(RuleBasedStateMachine):
    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp())
        self.m: SessionStateManager[SessionState] = SessionStateManager(
            max_bytes={"cpu": BUDGET}, park_tier="disk", spool_dir=str(self.folder / "spool")
        )
        self.model: dict[str, dict[str, torch.Tensor]] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    @initialize(target=sessions)
    def first(self) -> str:
        return self.create(1.0)

    @rule(target=sessions, value=st.floats(-4, 4, allow_nan=False))
    def create(self, value: float) -> str:
        sid = self._new_id()
        history = LatentBuffer(name="history", dim=0).allocate().commit(torch.full((16,), value))
        cache = TensorCache(name="cache").allocate().commit(torch.full((CACHE,), value))
        record = SessionState(objects={"history": history, "cache": cache})
        self.m.put(sid, record)
        self.model[sid] = _values(record)
        return sid

    @rule(target=sessions, source=sessions)
    def fork(self, source: str) -> str:
        if source not in self.model:
            return source
        sid = self._new_id()
        self.m.fork(source, sid)
        self.model[sid] = {k: v.clone() for k, v in self.model[source].items()}
        return sid

    @rule(sid=sessions, value=st.floats(-4, 4, allow_nan=False), cache=st.booleans())
    def step(self, sid: str, value: float, cache: bool) -> None:
        if sid not in self.model:
            return
        state = self.m.get(sid)
        assert state is not None
        if cache:  # a new cache: what a step writes wholesale
            new = state.update_object("cache", lambda c: c.commit(torch.full((CACHE,), value)))
        else:  # a chunk on the shared history
            new = state.update_object("history", lambda h: h.commit(torch.full((2,), value)))
        self.m.put(sid, new)
        self.model[sid] = _values(new)

    @rule(sid=sessions)
    def get(self, sid: str) -> None:
        if sid not in self.model:
            assert self.m.get(sid) is None
            return
        state = self.m.get(sid)
        assert state is not None
        got = _values(state)
        assert all(torch.equal(got[k], self.model[sid][k]) for k in got)

    @rule(sid=consumes(sessions))
    def drop(self, sid: str) -> None:
        assert self.m.drop(sid) == (sid in self.model)
        self.model.pop(sid, None)

    @rule(sid=sessions)
    def prefetch(self, sid: str) -> None:
        self.m.prefetch(sid)

    @rule(data=st.data())
    def family_snapshot(self, data: st.DataObject) -> None:
        held = sorted(self.model)
        if not held:
            return
        ids = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
        path = self.folder / "family.safetensors"
        self.m.snapshot_many(ids, path)
        other: SessionStateManager[SessionState] = SessionStateManager()
        for sid, record in other.restore_many(path).items():
            got = _values(record)
            assert all(torch.equal(got[k], self.model[sid][k]) for k in got)

    @invariant()
    def every_session_reads_as_the_model_says(self) -> None:
        assert sorted(self.m.session_ids()) == sorted(self.model)
        for sid, expected in self.model.items():
            state = self.m.peek(sid, on_host=True)
            assert state is not None
            got = _values(state)
            assert all(torch.equal(got[k], expected[k]) for k in got), sid

    @invariant()
    def bytes_are_a_recount_within_the_budget(self) -> None:
        assert_stats_equal_a_recount(self.m)
        assert self.m.stats().get("nbytes:cpu", 0) <= BUDGET

    @invariant()
    def the_tier_holds_each_parked_object_once(self) -> None:
        # Objects parked from one resident object are one parked object; the disk tier
        # holds at most what the sessions hold parked, counted per distinct object.
        parked = self.m.stats()["nbytes_parked:disk"]
        per_session = sum(
            sum(self.m.session_stats(sid)["nbytes_parked"].values()) for sid in self.model
        )
        assert parked <= per_session


TestForkMachine = ForkMachine.TestCase
