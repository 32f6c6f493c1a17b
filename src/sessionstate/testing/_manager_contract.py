"""The `SessionStateManager` contract as a state machine, against an ``OrderedDict`` LRU."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import ClassVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sessionstate._checks import ON_FULL_CHOICES, check_choice
from sessionstate._errors import SessionAdmissionError, SessionStateLostError
from sessionstate._manager import OnFull, SessionStateManager
from sessionstate._objects import LatentBuffer
from sessionstate._session import SessionState
from sessionstate.testing._common import (
    DEFAULT_CAPS,
    DEFAULT_SESSION_IDS,
    as_strategy,
    check_positive,
    expect_raises,
    fail,
)
from sessionstate.testing._versions import VersionLog
from sessionstate.testing.recount import _stats_bytes, recount_nbytes_by_device
from sessionstate.testing.strategies import session_states


def _default_advance(state: SessionState, step: int) -> SessionState:
    """One model step: note the step, and re-commit each buffer's newest chunk."""
    if not type(state).__session_attrs__:
        state = state.with_attrs(machine_step=step)
    for name, obj in state.objects.items():
        if isinstance(obj, LatentBuffer) and obj.is_allocated and len(obj):
            state = state.with_object(name, obj.commit(obj.view(last=1)[0]))
    return state


