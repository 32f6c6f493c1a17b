"""The `LatentBuffer` contract as a state machine, against a ``collections.deque``."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sessionstate._accounting import nbytes_by_device
from sessionstate._errors import NotAllocatedError
from sessionstate._objects import LatentBuffer
from sessionstate._stateobject import StateObject
from sessionstate._tree import tree_equal, tree_leaves
from sessionstate.testing._common import (
    DEFAULT_MAXLENS,
    as_maxlen_strategy,
    expect_raises,
    fail,
)
from sessionstate.testing._versions import VersionLog
from sessionstate.testing.strategies import chunks


def _require_record(obj: object, origin: str) -> None:
    leaves = tree_leaves(obj)
    if len(leaves) == 1 and leaves[0] is obj:
        msg = (
            f"{origin} returned a {type(obj).__name__}, which is not a pytree record, so its "
            "tensors cannot be snapshotted and compared. Decorate the class with "
            "`@sessionstate.record`, or call `sessionstate.register_record` on it."
        )
        raise TypeError(msg)


def _time_major_buffer() -> LatentBuffer:
    return LatentBuffer(dim=0)


def _view_last(obj: Any, last: int) -> tuple[Any, ...]:
    # `StateObject.view` takes no arguments; a ring-like object also accepts `last=`.
    return tuple(obj.view(last=last))


def _len(obj: Any) -> int | None:
    return len(obj) if hasattr(obj, "__len__") else None


class RingContractMachine(RuleBasedStateMachine):
    """The `LatentBuffer` contract, checked against a ``collections.deque(maxlen=k)``.

    Runs sequences of ``allocate(maxlen=k)`` (k drawn from `maxlen_strategy`), ``commit``
    (fresh chunks from `chunk_strategy`, runs of them, and re-commits of earlier chunks),
    ``view()``, ``view(last=n)``, ``reset()`` and ``evict()`` on the object `make_object`
    builds, and after every step checks that:

    - the object retains what the deque retains, oldest to newest (the very tensor objects,
      when `holds_by_reference`), and reports the bytes its retained chunks keep alive;
    - ``view(last=n)`` returns the newest ``min(n, len)`` chunks, and raises `ValueError` for
      ``n > maxlen`` and for negative ``n``; ``allocate`` refuses a non-positive ``maxlen``;
    - ``commit``, ``view`` and ``reset`` before ``allocate`` (or after ``evict``) raise
      `NotAllocatedError`, and an evicted object holds no bytes;
    - no record the machine produced has changed since: every tensor any of them holds still
      matches its snapshot clone (`tree_equal`), layout, storage and version counter, and every
      record has the structure and leaves it was made with; at the end of each run every record
      is compared whole with `tree_equal` against its snapshot, and its `nbytes_by_device`
      against the count taken when it was made.

    The object must be a pytree record (see `record`). Configure a subclass with
    `ring_contract_machine` rather than by hand.

    >>> from hypothesis import settings
    >>> from hypothesis.stateful import run_state_machine_as_test
    >>> quick = settings(max_examples=3, stateful_step_count=5, database=None, deadline=None)
    >>> run_state_machine_as_test(RingContractMachine, settings=quick)
    """

    make_object: ClassVar[Callable[[], StateObject]] = _time_major_buffer
    """Builds the unallocated object under test."""
    chunk_strategy: ClassVar[st.SearchStrategy[torch.Tensor]] = chunks()
    """Chunks to commit; every sequence of them must be accepted by the object."""
    maxlen_strategy: ClassVar[st.SearchStrategy[int | None]] = DEFAULT_MAXLENS
    """Ring sizes to allocate with (None: unbounded)."""
    holds_by_reference: ClassVar[bool] = True
    """Whether ``view()`` returns the committed tensor objects themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.obj: StateObject = type(self).make_object()
        _require_record(self.obj, "`make_object()`")
        self.model: deque[torch.Tensor] | None = None
        self.committed: list[torch.Tensor] = []
        self.versions = VersionLog()
        self.versions.keep(self.obj, "make_object()")

    def _advance(self, obj: StateObject, label: str) -> None:
        self.obj = obj
        self.versions.keep(obj, label)

    @property
    def _maxlen(self) -> int | None:
        return None if self.model is None else self.model.maxlen

    @initialize(allocated=st.sampled_from((True, True, True, False)), data=st.data())
    def begin(self, allocated: bool, data: st.DataObject) -> None:
        """Start allocated (most runs) or not (so use before allocate is checked early)."""
        if allocated:
            self.allocate(data)

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        """Allocate afresh with a drawn ring size; the model becomes an empty deque."""
        maxlen = data.draw(type(self).maxlen_strategy, label="maxlen")
        self._advance(self.obj.allocate(maxlen=maxlen), f"allocate(maxlen={maxlen})")
        self.model = deque(maxlen=maxlen)

    @rule(maxlen=st.integers(-2, 0))
    def allocate_invalid(self, maxlen: int) -> None:
        """A non-positive ``maxlen`` raises `ValueError`."""
        expect_raises(
            ValueError, f"allocate(maxlen={maxlen})", lambda: self.obj.allocate(maxlen=maxlen)
        )

    def _commit(self, chunk: torch.Tensor, label: str) -> None:
        if self.model is None:
            event("ring: commit before allocate")
            expect_raises(
                NotAllocatedError, "commit before allocate", lambda: self.obj.commit(chunk)
            )
            return
        if len(self.model) == self.model.maxlen:
            event("ring: commit dropped the oldest chunk")
        self._advance(self.obj.commit(chunk), label)
        self.model.append(chunk)
        self.committed.append(chunk)

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """Commit a fresh chunk (or check that an unallocated object refuses it)."""
        chunk = data.draw(type(self).chunk_strategy, label="chunk")
        self._commit(chunk, f"commit(<{tuple(chunk.shape)} chunk>)")

    @rule(data=st.data())
    def commit_many(self, data: st.DataObject) -> None:
        """Commit several fresh chunks in a row (enough to wrap a small ring)."""
        model = self.model
        most = (model.maxlen if model is not None and model.maxlen is not None else 2) + 2
        payloads = data.draw(
            st.lists(type(self).chunk_strategy, min_size=1, max_size=most), label="chunks"
        )
        for chunk in payloads:
            self._commit(chunk, f"commit(<{tuple(chunk.shape)} chunk>)")

    @precondition(lambda self: bool(self.committed))
    @rule(data=st.data())
    def recommit(self, data: st.DataObject) -> None:
        """Commit a chunk committed before, so versions alias each other's tensors."""
        i = data.draw(st.integers(0, len(self.committed) - 1), label="earlier chunk")
        self._commit(self.committed[i], f"commit(<earlier chunk {i}>)")

    @rule()
    def reset(self) -> None:
        """Reset: empty, same configuration (the deque is cleared, its maxlen kept)."""
        if self.model is None:
            expect_raises(NotAllocatedError, "reset before allocate", self.obj.reset)
            return
        self._advance(self.obj.reset(), "reset()")
        self.model.clear()

    @rule()
    def evict(self) -> None:
        """Evict: storage released; the object must be allocated again before use."""
        self._advance(self.obj.evict(), "evict()")
        self.model = None
        if self.obj.is_allocated:
            fail("An evicted object reports `is_allocated`; eviction makes it non-resident.")
        if self.obj.nbytes_by_device():
            fail(f"An evicted object still holds {self.obj.nbytes_by_device()} bytes.")

    @rule(data=st.data())
    def view_last(self, data: st.DataObject) -> None:
        """``view(last=n)`` for n from -1 to past the ring size (or past the length)."""
        model = self.model
        if model is None:
            expect_raises(NotAllocatedError, "view before allocate", self.obj.view)
            return
        bound = model.maxlen if model.maxlen is not None else len(model)
        n = data.draw(st.integers(-1, bound + 2), label="last")
        if n < 0 or (model.maxlen is not None and n > model.maxlen):
            event("ring: view(last=n) out of range")
            expect_raises(
                ValueError,
                f"view(last={n}) on a ring of {model.maxlen}",
                lambda: _view_last(self.obj, n),
            )
            return
        got = _view_last(self.obj, n)
        expected = tuple(model)[len(model) - min(n, len(model)) :]
        self._check_chunks(got, expected, f"view(last={n})")

    def _check_chunks(
        self, got: tuple[Any, ...], expected: tuple[torch.Tensor, ...], action: str
    ) -> None:
        if not tree_equal(got, expected):
            fail(
                f"`{action}` returned {len(got)} chunks that differ from the {len(expected)} the "
                f"model retains (ring size {self._maxlen})."
            )
        if type(self).holds_by_reference and any(
            g is not e for g, e in zip(got, expected, strict=True)
        ):
            fail(f"`{action}` returned copies; the object should hold chunks by reference.")

    @invariant()
    def agrees_with_model(self) -> None:
        """The current object retains what the deque retains, and the bytes they keep alive."""
        model = self.model
        if model is None:
            return
        if not self.obj.is_allocated:
            fail("An allocated object reports `is_allocated == False`.")
        expected = tuple(model)
        self._check_chunks(tuple(self.obj.view()), expected, "view()")
        length = _len(self.obj)
        if length is not None and length != len(model):
            fail(f"`len()` is {length}, the model retains {len(model)}.")
        # An object holding references keeps exactly the committed storages alive; one that
        # copies keeps whatever its views reach.
        retained = expected if type(self).holds_by_reference else tuple(self.obj.view())
        if self.obj.nbytes_by_device() != nbytes_by_device(retained):
            fail(
                f"`nbytes_by_device()` is {self.obj.nbytes_by_device()}, but its retained chunks "
                f"keep {nbytes_by_device(retained)} alive."
            )

    @invariant()
    def earlier_versions_unchanged(self) -> None:
        """No record produced so far has changed (each tensor once, each record's leaves)."""
        self.versions.check()

    def teardown(self) -> None:
        """At the end of a run, compare every record as a whole with its snapshot and bytes."""
        self.versions.check_all()


