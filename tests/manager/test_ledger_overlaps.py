"""The manager's ledger over storages that overlap without being one storage object (issue 21).

Several `torch.from_numpy` views of one array are distinct storage objects over overlapping
memory, and a tensor view of a KV pool overlaps the blocks a `KVHandle` reports. Put into a
manager in every order, and dropped, the ledger must agree with an independent recount.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sessionstate import KVPool, SessionState, SessionStateManager, TensorCache
from sessionstate._accounting import EngineBlock, StorageEntry, leaf_entries, storage_entries
from sessionstate._manager import Ledger
from sessionstate._manager._ledger import SessionLedger
from sessionstate.testing import EagerLedger, recount_nbytes_by_device


def _values() -> dict[str, object]:
    array = np.arange(20, dtype=np.float32)
    pool = KVPool(4, block_tokens=2, token_shape=(2,))
    handle = pool.append(pool.empty(), torch.ones(3, 2))
    values: dict[str, object] = {
        "whole": torch.from_numpy(array),
        "head": torch.from_numpy(array[:8]),
        "middle": torch.from_numpy(array[6:14]),
        "pool_view": pool.storage[1:3],
        "handle": handle,
    }
    whole, head, middle = (values[k] for k in ("whole", "head", "middle"))
    assert isinstance(whole, torch.Tensor)
    assert isinstance(head, torch.Tensor)
    assert isinstance(middle, torch.Tensor)
    # Three storage objects over one allocation: not one storage, but overlapping memory.
    assert len({t.untyped_storage()._cdata for t in (whole, head, middle)}) == 3
    assert middle.data_ptr() == whole.data_ptr() + 6 * 4
    return values


_AS: dict[str, Callable[[object], SessionState]] = {
    "attr": lambda v: SessionState(attrs={"v": v}),
    "object": lambda v: SessionState(
        objects={"c": TensorCache(name="c").allocate().commit((v, None))}
    ),
}


def _check(m: SessionStateManager, held: dict[str, SessionState]) -> None:
    assert sorted(m.session_ids()) == sorted(held)  # type: ignore[type-var]
    recount = recount_nbytes_by_device(list(held.values()))
    stats = m.stats()
    assert {k: v for k, v in stats.items() if k.startswith("nbytes:")} == {
        f"nbytes:{device}": n for device, n in recount.items()
    }
    assert stats["total_nbytes"] == sum(recount.values())
    if "max_bytes:cpu" in stats:  # what the budget reads on every put: each session alone
        for sid, record in held.items():
            alone = recount_nbytes_by_device([record]).get("cpu", 0)
            assert m._table.ledger.session_total(sid, "cpu") == alone


@pytest.mark.parametrize("budget", [None, {"cpu": 1 << 20}], ids=["no-budget", "budget"])
@pytest.mark.parametrize("kind", sorted(_AS))
def test_overlapping_storages_in_every_order_match_a_recount(
    kind: str, budget: dict[str, int] | None
) -> None:
    # The ledger measures the union when a total is read: without a budget by `stats()`, with
    # one by the checks of every put too: both must agree with the recount.
    values = _values()
    names = list(values)
    for order in itertools.permutations(names):
        m = SessionStateManager(max_bytes=budget)
        held: dict[str, SessionState] = {}
        for name in order:
            held[name] = _AS[kind](values[name])
            m.put(name, held[name])
            _check(m, held)
        for name in order:  # the first put is the first dropped
            assert m.drop(name)
            del held[name]
            _check(m, held)


def _one_record(kind: str, held: dict[str, object]) -> SessionState:
    if kind == "attr":
        return SessionState(attrs=dict(held))
    return SessionState(
        objects={n: TensorCache(name=n).allocate().commit((v, None)) for n, v in held.items()}
    )


@pytest.mark.parametrize("kind", sorted(_AS))
def test_a_sessions_own_total_over_overlapping_storages_matches_a_recount(kind: str) -> None:
    # What a budget reads on every put: the bytes one session holds alone, from its own
    # ledger, with storages over overlapping memory and owned ones in one record, in every
    # order they come and go.
    values = _values()
    for order in itertools.permutations(values):
        ledger = SessionLedger(per_session=True)
        held: dict[str, object] = {}
        for name in [*order, *order]:  # grow to every value, then shrink, first in first out
            if name in held:
                del held[name]
            else:
                held[name] = values[name]
            record = _one_record(kind, held)
            ledger.set("s", ledger.values_for("s", record))
            recount = recount_nbytes_by_device([record])
            assert ledger.session_total("s", "cpu") == recount.get("cpu", 0)
            assert ledger.totals() == recount


def test_replacing_a_value_by_an_overlapping_one_keeps_the_ledger_exact() -> None:
    values = _values()
    m = SessionStateManager()
    held = {"a": SessionState(attrs={"v": values["middle"]})}
    m.put("a", held["a"])
    for name in ["whole", "head", "middle", "pool_view", "handle", "head"]:
        held["b"] = SessionState(attrs={"v": values[name]})
        m.put("b", held["b"])
        _check(m, held)
        held["a"] = SessionState(attrs={"v": values[name], "w": values["middle"]})
        m.put("a", held["a"])
        _check(m, held)


# -- a lazy ledger counts a storage that owns its memory by its size alone -----------------
#
# Unless the device also holds a range over memory some storage does not own. These drive
# owned storages, aliases made of them while they are held (`torch.from_numpy` of
# `tensor.numpy()`, which also marks the tensor's storage as no longer resizable), and
# entries a leaf reports itself over part of an owned storage, in any order.

_OWNED_OPS = st.lists(
    st.tuples(
        st.sampled_from(["owned", "alias", "report", "block", "remove", "read"]),
        st.integers(0, 3),  # which owned tensor
        st.integers(0, 7),  # where an alias starts, or which held entry goes
    ),
    max_size=40,
)


@given(ops=_OWNED_OPS)
def test_a_lazy_ledger_counts_owned_storages_and_their_aliases_once(
    ops: list[tuple[str, int, int]],
) -> None:
    tensors = [torch.zeros(8) for _ in range(4)]
    # Lazy ledgers read after every change, at "read" only, and only at the end.
    eager, lazy, sometimes, unread = (
        EagerLedger(),
        Ledger(),
        Ledger(),
        Ledger(),
    )
    held: list[list[StorageEntry]] = []
    keep: list[object] = []  # what the aliases' entries point into, alive throughout
    for op, which, at in ops:
        if op == "remove":
            if held:
                entries = held.pop(at % len(held))
                for ledger in (eager, lazy, sometimes, unread):
                    ledger.remove(entries)
        elif op == "read":
            assert sometimes.totals() == eager.totals()
            continue
        else:
            tensor = tensors[which]
            if op == "owned":
                entries = storage_entries(tensor[at:])
            elif op == "alias":
                alias = torch.from_numpy(tensor.numpy()[at:])
                keep.append(alias)
                entries = storage_entries(alias)
            elif op == "block":  # an engine block of the tensor as a pool, four bytes
                storage = tensor.untyped_storage()
                block = EngineBlock(storage._cdata, at)
                entries = [("cpu", block, storage.data_ptr() + 4 * at, 4, tensor)]
            else:  # a reported entry: part of the tensor's storage, another identity
                storage = tensor.untyped_storage()
                pointer = storage.data_ptr() + 4 * at
                entries = [("cpu", ("reported", which, at), pointer, 4, storage)]
            held.append(entries)
            for ledger in (eager, lazy, sometimes, unread):
                ledger.add(entries)
        covered = {b for e in held for _, _, p, n, _ in e for b in range(p, p + n)}
        assert lazy.totals() == eager.totals() == ({"cpu": len(covered)} if covered else {})
    assert sometimes.totals() == unread.totals() == eager.totals()


def test_a_device_counts_by_size_again_once_its_last_shared_range_goes() -> None:
    ledger = Ledger()
    held = storage_entries(torch.zeros(4))
    shared = [("cpu", "shared", 8, 8, None)]
    ledger.add(held)
    ledger.add(shared)
    assert ledger.totals() == {"cpu": 16 + 8}
    ranges = ledger._shared["cpu"]
    assert ranges.sorted  # sorted, and owned changes placed among the ranges
    assert "cpu" in ledger._tracked
    ledger.remove(shared)
    for _ in range(20):
        churn = storage_entries(torch.zeros(2))
        ledger.add(churn)
        ledger.remove(churn)
    assert not ranges.sorted
    assert not ranges._pending
    assert "cpu" not in ledger._tracked
    assert ledger.totals() == {"cpu": 16}


def test_kv_blocks_count_by_size_until_their_pools_storage_is_held() -> None:
    pool = KVPool(4, block_tokens=2, token_shape=(2,))
    handle = pool.append(pool.empty(), torch.ones(3, 2))  # two blocks
    lazy, eager = Ledger(), EagerLedger()
    blocks, storage = leaf_entries(handle), storage_entries(pool.storage[1:3])
    for order in ([blocks, storage], [storage, blocks]):
        for entries in order:
            for ledger in (lazy, eager):
                ledger.add(entries)
            assert lazy.totals() == eager.totals()
            assert lazy.engine_totals() == eager.engine_totals()
        # The blocks lie inside the pool's storage: the union is the storage, once.
        assert lazy.totals() == {"cpu": pool.storage.nbytes}
        assert lazy.engine_totals() == {"cpu": 2 * pool.block_nbytes}
        for entries in order:
            for ledger in (lazy, eager):
                ledger.remove(entries)
            assert lazy.totals() == eager.totals()
            assert lazy.engine_totals() == eager.engine_totals()
    lazy.add(blocks)
    assert lazy.totals() == {"cpu": 2 * pool.block_nbytes}
    shared = lazy._shared.get("cpu")
    assert "cpu" not in lazy._tracked
    assert shared is None or not shared.shared