class ManagerContractMachine(RuleBasedStateMachine):
    """The `SessionStateManager` contract, checked against an ``OrderedDict`` LRU model.

    Creates a manager with a small cap (drawn from `max_sessions_strategy`) and runs ``put``,
    ``get``, ``get_or_create``, ``require``, ``peek``, ``drop``, ``in``, ``len``, ``clear``, a model
    step (get, advance the record, put it back) and a fork (a held record, advanced, put under
    another id, so sessions share storages) over a few session ids. After every step it
    checks that:

    - ``session_ids()`` is the model's order, least recently used first (so ``in``, ``len``
      and ``stats`` did not touch it), and ``len`` agrees;
    - the hits, misses and evictions counters match the model's, and ``stats()``'s byte keys
      equal `recount_nbytes_by_device` of the records the model holds (each storage once
      across sessions, counted without the library's accounting);
    - at the cap, a new session evicts the least recently used one (``on_full="evict"``), or
      raises `SessionAdmissionError` and changes nothing (``on_full="refuse"``); a refused
      ``get_or_create`` still counts its lookup as a miss;
    - every record the machine has held, evicted ones included, is unchanged (checked as in
      `RingContractMachine`);
    - ``peek`` returns the stored record and touches neither the order nor the counters.

    Configure a subclass with `manager_contract_machine`.

    >>> from hypothesis import settings
    >>> from hypothesis.stateful import run_state_machine_as_test
    >>> quick = settings(max_examples=3, stateful_step_count=5, database=None, deadline=None)
    >>> run_state_machine_as_test(ManagerContractMachine, settings=quick)
    """

    max_sessions_strategy: ClassVar[st.SearchStrategy[int]] = DEFAULT_CAPS
    """Caps to create the manager with."""
    on_full: ClassVar[OnFull] = "evict"
    """What a new session does at the cap."""
    session_id_strategy: ClassVar[st.SearchStrategy[str]] = DEFAULT_SESSION_IDS
    """Session ids; a few more than the cap, so sessions are evicted and come back."""
    state_strategy: ClassVar[st.SearchStrategy[SessionState]] = session_states()
    """Records to store."""
    manager_factory: ClassVar[Callable[..., SessionStateManager]] = SessionStateManager
    """Builds the manager under test: ``manager_factory(max_sessions, on_full=...)``."""
    advance: ClassVar[Callable[[SessionState, int], SessionState]] = _default_advance
    """One model step on a stored record: ``advance(state, step) -> state``."""

    def __init__(self) -> None:
        super().__init__()
        self._manager: SessionStateManager | None = None
        self.model: OrderedDict[str, SessionState] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.steps = 0
        self.held = VersionLog()

    @property
    def manager(self) -> SessionStateManager:
        """The manager under test (created by the `create` rule)."""
        if self._manager is None:
            msg = "The manager is created by the `create` initialize rule; it has not run yet."
            raise RuntimeError(msg)
        return self._manager

    @initialize(data=st.data())
    def create(self, data: st.DataObject) -> None:
        """Create the manager with a drawn cap."""
        cap = data.draw(type(self).max_sessions_strategy, label="max_sessions")
        self._manager = type(self).manager_factory(cap, on_full=type(self).on_full)

    @property
    def _full(self) -> bool:
        return len(self.model) >= self.manager.max_sessions

    def _draw_id(self, data: st.DataObject) -> str:
        return data.draw(type(self).session_id_strategy, label="session_id")

    def _draw_state(self, data: st.DataObject) -> SessionState:
        state = data.draw(type(self).state_strategy, label="state")
        self.held.keep(state, "a drawn state")
        return state

    def _touch(self, sid: str) -> None:
        self.model.move_to_end(sid)

    def _admit(self, sid: str) -> None:
        """Model admission of a new session; evicts the LRU one when full (evict mode)."""
        if self._full:
            event("manager: evicted the least recently used session")
            evicted_id, evicted = self.model.popitem(last=False)
            self.evictions += 1
            self.held.keep(evicted, f"session {evicted_id!r}, evicted by {sid!r}")

    def _refused(self, sid: str) -> bool:
        return sid not in self.model and self._full and type(self).on_full == "refuse"

    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        """Store a drawn record under a drawn id."""
        sid, state = self._draw_id(data), self._draw_state(data)
        self._put(sid, state)

    def _put(self, sid: str, state: SessionState) -> None:
        if self._refused(sid):
            event("manager: refused a new session at the cap")
            expect_raises(
                SessionAdmissionError,
                f"put({sid!r}) at the cap",
                lambda: self.manager.put(sid, state),
            )
            return
        self.manager.put(sid, state)
        if sid in self.model:
            self._touch(sid)
        else:
            self._admit(sid)
        self.model[sid] = state

    def _check_lookup(self, sid: str, got: SessionState | None, action: str) -> None:
        expected = self.model.get(sid)
        if got is not expected:
            fail(
                f"`{action}` returned {'a record' if got is not None else 'None'}; the model "
                f"{'holds a different record' if expected is not None else 'holds no session'}"
                f" for {sid!r}."
            )

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        """Look a session up: a hit touches it, a miss returns None."""
        sid = self._draw_id(data)
        got = self.manager.get(sid)
        self._check_lookup(sid, got, f"get({sid!r})")
        if sid in self.model:
            self.hits += 1
            self._touch(sid)
        else:
            self.misses += 1

    @rule(data=st.data())
    def require(self, data: st.DataObject) -> None:
        """Look a continuation up: a miss raises `SessionStateLostError`."""
        sid = self._draw_id(data)
        if sid in self.model:
            self._check_lookup(sid, self.manager.require(sid), f"require({sid!r})")
            self.hits += 1
            self._touch(sid)
        else:
            expect_raises(
                SessionStateLostError,
                f"require({sid!r}) of an absent session",
                lambda: self.manager.require(sid),
            )
            self.misses += 1

    @rule(data=st.data())
    def get_or_create(self, data: st.DataObject) -> None:
        """Get a session, or create it from a factory (called once, only on a miss)."""
        sid, state = self._draw_id(data), self._draw_state(data)
        calls: list[None] = []

        def factory() -> SessionState:
            calls.append(None)
            return state

        action = f"get_or_create({sid!r}, factory)"
        if sid in self.model:
            self._check_lookup(sid, self.manager.get_or_create(sid, factory), action)
            self.hits += 1
            self._touch(sid)
            if calls:
                fail(f"`{action}` called the factory for a session it holds.")
            return
        self.misses += 1
        if self._refused(sid):
            event("manager: refused a new session at the cap")
            expect_raises(
                SessionAdmissionError,
                f"{action} at the cap",
                lambda: self.manager.get_or_create(sid, factory),
            )
            return
        got = self.manager.get_or_create(sid, factory)
        self._admit(sid)
        self.model[sid] = state
        if got is not state or len(calls) != 1:
            fail(f"`{action}` for a new session must call the factory once and store its record.")

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A model step: get a held session, advance its record, put the new one back."""
        sid = data.draw(st.sampled_from(list(self.model)), label="held session_id")
        state = self.manager.get(sid)
        self._check_lookup(sid, state, f"get({sid!r})")
        self.hits += 1
        self._touch(sid)
        if state is None:
            fail(f"`get({sid!r})` lost a session the model holds.")
        self.steps += 1
        new = type(self).advance(state, self.steps)
        self.held.keep(new, f"advance of session {sid!r}")
        self.manager.put(sid, new)
        self._touch(sid)
        self.model[sid] = new

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """Store a held record, advanced, under another id: two sessions share storages."""
        source = data.draw(st.sampled_from(list(self.model)), label="source session_id")
        sid = self._draw_id(data)
        self.steps += 1
        state = type(self).advance(self.model[source], self.steps)
        self.held.keep(state, f"fork of session {source!r}")
        self._put(sid, state)

    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """End a session; `drop` says whether it was held."""
        sid = self._draw_id(data)
        was_held = self.manager.drop(sid)
        if was_held != (sid in self.model):
            fail(f"`drop({sid!r})` returned {was_held}; the model holds it: {sid in self.model}.")
        held = self.model.pop(sid, None)
        if held is not None:
            self.held.keep(held, f"session {sid!r}, dropped")

    @rule(data=st.data())
    def peek(self, data: st.DataObject) -> None:
        """Inspect a session: no LRU touch, no hit or miss (checked after the step)."""
        sid = self._draw_id(data)
        self._check_lookup(sid, self.manager.peek(sid), f"peek({sid!r})")

    @rule(data=st.data())
    def contains(self, data: st.DataObject) -> None:
        """``in`` agrees with the model (and, checked after the step, touches nothing)."""
        sid = self._draw_id(data)
        if (sid in self.manager) != (sid in self.model):
            fail(f"`{sid!r} in manager` is {sid in self.manager}; the model: {sid in self.model}.")

    @rule()
    def length(self) -> None:
        """``len`` agrees with the model."""
        if len(self.manager) != len(self.model):
            fail(f"`len(manager)` is {len(self.manager)}; the model holds {len(self.model)}.")

    @rule()
    def clear(self) -> None:
        """Drop every session; the counters are kept."""
        for sid, state in self.model.items():
            self.held.keep(state, f"session {sid!r}, cleared")
        self.manager.clear()
        self.model.clear()

    @invariant()
    def agrees_with_model(self) -> None:
        """Order, size, counters and bytes agree with the model."""
        if self._manager is None:
            return
        ids = self.manager.session_ids()
        if ids != list(self.model):
            fail(
                f"`session_ids()` is {ids}; the LRU model (least recently used first) is "
                f"{list(self.model)}."
            )
        recount = recount_nbytes_by_device(list(self.model.values()))
        expected = {
            "sessions": len(self.model),
            "max_sessions": self.manager.max_sessions,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            **_stats_bytes(recount),
            "forks": 0,
        }
        # (`shared_sessions` is the manager's count of sessions sharing a storage, which
        # records drawn from one pool of payloads do: not modelled here.)
        stats = self.manager.stats()
        stats.pop("shared_sessions", None)
        if stats != expected:
            fail(f"`stats()` is {stats}; the model expects {expected}.")

    @invariant()
    def held_records_unchanged(self) -> None:
        """Every record the machine has held, evicted ones included, is unchanged."""
        self.held.check()

    def teardown(self) -> None:
        """At the end of a run, compare every held record as a whole with its snapshot."""
        self.held.check_all()


def manager_contract_machine(
    *,
    max_sessions: int | st.SearchStrategy[int] = DEFAULT_CAPS,
    on_full: OnFull = "evict",
    states: st.SearchStrategy[SessionState] | None = None,
    session_ids: st.SearchStrategy[str] = DEFAULT_SESSION_IDS,
    manager_factory: Callable[..., SessionStateManager] = SessionStateManager,
    advance: Callable[[SessionState, int], SessionState] = _default_advance,
    name: str | None = None,
) -> type[ManagerContractMachine]:
    """A `ManagerContractMachine` with the given cap, full policy, records and manager.

    Args:
        max_sessions: The cap: an int forces it, a strategy draws one per run (default 1..4).
        on_full: ``"evict"`` or ``"refuse"``, passed to the manager.
        states: Records to store (default `session_states()`); a model passes a strategy
            for its own session class.
        session_ids: Session ids to use; keep a few more than the cap.
        manager_factory: Builds the manager: ``manager_factory(max_sessions, on_full=...)``
            (a `SessionStateManager` subclass or a wrapper with the same interface).
        advance: One model step, ``advance(state, step) -> state``, applied to a stored
            record before it is put back (default: set attr ``machine_step`` on undeclared
            sessions, and re-commit each buffer's newest chunk).
        name: The class name (shows in test reports).

    Raises:
        ValueError: for a non-positive int cap or an unknown ``on_full``.

    >>> Machine = manager_contract_machine(max_sessions=2, on_full="refuse")
    >>> Machine.on_full
    'refuse'
    >>> TestRefusingManager = Machine.TestCase  # assign in a test module to run it
    """
    if not isinstance(max_sessions, st.SearchStrategy):
        check_positive("max_sessions", max_sessions)
    check_choice(on_full, "on_full", ON_FULL_CHOICES)

    class Configured(ManagerContractMachine):
        pass

    # Set after the class statement: a class body cannot see the function's arguments
    # under the same names.
    Configured.max_sessions_strategy = as_strategy(max_sessions)
    Configured.on_full = on_full
    if states is not None:
        Configured.state_strategy = states
    Configured.session_id_strategy = session_ids
    Configured.manager_factory = manager_factory
    Configured.advance = advance
    Configured.__name__ = Configured.__qualname__ = name or ManagerContractMachine.__name__
    return Configured
