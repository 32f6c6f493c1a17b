"""The public testing tools: strategies keep what their knobs promise; machines have teeth."""

from __future__ import annotations

import re
from collections.abc import Collection, Hashable
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from sessionstate import (
    LatentBuffer,
    NotAllocatedError,
    SessionState,
    SessionStateManager,
    StateObject,
    field,
    record,
    register_record,
    static_field,
    tree_equal,
)
from sessionstate.testing import (
    CHUNK_DERIVATIONS,
    POOL_DERIVATIONS,
    ManagerContractMachine,
    RingContractMachine,
    TensorPool,
    chunks,
    manager_contract_machine,
    ring_contract_machine,
    session_states,
    tensor_pools,
    tensors,
)

# `find` returns the first example it meets: no shrinking, no database.
_FIND = settings(max_examples=1000, database=None, phases=(Phase.generate,))


def _storage_id(t: torch.Tensor) -> int:
    # torch's own storage identity; the pool's provenance must agree with it.
    return t.untyped_storage()._cdata


# ---- tensors ----------------------------------------------------------------------------------


@given(tensors(devices=("meta",)))
def test_forcing_meta_gives_only_meta_tensors(t: torch.Tensor) -> None:
    assert t.is_meta


@given(tensors(devices=("cpu",), dtypes=(torch.bfloat16,)))
def test_forcing_device_and_dtype(t: torch.Tensor) -> None:
    assert t.device.type == "cpu"
    assert t.dtype == torch.bfloat16


@given(tensors(min_dims=2, max_dims=2, max_side=3, allow_empty=False))
def test_shape_bounds_and_no_empty(t: torch.Tensor) -> None:
    assert t.ndim == 2
    assert all(1 <= side <= 3 for side in t.shape)
    assert t.numel() > 0


@given(tensors())
def test_tensors_are_fresh_exact_allocations(t: torch.Tensor) -> None:
    assert t.is_contiguous()
    assert t.storage_offset() == 0
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert t.ndim <= 3


def test_tensors_randomise_devices_dtypes_and_emptiness_by_default() -> None:
    find(tensors(), lambda t: t.is_meta, settings=_FIND)
    find(tensors(), lambda t: t.device.type == "cpu" and t.numel() > 1, settings=_FIND)
    find(tensors(), lambda t: t.numel() == 0, settings=_FIND)
    find(tensors(), lambda t: t.ndim == 0, settings=_FIND)
    find(tensors(), lambda t: t.dtype == torch.bool, settings=_FIND)


# ---- tensor_pools -----------------------------------------------------------------------------


@given(tensor_pools())
def test_pool_provenance_matches_torch(pool: TensorPool) -> None:
    for entry in pool.entries:
        t = entry.tensor
        a = entry.allocation
        assert pool.allocation_nbytes[a] == t.untyped_storage().nbytes()
        assert pool.allocation_devices[a] == str(t.device)
        if entry.derivation == "base":
            assert entry.source is None
        else:
            assert entry.source is not None
            assert entry.derivation in POOL_DERIVATIONS
    for x in pool.entries:
        for y in pool.entries:
            same = _storage_id(x.tensor) == _storage_id(y.tensor)
            assert same == (x.allocation == y.allocation)


@given(tensor_pools(min_bases=2, max_bases=3, max_derived=0))
def test_pool_base_bounds(pool: TensorPool) -> None:
    assert 2 <= len(pool) <= 3
    assert all(entry.derivation == "base" for entry in pool.entries)


@given(tensor_pools(derivations=("alias",)))
def test_forcing_alias_repeats_objects(pool: TensorPool) -> None:
    for entry in pool.entries:
        if entry.source is not None:
            assert entry.tensor is pool.tensors[entry.source]


@given(tensor_pools(derivations=("clone",)))
def test_forcing_clone_gives_new_allocations(pool: TensorPool) -> None:
    assert len(set(e.allocation for e in pool.entries)) == len(pool)
    for entry in pool.entries:
        if entry.source is not None:
            assert tree_equal(entry.tensor, pool.tensors[entry.source])


@given(tensor_pools(devices=("meta",), derivations=("view", "transpose")))
def test_forcing_meta_pool(pool: TensorPool) -> None:
    assert all(t.is_meta for t in pool.tensors)
    assert set(pool.allocation_devices) == {"meta"}


@pytest.mark.parametrize("derivation", POOL_DERIVATIONS)
def test_every_pool_derivation_occurs(derivation: str) -> None:
    find(
        tensor_pools(derivations=(derivation,)),
        lambda pool: any(e.derivation == derivation for e in pool.entries),
        settings=_FIND,
    )


