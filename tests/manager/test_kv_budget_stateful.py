"""One budget over KV and model state: sessions x steps x park/unpark x prefetch x faults.

Several sessions share one small `KVPool`; each step appends tokens to a session's `KVCache`
and commits to its parkable `TensorCache` and `LatentBuffer`, under a manager with a byte
budget (or none) and a pool that may hold fewer sessions than are served. A step runs as the
managed DreamZero path runs one (`models/dreamzero/_managed.py`): while the pool lacks the
blocks the step can need, the least recently used other sessions' KV is parked first
(`park_until`), then the session is read (unparking it), stepped inside `pool.transaction()`
and published with `put`. Faults raise midway through a step; explicit gets unpark; a
`park_until` rule parks KV outside a step; prefetch (when the manager has it) starts an
unpark in the background and a step of another session runs before the get.

The model is plain Python and torch: per session, its tokens (the window rule applied at block
granularity, as `KVPool.append` applies it), its feature tensor and its ring's chunks. After
every rule:

- every live session's KV reads (`KVHandle.read()`, through a resident copy for a parked
  session) are `torch.equal` to the model's tokens, and its other objects to the model's;
- the pool's free blocks are its total less the blocks the stored records' handles hold (and
  all of them once the sessions are dropped, at teardown);
- the manager's `stats()` byte keys equal `recount_nbytes_by_device` of the stored records,
  `engine_nbytes:cpu` the blocks held;
- resident bytes never exceed ``max_bytes``.

A fault (or a step the pool or the budget refuses) leaves the stored record the same object
and the pool's free blocks as they were before the step's transaction.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from typing import Any, ClassVar, Literal

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import event, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from sessionstate import (
    KVCache,
    KVPool,
    KVPoolExhaustedError,
    LatentBuffer,
    SessionAdmissionError,
    SessionState,
    SessionStateManager,
    TensorCache,
)
from sessionstate.testing import recount_nbytes_by_device

_IDS = ("a", "b", "c", "d")
_BT = 2  # tokens per block
_WIDTH = 2  # one token's KV: (2,) float32, so a block is 16 bytes
_WINDOW = 5  # tokens kept: at most ceil((5 + 1) / 2) = 3 blocks between steps
_MAX_NEW = 3  # tokens a step appends: at most 2 fresh blocks
_WINDOW_BLOCKS = 3
_STEP_NEED = _WINDOW_BLOCKS + 2  # what `_kv_need` asks for a session holding nothing resident


def _settle() -> None:
    """Wait for the background restores started so far (one worker runs them in order)."""
    from sessionstate._storage._park import _executor

    _executor().submit(lambda: None).result()


class _FaultError(RuntimeError):
    """The step failed midway (a network, a transform, a commit)."""


def _windowed(tokens: torch.Tensor) -> torch.Tensor:
    # `KVPool.append(window=...)`: whole leading blocks older than the window are left out.
    while tokens.shape[0] - _BT >= _WINDOW:
        tokens = tokens[_BT:]
    return tokens


def _new_session() -> SessionState:
    return SessionState(
        objects={
            "kv": KVCache(name="kv").allocate(),
            "feat": TensorCache(name="feat").allocate(),
            "ring": LatentBuffer(name="ring", dim=0).allocate(maxlen=2),
        },
        attrs={"step": 0, "pos": torch.zeros(2)},
    )


class KVBudgetMachine(RuleBasedStateMachine):
    tier: ClassVar[str] = "host"
    via_step: ClassVar[bool] = False  # steps through `manager.step` with `pools=`

    def __init__(self) -> None:
        super().__init__()
        # Per session: the tokens its KV reads, its feature, its ring's chunks, its step.
        self.model: dict[str, dict[str, Any]] = {}
        self.counter = 0
        self.evictions = 0
        self.spool: str | None = None

    @initialize(data=st.data())
    def create(self, data: st.DataObject) -> None:
        declared = {"step_tokens": _MAX_NEW, "window_tokens": _WINDOW} if self.via_step else {}
        self.pool = KVPool(
            data.draw(st.sampled_from([3, 5, 6, 8, 10, 14]), label="pool blocks"),
            block_tokens=_BT,
            token_shape=(_WIDTH,),
            name="kv",
            **declared,  # type: ignore[arg-type]
        )
        self.start_free = self.pool.free_blocks
        # A session holds at most 3 blocks (48 bytes), a 16-byte feature and two 8-byte chunks.
        budget = data.draw(st.one_of(st.none(), st.integers(0, 320)), label="budget")
        self.budget = budget
        self.on_full: Literal["evict", "refuse"] = data.draw(
            st.sampled_from(["evict", "refuse"]), label="on_full"
        )
        if self.tier == "disk":
            self.spool = tempfile.mkdtemp(prefix="kv-budget-")
        self.manager: SessionStateManager[SessionState] = SessionStateManager(
            data.draw(st.sampled_from([2, 3, 8]), label="max_sessions"),
            on_full=self.on_full,
            max_bytes=None if budget is None else {"cpu": budget},
            park_tier=self.tier,  # type: ignore[arg-type]
            spool_dir=self.spool,
            **({"pools": (self.pool,)} if self.via_step else {}),  # type: ignore[arg-type]
        )

    # -- helpers ----------------------------------------------------------------------------

    def _values(self, n: int) -> torch.Tensor:
        self.counter += 1
        return torch.arange(n, dtype=torch.float32) + 1000.0 * self.counter

    def _parked(self, sid: str) -> bool:
        state = self.manager.peek(sid)
        return state is not None and bool(state.parked)

    def _sync(self, *, dropped: str | None = None) -> None:
        """Fold this rule's evictions (by the cap or the budget) into the model."""
        held = set(self.manager.session_ids())
        assert held <= set(self.model)
        vanished = set(self.model) - held - ({dropped} if dropped else set())
        for sid in vanished:
            del self.model[sid]
        if vanished:
            event("evicted a session")
        self.evictions += len(vanished)
        assert self.manager.stats()["evictions"] == self.evictions

    def _check_reads(self, sid: str, state: SessionState) -> None:
        want = self.model[sid]
        assert state.parked == ()
        cache = state.object("kv", KVCache)
        handle = cache.view()
        assert handle is not None
        assert handle.alive
        assert handle.pool is self.pool
        assert torch.equal(handle.read(), want["kv"])
        feat = state.object("feat", TensorCache).view()
        assert torch.equal(feat[0], want["feat"])
        ring = state.object("ring", LatentBuffer)
        assert len(ring) == len(want["ring"])
        for got, chunk in zip(ring.view(), want["ring"], strict=True):
            assert torch.equal(got, chunk)
        assert state.attrs["step"] == want["step"]
        assert torch.equal(state.attrs["pos"], want["pos"])

    def _kv_left_to_park(self, keep: set[str]) -> list[str]:
        """The sessions but ``keep`` whose KV holds blocks of the pool, resident."""
        out = []
        for sid in self.manager.session_ids():
            record = self.manager.peek(sid)
            assert record is not None
            cache = record.objects["kv"]
            handle = cache.handle if isinstance(cache, KVCache) else None
            if sid not in keep and handle is not None and handle.blocks:
                out.append(str(sid))
        return out

    def _objects_left_to_park(self, keep: set[str]) -> list[str]:
        """The sessions but ``keep`` with a resident parkable object holding CPU bytes."""
        out = []
        for sid in self.manager.session_ids():
            record = self.manager.peek(sid)
            assert record is not None
            if sid in keep:
                continue
            for name, obj in record.objects.items():
                if name not in record.parked and recount_nbytes_by_device(obj).get("cpu", 0):
                    out.append(str(sid))
                    break
        return out

    def _kv_need(self, sid: str) -> int:
        # As the DreamZero path asks: a window (unparking it) and a step's fresh blocks, less
        # what the session holds resident in the pool.
        need = _STEP_NEED
        state = self.manager.peek(sid)
        cache = None if state is None else state.objects.get("kv")
        handle = cache.handle if isinstance(cache, KVCache) else None
        if handle is not None and handle.pool is self.pool:
            need -= len(handle.blocks)
        return max(need, 0)

    def _make_kv_room(self, sid: str) -> None:
        # As DreamZero's `_make_kv_room`: free blocks to spare for any step cost one lookup.
        pool = self.pool
        if pool.free_blocks >= _STEP_NEED:
            return
        need = self._kv_need(sid)
        parked = self._parked(sid)
        done = self.manager.park_until(
            lambda: pool.free_blocks >= need, frees=pool.owns_entry, keep=(sid,)
        )
        assert done == (pool.free_blocks >= need)
        assert self._parked(sid) == parked  # the session stepping is never parked for it
        if not done:  # only once no other session's KV is left to park
            assert self._kv_left_to_park({sid}) == []
        event(f"park_until before a step: {'room' if done else 'nothing left to park'}")

    def _read(self, sid: str) -> SessionState | None:
        """``get`` of a held session, refusals checked; None if it stays parked."""
        was_parked = self._parked(sid)
        stored = self.manager.peek(sid)
        try:
            state = self.manager.get(sid)
        except KVPoolExhaustedError as exc:
            # The pool cannot take its KV back: it stays parked, the same record.
            assert was_parked
            assert "bytes" in str(exc)  # noqa: PT017 - a rule's outcome, not a test's
            assert self.manager.peek(sid) is stored
            event("unpark: the pool lacks the blocks")
            self._sync()
            return None
        except SessionAdmissionError:
            assert was_parked
            assert self.on_full == "refuse"
            assert self.manager.peek(sid) is stored
            assert self._objects_left_to_park({sid}) == []  # parked every other one first
            event("unpark: refused by the budget")
            self._sync()
            return None
        assert state is not None
        if was_parked:
            event("unparked a session")
        del stored
        self._sync()
        self._check_reads(sid, state)
        return state

    def _step_through_the_manager(self, sid: str, n: int, fault: str | None) -> None:
        # The manager makes the room (bytes and the pool's blocks), reads, runs the step in
        # the pool's transaction and publishes: a failure leaves the stored record's content
        # (the invariants read it against the model) and the pool's blocks as they were.
        kv = self._values(n * _WIDTH).reshape(n, _WIDTH)
        feat = self._values(4)
        chunk = self._values(2)

        def fn(state: SessionState) -> tuple[SessionState, None]:
            new = state.update_object("kv", lambda c: c.append(self.pool, kv, window=_WINDOW))
            if fault == "after the KV append":
                raise _FaultError(fault)
            new = new.update_object("feat", lambda c: c.commit((feat,)))
            new = new.update_object("ring", lambda r: r.commit(chunk))
            new = new.with_attrs(step=state.attrs["step"] + 1, pos=chunk + 0.5)
            if fault == "after every commit":
                raise _FaultError(fault)
            return new, None

        try:
            self.manager.step(sid, fn, new=_new_session)
        except _FaultError:
            event("step through the manager failed: a fault")
            self._sync()
            return
        except KVPoolExhaustedError as exc:
            # Only once the room-making left no other session's KV resident; the error names
            # the session.
            assert f"Session {sid!r}: a step can need" in str(exc)  # noqa: PT017 - a rule
            assert self._kv_left_to_park({sid}) == []
            event("step through the manager failed: the pool")
            self._sync()
            return
        except SessionAdmissionError:
            event("step through the manager refused")
            self._sync()
            return
        self._stepped(sid, kv, feat, chunk)

    def _stepped(self, sid: str, kv: torch.Tensor, feat: torch.Tensor, chunk: torch.Tensor) -> None:
        before = self.model.get(sid)
        tokens = kv if before is None else torch.cat([before["kv"], kv])
        ring = [] if before is None else before["ring"]
        self.model[sid] = {
            "kv": _windowed(tokens),
            "feat": feat,
            "ring": [*ring, chunk][-2:],
            "step": 1 if before is None else before["step"] + 1,
            "pos": chunk + 0.5,
        }
        event("stepped a session")
        self._sync()

    def _step(self, sid: str, n: int, fault: str | None) -> None:
        if self.via_step:
            self._step_through_the_manager(sid, n, fault)
            return
        self._make_kv_room(sid)
        held = sid in self.model
        state = self._read(sid) if held else None
        if held and state is None:
            return  # stays parked: the step did not start
        if state is None:
            state = _new_session()
        stored = self.manager.peek(sid)
        kv = self._values(n * _WIDTH).reshape(n, _WIDTH)
        feat = self._values(4)
        chunk = self._values(2)
        free = self.pool.free_blocks
        at_cap = sid not in self.model and len(self.model) >= self.manager.max_sessions
        try:
            with self.pool.transaction():
                new = state.update_object("kv", lambda c: c.append(self.pool, kv, window=_WINDOW))
                if fault == "after the KV append":
                    raise _FaultError(fault)
                new = new.update_object("feat", lambda c: c.commit((feat,)))
                new = new.update_object("ring", lambda r: r.commit(chunk))
                # An attribute: it stays resident while the session is parked, so a budget
                # full of parked sessions' attributes evicts.
                new = new.with_attrs(step=state.attrs["step"] + 1, pos=chunk + 0.5)
                alone = recount_nbytes_by_device(new).get("cpu", 0)
                if fault == "after every commit":
                    raise _FaultError(fault)
                self.manager.put(sid, new)
        except (_FaultError, KVPoolExhaustedError) as exc:
            # Rolled back: the stored record (or its absence) and the pool are as they were.
            event(f"step failed: {type(exc).__name__}")
            assert self.manager.peek(sid) is stored
            assert self.pool.free_blocks == free
            if isinstance(exc, KVPoolExhaustedError):
                # Before the step, parking left no other session's KV resident.
                assert self._kv_left_to_park({sid}) == []
            self._sync()
            return
        except SessionAdmissionError:
            # The cap or the budget refused the new record: the stored one stays. Others may
            # have been parked (or evicted) trying: the pool may have gained blocks, not lost.
            assert self.manager.peek(sid) is stored
            assert self.pool.free_blocks >= free
            # A record over the whole budget alone is refused before the cap is consulted.
            over_alone = self.budget is not None and alone > self.budget
            if at_cap and not over_alone:
                assert self.on_full == "refuse"
                event("step refused by the session cap")
                self._sync()
                return
            event("step refused by the budget")
            assert self.budget is not None
            if alone <= self.budget:  # not the record alone: every other session parked first
                assert self.on_full == "refuse"
                assert self._objects_left_to_park({sid}) == []
            self._sync()
            return
        del new, state, stored
        self._stepped(sid, kv, feat, chunk)

    # -- rules ------------------------------------------------------------------------------

    @rule(
        sid=st.sampled_from(_IDS),
        n=st.integers(1, _MAX_NEW),
        fault=st.sampled_from([None, None, None, "after the KV append", "after every commit"]),
    )
    def step(self, sid: str, n: int, fault: str | None) -> None:
        self._step(sid, n, fault)

    @rule(sid=st.sampled_from(_IDS))
    def get(self, sid: str) -> None:
        if sid not in self.model:
            assert self.manager.get(sid) is None
            return
        state = self._read(sid)
        del state

    @rule(
        want_free=st.integers(0, 14),
        keep=st.sets(st.sampled_from(_IDS), max_size=2),
        by_device=st.booleans(),
    )
    def park(self, want_free: int, keep: set[str], by_device: bool) -> None:
        pool = self.pool
        before = {sid: self._parked(sid) for sid in self.model}
        # Parking KV outside a step: for the pool's blocks, or (by device) every parkable
        # object on the CPU, as the budget parks.
        frees = (lambda entry: entry[0] == "cpu") if by_device else pool.owns_entry
        done = self.manager.park_until(
            lambda: pool.free_blocks >= want_free, frees=frees, keep=keep
        )
        assert done == (pool.free_blocks >= want_free)
        for sid in keep & set(self.model):
            assert self._parked(sid) == before[sid]
        if not done:  # only once nothing it may park is left
            left = self._objects_left_to_park(keep) if by_device else self._kv_left_to_park(keep)
            assert left == []
        if any(self._parked(s) and not before[s] for s in self.model):
            event("park_until parked a session")
        self._sync()

    @rule(sid=st.sampled_from(_IDS))
    def drop(self, sid: str) -> None:
        assert self.manager.drop(sid) == (sid in self.model)
        self.model.pop(sid, None)
        self._sync(dropped=sid)

    @rule(
        sid=st.sampled_from(_IDS),
        make_room=st.booleans(),
        other=st.sampled_from(_IDS),
        step_other=st.booleans(),
        n=st.integers(1, _MAX_NEW),
    )
    def prefetch_then_get(
        self, sid: str, make_room: bool, other: str, step_other: bool, n: int
    ) -> None:
        # A scheduler that knows the next session starts its unpark, steps the current one,
        # then reads the next: wrong or late prefetches cost bytes, never correctness.
        held, parked = sid in self.model, self._parked(sid)
        started = self.manager.prefetch(sid, make_room=make_room)
        assert isinstance(started, bool)
        if not (held and parked):
            assert not started
        event(f"prefetch: {'started' if started else 'not started'}")
        # The background restore done before the next step (the copy fully hidden): the
        # blocks it took are off the free list now, deterministically.
        _settle()
        self._sync()
        self._within_budget_with_prefetches()
        if step_other and other != sid:
            self._step(other, n, None)
            self._within_budget_with_prefetches()
        if sid in self.model:
            state = self._read(sid)
            del state
        else:
            assert self.manager.get(sid) is None
        _settle()  # a dropped prefetch's tree is gone (its blocks back) once its restore ends
        assert not self.manager._table.parking.reserved()  # nothing is prefetched past the get

    def _within_budget_with_prefetches(self) -> None:
        # A prefetch's restored bytes are resident before the get: charged to the budget.
        if self.budget is None:
            return
        reserved = self.manager._table.parking.reserved().get("cpu", 0)
        assert self.manager.stats().get("nbytes:cpu", 0) + reserved <= self.budget

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def pool_ledger_budget_and_reads(self) -> None:
        manager, pool = self.manager, self.pool
        records = [manager.peek(sid) for sid in manager.session_ids()]
        assert set(manager.session_ids()) == set(self.model)
        # The pool: free blocks are the total less what the stored handles hold.
        blocks: set[int] = set()
        for record in records:
            assert record is not None
            cache = record.objects["kv"]
            if isinstance(cache, KVCache) and cache.handle is not None:
                assert cache.handle.alive
                blocks.update(cache.handle.blocks)
        assert pool.free_blocks == pool.num_blocks - len(blocks)
        # The ledger: stats equal an independent recount of the stored records.
        stats = manager.stats()
        recount = recount_nbytes_by_device(records)
        assert {k: v for k, v in stats.items() if k.startswith("nbytes:")} == {
            f"nbytes:{d}": n for d, n in recount.items()
        }
        assert stats["total_nbytes"] == sum(recount.values())
        assert stats.get("engine_nbytes:cpu", 0) == len(blocks) * pool.block_nbytes
        if self.budget is not None:
            assert stats.get("nbytes:cpu", 0) <= self.budget
        if "parks" in stats:
            assert stats["parked_sessions"] == sum(bool(r.parked) for r in records if r)
            assert stats["kv_parks"] <= stats["parks"]
            assert stats["kv_unparks"] <= stats["kv_parks"]
            assert stats["unparks"] <= stats["parks"]
        del records
        self._check_every_read()
        assert pool.free_blocks == pool.num_blocks - len(blocks)

    def _check_every_read(self) -> None:
        # Every resident session's reads now; a parked one's through a resident copy, when
        # the pool has room for it (the copy's blocks go back as it is dropped, on return).
        for sid in self.manager.session_ids():
            record = self.manager.peek(sid)
            assert record is not None
            if not record.parked:
                self._check_reads(str(sid), record)
                continue
            try:
                copy = record.unpark()
            except KVPoolExhaustedError:
                event("invariant: a parked session's KV does not fit the pool now")
                continue
            self._check_reads(str(sid), copy)

    def teardown(self) -> None:
        manager = getattr(self, "manager", None)
        # After a failed rule its traceback still holds records: their blocks are not back.
        failing = sys.exc_info()[1] is not None
        if manager is not None:
            for sid in list(manager.session_ids()):
                manager.drop(sid)
            _settle()
            # Every block is back once no session is held.
            if not failing:
                assert self.pool.free_blocks == self.start_free == self.pool.num_blocks
        if self.spool is not None:
            shutil.rmtree(self.spool, ignore_errors=True)


