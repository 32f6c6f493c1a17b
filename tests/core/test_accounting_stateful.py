"""Byte accounting against a naive model that counts each allocation once, by provenance.

The model never asks torch or the library which tensors share storage: it knows, because it
recorded which allocation every tensor was derived from when the tensor was made (the pool's
provenance, or the machine's own bookkeeping below). An allocation's size is known when it is
made: a fresh contiguous tensor holds exactly ``numel * element_size`` bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sessionstate import (
    LatentBuffer,
    SessionState,
    SessionStateManager,
    nbytes_by_device,
    nbytes_by_key,
)
from sessionstate.testing import TensorPool, session_states, tensor_pools, tensors


def naive_nbytes_by_device(
    allocations: Iterable[int], nbytes: dict[int, int], devices: dict[int, str]
) -> dict[str, int]:
    """Sum each distinct allocation once; devices holding no bytes are absent."""
    out: dict[str, int] = {}
    for a in set(allocations):
        out[devices[a]] = out.get(devices[a], 0) + nbytes[a]
    return {device: n for device, n in out.items() if n}


def pool_model(pool: TensorPool, held: Iterable[torch.Tensor]) -> dict[str, int]:
    return naive_nbytes_by_device(
        (pool.allocation_of(t) for t in held),
        dict(enumerate(pool.allocation_nbytes)),
        dict(enumerate(pool.allocation_devices)),
    )


def session_tensors(state: SessionState) -> list[torch.Tensor]:
    """The tensors a session holds, walked by hand rather than by the library's tree walk."""
    out: list[torch.Tensor] = []
    for obj in state.objects.values():
        assert isinstance(obj, LatentBuffer)
        if obj.is_allocated:
            out.extend(obj.view())
    for value in state.attrs.values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, tuple):  # a list attribute is stored as a tuple
            out.extend(value)
    return out


@st.composite
def pools_and_picks(draw: st.DrawFn) -> tuple[TensorPool, list[torch.Tensor]]:
    pool = draw(tensor_pools())
    picks = draw(st.lists(st.sampled_from(pool.tensors), max_size=10))
    return pool, picks


@given(pools_and_picks())
def test_nbytes_by_device_counts_each_allocation_once(case: tuple[TensorPool, list]) -> None:
    pool, picks = case
    half = len(picks) // 2
    tree = {"views": picks[:half], "more": (tuple(picks[half:]), {"n": 3, "none": None})}
    assert nbytes_by_device(tree) == pool_model(pool, picks)


@given(pools_and_picks())
def test_nbytes_by_key_attributes_each_allocation_to_its_first_leaf(
    case: tuple[TensorPool, list],
) -> None:
    pool, picks = case
    per_key = nbytes_by_key(picks)
    seen: set[int] = set()
    for i, t in enumerate(picks):
        a = pool.allocation_of(t)
        expected = {} if a in seen else pool_model(pool, [t])
        seen.add(a)
        assert per_key[f"[{i}]"] == expected
    totals: dict[str, int] = {}
    for counts in per_key.values():
        for device, n in counts.items():
            totals[device] = totals.get(device, 0) + n
    assert totals == nbytes_by_device(picks)


@given(st.data())
def test_session_bytes_cover_both_buckets_once(data: st.DataObject) -> None:
    pool = data.draw(tensor_pools(), label="pool")
    state = data.draw(session_states(pools=st.just(pool)), label="state")
    expected = pool_model(pool, session_tensors(state))
    assert state.nbytes_by_device() == expected
    assert nbytes_by_device(state) == expected
    per_value: dict[str, int] = {}
    for counts in state.nbytes_by_value().values():
        for device, n in counts.items():
            per_value[device] = per_value.get(device, 0) + n
    assert per_value == expected


@given(st.data())
def test_manager_dedups_across_sessions(data: st.DataObject) -> None:
    pool = data.draw(tensor_pools(max_bases=2), label="pool")
    states = data.draw(
        st.lists(session_states(pools=st.just(pool)), min_size=1, max_size=4), label="states"
    )
    manager = SessionStateManager(max_sessions=8)
    for i, state in enumerate(states):
        manager.put(f"s{i}", state)
    everything = [t for state in states for t in session_tensors(state)]
    expected = pool_model(pool, everything)
    stats = manager.stats()
    by_device = {k.removeprefix("nbytes:"): v for k, v in stats.items() if k.startswith("nbytes:")}
    assert by_device == expected
    assert stats["total_nbytes"] == sum(expected.values())
    per_session = manager.nbytes_by_session()
    for i, state in enumerate(states):
        assert per_session[f"s{i}"] == pool_model(pool, session_tensors(state))