def test_pools_make_non_contiguous_and_empty_views() -> None:
    find(tensor_pools(), lambda p: any(not t.is_contiguous() for t in p.tensors), settings=_FIND)
    find(
        tensor_pools(),
        lambda p: any(
            e.tensor.numel() == 0 and p.allocation_nbytes[e.allocation] > 0 for e in p.entries
        ),
        settings=_FIND,
    )
    find(tensor_pools(), lambda p: len({id(t) for t in p.tensors}) < len(p), settings=_FIND)


def test_allocation_of_unknown_tensor() -> None:
    pool = TensorPool(entries=(), allocation_nbytes=(), allocation_devices=())
    with pytest.raises(
        KeyError,
        match=re.escape(
            "Tensor of shape (2,) on cpu is not in this pool; only the pool's own tensor "
            "objects (`pool.tensors`) have a known allocation."
        ),
    ):
        pool.allocation_of(torch.zeros(2))


# ---- chunks -----------------------------------------------------------------------------------


@given(st.lists(chunks(dim=1, feature_shape=(2, 3), dtype=torch.float16), max_size=5))
def test_chunks_share_one_layout(payloads: list[torch.Tensor]) -> None:
    buf = LatentBuffer(dim=1).allocate()
    for chunk in payloads:
        assert chunk.dtype == torch.float16
        assert chunk.shape[0] == 2
        assert chunk.shape[2] == 3
        assert 0 <= chunk.shape[1] <= 3
        buf = buf.commit(chunk)
    assert len(buf) == len(payloads)


@given(chunks(device="meta", max_len=2, allow_empty=False))
def test_chunks_forced_meta_and_non_empty(chunk: torch.Tensor) -> None:
    assert chunk.is_meta
    assert 1 <= chunk.shape[0] <= 2


@given(chunks(derivations=("slice",), allow_empty=False))
def test_slice_chunks_keep_a_larger_allocation(chunk: torch.Tensor) -> None:
    assert chunk.untyped_storage().nbytes() > chunk.numel() * chunk.element_size()


@given(chunks(derivations=("expand",), max_len=3))
def test_expand_chunks_overlap(chunk: torch.Tensor) -> None:
    if chunk.shape[0] > 1:
        assert chunk.stride(0) == 0


@pytest.mark.parametrize("derivation", CHUNK_DERIVATIONS)
def test_every_chunk_derivation_has_the_layout(derivation: str) -> None:
    chunk = find(
        chunks(derivations=(derivation,), feature_shape=(2, 4)),
        lambda c: c.shape[0] > 1,
        settings=_FIND,
    )
    assert chunk.shape[1:] == (2, 4)
    if derivation in ("transpose", "expand", "strided"):
        assert not chunk.is_contiguous()


# ---- session_states ---------------------------------------------------------------------------


def _tensors_of(state: SessionState) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for obj in state.objects.values():
        assert isinstance(obj, LatentBuffer)
        out.extend(obj.chunks)
    for value in state.attrs.values():
        out.extend(value if isinstance(value, list) else [value])
    return [t for t in out if isinstance(t, torch.Tensor)]


@given(st.data())
def test_session_states_draw_every_tensor_from_the_pool(data: st.DataObject) -> None:
    pool = data.draw(tensor_pools(), label="pool")
    state = data.draw(session_states(pools=st.just(pool), max_objects=3, max_attrs=4))
    assert len(state.objects) <= 3
    assert len(state.attrs) <= 4
    for t in _tensors_of(state):
        pool.allocation_of(t)
    for name, obj in state.objects.items():
        assert isinstance(obj, LatentBuffer)
        assert obj.name == name
        assert obj.dim == 0
    for value in state.attrs.values():
        # A drawn list is stored as a tuple: attributes are deeply immutable.
        assert value is None or isinstance(value, int | torch.Tensor | tuple)


@given(session_states(maxlen=2, allow_unallocated=False))
def test_session_states_forced_ring(state: SessionState) -> None:
    for obj in state.objects.values():
        assert isinstance(obj, LatentBuffer)
        assert obj.is_allocated
        assert obj.maxlen == 2
        assert len(obj) <= 2


@given(session_states(maxlen=None, max_objects=0, max_attrs=0))
def test_session_states_empty_when_forced(state: SessionState) -> None:
    assert not state.objects
    assert not state.attrs


