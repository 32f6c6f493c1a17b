"""The ledger's short cuts stay exact: values walked without a tree flatten, KV commits, caches.

A put walks only the values that changed, and some of those without flattening them: an
attribute that is a tensor or a scalar is its own leaf; a `KVCache` commit says its leaves
are the new handle alone (the old one goes); a `TensorCache` committed the contents it holds
is the same object, so nothing is walked. These tests drive such puts, branches from earlier
versions included, and compare `stats()` after every call with an independent recount, and
the pool's free blocks with the blocks live handles hold.
"""

from __future__ import annotations

import copy
import gc
import operator
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionstate import (
    KVCache,
    KVHandle,
    KVPool,
    LatentBuffer,
    SessionAdmissionError,
    SessionState,
    SessionStateManager,
    TensorCache,
)
from sessionstate._accounting import derivation, storage_entries
from sessionstate._manager import Ledger
from sessionstate.testing import EagerLedger
from tests.support import assert_stats_equal_a_recount

ATTR_VALUES = [None, 3, 2.5, True, "text", b"raw"]

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["append", "empty", "same-kv", "cache", "alias-cache", "same-cache", "attr", "put"]
        ),
        st.integers(0, 20),  # which earlier version to build on
        st.integers(0, len(ATTR_VALUES)),  # an attribute value (the last: a tensor)
    ),
    max_size=30,
)


def _run(ops: list[tuple[str, int, int]], manager: SessionStateManager, pool: KVPool) -> None:
    first = SessionState(
        objects={"kv": KVCache().allocate(), "cache": TensorCache().allocate()},
        attrs={"a": torch.zeros(2)},
    )
    versions = [first]
    manager.put("s", first)
    for op, which, value in ops:
        base = versions[which % len(versions)]
        kv = base.object("kv", KVCache)
        cache = base.object("cache", TensorCache)
        if op == "append":
            state = base.with_object("kv", kv.append(pool, torch.ones(value + 1, 2)))
        elif op == "empty":
            state = base.with_object("kv", kv.commit(None))
        elif op == "same-kv":
            state = base.with_object("kv", kv.commit(kv.view()))
        elif op == "cache":
            state = base.with_object("cache", cache.commit((torch.zeros(value + 1),)))
        elif op == "alias-cache":
            # A flat tuple (the ledger's short cut) of None, tensors of the record's own
            # attribute (the same one twice, a view of it when it is a tensor) and a new one.
            a = base.attrs["a"]
            held = (a, a[:1]) if isinstance(a, torch.Tensor) else ()
            state = base.with_object("cache", cache.commit((None, *held, torch.ones(value + 1))))
        elif op == "same-cache":
            state = base.with_object("cache", cache.commit(cache.view()))
        elif op == "attr":
            chosen = ATTR_VALUES[value] if value < len(ATTR_VALUES) else torch.ones(value)
            state = base.with_values(a=chosen)
        else:
            state = base
        manager.put("s", state)
        versions.append(state)
        assert_stats_equal_a_recount(manager)


@settings(max_examples=40)  # the suite's costliest property (~0.2 s an example)
@given(ops=OPS, budget=st.booleans())
def test_stats_equal_a_recount_after_kv_cache_and_attribute_puts(
    ops: list[tuple[str, int, int]], budget: bool
) -> None:
    pool = KVPool(64, block_tokens=2, token_shape=(2,))
    manager = SessionStateManager(max_bytes={"cpu": 1 << 20} if budget else None)
    _run(ops, manager, pool)
    manager.drop("s")
    gc.collect()
    assert manager.stats()["total_nbytes"] == 0
    assert pool.free_blocks == pool.num_blocks


@pytest.mark.parametrize(
    "contents",
    [
        None,
        (),
        (None, None),
        (torch.zeros(2), None, torch.ones(3)),
        (torch.zeros(2), (torch.ones(1), None)),  # nested: flattened as a tree
        [torch.zeros(2), None],  # a list: flattened as a tree
        (torch.nn.Parameter(torch.zeros(2)), torch.ones(1)),  # a subclass: flattened
        (torch.zeros(2), 3),
    ],
)
def test_a_caches_leaves_without_a_flatten_are_its_tree_leaves(contents: object) -> None:
    from sessionstate._manager._ledger import _flat_cache_leaves
    from sessionstate._tree import tree_leaves

    cache = TensorCache().allocate().commit(contents)
    flat = _flat_cache_leaves(cache)
    leaves = tree_leaves(cache)
    if flat is not None:
        assert len(flat) == len(leaves)
        assert all(map(operator.is_, flat, leaves))
    # The short cut is taken exactly for a flat tuple of plain tensors and None.
    is_flat = type(contents) is tuple and all(
        type(x) is torch.Tensor or x is None for x in contents
    )
    assert (flat is not None) == is_flat


