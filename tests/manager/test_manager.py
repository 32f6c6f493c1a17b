"""Examples for `sessionstate._manager`: the session table, LRU cap, stats and threads."""

from __future__ import annotations

import contextlib
import random
import re
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

import sessionstate as ss
from sessionstate import (
    LatentBuffer,
    SessionAdmissionError,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
)
from sessionstate.testing import recount_nbytes_by_device


def _state(nbytes: int = 16, **attrs: object) -> SessionState:
    return SessionState(attrs={"x": torch.zeros(nbytes // 4), **attrs})


# --- basic table ----------------------------------------------------------------------------


def test_defaults() -> None:
    manager = SessionStateManager()
    assert manager.max_sessions == ss.DEFAULT_MAX_SESSIONS == 64
    assert manager.on_full == "evict"
    assert len(manager) == 0
    assert manager.session_ids() == []


def test_put_then_get_returns_the_same_record() -> None:
    manager = SessionStateManager(4)
    state = _state()
    manager.put("a", state)
    assert manager.get("a") is state
    assert manager.require("a") is state
    assert "a" in manager
    assert len(manager) == 1


def test_put_replaces_the_record() -> None:
    manager = SessionStateManager(4)
    first, second = _state(), _state()
    manager.put("a", first)
    manager.put("a", second)
    assert manager.get("a") is second
    assert len(manager) == 1
    assert manager.stats()["evictions"] == 0


def test_get_of_an_unknown_session_is_none() -> None:
    manager = SessionStateManager(4)
    assert manager.get("nobody") is None
    assert "nobody" not in manager
    assert len(manager) == 0


def test_get_or_create_creates_once() -> None:
    manager = SessionStateManager(4)
    calls: list[int] = []

    def factory() -> SessionState:
        calls.append(1)
        return _state()

    first = manager.get_or_create("a", factory)
    again = manager.get_or_create("a", factory)
    assert first is again
    assert manager.get("a") is first
    assert len(calls) == 1


def test_get_or_create_accepts_a_subclass_factory() -> None:
    class Mine(SessionState):
        step = ss.SessionAttr(0)

    manager = SessionStateManager(4)
    assert type(manager.get_or_create("a", Mine)) is Mine


def test_drop() -> None:
    manager = SessionStateManager(4)
    manager.put("a", _state())
    assert manager.drop("a") is True
    assert manager.drop("a") is False
    assert manager.drop("never") is False
    assert "a" not in manager
    assert manager.get("a") is None
    assert manager.stats()["evictions"] == 0


def test_clear_keeps_statistics() -> None:
    manager = SessionStateManager(4)
    manager.put("a", _state())
    manager.get("a")
    manager.clear()
    stats = manager.stats()
    assert (stats["sessions"], stats["hits"], stats["total_nbytes"]) == (0, 1, 0)


def test_require_never_creates() -> None:
    manager = SessionStateManager(4)
    with pytest.raises(SessionStateLostError, match=re.escape("'ghost'")) as info:
        manager.require("ghost")
    assert isinstance(info.value, KeyError)
    assert "ghost" not in manager
    assert len(manager) == 0


def test_require_after_eviction_and_drop() -> None:
    manager = SessionStateManager(1)
    manager.put("a", _state())
    manager.put("b", _state())
    with pytest.raises(SessionStateLostError):
        manager.require("a")
    manager.drop("b")
    with pytest.raises(SessionStateLostError):
        manager.require("b")


def test_put_rejects_a_non_session() -> None:
    manager = SessionStateManager(4)
    with pytest.raises(TypeError, match="stores SessionState records"):
        manager.put("a", {"x": 1})  # type: ignore[arg-type]
    assert "a" not in manager


def test_get_or_create_rejects_a_factory_returning_a_non_session() -> None:
    manager = SessionStateManager(4)
    with pytest.raises(TypeError, match="got dict"):
        manager.get_or_create("a", dict)  # type: ignore[arg-type]
    assert "a" not in manager


def test_a_failed_create_evicts_nothing() -> None:
    manager = SessionStateManager(1)
    manager.put("a", _state())

    def broken() -> SessionState:
        raise RuntimeError("model failed to build its state")

    with pytest.raises(RuntimeError):
        manager.get_or_create("b", broken)
    assert "a" in manager
    assert manager.stats()["evictions"] == 0


@pytest.mark.parametrize(
    ("session_id", "error"),
    [([1], TypeError), ({"a": 1}, TypeError), ({"a"}, TypeError), (bytearray(b"a"), TypeError)],
    ids=repr,
)
def test_invalid_session_ids(session_id: object, error: type[Exception]) -> None:
    manager = SessionStateManager(4)
    calls = [
        lambda: manager.get(session_id),  # type: ignore[arg-type]
        lambda: manager.require(session_id),  # type: ignore[arg-type]
        lambda: manager.put(session_id, _state()),  # type: ignore[arg-type]
        lambda: manager.get_or_create(session_id, SessionState),  # type: ignore[arg-type]
        lambda: manager.drop(session_id),  # type: ignore[arg-type]
    ]
    for call in calls:
        with pytest.raises(error, match="`session_id` must be hashable"):
            call()
    assert len(manager) == 0
    assert manager.stats()["misses"] == 0


def test_contains_with_a_non_string_is_false() -> None:
    manager = SessionStateManager(4)
    manager.put("1", _state())
    assert 1 not in manager
    assert None not in manager


@pytest.mark.parametrize("cap", [0, -1, True, False, 2.0, "4", None], ids=repr)
def test_bad_caps(cap: object) -> None:
    with pytest.raises(ValueError, match="`max_sessions` must be a positive int"):
        SessionStateManager(cap)  # type: ignore[arg-type]


def test_bad_on_full() -> None:
    with pytest.raises(ValueError, match="`on_full` must be 'evict' or 'refuse'"):
        SessionStateManager(4, on_full="drop")  # type: ignore[arg-type]


def test_repr() -> None:
    manager = SessionStateManager(3, on_full="refuse")
    manager.put("a", _state())
    assert repr(manager) == "SessionStateManager(sessions=1, max_sessions=3, on_full='refuse')"


# --- LRU order ------------------------------------------------------------------------------


def _filled(*ids: str, cap: int = 3) -> SessionStateManager:
    manager = SessionStateManager(cap)
    for sid in ids:
        manager.put(sid, _state())
    return manager


def test_session_ids_are_least_recently_used_first() -> None:
    assert _filled("a", "b", "c").session_ids() == ["a", "b", "c"]


def test_get_touches() -> None:
    manager = _filled("a", "b", "c")
    manager.get("a")
    assert manager.session_ids() == ["b", "c", "a"]
    manager.put("d", _state())
    assert manager.session_ids() == ["c", "a", "d"]


def test_get_or_create_touches() -> None:
    manager = _filled("a", "b", "c")
    manager.get_or_create("a", SessionState)
    assert manager.session_ids() == ["b", "c", "a"]


def test_put_touches() -> None:
    manager = _filled("a", "b", "c")
    manager.put("a", _state())
    assert manager.session_ids() == ["b", "c", "a"]


def test_require_touches() -> None:
    manager = _filled("a", "b", "c")
    manager.require("b")
    assert manager.session_ids() == ["a", "c", "b"]


def test_contains_and_len_do_not_touch() -> None:
    manager = _filled("a", "b", "c")
    assert "a" in manager
    assert len(manager) == 3
    manager.session_ids()
    manager.stats()
    manager.nbytes_by_session()
    manager.put("d", _state())
    assert manager.session_ids() == ["b", "c", "d"]


def test_a_miss_does_not_touch() -> None:
    manager = _filled("a", "b", "c")
    manager.get("zzz")
    assert manager.session_ids() == ["a", "b", "c"]


def test_a_session_touched_every_step_survives() -> None:
    manager = SessionStateManager(3)
    manager.put("s0", _state())
    for i in range(1, 10):
        manager.put(f"s{i}", _state())
        manager.get("s0")
    assert manager.session_ids() == ["s8", "s9", "s0"]
    assert manager.stats()["evictions"] == 10 - 3


# --- eviction -------------------------------------------------------------------------------


def test_eviction_drops_the_table_entry_only() -> None:
    manager = SessionStateManager(1)
    ring = LatentBuffer(name="r", dim=0).allocate(maxlen=2).commit(torch.ones(1, 4))
    held = SessionState(objects={"r": ring}, attrs={"step": 1})
    snapshot = ss.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, held)
    manager.put("a", held)
    manager.put("b", _state())
    assert "a" not in manager
    assert manager.stats()["evictions"] == 1
    assert ss.tree_equal(held, snapshot)
    # The caller keeps working on its record, and may bring it back.
    advanced = held.update_object("r", lambda b: b.commit(torch.zeros(1, 4)))
    assert len(advanced.object("r")) == 2
    manager.put("a", advanced)
    assert manager.get("a") is advanced
    assert "b" not in manager


def test_get_or_create_evicts_at_the_cap() -> None:
    manager = _filled("a", "b", cap=2)
    manager.get_or_create("c", SessionState)
    assert manager.session_ids() == ["b", "c"]
    assert manager.stats()["evictions"] == 1


def test_refuse_keeps_residents() -> None:
    manager = SessionStateManager(2, on_full="refuse")
    a, b = _state(), _state()
    manager.put("a", a)
    manager.put("b", b)
    with pytest.raises(SessionAdmissionError, match="on_full='refuse'") as info:
        manager.put("c", _state())
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(SessionAdmissionError):
        manager.get_or_create("c", SessionState)
    assert manager.session_ids() == ["a", "b"]
    assert manager.get("a") is a
    assert manager.get("b") is b
    assert "c" not in manager
    assert manager.stats()["evictions"] == 0
    # Residents may still be replaced; a drop makes room.
    manager.put("a", _state())
    manager.drop("b")
    manager.put("c", _state())
    assert sorted(manager.session_ids()) == ["a", "c"]


# --- stats ----------------------------------------------------------------------------------


def test_stats_keys_and_counters() -> None:
    manager = SessionStateManager(2)
    assert manager.stats() == {
        "sessions": 0,
        "max_sessions": 2,
        "hits": 0,
        "misses": 0,
        "evictions": 0,
        "total_nbytes": 0,
        "forks": 0,
        "shared_sessions": 0,
    }
    manager.get("a")  # miss
    manager.get_or_create("a", lambda: _state(16))  # miss, create
    manager.get_or_create("a", SessionState)  # hit
    manager.get("a")  # hit
    manager.require("a")  # hit
    manager.put("b", _state(8))  # neither
    manager.put("c", _state(4))  # evicts a
    with pytest.raises(SessionStateLostError):
        manager.require("a")  # miss
    assert manager.stats() == {
        "sessions": 2,
        "max_sessions": 2,
        "hits": 3,
        "misses": 3,
        "evictions": 1,
        "total_nbytes": 12,
        "nbytes:cpu": 12,
        "forks": 0,
        "shared_sessions": 0,
    }


def test_stats_dedups_a_storage_shared_across_sessions() -> None:
    shared = torch.zeros(64)  # 256 bytes
    manager = SessionStateManager(8)
    manager.put("a", SessionState(attrs={"x": shared}))
    manager.put("b", SessionState(attrs={"y": shared[10:]}))
    ring = LatentBuffer(dim=0).allocate().commit(shared.view(8, 8))
    manager.put("c", SessionState(objects={"r": ring}, attrs={"own": torch.zeros(2)}))
    stats = manager.stats()
    assert stats["nbytes:cpu"] == 256 + 8
    assert stats["total_nbytes"] == 264
    # Per session, each counts the storage it keeps alive.
    assert manager.nbytes_by_session() == {
        "a": {"cpu": 256},
        "b": {"cpu": 256},
        "c": {"cpu": 264},
    }


def test_stats_has_a_key_per_device() -> None:
    manager = SessionStateManager(4)
    manager.put("a", SessionState(attrs={"m": torch.empty(10, device="meta")}))
    manager.put("b", SessionState(attrs={"c": torch.zeros(3, dtype=torch.float64)}))
    stats = manager.stats()
    assert stats["nbytes:meta"] == 40
    assert stats["nbytes:cpu"] == 24
    assert stats["total_nbytes"] == 64
    assert [k for k in stats if k.startswith("nbytes:")] == ["nbytes:cpu", "nbytes:meta"]


def test_the_same_record_under_two_ids_counts_once() -> None:
    manager = SessionStateManager(4)
    state = _state(40)
    manager.put("a", state)
    manager.put("b", state)
    assert manager.stats()["nbytes:cpu"] == 40


# --- threads --------------------------------------------------------------------------------


@pytest.fixture
def _fast_switching() -> Iterator[None]:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


@pytest.mark.usefixtures("_fast_switching")
def test_threaded_stress() -> None:
    cap, n_threads, n_ops = 16, 8, 1500
    ids = [f"s{i}" for i in range(50)]
    manager = SessionStateManager(cap)
    shared = torch.zeros(32)
    made: list[SessionState] = []  # keeps every record alive so identities stay unique
    made_ids: set[int] = set()
    made_lock = threading.Lock()
    errors: list[BaseException] = []
    too_many: list[int] = []
    lookups = [0] * n_threads
    barrier = threading.Barrier(n_threads)

    def make(rng: random.Random) -> SessionState:
        leaf = shared[rng.randrange(32) :] if rng.random() < 0.5 else torch.zeros(rng.randrange(8))
        state = SessionState(attrs={"x": leaf})
        with made_lock:
            made.append(state)
            made_ids.add(id(state))
        return state

    def worker(index: int) -> None:
        rng = random.Random(index)
        try:
            barrier.wait()
            for _ in range(n_ops):
                sid = rng.choice(ids)
                op = rng.random()
                if op < 0.35:
                    manager.get_or_create(sid, lambda rng=rng: make(rng))
                    lookups[index] += 1
                elif op < 0.65:
                    manager.put(sid, make(rng))
                elif op < 0.75:
                    manager.drop(sid)
                elif op < 0.85:
                    manager.get(sid)
                    lookups[index] += 1
                elif op < 0.9:
                    with contextlib.suppress(SessionStateLostError):
                        manager.require(sid)
                    lookups[index] += 1
                else:
                    stats = manager.stats()
                    if stats["sessions"] > cap:
                        too_many.append(stats["sessions"])
                observed = len(manager)
                if observed > cap:
                    too_many.append(observed)
                if len(manager.session_ids()) > cap:
                    too_many.append(-1)
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert too_many == []

    held = {sid: manager.get(sid) for sid in manager.session_ids()}
    assert 0 < len(held) <= cap
    assert all(state is not None and id(state) in made_ids for state in held.values())

    stats = manager.stats()
    assert stats["sessions"] == len(held)
    assert stats["hits"] + stats["misses"] == sum(lookups) + len(held)
    recount = recount_nbytes_by_device(list(held.values()))
    assert stats["total_nbytes"] == sum(recount.values())
    assert {k: v for k, v in stats.items() if k.startswith("nbytes:")} == {
        f"nbytes:{device}": n for device, n in recount.items()
    }


def test_a_factory_that_stores_its_own_session_evicts_once() -> None:
    manager = SessionStateManager(max_sessions=1)
    manager.put("a", SessionState())
    stored = SessionState(attrs={"by": "factory"})

    def factory() -> SessionState:
        manager.put("b", stored)  # re-entrant: evicts "a" to make room
        return SessionState(attrs={"by": "return"})

    created = manager.get_or_create("b", factory)
    assert manager.session_ids() == ["b"]
    assert manager.stats()["evictions"] == 1
    assert manager.peek("b") is created