def test_session_states_alias_between_buckets_and_vary_lifecycles() -> None:
    def aliased(state: SessionState) -> bool:
        chunk_ids = {id(c) for o in state.objects.values() if o.is_allocated for c in o.view()}
        return any(id(v) in chunk_ids for v in state.attrs.values())

    find(session_states(), aliased, settings=_FIND)
    find(
        session_states(),
        lambda s: any(not o.is_allocated for o in s.objects.values()),
        settings=_FIND,
    )
    find(
        session_states(),
        lambda s: any(
            isinstance(o, LatentBuffer) and o.maxlen and len(o) for o in s.objects.values()
        ),
        settings=_FIND,
    )


# ---- knob validation messages -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "exc", "message"),
    [
        (
            lambda: tensors(devices=()),
            ValueError,
            "`devices` must name at least one option, got () (tuple).",
        ),
        (
            lambda: tensors(devices=("gpu0",)),
            ValueError,
            "`devices` must hold device strings such as 'cpu', 'meta' or 'cuda:0', got "
            "'gpu0' (str).",
        ),
        (
            lambda: tensors(min_dims=3, max_dims=2),
            ValueError,
            "`max_dims` must be >= `min_dims`, got max_dims=2, min_dims=3.",
        ),
        (
            lambda: tensors(max_side=0, allow_empty=False),
            ValueError,
            "`max_side=0` makes every tensor with a dimension empty; pass `allow_empty=True`.",
        ),
        (
            lambda: tensors(max_dims=-1),
            ValueError,
            "`max_dims` must be a non-negative int, got -1 (int).",
        ),
        (
            lambda: tensor_pools(derivations=("rotate",)),
            ValueError,
            f"`derivations` has unknown options ['rotate']; choose from {list(POOL_DERIVATIONS)}.",
        ),
        (
            lambda: tensor_pools(min_bases=0),
            ValueError,
            "`min_bases` must be a positive int, got 0 (int).",
        ),
        (
            lambda: tensor_pools(min_bases=2, max_bases=1),
            ValueError,
            "`max_bases` must be >= `min_bases`, got max_bases=1, min_bases=2.",
        ),
        (
            lambda: chunks(dim=2, feature_shape=(2,)),
            ValueError,
            "`dim` must be an int in 0..1 (a position in `feature_shape` (2,)), got 2 (int).",
        ),
        (
            lambda: chunks(max_len=0, allow_empty=False),
            ValueError,
            "`max_len=0` makes every chunk empty; pass `allow_empty=True` or a larger `max_len`.",
        ),
        (
            lambda: session_states(max_objects=5),
            ValueError,
            "`max_objects` must be at most 4, got 5.",
        ),
        (
            lambda: session_states(maxlen=0),
            ValueError,
            "`maxlen` must be a positive int, got 0 (int).",
        ),
        (
            lambda: ring_contract_machine(maxlen=-1),
            ValueError,
            "`maxlen` must be a positive int, got -1 (int).",
        ),
        (
            lambda: manager_contract_machine(max_sessions=0),
            ValueError,
            "`max_sessions` must be a positive int, got 0 (int).",
        ),
        (
            lambda: manager_contract_machine(on_full="drop"),  # type: ignore[arg-type]
            ValueError,
            "`on_full` must be 'evict' or 'refuse', got 'drop' (str): ",
        ),
    ],
)
def test_knob_messages(make: Any, exc: type[Exception], message: str) -> None:
    with pytest.raises(exc, match=re.escape(message)):
        make()


# ---- machine factories ------------------------------------------------------------------------


def test_ring_contract_machine_configures_a_subclass() -> None:
    strategy = chunks(device="meta")
    machine = ring_contract_machine(
        LatentBuffer, chunk_strategy=strategy, maxlen=3, holds_by_reference=False, name="Mine"
    )
    assert issubclass(machine, RingContractMachine)
    assert machine.__name__ == "Mine"
    assert machine.make_object is LatentBuffer
    assert machine.chunk_strategy is strategy
    assert machine.holds_by_reference is False
    assert find(machine.maxlen_strategy, lambda _: True) == 3
    # The base class is untouched.
    assert RingContractMachine.holds_by_reference is True
    assert RingContractMachine.chunk_strategy is not strategy