def test_a_kv_cache_commit_derives_its_successor_from_the_handle_alone() -> None:
    pool = KVPool(4, block_tokens=2, token_shape=())
    empty = KVCache().allocate()
    one = empty.commit(pool.append(pool.empty(), torch.ones(1)))
    two = one.commit(pool.append(one.view(), torch.ones(1)))
    cleared = two.commit(None)
    first, second, last = derivation(one), derivation(two), derivation(cleared)
    assert first is not None
    assert second is not None
    assert last is not None
    assert (first.base(), first.dropped, list(first.leaves)) == (empty, 0, [one.view()])
    assert (second.base(), second.dropped, list(second.leaves)) == (one, 1, [two.view()])
    assert (last.base(), last.dropped, list(last.leaves)) == (two, 1, [])


def test_committing_a_caches_own_contents_returns_the_cache() -> None:
    cache = TensorCache().allocate().commit((torch.zeros(2),))
    assert cache.commit(cache.view()) is cache
    other = cache.commit((torch.zeros(2),))
    assert other is not cache
    assert other.view() is not cache.view()


def test_a_handle_gives_its_blocks_back_when_collected() -> None:
    pool = KVPool(3, block_tokens=1, token_shape=())
    handle = pool.append(pool.empty(), torch.ones(2))
    longer = pool.append(handle, torch.ones(1))
    assert pool.free_blocks == 0
    del handle
    gc.collect()
    assert pool.free_blocks == 0  # `longer` still holds both of its first blocks
    del longer
    gc.collect()
    assert pool.free_blocks == 3


def test_a_copy_of_a_handle_is_the_handle_so_its_blocks_stay_held() -> None:
    pool = KVPool(2, block_tokens=1, token_shape=())
    handle = pool.append(pool.empty(), torch.ones(1))
    assert copy.copy(handle) is handle
    assert copy.deepcopy({"kv": handle})["kv"] is handle
    gc.collect()
    assert (handle.alive, pool.free_blocks) == (True, 1)


def test_a_rolled_back_step_kills_its_handles_and_frees_their_blocks_once() -> None:
    pool = KVPool(2, block_tokens=1, token_shape=())
    kept = pool.append(pool.empty(), torch.ones(1))
    made: list[KVHandle] = []

    def failing_step() -> None:
        with pool.transaction():
            made.append(pool.append(kept, torch.ones(1)))
            raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        failing_step()
    assert (made[0].alive, kept.alive, pool.free_blocks) == (False, True, 1)
    made.clear()  # collected after the rollback released it: nothing is given back twice
    gc.collect()
    assert pool.free_blocks == 1
    assert kept.read().tolist() == [1.0]


class TestWithValues:
    def test_equals_with_object_then_with_attrs(self) -> None:
        base = SessionState(objects={"c": TensorCache().allocate()}, attrs={"n": 1})
        cache = base.object("c", TensorCache).commit((torch.ones(1),))
        batched = base.with_values({"c": cache}, n=2, m=torch.zeros(1))
        chained = base.with_object("c", cache).with_attrs(n=2, m=torch.zeros(1))
        assert batched.objects == chained.objects
        assert list(batched.attrs) == list(chained.attrs) == ["n", "m"]
        assert (batched.attrs["n"], base.attrs["n"]) == (2, 1)

    def test_freezes_attributes_as_with_attrs(self) -> None:
        state = SessionState().with_values(ids=[1, [2, 3]])
        assert state.attrs["ids"] == (1, (2, 3))

    def test_a_name_in_both_buckets_is_refused(self) -> None:
        base = SessionState(objects={"c": TensorCache()}, attrs={"n": 1})
        with pytest.raises(ValueError, match=r"\['c'\] are both state objects and attributes"):
            base.with_values(c=1)
        with pytest.raises(ValueError, match=r"\['n'\] are both state objects and attributes"):
            base.with_values({"n": TensorCache()})

    def test_an_object_that_is_not_a_state_object_is_refused(self) -> None:
        with pytest.raises(TypeError, match="must be a StateObject"):
            SessionState().with_values({"c": torch.zeros(1)})  # type: ignore[dict-item]