# Same-size dtype pairs: `t.view(dtype)` reinterprets the bytes in place for any layout.
_REINTERPRET = {
    torch.float32: torch.int32,
    torch.int32: torch.float32,
    torch.float64: torch.int64,
    torch.int64: torch.float64,
    torch.float16: torch.bfloat16,
    torch.bfloat16: torch.float16,
    torch.uint8: torch.int8,
    torch.int8: torch.uint8,
    torch.bool: torch.uint8,
}


class AccountingMachine(RuleBasedStateMachine):
    """Grow and shrink a set of held tensors; the model tracks allocations by itself.

    Every tree the machine builds is kept with the count the model gave it then; at the end of
    a run, accounting of every earlier tree must still agree, however tensors came and went.
    """

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[torch.Tensor, int]] = []
        self.nbytes: dict[int, int] = {}
        self.devices: dict[int, str] = {}
        self.trees: list[tuple[tuple[torch.Tensor, ...], dict[str, int]]] = []

    def _new_allocation(self, t: torch.Tensor) -> int:
        a = len(self.nbytes)
        self.nbytes[a] = t.numel() * t.element_size()
        self.devices[a] = str(t.device)
        return a

    def _hold(self, t: torch.Tensor, allocation: int) -> None:
        self.held.append((t, allocation))
        tree = tuple(t for t, _ in self.held)
        self.trees.append((tree, self._model(a for _, a in self.held)))

    def _model(self, allocations: Iterable[int]) -> dict[str, int]:
        return naive_nbytes_by_device(allocations, self.nbytes, self.devices)

    def _pick(self, data: st.DataObject) -> tuple[torch.Tensor, int]:
        return data.draw(st.sampled_from(self.held), label="held tensor")

    @rule(t=tensors(max_dims=3))
    def allocate(self, t: torch.Tensor) -> None:
        self._hold(t, self._new_allocation(t))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def alias(self, data: st.DataObject) -> None:
        t, a = self._pick(data)
        self._hold(t, a)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data(), how=st.sampled_from(["narrow", "select", "unsqueeze", "reinterpret"]))
    def view(self, data: st.DataObject, how: str) -> None:
        t, a = self._pick(data)
        if how in ("narrow", "select") and (t.ndim == 0 or t.shape[0] == 0):
            how = "unsqueeze"
        if how == "narrow":
            start = data.draw(st.integers(0, t.shape[0]), label="start")
            v = t.narrow(0, start, data.draw(st.integers(0, t.shape[0] - start), label="length"))
        elif how == "select":
            v = t.select(0, data.draw(st.integers(0, t.shape[0] - 1), label="index"))
        elif how == "reinterpret":
            v = t.view(_REINTERPRET[t.dtype])
        else:
            v = t.unsqueeze(0)
        self._hold(v, a)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def contiguous(self, data: st.DataObject) -> None:
        # `contiguous()` returns the tensor itself when it already is, and a copy otherwise.
        t, a = self._pick(data)
        c = t.contiguous()
        self._hold(c, a if t.is_contiguous() else self._new_allocation(c))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def to_meta(self, data: st.DataObject) -> None:
        t, a = self._pick(data)
        m = t.to("meta")
        self._hold(m, a if t.is_meta else self._new_allocation(m))

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.held) - 1), label="index")
        del self.held[i]
        tree = tuple(t for t, _ in self.held)
        self.trees.append((tree, self._model(a for _, a in self.held)))

    @staticmethod
    def _check(tree: tuple[torch.Tensor, ...], expected: dict[str, int]) -> None:
        assert nbytes_by_device(tree) == expected
        assert nbytes_by_device({"reversed": tree[::-1], "again": tree}) == expected

    @invariant()
    def current_tree_counts_as_its_model(self) -> None:
        if self.trees:
            self._check(*self.trees[-1])

    def teardown(self) -> None:
        # Counting is a pure function of what a tree reaches: earlier trees still agree.
        for tree, expected in self.trees:
            self._check(tree, expected)


TestAccounting = AccountingMachine.TestCase