def test_manager_contract_machine_configures_a_subclass() -> None:
    states = session_states(max_objects=0)
    machine = manager_contract_machine(max_sessions=3, on_full="refuse", states=states)
    assert issubclass(machine, ManagerContractMachine)
    assert machine.on_full == "refuse"
    assert machine.state_strategy is states
    assert machine.manager_factory is SessionStateManager
    assert find(machine.max_sessions_strategy, lambda _: True) == 3
    assert ManagerContractMachine.on_full == "evict"


# ---- the machines catch broken implementations ------------------------------------------------

_HUNT = settings(
    max_examples=300,
    stateful_step_count=20,
    database=None,
    derandomize=True,
    deadline=None,
    phases=(Phase.explicit, Phase.generate),
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
)
_QUICK = settings(
    max_examples=15,
    stateful_step_count=15,
    database=None,
    derandomize=True,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def _fresh_chunks() -> st.SearchStrategy[torch.Tensor]:
    return st.integers(1, 2).map(lambda n: torch.ones(n, 2))


@register_record
@attrs.frozen(eq=False)
class _MutatingBuffer(LatentBuffer):
    """Writes into the chunk it held last: every earlier record holding it changes."""

    def commit(self, chunk: torch.Tensor, /) -> LatentBuffer:
        if self.chunks:
            self.chunks[-1].add_(1)
        return super().commit(chunk)


@register_record
@attrs.frozen(eq=False)
class _ShortWindowBuffer(LatentBuffer):
    """Returns a silently shorter window instead of raising for ``last > maxlen``."""

    def view(self, *, last: int | None = None) -> tuple[torch.Tensor, ...]:
        if last is not None and self.maxlen is not None:
            last = min(last, self.maxlen)
        return super().view(last=last)


@register_record
@attrs.frozen(eq=False)
class _CopyingBuffer(LatentBuffer):
    """Stores copies of committed chunks."""

    def commit(self, chunk: torch.Tensor, /) -> LatentBuffer:
        return super().commit(chunk.clone())


@register_record
@attrs.frozen(eq=False)
class _LeakyEvictBuffer(LatentBuffer):
    """Reports itself evicted but keeps its chunks."""

    evicted: bool = static_field(default=False, kw_only=True)

    @property
    def is_allocated(self) -> bool:
        return self.allocated and not self.evicted

    def evict(self) -> LatentBuffer:
        return attrs.evolve(self, evicted=True)


@register_record
@attrs.frozen(eq=False)
class _ForgivingBuffer(LatentBuffer):
    """Commits without being allocated."""

    def commit(self, chunk: torch.Tensor, /) -> LatentBuffer:
        return super(_ForgivingBuffer, attrs.evolve(self, allocated=True)).commit(chunk)


@attrs.frozen(eq=False)
class _UnregisteredBuffer(LatentBuffer):
    """A subclass someone forgot to register as a pytree record."""


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (_MutatingBuffer, "changed after it was made"),
        (_ShortWindowBuffer, "should raise ValueError"),
        (_CopyingBuffer, "returned copies"),
        (_LeakyEvictBuffer, "An evicted object still holds"),
        (_ForgivingBuffer, "commit before allocate should raise NotAllocatedError"),
    ],
)
def test_ring_machine_catches(cls: type[LatentBuffer], message: str) -> None:
    machine = ring_contract_machine(
        lambda: cls(dim=0), chunk_strategy=_fresh_chunks(), maxlen=st.sampled_from([None, 1, 2])
    )
    with pytest.raises(AssertionError, match=re.escape(message)):
        run_state_machine_as_test(machine, settings=_HUNT)


def test_copying_buffer_passes_when_copies_are_declared() -> None:
    machine = ring_contract_machine(
        lambda: _CopyingBuffer(dim=0), chunk_strategy=_fresh_chunks(), holds_by_reference=False
    )
    run_state_machine_as_test(machine, settings=_QUICK)


def test_ring_machine_requires_a_record() -> None:
    machine = ring_contract_machine(lambda: _UnregisteredBuffer(dim=0))
    with pytest.raises(
        TypeError,
        match=re.escape(
            "`make_object()` returned a _UnregisteredBuffer, which is not a pytree record, so "
            "its tensors cannot be snapshotted and compared. Decorate the class with "
            "`@sessionstate.record`, or call `sessionstate.register_record` on it."
        ),
    ):
        run_state_machine_as_test(machine, settings=_QUICK)