SPANS = st.lists(
    st.tuples(st.booleans(), st.integers(0, 40), st.integers(1, 12), st.integers(0, 3)),
    max_size=60,
)


@given(ops=SPANS)
def test_a_lazy_ledger_reads_the_same_totals_as_an_eager_one(
    ops: list[tuple[bool, int, int, int]],
) -> None:
    # Entries over overlapping address ranges (several identities per range too), added and
    # removed in any order; totals read after every change and only at the end.
    eager, lazy, rare = EagerLedger(), Ledger(), Ledger()
    # Thirty disjoint ranges held throughout, so a read after one change places it among
    # them (the incremental path) rather than sorting afresh.
    held: list[tuple[str, object, int, int, None]] = [
        ("cpu", ("base", i), 10_000 + 100 * i, 10, None) for i in range(30)
    ]
    for ledger in (eager, lazy, rare):
        ledger.add(held)
        ledger.totals()
    base = len(held)
    for add, start, size, alias in ops:
        if add or len(held) == base:
            entry = ("cpu", (start, size, alias), 1000 + start, size, None)
            if entry in held:
                continue
            held.append(entry)
            for ledger in (eager, lazy, rare):
                ledger.add([entry])
        else:
            entry = held.pop(base + start % (len(held) - base))
            for ledger in (eager, lazy, rare):
                ledger.remove([entry])
        covered = {b for _, _, pointer, n, _ in held for b in range(pointer, pointer + n)}
        assert eager.totals() == lazy.totals() == ({"cpu": len(covered)} if covered else {})
    assert rare.totals() == eager.totals()


@pytest.mark.parametrize("churn", ["shared", "owned"])
def test_a_lazy_ledger_nobody_reads_stays_bounded(churn: str) -> None:
    # A manager without a budget whose `stats()` is read once, then never: the pending range
    # changes (of shared ranges, or of owned storages placed among them) are folded in as
    # they outgrow the held ranges, and the total is still exact.
    ledger = Ledger()
    kept = ("cpu", "kept", 8, 8, None)  # a shared range: the device's ranges are sorted
    ledger.add([kept])
    assert ledger.totals() == {"cpu": 8}
    pending = []
    for i in range(5000):
        if churn == "shared":
            entries = [("cpu", ("temp", i), 100 + 16 * i, 8, None)]
        else:
            entries = storage_entries(torch.zeros(2))
        ledger.add(entries)
        ledger.remove(entries)
        pending.append(len(ledger._shared["cpu"]._pending))
    # A fold can fall between a range's add and its remove: two ranges held then.
    assert max(pending) <= 8 * 2 + 256 + 1
    assert max(pending) > 8  # the changes were placed, not skipped
    assert ledger.totals() == {"cpu": 8}


# -- put by what changed: a successor with the stored record's names is compared by identity and
# -- only its changed values walked; a batch of such records moves the ledger once.

BATCH_OPS = st.lists(
    st.lists(
        st.sampled_from(["attr", "tensor-attr", "commit", "same", "new-name", "drop-name"]),
        min_size=3,
        max_size=3,
    ),
    max_size=12,
)


def _next(state: SessionState, op: str, k: int) -> SessionState:
    cache = state.object("cache", TensorCache)
    if op == "attr":
        return state.with_attrs(n=k)
    if op == "tensor-attr":
        return state.with_attrs(x=torch.full((k % 5 + 1,), float(k)))
    if op == "commit":
        return state.with_object("cache", cache.commit((torch.zeros(k % 7 + 1),)))
    if op == "new-name":  # different names: the whole record is walked
        return state.with_attrs(**{f"extra{k % 3}": torch.ones(2)})
    if op == "drop-name":
        return state.clear_attrs(*[n for n in state.attrs if n.startswith("extra")])
    return state


