"""SessionStateManager under a byte budget, against a model, with parking on both tiers.

Random budgets and records drawn from a shared pool of tensors (views of a few allocations), so
aliases within a record (object and object, object and attribute) and across sessions are
common. After every call: resident bytes on the budgeted device are at or below the budget;
every stored record, unparked, is `tree_equal` to what was put; a record read back through
`get` has the alias graph and `nbytes_by_device` of the record that was put; the counters
(hits, misses, evictions, parks, unparks) agree with the model; `stats()` equals a recount.
"""

from __future__ import annotations

from typing import Any, ClassVar

import hypothesis.strategies as st
import torch
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sessionstate import (
    LatentBuffer,
    ParkedObject,
    SessionAdmissionError,
    SessionState,
    SessionStateManager,
    TensorCache,
    nbytes_by_device,
    tree_equal,
)
from tests.support import alias_graph

_IDS = st.sampled_from(["a", "b", "c", "d"])


def _parked_handles(record: SessionState) -> dict[int, Any]:
    return {
        id(obj.handle): obj.handle
        for obj in record.objects.values()
        if isinstance(obj, ParkedObject)
    }


class BudgetMachine(RuleBasedStateMachine):
    tier: ClassVar[str] = "host"

    def __init__(self) -> None:
        super().__init__()
        self.model: dict[str, SessionState] = {}
        self.parked: set[str] = set()
        self.hits = self.misses = self.evictions = self.parks = self.unparks = 0

    @initialize(data=st.data())
    def create(self, data: st.DataObject) -> None:
        sizes = data.draw(st.lists(st.integers(1, 24), min_size=1, max_size=4), label="sizes")
        self.pool: list[torch.Tensor] = []
        for i, n in enumerate(sizes):
            base = torch.arange(n, dtype=torch.float32) + 100 * i
            self.pool += [base, base[n // 2 :], base.view(1, n)[:, :1].reshape(1), base.clone()]
        self.budget = data.draw(st.integers(0, 4 * sum(sizes) + 16), label="budget")
        self.on_full = data.draw(st.sampled_from(["evict", "refuse"]), label="on_full")
        self.manager = SessionStateManager(
            8, on_full=self.on_full, max_bytes={"cpu": self.budget}, park_tier=self.tier
        )

    # -- drawing ---------------------------------------------------------------------------------

    def _tensor(self, data: st.DataObject) -> torch.Tensor:
        if data.draw(st.integers(0, 5), label="fresh?") == 0:
            return torch.randn(data.draw(st.integers(1, 8), label="fresh size"))
        return data.draw(st.sampled_from(self.pool), label="pool tensor")

    def _record(self, data: st.DataObject) -> SessionState:
        objects: dict[str, Any] = {}
        for i in range(data.draw(st.integers(0, 2), label="caches")):
            count = data.draw(st.integers(1, 2), label="cache size")
            contents = tuple(self._tensor(data) for _ in range(count))
            objects[f"cache{i}"] = TensorCache(name=f"cache{i}").allocate().commit(contents)
        if data.draw(st.booleans(), label="ring?"):
            ring = LatentBuffer(name="ring", dim=0).allocate(maxlen=2)
            for _ in range(data.draw(st.integers(0, 3), label="chunks")):
                ring = ring.commit(self._tensor(data).reshape(-1))
            objects["ring"] = ring
        attributes: dict[str, Any] = {"step": data.draw(st.integers(0, 9), label="step")}
        if data.draw(st.booleans(), label="tensor attr?"):
            attributes["x"] = self._tensor(data)
        return SessionState(objects=objects, attrs=attributes)

    # -- checks -------------------------------------------------------------------------------

    def _check_resident(self, sid: str, got: SessionState) -> None:
        expected = self.model[sid]
        assert got.parked == ()
        assert tree_equal(got, expected)
        assert alias_graph(got) == alias_graph(expected)
        assert nbytes_by_device(got) == nbytes_by_device(expected)

    def _sync(self, *, unparked: str | None = None, dropped: str | None = None) -> None:
        """Fold the manager's parking and evictions this call into the model, and check them."""
        stats = self.manager.stats()
        held = set(self.manager.session_ids())
        vanished = set(self.model) - held - ({dropped} if dropped else set())
        assert held <= set(self.model)
        for sid in vanished:
            del self.model[sid]
        self.evictions += len(vanished)
        parked_now = {sid for sid in held if self.manager.peek(sid).parked}  # type: ignore[union-attr]
        newly = parked_now - self.parked
        assert newly <= held
        gained = stats["parks"] - self.parks
        assert len(newly) <= gained <= len(newly) + len(vanished)
        if gained:
            event("budget: parked a session")
        if vanished:
            event("budget: evicted a session")
        if unparked is not None:
            event("budget: unparked a session")
        self.parks = stats["parks"]
        self.unparks += unparked is not None
        self.parked = parked_now
        assert stats["evictions"] == self.evictions
        assert stats["unparks"] == self.unparks
        assert (stats["hits"], stats["misses"]) == (self.hits, self.misses)

    def _lookup(self, sid: str, action: str, data: st.DataObject) -> None:
        was_held = sid in self.model
        was_parked = sid in self.parked
        try:
            if action == "get":
                got = self.manager.get(sid)
            else:
                candidate = self._record(data)
                got = self.manager.get_or_create(sid, lambda: candidate)
        except SessionAdmissionError:
            # Refused: the budget cannot make room for it under `on_full="refuse"`. A refused
            # miss still counts as a miss; a refused unpark leaves the session parked.
            assert self.on_full == "refuse" or not was_held
            event("budget: refused")
            if not was_held:
                self.misses += 1
            self._sync()
            if was_held:
                assert sid in self.parked
            return
        if was_held:
            self.hits += 1
            assert got is not None
            self._sync(unparked=sid if was_parked else None)
            self._check_resident(sid, got)
            return
        self.misses += 1
        if action == "get":
            assert got is None
            self._sync()
            return
        assert got is candidate
        self.model[sid] = candidate
        self._sync()

    # -- rules --------------------------------------------------------------------------------

    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        sid = data.draw(_IDS, label="sid")
        record = self._record(data)
        alone = nbytes_by_device(record).get("cpu", 0)
        try:
            self.manager.put(sid, record)
        except SessionAdmissionError:
            assert alone > self.budget or self.on_full == "refuse"
            self._sync()
            return
        assert alone <= self.budget
        self.model[sid] = record
        self.parked.discard(sid)
        self._sync()

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        self._lookup(data.draw(_IDS, label="sid"), "get", data)

    @rule(data=st.data())
    def get_or_create(self, data: st.DataObject) -> None:
        self._lookup(data.draw(_IDS, label="sid"), "get_or_create", data)

    @rule(data=st.data())
    def peek(self, data: st.DataObject) -> None:
        sid = data.draw(_IDS, label="sid")
        before = (self.manager.session_ids(), self.manager.stats())
        got = self.manager.peek(sid)
        assert (self.manager.session_ids(), self.manager.stats()) == before
        if sid not in self.model:
            assert got is None
            return
        assert got is not None
        assert (sid in self.parked) == bool(got.parked)
        assert tree_equal(got.unpark(), self.model[sid])

    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        sid = data.draw(_IDS, label="sid")
        assert self.manager.drop(sid) == (sid in self.model)
        self.model.pop(sid, None)
        self.parked.discard(sid)
        self._sync(dropped=sid)

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def within_budget_and_recounted(self) -> None:
        stats = self.manager.stats()
        assert stats.get("nbytes:cpu", 0) <= self.budget
        records = [self.manager.peek(sid) for sid in self.manager.session_ids()]
        recount = nbytes_by_device(records)
        assert {k: v for k, v in stats.items() if k.startswith("nbytes:")} == {
            f"nbytes:{d}": n for d, n in recount.items()
        }
        assert stats["total_nbytes"] == sum(recount.values())
        handles: dict[int, Any] = {}
        for record in records:
            assert record is not None
            handles.update(_parked_handles(record))
        parked = {"host": 0, "disk": 0}
        for handle in handles.values():
            parked[handle.tier] += handle.nbytes
        assert stats["nbytes_parked:host"] == parked["host"]
        assert stats["nbytes_parked:disk"] == parked["disk"]
        assert stats["parked_sessions"] == len(self.parked)
        assert stats["max_bytes:cpu"] == self.budget

    @invariant()
    def every_record_unparks_to_what_was_put(self) -> None:
        for sid, expected in self.model.items():
            got = self.manager.peek(sid)
            assert got is not None
            assert tree_equal(got.unpark(), expected)


class DiskBudgetMachine(BudgetMachine):
    tier = "disk"


TestBudgetHost = BudgetMachine.TestCase
TestBudgetHost.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestBudgetDisk = DiskBudgetMachine.TestCase
TestBudgetDisk.settings = settings(max_examples=15, stateful_step_count=20, deadline=None)
