"""`SessionStateManager.fork`: branches that share the source's record, counted once.

A branch holds the source's record itself; a step of a branch copies only what it writes; a
parked source forks parked, and its parked bytes live until the last session holding them
unparks or goes; the cap is checked for the whole fork before anything changes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from sessionstate import (
    KVCache,
    KVPool,
    LatentBuffer,
    RandomKey,
    SessionAdmissionError,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
    TensorCache,
    tree_equal,
)
from tests.support import assert_stats_equal_a_recount, parkable_record


def _history(n: int = 8) -> SessionState:
    buffer = LatentBuffer(name="h", dim=0).allocate().commit(torch.arange(float(n)))
    return SessionState(objects={"h": buffer}, attrs={"step": 0})


def _stepped(state: SessionState, value: float) -> SessionState:
    return state.update_object("h", lambda b: b.commit(torch.full((2,), value))).with_attrs(
        step=state.attrs["step"] + 1
    )


def test_a_fork_shares_the_record_and_a_branch_copies_only_what_it_writes() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager()
    m.put("a", _history())
    m.put("z", _history(2))
    m.fork("a", "b", "c")
    assert m.session_ids() == ["z", "a", "b", "c"]
    assert m.peek("b") is m.peek("a") is m.peek("c")
    assert m.stats()["total_nbytes"] == 8 * 4 + 2 * 4
    for i, sid in enumerate(("b", "c")):
        m.put(sid, _stepped(m.require(sid), float(i)))
    # Each branch added its own chunk (2 floats); the history is held once.
    assert m.stats()["total_nbytes"] == 8 * 4 + 2 * 4 + 2 * (2 * 4)
    assert_stats_equal_a_recount(m)
    b = m.session_stats("b")
    assert b["nbytes"] == {"cpu": 8 * 4 + 2 * 4}
    assert b["nbytes_shared"] == {"cpu": 8 * 4}
    assert b["shared_with"] == ["a", "c"]
    assert m.session_stats("z")["nbytes_shared"] == {}
    assert m.session_stats("z")["shared_with"] == []
    # A branch is what a deep copy stepped the same way would be.
    assert tree_equal(m.peek("b"), _stepped(_history(), 0.0))


def test_a_branch_of_a_kv_session_copies_only_the_partial_block() -> None:
    pool = KVPool(8, block_tokens=4, token_shape=(2,))
    m: SessionStateManager[SessionState] = SessionStateManager(pools=(pool,))
    handle = pool.append(pool.empty(), torch.arange(12.0).view(6, 2))
    m.put("a", SessionState(objects={"kv": KVCache(name="kv").allocate().commit(handle)}))
    del handle
    m.fork("a", "b")
    assert pool.free_blocks == 6  # shared: no block taken
    for sid, value in (("a", 100.0), ("b", 200.0)):
        state = m.require(sid)
        grown = pool.append(state.object("kv", KVCache).view(), torch.full((1, 2), value))
        m.put(sid, state.update_object("kv", lambda c, h=grown: c.commit(h)))
    # The full block stays shared; each branch wrote into its own copy of the partial one.
    assert pool.free_blocks == 5
    a, b = (m.peek(s).object("kv", KVCache).view().read() for s in ("a", "b"))
    assert torch.equal(a[:6], b[:6])
    assert a[6].tolist() == [100.0, 100.0]
    assert b[6].tolist() == [200.0, 200.0]
    assert_stats_equal_a_recount(m)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_parked_source_forks_parked_and_its_bytes_outlive_each_holder(
    tier: str, tmp_path: Path
) -> None:
    budget = {"cpu": 100}
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes=budget, park_tier=tier, spool_dir=str(tmp_path)
    )
    m.put("a", parkable_record(fill=1.0))
    expected = m.peek("a", on_host=True)
    m.put("x", parkable_record(fill=2.0))  # parks "a"
    assert m.session_stats("a")["parked"]
    m.fork("a", "b", "c")
    assert m.session_stats("b")["parked"] == m.session_stats("a")["parked"]
    assert m.stats()["parked_sessions"] == 3
    # Each holder unparks (and is parked again by the next) into its own copy; the bytes a
    # sibling still holds parked stay readable until the last one is back or gone.
    for sid in ("b", "a"):
        assert tree_equal(m.get(sid), expected)
    assert m.drop("b")
    assert tree_equal(m.get("c"), expected)
    assert tree_equal(m.get("a"), expected)
    assert_stats_equal_a_recount(m)


def test_dropping_the_parked_source_keeps_its_branches_bytes(tmp_path: Path) -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 100}, park_tier="disk", spool_dir=str(tmp_path)
    )
    m.put("a", parkable_record(fill=3.0))
    expected = m.peek("a", on_host=True)
    m.put("x", parkable_record(fill=4.0))
    m.fork("a", "b")
    m.drop("a")
    assert list(tmp_path.rglob("*")), "the spool file the branch holds is still there"
    assert tree_equal(m.get("b"), expected)


def test_a_fork_that_the_cap_cannot_hold_changes_nothing() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(max_sessions=3, on_full="refuse")
    m.put("a", _history())
    m.put("z", _history(2))
    with pytest.raises(SessionAdmissionError, match=r"fork session 'a' into 2 branches.*1 free"):
        m.fork("a", "b", "c")
    assert m.session_ids() == ["a", "z"]
    evicting: SessionStateManager[SessionState] = SessionStateManager(max_sessions=3)
    evicting.put("a", _history())
    with pytest.raises(SessionAdmissionError, match=r"leaves 2 beside the source"):
        evicting.fork("a", "b", "c", "d")
    evicting.put("z", _history(2))
    evicting.fork("a", "b", "c")  # evicts the least recently used other session
    assert evicting.session_ids() == ["a", "b", "c"]


def test_fork_refuses_bad_ids_and_changes_nothing() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager()
    m.put("a", _history())
    m.put("z", _history())
    with pytest.raises(SessionStateLostError, match=r"Cannot fork session 'nobody'"):
        m.fork("nobody", "b")
    with pytest.raises(ValueError, match=r"names no branch"):
        m.fork("a")
    with pytest.raises(ValueError, match=r"into 'z': that id is a held session"):
        m.fork("a", "z")
    with pytest.raises(ValueError, match=r"into 'a': that id is the source"):
        m.fork("a", "a")
    with pytest.raises(ValueError, match=r"into 'b': that id is named twice"):
        m.fork("a", "b", "b")
    msg = (
        "`fork` takes each branch id as its own argument, got the collection ['b', 'c']; "
        "unpack it: `fork('a', *ids)`."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        m.fork("a", ["b", "c"])  # type: ignore[arg-type]
    assert m.session_ids() == ["a", "z"]


def test_a_refused_branch_rolls_the_whole_fork_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # The second branch's put fails (its put made to fail: a fork adds no bytes, so no
    # budget refuses one).
    import sessionstate._manager._family as family_module

    m: SessionStateManager[SessionState] = SessionStateManager()
    m.put("a", SessionState(objects={"c": TensorCache(name="c").allocate()}))
    calls = []
    real = family_module.put_locked

    def failing(table: Any, session_id: object, state: SessionState, **kwargs: Any) -> None:
        calls.append(session_id)
        if session_id == "c":
            raise RuntimeError("no room")
        real(table, session_id, state, **kwargs)

    monkeypatch.setattr(family_module, "put_locked", failing)
    with pytest.raises(RuntimeError, match="no room"):
        m.fork("a", "b", "c")
    assert calls == ["b", "c"]
    assert m.session_ids() == ["a"]


def _family(m: SessionStateManager[SessionState], n: int) -> list[str]:
    m.put("src", _history(4096))
    branches = [f"b{i}" for i in range(n)]
    m.fork("src", *branches)
    for i, branch in enumerate(branches):
        m.put(branch, _stepped(m.require(branch), float(i)))
    return ["src", *branches]


def test_a_family_snapshot_writes_what_branches_share_once(tmp_path: Path) -> None:
    m: SessionStateManager[SessionState] = SessionStateManager()
    ids = _family(m, 8)
    family, one = tmp_path / "family.safetensors", tmp_path / "one.safetensors"
    m.snapshot_many(ids, family, metadata={"run": "7"})
    m.snapshot("src", one)
    # The history (16 KiB) once, plus each branch's own chunk and a header per record.
    size, single = family.stat().st_size, one.stat().st_size
    assert single < size < single + 8 * (single - 4096 * 4 + 2 * 4)
    assert size < 2 * single
    restored = SessionStateManager[SessionState]().restore_many(family)
    assert list(restored) == ids
    for sid in ids:
        assert tree_equal(restored[sid], m.peek(sid))
    bases = {
        restored[sid].object("h", LatentBuffer).view()[0].untyped_storage().data_ptr()
        for sid in ids
    }
    assert len(bases) == 1  # the history is one storage again


def test_a_parked_family_is_read_once_on_the_host_and_restores_shared(tmp_path: Path) -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 100}, park_tier="disk", spool_dir=str(tmp_path / "spool")
    )
    m.put("a", parkable_record(fill=5.0))
    m.put("x", parkable_record(fill=6.0))  # parks "a"
    m.fork("a", "b")  # parked, sharing its parked bytes
    expected = m.peek("a", on_host=True)
    path = tmp_path / "family.safetensors"
    m.snapshot_many(["a", "b"], path)
    assert m.session_stats("a")["parked"]
    assert m.session_stats("b")["parked"]
    out = SessionStateManager[SessionState]().restore_many(path, session_ids=["p", "q"])
    assert tree_equal(out["p"], expected)
    assert tree_equal(out["q"], expected)
    cache_p = out["p"].object("cache", TensorCache).view()[0]
    cache_q = out["q"].object("cache", TensorCache).view()[0]
    assert cache_p.untyped_storage().data_ptr() == cache_q.untyped_storage().data_ptr()


def test_restore_many_is_all_or_nothing(tmp_path: Path) -> None:
    m: SessionStateManager[SessionState] = SessionStateManager()
    ids = _family(m, 2)
    path = tmp_path / "family.safetensors"
    m.snapshot_many(ids, path)
    with pytest.raises(ValueError, match=r"\['src', 'b0', 'b1'\] already held"):
        m.restore_many(path)
    capped: SessionStateManager[SessionState] = SessionStateManager(
        max_sessions=2, on_full="refuse"
    )
    with pytest.raises(SessionAdmissionError):
        capped.restore_many(path)
    assert capped.session_ids() == []
    with pytest.raises(ValueError, match=r"holds 3 records but 1 session ids"):
        capped.restore_many(path, session_ids=["only"])
    with pytest.raises(SessionStateLostError, match=r"Nothing was written"):
        m.snapshot_many(["src", "gone"], tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(ValueError, match=r"distinct session ids"):
        m.snapshot_many(["src", "src"], tmp_path / "x.safetensors")


def _cache_record(n: int, fill: float) -> SessionState:
    cache = TensorCache(name="cache").allocate().commit(torch.full((n,), fill))
    return SessionState(objects={"cache": cache}, attrs={"step": 1})


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_family_parks_once_and_comes_back_shared(tier: str, tmp_path: Path) -> None:
    # 400 bytes a record; room for two. The source and three branches share one cache.
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 900}, park_tier=tier, spool_dir=str(tmp_path)
    )
    m.put("a", _cache_record(100, 1.0))
    expected = m.peek("a")
    m.fork("a", "b", "c", "d")
    m.put("x", _cache_record(100, 2.0))
    m.put("y", _cache_record(100, 3.0))  # over: the family parks
    parked = [sid for sid in "abcd" if m.session_stats(sid)["parked"]]
    assert parked == list("abcd")
    stats = m.stats()
    # Parked once: one copy on the tier for four sessions.
    assert stats[f"nbytes_parked:{tier}"] == 400
    assert stats["parks"] == 4
    assert_stats_equal_a_recount(m)
    # Back one by one: the first copies the bytes in, the others take the same object.
    got = [m.get(sid) for sid in "abcd"]
    assert all(tree_equal(r, expected) for r in got)
    caches = {id(r.object("cache")) for r in got if r is not None}
    assert len(caches) == 1
    assert m.stats()["total_nbytes"] <= 900
    assert_stats_equal_a_recount(m)


def test_a_diverged_branch_parks_only_what_it_no_longer_shares(tmp_path: Path) -> None:
    history = LatentBuffer(name="h", dim=0).allocate().commit(torch.zeros(100))
    record = SessionState(objects={"h": history, "cache": TensorCache(name="cache").allocate()})
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 1000}, park_tier="host"
    )
    m.put("a", record)
    m.fork("a", "b")
    # "b" writes a new cache; the history (an object it did not write) stays the source's.
    m.put("b", m.require("b").update_object("cache", lambda c: c.commit(torch.ones(50))))
    m.put("x", _cache_record(150, 4.0))  # parks "a", then "b": the history once
    assert m.session_stats("a")["parked"]
    assert m.session_stats("b")["parked"]
    assert m.stats()["nbytes_parked:host"] == 400 + 200
    back_a, back_b = m.get("a"), m.get("b")
    assert back_a is not None
    assert back_b is not None
    assert back_a.object("h") is back_b.object("h")
    assert_stats_equal_a_recount(m)


# -- found by an adversarial review of forks ---------------------------------------------------


def test_records_the_caller_parked_itself_read_back_their_own_bytes() -> None:
    # A handle the manager did not make is never remembered for sharing: a later handle at
    # the same address must not hand back an earlier session's object.
    m: SessionStateManager[SessionState] = SessionStateManager()
    for i in range(30):
        cache = TensorCache(name="cache").allocate().commit(torch.full((2,), float(i)))
        m.put(i, SessionState(objects={"cache": cache}).park("host"))
        got = m.get(i)
        assert got is not None
        assert got.object("cache", TensorCache).view()[0].item() == i


def test_a_branch_takes_a_siblings_parked_bytes_only_if_it_holds_all_of_them() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 200}, park_tier="host"
    )
    history = LatentBuffer(name="h", dim=0).allocate().commit(torch.zeros(4))  # 16 bytes
    cache = TensorCache(name="c").allocate().commit(torch.ones(45))  # 180 bytes
    m.put("s", SessionState(objects={"h": history, "c": cache}))
    m.fork("s", "t")
    m.put("t", m.require("t").update_object("c", lambda c: c.commit(torch.ones(4))))
    m.put("y", SessionState(attrs={"x": torch.zeros(45)}))  # parks "t"
    m.drop("s")
    m.drop("y")
    assert m.stats()["nbytes_parked:host"] == 32  # "t"'s own two objects, nothing of "s"
    back = m.get("t")
    assert back is not None
    assert m.stats()["nbytes:cpu"] == 32


def test_a_record_put_by_hand_keeps_parked_bytes_whose_holder_is_evicted() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_sessions=2, max_bytes={"cpu": 100}, park_tier="host"
    )
    m.put("a", _cache_record(16, 1.0))
    m.put("x", _cache_record(16, 2.0))  # parks "a"
    m.put("b", m.peek("a"))  # a fork by hand; the cap evicts "a"
    assert m.session_ids() == ["x", "b"]
    back = m.get("b")
    assert back is not None
    assert back.object("cache", TensorCache).view()[0].item() == 1.0


def test_dropping_a_prefetched_fork_gives_its_restores_blocks_back() -> None:
    pool = KVPool(8, block_tokens=2, token_shape=(2,))
    m: SessionStateManager[SessionState] = SessionStateManager(pools=(pool,))
    handle = pool.append(pool.empty(), torch.arange(8.0).view(4, 2))
    m.put("a", SessionState(objects={"kv": KVCache(name="kv").allocate().commit(handle)}))
    del handle
    m.park_until(lambda: pool.free_blocks == 8, frees=pool.owns_entry)
    m.fork("a", "b")
    assert m.prefetch("a")
    m.drop("a")
    assert pool.free_blocks == 8  # "b" is parked: nothing holds a block
    back = m.get("b")
    assert back is not None
    assert torch.equal(back.object("kv", KVCache).view().read(), torch.arange(8.0).view(4, 2))


def test_the_immutability_guard_sees_a_siblings_write_in_place() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 100}, park_tier="disk", check_immutable=True
    )
    m.put("a", _cache_record(16, 1.0))
    m.put("x", _cache_record(16, 2.0))
    m.fork("a", "b")
    m.drop("x")
    a = m.get("a")
    assert a is not None
    a.object("cache", TensorCache).view().fill_(666.0)  # illegal: a write into a record
    b = m.get("b")  # its own copy of the parked bytes, not the written object
    assert b is not None
    assert b.object("cache", TensorCache).view()[0].item() == 1.0


def test_a_family_the_cap_cannot_hold_is_refused_before_anything_is_stored(
    tmp_path: Path,
) -> None:
    m: SessionStateManager[SessionState] = SessionStateManager()
    ids = _family(m, 2)
    path = tmp_path / "family.safetensors"
    m.snapshot_many(ids, path)
    small: SessionStateManager[SessionState] = SessionStateManager(max_sessions=2)
    small.put("z", _history(2))
    with pytest.raises(SessionAdmissionError, match="cannot hold it"):
        small.restore_many(path)
    assert small.session_ids() == ["z"]
    assert small.stats()["evictions"] == 0


def test_a_sibling_that_takes_a_prefetch_leaves_no_reservation_behind() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 200}, park_tier="host"
    )
    for sid, fill in (("a", 1.0), ("x", 2.0), ("y", 3.0), ("z", 4.0)):
        m.put(sid, _cache_record(16, fill))  # "a" parks
    m.fork("a", "b")
    m.drop("x")
    m.drop("y")
    assert m.prefetch("a")
    back = m.get("b")  # takes the background restore of the bytes both hold
    assert back is not None
    assert not m.session_stats("a")["prefetching"]
    before = m.stats()["parks"]
    m.put("w", _cache_record(16, 5.0))  # fits beside "b" and "z": nothing parks
    assert m.stats()["parks"] == before
    again = m.get("a")
    assert again is not None
    assert again.object("cache", TensorCache).view()[0].item() == 1.0


@pytest.mark.parametrize("batch", ["restore_many", "put_many"])
def test_a_batch_the_budget_cannot_hold_evicts_nobody_first(batch: str, tmp_path: Path) -> None:
    # Each record alone fits the budget, the two together do not: with on_full="evict" the
    # batch is refused before any other session is evicted (or parked) for it.
    records = [SessionState(attrs={"x": torch.full((150,), float(i))}) for i in range(2)]
    path = tmp_path / "pair.safetensors"
    source: SessionStateManager[SessionState] = SessionStateManager()
    source.put_many({"a": records[0], "b": records[1]})
    source.snapshot_many(["a", "b"], path)
    m: SessionStateManager[SessionState] = SessionStateManager(max_bytes={"cpu": 1000})
    m.put("other", SessionState(attrs={"y": torch.zeros(50)}))
    m.put("parkable", _cache_record(50, 1.0))
    store = {
        "restore_many": lambda: m.restore_many(path),
        "put_many": lambda: m.put_many({"a": records[0], "b": records[1]}),
    }[batch]
    with pytest.raises(SessionAdmissionError) as refused:
        store()
    assert str(refused.value) == (
        "Cannot store the batch ['a', 'b']: together it holds 1200 bytes on cpu, more than the "
        "whole budget of 1000 bytes there (`max_bytes`); storing it would evict or park every "
        "other session and still not fit. Store a smaller batch, or raise the budget for cpu."
    )
    assert m.session_ids() == ["other", "parkable"]
    assert m.stats()["evictions"] == 0
    assert m.session_stats("parkable")["resident"]
    assert_stats_equal_a_recount(m)
    # One restore over the whole budget is refused before anything is evicted too.
    big = tmp_path / "big.safetensors"
    source.put("big", SessionState(attrs={"x": torch.zeros(300)}))
    source.snapshot("big", big)
    with pytest.raises(SessionAdmissionError, match="more than the whole budget"):
        m.restore("big", big)
    assert m.session_ids() == ["other", "parkable"]
    assert m.stats()["evictions"] == 0
    m.put_many({"a": records[0]})  # a batch that fits beside them (600 + 200 + 200) is stored
    assert m.session_ids() == ["other", "parkable", "a"]


def _draw(m: SessionStateManager[SessionState], sid: str) -> torch.Tensor:
    noise, _ = m.peek(sid).object("key", RandomKey).normal((6,))
    return noise


def test_a_fork_splits_the_random_key_and_shares_everything_else() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager()
    source = _history().with_object("key", RandomKey.seeded(0))
    m.put("src", source)
    m.fork("src", "a", "b")
    want = source.split_random(3)
    for sid, record in zip(("src", "a", "b"), want, strict=True):
        assert tree_equal(m.peek(sid), record)
        assert m.peek(sid).object("h") is source.object("h")
    draws = [_draw(m, sid) for sid in ("src", "a", "b")]
    assert not any(torch.equal(x, y) for i, x in enumerate(draws) for y in draws[i + 1 :])
    # Forked again, the source's new key splits into new keys: no branch repeats another.
    m.fork("src", "c")
    assert all(not torch.equal(_draw(m, "c"), d) for d in draws)
    assert_stats_equal_a_recount(m)


def test_a_fork_that_shares_its_key_draws_the_same_noise() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager()
    m.put("src", _history().with_object("key", RandomKey.seeded(0)))
    before = m.peek("src")
    m.fork("src", "a", "b", share_random=True)
    assert m.peek("a") is m.peek("b") is m.peek("src") is before
    assert torch.equal(_draw(m, "a"), _draw(m, "src"))
    with pytest.raises(TypeError, match=r"`share_random` must be a bool"):
        m.fork("src", "c", share_random=1)  # type: ignore[arg-type]
    assert "c" not in m


def test_a_parked_source_forks_with_its_key_split_and_its_bytes_parked() -> None:
    m: SessionStateManager[SessionState] = SessionStateManager(max_bytes={"cpu": 130})
    m.put("src", parkable_record(fill=1.0).with_object("key", RandomKey.seeded(0)))
    expected = m.peek("src", on_host=True)
    m.put("x", parkable_record(fill=2.0))  # parks "src", all but its key (not parkable)
    assert m.peek("src").parked == ("cache", "ring")
    m.fork("src", "a")
    src, a = m.peek("src"), m.peek("a")
    assert a.objects["cache"] is src.objects["cache"]  # the one parked object, not unparked
    assert a.parked == ("cache", "ring")
    assert not torch.equal(_draw(m, "a"), _draw(m, "src"))
    keys = expected.split_random(2)
    assert tree_equal(m.get("a"), keys[1])
    assert tree_equal(m.get("src"), keys[0])
    assert_stats_equal_a_recount(m)


@pytest.mark.parametrize("on_full", ["refuse", "evict"])
def test_the_sources_new_key_is_held_to_the_budget(on_full: str) -> None:
    # "b" shares the source's record, key included; forking "a" again gives the source a
    # new 16-byte key held alone: its room is made (parking "z"), or the fork is refused.
    budget = 140 if on_full == "refuse" else 175
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": budget},
        on_full=on_full,  # type: ignore[arg-type]
    )
    m.put("z", _cache_record(10, 2.0))
    m.put("a", _cache_record(25, 1.0).with_object("key", RandomKey.seeded(0)))
    m.fork("a", "b", share_random=True)
    before = m.peek("a")
    if on_full == "refuse":
        with pytest.raises(SessionAdmissionError, match="Cannot make room for session 'a'"):
            m.fork("a", "c")
        assert "c" not in m
        assert m.peek("a") is before
        assert m.stats()["nbytes:cpu"] == 100 + 16
    else:
        m.fork("a", "c")
        assert m.peek("z").parked == ("cache",)  # parked for the source's new key
        assert m.stats()["nbytes:cpu"] == 100 + 3 * 16
        assert m.stats()["evictions"] == 0
    assert m.stats()["nbytes:cpu"] <= budget
    assert_stats_equal_a_recount(m)


def test_a_family_that_fits_the_budget_is_unparked_once(tmp_path: Path) -> None:
    # A 4,000-byte history three forks share, under a 4,200-byte budget: reading a branch
    # whose parked history a resident sibling holds costs nothing, so nobody is parked for it
    # (the family was parked and read back member by member, one disk round trip a read).
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 4200}, park_tier="disk", spool_dir=tmp_path
    )
    m.put("a", _cache_record(1000, 1.0))
    m.fork("a", "b", "c")
    m.put("x", _cache_record(50, 2.0))
    m.put("y", SessionState(attrs={"y": torch.zeros(50)}))  # parks the family's history
    assert [m.peek(sid).parked for sid in "abcx"] == [("cache",)] * 3 + [()]
    for sid in "abcabc":
        m.require(sid)
    assert [m.session_stats(sid)["resident"] for sid in "abc"] == [True] * 3
    s = m.stats()
    assert (s["unparks"], s["parks"], s["nbytes:cpu"]) == (3, 4, 4200)
    history = {
        m.peek(sid).object("cache", TensorCache).view().untyped_storage().data_ptr()
        for sid in "abc"
    }
    assert len(history) == 1  # one history, shared again
    assert_stats_equal_a_recount(m)


def test_a_branch_of_a_kv_parked_source_counts_its_unpark_as_kv() -> None:
    # The branch holds the source's parked K/V: its unpark moves K/V, counted in kv_unparks.
    pool = KVPool(8, block_tokens=4, token_shape=(2,))
    m: SessionStateManager[SessionState] = SessionStateManager(pools=(pool,))
    handle = pool.append(pool.empty(), torch.arange(12.0).view(6, 2))
    m.put("a", SessionState(objects={"kv": KVCache(name="kv").allocate().commit(handle)}))
    del handle
    assert m.park_until(lambda: pool.free_blocks == 8, frees=pool.owns_entry)
    assert m.stats()["kv_parks"] == 1
    m.fork("a", "b")
    assert m.peek("b").parked == ("kv",)
    b = m.require("b")
    assert torch.equal(b.object("kv", KVCache).view().read(), torch.arange(12.0).view(6, 2))
    assert (m.stats()["unparks"], m.stats()["kv_unparks"]) == (1, 1)
    m.require("a")
    assert (m.stats()["unparks"], m.stats()["kv_unparks"]) == (2, 2)


# -- reliability round 5 (issue 50) -----------------------------------------------------------


def _kv_family(tier: str, tmp_path: Path) -> SessionStateManager[SessionState]:
    # "a" and its branch "b" share a 4,000 B history; each grew its own K/V past the fork.
    pool = KVPool(16, block_tokens=2, token_shape=(1,))
    m: SessionStateManager[SessionState] = SessionStateManager(
        max_bytes={"cpu": 9000}, park_tier=tier, spool_dir=str(tmp_path / "spool"), pools=(pool,)
    )
    history = LatentBuffer(name="h", dim=0).allocate().commit(torch.zeros(1000))
    kv = KVCache().allocate().append(pool, torch.ones(3, 1))
    m.put("a", SessionState(objects={"h": history, "kv": kv}))
    del history, kv
    m.fork("a", "b")
    for i, sid in enumerate("ab"):
        state = m.require(sid)
        grown = state.object("kv", KVCache).append(pool, torch.full((1, 1), float(i)))
        m.put(sid, state.with_object("kv", grown))
    del state, grown
    return m


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_kv_familys_other_objects_park_once_and_come_back_shared(
    tier: str, tmp_path: Path
) -> None:
    m = _kv_family(tier, tmp_path)
    expected = {sid: m.peek(sid, on_host=True) for sid in "ab"}
    kv_bytes = 2 * (2 * 2 * 4)  # each branch's two blocks of 2 float tokens
    m.put("x", _cache_record(1500, 1.0))  # 6,000 B: the family parks
    assert [m.session_stats(sid)["parked"] for sid in "ab"] == [["h", "kv"]] * 2
    # The history once on the tier, beside each branch's own K/V.
    assert m.stats()[f"nbytes_parked:{tier}"] == 4000 + kv_bytes
    assert m.stats()["kv_parks"] == 2
    path = tmp_path / "family.safetensors"
    m.snapshot_many(["a", "b"], path)
    assert path.stat().st_size < 2 * 4000  # the history written once
    assert m.drop("x")
    back = {sid: m.require(sid) for sid in "ab"}
    for sid in "ab":
        assert tree_equal(back[sid], expected[sid])
    assert back["a"].object("h") is back["b"].object("h")
    # The history once, and the three blocks the family held (one shared).
    assert m.stats()["total_nbytes"] == 4000 + 3 * 8
    assert m.stats()["kv_unparks"] == 2
    assert_stats_equal_a_recount(m)