def ring_contract_machine(
    factory: Callable[[], StateObject] = _time_major_buffer,
    *,
    chunk_strategy: st.SearchStrategy[torch.Tensor] | None = None,
    maxlen: int | st.SearchStrategy[int | None] | None = DEFAULT_MAXLENS,
    holds_by_reference: bool = True,
    name: str | None = None,
) -> type[RingContractMachine]:
    """A `RingContractMachine` for the object ``factory`` builds.

    Args:
        factory: Builds the unallocated object under test (a `StateObject` record with
            ``allocate(maxlen=...)`` and ``view(last=...)``).
        chunk_strategy: Payloads to commit, all acceptable to the object (default `chunks()`,
            matching ``LatentBuffer(dim=0)``).
        maxlen: Ring size to allocate with: an int forces a ring, None forces unbounded, a
            strategy draws one at each ``allocate`` (default: unbounded or 1..4).
        holds_by_reference: Whether ``view()`` returns the committed tensors themselves.
        name: The class name (shows in test reports).

    Raises:
        ValueError: if ``maxlen`` is an int that is not positive.

    >>> from sessionstate import LatentBuffer
    >>> Machine = ring_contract_machine(lambda: LatentBuffer(dim=1), maxlen=3,
    ...                                 chunk_strategy=chunks(dim=1, feature_shape=(2, 2)))
    >>> Machine.__name__
    'RingContractMachine'
    >>> TestRing3 = Machine.TestCase  # assign in a test module to run it under pytest
    """
    maxlens = as_maxlen_strategy(maxlen)

    class Configured(RingContractMachine):
        pass

    # Set after the class statement: a class body cannot see the function's arguments
    # under the same names.
    Configured.make_object = factory
    if chunk_strategy is not None:
        Configured.chunk_strategy = chunk_strategy
    Configured.maxlen_strategy = maxlens
    Configured.holds_by_reference = holds_by_reference
    Configured.__name__ = Configured.__qualname__ = name or RingContractMachine.__name__
    return Configured