@given(BATCH_OPS, st.booleans())
def test_puts_by_what_changed_and_batches_equal_a_recount(
    rounds: list[list[str]], budgeted: bool
) -> None:
    manager: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 1 << 20} if budgeted else None
    )
    states = {
        f"s{i}": SessionState(
            objects={"cache": TensorCache().allocate().commit((torch.zeros(3),))},
            attrs={"n": 0, "x": torch.zeros(2)},
        )
        for i in range(3)
    }
    manager.put_many(states)
    for k, ops in enumerate(rounds, start=1):
        states = {sid: _next(s, op, k) for (sid, s), op in zip(states.items(), ops, strict=True)}
        if k % 2:
            manager.put_many(states)
        else:
            for sid, s in states.items():
                manager.put(sid, s)
        for sid, s in states.items():
            assert manager.peek(sid) is s
        assert_stats_equal_a_recount(manager)


def test_a_stored_record_keeps_no_earlier_version_alive() -> None:
    # Values walked against the stored ones point back at them until they are stored; stored
    # values must not, or every version of a session would stay alive.
    manager: SessionStateManager[SessionState] = SessionStateManager()
    first = SessionState(attrs={"n": 0, "x": torch.zeros(1000)})
    manager.put_many({"a": first})
    first_x = weakref.ref(first.attrs["x"])
    state = first.with_attrs(x=torch.ones(1000))
    del first
    manager.put_many({"a": state})
    for k in range(3):
        state = state.with_attrs(n=k)
        manager.put("a", state)
        manager.put_many({"a": state.with_attrs(n=-k)})
    gc.collect()
    assert first_x() is None


@pytest.mark.parametrize("maxlen", [1, 2, 8])
def test_the_ledger_keeps_at_most_a_rings_worth_of_dropped_chunks_alive(maxlen: int) -> None:
    # The ledger's entries keep their storages alive; a ring's dropped chunks must not stay
    # reachable through them beyond one ring's worth, unseen by `stats()` and the budget.
    manager: SessionStateManager[SessionState] = SessionStateManager()
    ring = LatentBuffer(name="b", dim=0).allocate(maxlen=maxlen)
    record = SessionState(objects={"b": ring})
    refs = []  # weak references to the chunks' storages (what the ledger's entries hold)
    for i in range(200):
        chunk = torch.full((100,), float(i))
        refs.append(chunk.untyped_storage()._weak_ref())
        record = record.with_object("b", record.object("b", LatentBuffer).commit(chunk))
        manager.put("a", record)
        del chunk
    del record
    gc.collect()
    alive = sum(not torch.UntypedStorage._expired(ref) for ref in refs)
    for ref in refs:
        torch.UntypedStorage._free_weak_ref(ref)
    assert maxlen <= alive <= 2 * maxlen + 1
    assert manager.stats()["total_nbytes"] == maxlen * 400


@pytest.mark.parametrize("batched", [False, True])
def test_a_refused_put_keeps_none_of_its_new_chunks_alive(batched: bool) -> None:
    # A put walks the new record before the budget refuses it, and the walk of a buffer's
    # commit extends the stored buffer's ledger backing in place: a refusal must cut that
    # extension off, or the refused chunk stays alive until the session's next put.
    manager: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 20_000}, park_tier="disk"
    )
    buffer = LatentBuffer(name="b", dim=0).allocate().commit(torch.ones(1000))
    record = SessionState(objects={"b": buffer})
    manager.put("a", record)
    chunk = torch.zeros(1000)
    ref = chunk.untyped_storage()._weak_ref()
    refused = record.with_object("b", buffer.commit(chunk)).with_attrs(big=torch.zeros(10_000))
    del chunk
    store = (lambda r: manager.put_many({"a": r})) if batched else (lambda r: manager.put("a", r))
    with pytest.raises(SessionAdmissionError):
        store(refused)
    del refused
    gc.collect()
    try:
        assert torch.UntypedStorage._expired(ref)
    finally:
        torch.UntypedStorage._free_weak_ref(ref)
    assert manager.peek("a") is record
    assert_stats_equal_a_recount(manager)
    # The stored buffer goes on growing as before.
    grown = record.with_object("b", buffer.commit(torch.full((1000,), 2.0)))
    manager.put("a", grown)
    assert_stats_equal_a_recount(manager)