@record
class TupleRing(StateObject):
    """A downstream ring written from scratch: checked by the same machine in one line."""

    items: tuple[torch.Tensor, ...] = field(default=())
    maxlen: int | None = static_field(default=None)
    allocated: bool = static_field(default=False)

    @property
    def is_allocated(self) -> bool:
        return self.allocated

    def __len__(self) -> int:
        return len(self.items)

    def _require(self) -> None:
        if not self.allocated:
            msg = "TupleRing is not allocated; call `.allocate(maxlen=...)` first."
            raise NotAllocatedError(msg)

    def allocate(self, *, maxlen: int | None = None) -> TupleRing:  # type: ignore[override]
        if maxlen is not None and maxlen <= 0:
            msg = f"`maxlen` must be positive, got {maxlen}."
            raise ValueError(msg)
        return TupleRing(maxlen=maxlen, allocated=True)

    def commit(self, payload: torch.Tensor, /) -> TupleRing:
        self._require()
        items = (*self.items, payload)
        if self.maxlen is not None:
            items = items[-self.maxlen :]
        return attrs.evolve(self, items=items)

    def view(self, *, last: int | None = None) -> tuple[torch.Tensor, ...]:
        self._require()
        if last is None:
            return self.items
        if last < 0 or (self.maxlen is not None and last > self.maxlen):
            msg = f"`last` out of range: {last}."
            raise ValueError(msg)
        return self.items[len(self.items) - min(last, len(self.items)) :]

    def reset(self) -> TupleRing:
        self._require()
        return attrs.evolve(self, items=())

    def evict(self) -> TupleRing:
        return TupleRing()


def test_a_downstream_ring_passes() -> None:
    run_state_machine_as_test(ring_contract_machine(TupleRing), settings=_QUICK)


class _UntouchedGetManager(SessionStateManager):
    """`get` does not mark the session most recently used."""

    def get(self, session_id: str, /) -> SessionState | None:
        table = self._table
        with table.lock:
            state = table.records.get(session_id)
            if state is None:
                table.misses += 1
                return None
            table.hits += 1
            return state


class _SummingStatsManager(SessionStateManager):
    """Adds per-session byte counts: storages shared between sessions count twice."""

    def stats(self) -> dict[str, int]:
        out = {k: v for k, v in super().stats().items() if not k.startswith("nbytes:")}
        totals: dict[str, int] = {}
        for counts in self.nbytes_by_session().values():
            for device, n in counts.items():
                totals[device] = totals.get(device, 0) + n
        out["total_nbytes"] = sum(totals.values())
        out.update({f"nbytes:{d}": n for d, n in sorted(totals.items())})
        return out


class _MutatingManager(SessionStateManager):
    """Zeroes the tensors of a record it evicts (as if recycling their memory)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        table, admit = self._table, self._table.admit

        def mutating(session_id: Hashable, keep: Collection[Hashable] = ()) -> None:
            if len(table.records) >= table.max_sessions and table.on_full == "evict":
                _, evicted = next(iter(table.records.items()))
                for t in _tensors_of(evicted):
                    if t.device.type == "cpu" and t.numel():
                        t.zero_()
            admit(session_id, keep)

        table.admit = mutating  # type: ignore[method-assign]


class _RefuseLeaksManager(SessionStateManager):
    """Refuses a new session, but only after dropping the oldest one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        table, admit = self._table, self._table.admit

        def leaking(session_id: Hashable, keep: Collection[Hashable] = ()) -> None:
            if len(table.records) >= table.max_sessions and table.on_full == "refuse":
                table.records.popitem(last=False)
            admit(session_id, keep)

        table.admit = leaking  # type: ignore[method-assign]


_CPU_STATES = session_states(pools=tensor_pools(devices=("cpu",), allow_empty=False))


@pytest.mark.parametrize(
    ("manager_cls", "on_full", "message"),
    [
        (_UntouchedGetManager, "evict", "`session_ids()` is"),
        (_SummingStatsManager, "evict", "`stats()` is"),
        (_MutatingManager, "evict", "changed after it was made"),
        (_RefuseLeaksManager, "refuse", "at the cap should raise SessionAdmissionError"),
    ],
)
def test_manager_machine_catches(
    manager_cls: type[SessionStateManager], on_full: Any, message: str
) -> None:
    machine = manager_contract_machine(
        max_sessions=2, on_full=on_full, states=_CPU_STATES, manager_factory=manager_cls
    )
    with pytest.raises(AssertionError, match=re.escape(message)):
        run_state_machine_as_test(machine, settings=_HUNT)


def test_machines_are_rule_based_state_machines() -> None:
    assert issubclass(RingContractMachine, RuleBasedStateMachine)
    assert issubclass(ManagerContractMachine, RuleBasedStateMachine)