class DiskKVBudgetMachine(KVBudgetMachine):
    tier = "disk"


class StepKVBudgetMachine(KVBudgetMachine):
    """The same rules and invariants, each step through `SessionStateManager.step` of a plain
    manager given the pool (``pools=``): the manager makes the room, not the test."""

    via_step = True


TestKVBudgetHost = KVBudgetMachine.TestCase
TestKVBudgetDisk = DiskKVBudgetMachine.TestCase
TestKVBudgetDisk.settings = settings(max_examples=10, stateful_step_count=20, deadline=None)
TestKVBudgetThroughStep = StepKVBudgetMachine.TestCase


@pytest.mark.parametrize(
    "refusal", ["a record over the whole budget", "the cap", "the budget after parking"]
)
def test_every_refusal_leaves_no_reference_cycle_holding_the_callers_blocks(refusal: str) -> None:
    # A refused put's error is not kept in a manager frame: a frame/traceback cycle would
    # hold the caller's record (its KV blocks) until the cyclic collector runs, which is
    # off here. The refusals that report an event first (the cap with `on_full="refuse"`,
    # a budget parking cannot meet) as well as the put's own.
    import gc
    import weakref

    pool = KVPool(8, block_tokens=2, token_shape=())
    if refusal == "a record over the whole budget":
        manager = SessionStateManager(max_bytes={"cpu": 8})
    elif refusal == "the cap":
        manager = SessionStateManager(1, on_full="refuse")
        manager.put("held", SessionState())
    else:
        manager = SessionStateManager(on_full="refuse", max_bytes={"cpu": 24})
        manager.put("held", SessionState(attrs={"x": torch.zeros(4)}))  # 16 bytes, unparkable

    def step() -> weakref.ref[BaseException]:
        kv = KVCache().allocate().append(pool, torch.ones(4))  # 16 bytes
        try:
            manager.put("new", SessionState(objects={"kv": kv}))
        except SessionAdmissionError as exc:
            return weakref.ref(exc)
        raise AssertionError("the record was admitted")

    enabled = gc.isenabled()
    gc.disable()
    try:
        ref = step()
        freed = ref() is None and pool.free_blocks == pool.num_blocks
    finally:
        if enabled:
            gc.enable()
    assert freed
