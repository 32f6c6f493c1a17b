"""EncodeOnceKV against a dict model: stage, commit, discard, reset, evict, views and bytes.

Every object the machine produces is kept, and after every step none of them may have
changed (the `sessionstate.testing` version log). A Cosmos3 session holding the K/V also
runs through the manager contract machine, each step staging and committing new K/V.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sessionstate import (
    EncodeOnceKV,
    IncompleteStateError,
    KVPair,
    NotAllocatedError,
    nbytes_by_device,
    tree_equal,
)
from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Session, new_session
from sessionstate.testing import manager_contract_machine
from sessionstate.testing._versions import VersionLog

BRANCHES = ("cond", "uncond")


def _pair(seed: int, device: str) -> KVPair:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(2, 1, 3, 4, generator=g)
    if device == "meta":
        base = base.to("meta")
    # Key and value as views of one allocation half the time, so storages are shared.
    if seed % 2:
        return KVPair(base[0:1], base[1:2])
    return KVPair(base[0:1].clone(), base[1:2].clone())


class KVContractMachine(RuleBasedStateMachine):
    """The model: committed and staged dicts of (branch, layer) -> pair."""

    def __init__(self) -> None:
        super().__init__()
        self.obj = EncodeOnceKV(name="text_kv")
        self.committed: dict[tuple[str, int], KVPair] = {}
        self.staged: dict[tuple[str, int], KVPair] = {}
        self.num_layers = 0
        self.pool: list[KVPair] = []
        self.versions = VersionLog()
        self.versions.keep(self.obj, "EncodeOnceKV()")

    def _advance(self, obj: EncodeOnceKV, label: str) -> None:
        self.obj = obj
        self.versions.keep(obj, label)

    @initialize(device=st.sampled_from(["cpu", "meta"]))
    def make_pool(self, device: str) -> None:
        self.pool = [_pair(i, device) for i in range(6)]

    @rule(num_layers=st.integers(1, 4))
    def allocate(self, num_layers: int) -> None:
        self._advance(self.obj.allocate(num_layers=num_layers, branches=BRANCHES), "allocate")
        self.num_layers = num_layers
        self.committed, self.staged = {}, {}

    @rule(data=st.data())
    def stage(self, data: st.DataObject) -> None:
        if not self.obj.is_allocated:
            try:
                self.obj.stage({"cond": {0: self.pool[0]}})
            except NotAllocatedError:
                return
            raise AssertionError("stage before allocate must raise NotAllocatedError")
        branch = data.draw(st.sampled_from(BRANCHES))
        layers = data.draw(st.sets(st.integers(0, self.num_layers - 1), min_size=1))
        payload = {i: data.draw(st.sampled_from(self.pool)) for i in layers}
        self._advance(self.obj.stage({branch: payload}), "stage")
        self.staged.update({(branch, i): p for i, p in payload.items()})

    @rule()
    def commit_staged(self) -> None:
        if not self.obj.is_allocated:
            return
        merged = {**self.committed, **self.staged}
        whole = all(
            sum((b, i) in merged for i in range(self.num_layers)) in (0, self.num_layers)
            for b in BRANCHES
        )
        before = self.obj
        if not self.staged:
            try:
                self.obj.commit()
            except ValueError:
                return
            raise AssertionError("commit() with nothing staged must raise ValueError")
        if not whole:
            try:
                self.obj.commit()
            except IncompleteStateError:
                assert self.obj is before
                return
            raise AssertionError("a partial commit must raise IncompleteStateError")
        self._advance(self.obj.commit(), "commit()")
        self.committed, self.staged = merged, {}

    @rule(data=st.data())
    def commit_whole_branch(self, data: st.DataObject) -> None:
        if not self.obj.is_allocated or self.staged:
            return
        branch = data.draw(st.sampled_from(BRANCHES))
        pairs = [data.draw(st.sampled_from(self.pool)) for _ in range(self.num_layers)]
        self._advance(self.obj.commit({branch: pairs}), "commit(payload)")
        self.committed.update({(branch, i): p for i, p in enumerate(pairs)})

    @rule()
    def discard(self) -> None:
        if not self.obj.is_allocated:
            return
        self._advance(self.obj.discard(), "discard")
        self.staged = {}

    @rule()
    def reset(self) -> None:
        if not self.obj.is_allocated:
            return
        self._advance(self.obj.reset(), "reset")
        self.committed, self.staged = {}, {}

    @rule()
    def evict(self) -> None:
        self._advance(self.obj.evict(), "evict")
        self.committed, self.staged, self.num_layers = {}, {}, 0

    @invariant()
    def agrees_with_model(self) -> None:
        obj = self.obj
        if not obj.is_allocated:
            assert obj.nbytes_by_device() == {}
            assert obj.staged_nbytes_by_device() == {}
            try:
                obj.view()
            except NotAllocatedError:
                return
            raise AssertionError("view before allocate must raise NotAllocatedError")
        assert obj.has_staged == bool(self.staged)
        for include_staged in (False, True):
            held = {**self.committed, **self.staged} if include_staged else self.committed
            for b in BRANCHES:
                missing = tuple(i for i in range(self.num_layers) if (b, i) not in held)
                assert obj.missing_layers(b, include_staged=include_staged) == missing
                if missing:
                    with pytest.raises(IncompleteStateError, match=f"branch `{b}`"):
                        obj.view(b, include_staged=include_staged)
                    continue
                got = obj.view(b, include_staged=include_staged)
                assert all(p is held[(b, i)] for i, p in enumerate(got))
        committed = nbytes_by_device(list(self.committed.values()))
        both = nbytes_by_device([list(self.committed.values()), list(self.staged.values())])
        staged_only = {d: n - committed.get(d, 0) for d, n in both.items()}
        assert obj.nbytes_by_device() == committed
        assert obj.staged_nbytes_by_device() == {d: n for d, n in staged_only.items() if n}

    @invariant()
    def earlier_versions_unchanged(self) -> None:
        self.versions.check()

    def teardown(self) -> None:
        self.versions.check_all()


TestKVContract = KVContractMachine.TestCase

_CFG = Cosmos3Config.preset("tiny")


def _kv_payload(step: int) -> dict[str, list[KVPair]]:
    shape = (1, _CFG.num_kv_heads, _CFG.text_len, _CFG.head_dim)
    return {
        b: [
            KVPair(torch.full(shape, float(step + i)), torch.full(shape, float(-step - i)))
            for i in range(_CFG.num_layers)
        ]
        for b in BRANCHES
    }


@st.composite
def _cosmos3_sessions(draw: st.DrawFn) -> Cosmos3Session:
    state = new_session(_CFG)
    if draw(st.booleans()):
        payload = _kv_payload(draw(st.integers(0, 9)))
        state = state.with_object("text_kv", state.text_kv.commit(payload))
    if draw(st.booleans()):
        state = state.with_attrs(chunk_count=draw(st.integers(0, 5)))
    return state


def _advance(state: Cosmos3Session, step: int) -> Cosmos3Session:
    """A model step's writes: the K/V re-staged layer by layer, then committed."""
    kv = state.text_kv
    for b, pairs in _kv_payload(step).items():
        for i, pair in enumerate(pairs):
            kv = kv.stage({b: {i: pair}})
    return state.with_object("text_kv", kv.commit()).with_attrs(chunk_count=step)


TestCosmos3Manager = manager_contract_machine(
    states=_cosmos3_sessions(), advance=_advance, name="Cosmos3Manager"
).TestCase


def test_advance_leaves_its_input_unchanged() -> None:
    state = new_session(_CFG)
    after = _advance(state, 3)
    assert state.text_kv.is_empty
    assert after.text_kv.is_complete
    assert tree_equal(state, new_session(_CFG))
