"""Kept copies: parking a session again copies only what changed since its unpark.

An unpark keeps the tier's copy of the objects it restored; the next park of that session takes
it back for the objects it still holds unchanged (the very objects, every version counter as it
was) and copies the rest. What must hold: every unpark is bit-identical to the record as stored,
including after an in-place write since the last unpark; storages two objects share stay
shared; K/V is always copied; the copies go when their objects change or go, when the session
is dropped, and first when the host pool is full; ``keep_parked_copies=False`` keeps none.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sessionstate import (
    KVCache,
    KVPool,
    LatentBuffer,
    SessionState,
    SessionStateManager,
    TensorCache,
    tree_equal,
)
from sessionstate._stateobject import ParkedObject
from tests.support import assert_stats_equal_a_recount, clone_tree

_N = 256  # floats per tensor: 1 KiB


def _record(seed: float, n: int = _N) -> SessionState:
    # "still": changes only when asked; "moving": a ring each step commits to.
    still = TensorCache(name="still").allocate().commit((torch.full((n,), seed),))
    moving = LatentBuffer(name="moving", dim=0).allocate(maxlen=2).commit(torch.full((1, 4), seed))
    return SessionState(objects={"still": still, "moving": moving}, attrs={"step": 0})


def _step(state: SessionState) -> SessionState:
    # A model step: the ring moves on, the cache is left as it is.
    step = state.attrs["step"] + 1
    ring = state.object("moving", LatentBuffer).commit(torch.full((1, 4), float(step)))
    return state.with_object("moving", ring).with_attrs(step=step)


def _manager(tmp_path: Path, tier: str = "host", **kw: object) -> SessionStateManager:
    # A budget of one record and a half: every get of the other session parks this one.
    one = SessionStateManager()
    one.put("x", _record(0.0))
    budget = one.stats()["nbytes:cpu"] * 3 // 2
    return SessionStateManager(
        max_bytes={"cpu": budget},
        park_tier=tier,  # type: ignore[arg-type]
        spool_dir=tmp_path,
        **kw,  # type: ignore[arg-type]
    )


def _handle(m: SessionStateManager, sid: str, name: str) -> object:
    state = m.peek(sid)
    assert state is not None
    obj = state.objects[name]
    assert isinstance(obj, ParkedObject)
    return obj.handle


def _robin(m: SessionStateManager, rounds: int) -> dict[str, SessionState]:
    # Two sessions stepped in turn (each get parks the other); returns what each holds.
    expect = {"a": _record(1.0), "b": _record(2.0)}
    for sid, record in expect.items():
        m.put(sid, record)
    for _ in range(rounds):
        for sid in ("a", "b"):
            got = m.get(sid)
            assert got is not None
            assert tree_equal(got, expect[sid])
            expect[sid] = _step(got)
            m.put(sid, expect[sid])
    return expect


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_unchanged_session_parks_again_without_a_copy(tmp_path: Path, tier: str) -> None:
    m = _manager(tmp_path, tier)
    m.put("a", _record(1.0))
    m.put("b", _record(2.0))  # parks "a"
    first = _handle(m, "a", "still")
    a = m.get("a")  # parks "b", unparks "a": its copy is kept
    assert a is not None
    kept = m.stats()[f"nbytes_kept:{tier}"]
    assert kept > 0
    assert m.get("b") is not None  # parks "a" again: nothing of it changed
    stats = m.stats()
    assert (stats["reparks"], stats["nbytes_reparked"]) == (1, kept)
    assert _handle(m, "a", "still") is first  # the very bytes parked the first time
    again = m.get("a")
    assert again is not None
    assert tree_equal(again, _record(1.0))
    assert_stats_equal_a_recount(m)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_session_that_steps_copies_what_moved_and_keeps_the_rest(
    tmp_path: Path, tier: str
) -> None:
    m = _manager(tmp_path, tier)
    expect = _robin(m, 6)
    stats = m.stats()
    # The first park holds both objects, the second parks the still one apart, from the
    # third on its copy is taken back: each session's last four parks.
    assert stats["reparks"] >= 6
    for sid, record in expect.items():
        got = m.get(sid)
        assert got is not None
        assert tree_equal(got, record)
    assert_stats_equal_a_recount(m)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_an_in_place_write_since_the_unpark_is_parked(tmp_path: Path, tier: str) -> None:
    m = _manager(tmp_path, tier)
    _robin(m, 3)  # "a"'s cache has a kept copy of its own by now
    a = m.get("a")
    assert a is not None
    assert m.stats()[f"nbytes_kept:{tier}"] > 0
    (x,) = a.object("still", TensorCache).view()
    x[5:7].add_(40.0)  # through a view: the version counter the tensor shares moves
    expect = clone_tree(a)
    assert m.get("b") is not None  # parks "a": its cache must be copied again
    del a, x  # (else the unpark would hand the very object back, not the parked bytes)
    back = m.get("a")
    assert back is not None
    assert tree_equal(back, expect)
    assert back.object("still", TensorCache).view()[0][5].item() == 41.0


def test_an_in_place_write_into_an_object_handed_back_is_parked(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    expect = _robin(m, 3)
    a = m.get("a")  # the caller still holds "a"'s objects: the very ones come back
    assert a is not None
    assert a.objects["still"] is expect["a"].objects["still"]
    (x,) = a.object("still", TensorCache).view()
    x.add_(40.0)
    written = clone_tree(a)
    assert m.get("b") is not None  # parks "a": the written cache is copied
    del a, x, expect
    back = m.get("a")
    assert back is not None
    assert tree_equal(back, written)


def test_a_branch_that_wrote_in_place_does_not_take_its_siblings_bytes(tmp_path: Path) -> None:
    m = SessionStateManager(spool_dir=tmp_path)

    def park(sid: str) -> None:
        other = "c" if sid == "a" else "a"
        m.park_until(lambda: False, frees=lambda entry: True, keep=(other,))

    m.put("a", _record(1.0))
    m.fork("a", "c")
    park("a")  # "c" still holds the very objects "a"'s parked bytes were copied from
    c = m.get("c")
    assert c is not None
    (x,) = c.object("still", TensorCache).view()
    x.add_(40.0)
    park("c")  # its cache now differs from "a"'s parked bytes: copied, not shared
    del c, x
    for sid, value in (("c", 41.0), ("a", 1.0)):
        got = m.get(sid)
        assert got is not None
        assert torch.equal(got.object("still", TensorCache).view()[0], torch.full((_N,), value))


def test_an_object_written_after_its_park_is_never_handed_back(tmp_path: Path) -> None:
    # The caller keeps a record it got and writes into it once the session was parked again:
    # the next get brings back what was stored, not the written object.
    m = _manager(tmp_path)
    m.put("a", _record(1.0))
    m.put("b", _record(2.0))
    a = m.get("a")
    assert a is not None
    assert m.get("b") is not None  # parks "a": its kept copy taken back
    a.object("still", TensorCache).view()[0].add_(100.0)
    got = m.get("a")
    assert got is not None
    assert tree_equal(got, _record(1.0))


def test_a_sibling_is_never_handed_an_object_written_since_it_came_back(tmp_path: Path) -> None:
    m = SessionStateManager(spool_dir=tmp_path)
    m.put("a", _record(1.0))
    m.fork("a", "c")
    m.park_until(lambda: False, frees=lambda entry: True)  # both parked, one handle
    c = m.get("c")
    assert c is not None
    m.park_until(lambda: False, frees=lambda entry: True)  # "c" parked again
    c.object("still", TensorCache).view()[0].add_(100.0)  # into what "c" read, stored no more
    for sid in ("a", "c"):
        got = m.get(sid)
        assert got is not None
        assert tree_equal(got, _record(1.0))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_a_write_through_one_of_two_objects_sharing_a_storage_is_parked(
    tmp_path: Path, tier: str
) -> None:
    # Restored objects share their storage but not a version counter: a write through one
    # leaves the other's counter as it was, and must still keep both from a sibling's bytes.
    base = torch.arange(16.0)
    o0 = TensorCache(name="o0").allocate().commit((base[0:4],))
    o2 = TensorCache(name="o2").allocate().commit((base[0:8],))
    m = SessionStateManager(spool_dir=tmp_path, park_tier=tier)  # type: ignore[arg-type]

    def park(*keep: str) -> None:
        m.park_until(lambda: False, frees=lambda entry: True, keep=keep)

    m.put("a", SessionState(objects={"o0": o0, "o2": o2}))
    del base, o0, o2
    park()
    a = m.get("a")  # restored: o0 and o2 over one fresh storage
    m.fork("a", "c")  # "c" holds "a"'s very objects
    park("c")  # "a" parked again, its kept copy taken back
    c = m.get("c")
    assert c is not None
    c.object("o2", TensorCache).view()[0][0].add_(100.0)  # base[0]: o0 reads it too
    written = clone_tree(c)
    del a, c
    park()  # "c" parked: its bytes now differ from "a"'s
    got = m.get("c")
    assert got is not None
    assert tree_equal(got, written)
    (x0,), (x2,) = got.object("o0", TensorCache).view(), got.object("o2", TensorCache).view()
    assert x0[0].item() == 100.0
    assert x0.untyped_storage().data_ptr() == x2.untyped_storage().data_ptr()


def test_a_sibling_is_handed_none_of_a_handle_one_of_whose_objects_was_written(
    tmp_path: Path,
) -> None:
    def record() -> SessionState:
        base = torch.arange(16.0)
        o0 = TensorCache(name="o0").allocate().commit((base[0:4],))
        o2 = TensorCache(name="o2").allocate().commit((base[0:8],))
        return SessionState(objects={"o0": o0, "o2": o2})

    m = SessionStateManager(spool_dir=tmp_path)
    m.put("a", record())
    m.fork("a", "c")
    m.park_until(lambda: False, frees=lambda entry: True)  # one handle for both
    c = m.get("c")  # o0 and o2 restored over one storage; "a" could be handed them
    assert c is not None
    c.object("o2", TensorCache).view()[0][0].add_(100.0)  # o0 reads it, its counter stays
    got = m.get("a")
    assert got is not None
    assert tree_equal(got, record())


def test_a_park_refused_by_a_full_host_pool_keeps_its_copies_held(tmp_path: Path) -> None:
    # "a" and "c" keep the same copy; "a"'s park takes it back, then the pool refuses the rest
    # even after letting kept copies go: the copy "a" took back must not have gone with them.
    one = SessionStateManager()
    one.put("x", _record(1.0))
    nbytes = one.stats()["nbytes:cpu"]
    m = SessionStateManager(
        host_pool_bytes=nbytes + 256,
        host_pool_full="refuse",
        spool_dir=tmp_path,
        check_immutable=True,  # (no object handed back: each unpark restores its own)
    )

    def park(*keep: str) -> None:
        m.park_until(lambda: False, frees=lambda entry: True, keep=keep)

    m.put("a", _record(1.0))
    park()
    m.fork("a", "c")
    assert m.get("c") is not None  # "c" keeps the copy ("a" still holds it parked)
    base = m.get("a")  # and "a" keeps it too
    assert base is not None
    big = TensorCache(name="big").allocate().commit((torch.ones(4 * _N),))  # over the pool
    m.put("a", base.with_object("big", big))
    del big
    park("c")  # "a"'s park is refused: it stays resident
    assert not m.session_stats("a")["parked"]
    m.put("a", base)  # its unparked objects again, unchanged
    del base
    park("c")  # takes its copy back
    assert m.session_stats("a")["parked"]
    got = m.get("a")
    assert got is not None
    assert tree_equal(got, _record(1.0))
    assert_stats_equal_a_recount(m)


def test_objects_under_inference_mode_are_always_copied(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    _robin(m, 3)
    with torch.inference_mode():  # restored as inference tensors: no version counter
        a = m.get("a")
        assert a is not None
        (x,) = a.object("still", TensorCache).view()
        x.add_(1.0)
    assert m.stats()["nbytes_kept:host"] == 0
    reparks = m.stats()["reparks"]
    assert m.get("b") is not None
    assert m.stats()["reparks"] == reparks
    back = m.get("a")
    assert back is not None
    assert torch.equal(back.object("still", TensorCache).view()[0], torch.full((_N,), 2.0))


def test_objects_sharing_a_storage_are_never_parked_apart(tmp_path: Path) -> None:
    # The still cache and the moving ring's first chunk are views of one storage: parked
    # apart, it would be copied twice and come back as two storages.
    base = torch.arange(float(_N))
    half = _N // 2
    still = TensorCache(name="still").allocate().commit((base[:half],))
    moving = LatentBuffer(name="moving", dim=0).allocate().commit(base[half:].view(-1, 4))
    record = SessionState(objects={"still": still, "moving": moving}, attrs={"step": 0})
    m = _manager(tmp_path)
    m.put("a", record)
    m.put("b", _record(2.0))
    for _ in range(4):
        got = m.get("a")
        assert got is not None
        (x,) = got.object("still", TensorCache).view()
        ring = got.object("moving", LatentBuffer)
        first = ring.chunks[0]
        # One storage for both objects, as stored: the first chunk and the cache share it.
        assert x.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        m.put("a", _step(got))
        assert m.get("b") is not None  # parks "a": both objects into one handle, copied
        assert _handle(m, "a", "still") is _handle(m, "a", "moving")
    assert_stats_equal_a_recount(m)


def test_a_branch_of_an_unparked_session_shares_its_kept_copy(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    m.put("a", _record(1.0))
    m.put("b", _record(2.0))  # parks "a"
    assert m.get("a") is not None  # parks "b"; "a"'s copy kept
    m.fork("a", "c")  # "c" holds "a"'s very objects
    m.put("x", _record(3.0))  # parks "a" (its copy taken back) and "c" (the same bytes)
    assert m.session_stats("a")["parked"]
    assert m.session_stats("c")["parked"]
    stats = m.stats()
    assert stats["reparks"] == 1
    assert stats["nbytes_parked:host"] == 2 * stats["nbytes_reparked"]  # "b" and the family
    assert _handle(m, "a", "still") is _handle(m, "c", "still")
    assert_stats_equal_a_recount(m)
    for sid in ("c", "a"):
        got = m.get(sid)
        assert got is not None
        assert tree_equal(got, _record(1.0))


def test_kv_is_always_copied(tmp_path: Path) -> None:
    pool = KVPool(64, block_tokens=4, token_shape=(3,))
    m = _manager(tmp_path)

    def record(seed: float) -> SessionState:
        kv = KVCache().allocate().append(pool, torch.full((5, 3), seed))
        return _record(seed).with_object("kv", kv)

    m.put("a", record(1.0))
    m.put("b", record(2.0))
    for _ in range(3):
        for sid in ("a", "b"):
            got = m.get(sid)
            assert got is not None
            assert m.stats()["nbytes_kept:host"] <= 2 * 4 * _N  # never a K/V byte
    stats = m.stats()
    assert stats["reparks"] > 0
    assert stats["kv_parks"] == stats["parks"]
    for sid, seed in (("a", 1.0), ("b", 2.0)):
        got = m.get(sid)
        assert got is not None
        assert torch.equal(got.object("kv", KVCache).read(), torch.full((5, 3), seed))


def test_kept_copies_go_when_their_objects_go_or_the_session_does(tmp_path: Path) -> None:
    m = _manager(tmp_path)
    _robin(m, 3)
    a = m.get("a")
    assert a is not None
    assert m.stats()["nbytes_kept:host"] > 0
    m.put("a", _record(9.0))  # nothing of the unparked record is held now
    del a
    assert m.stats()["nbytes_kept:host"] == 0
    m.get("b")
    assert m.stats()["nbytes_kept:host"] > 0
    m.drop("b")
    assert m.stats()["nbytes_kept:host"] == 0


def test_a_full_host_pool_lets_kept_copies_go_before_it_spills(tmp_path: Path) -> None:
    one = SessionStateManager()
    one.put("x", _record(0.0))
    nbytes = one.stats()["nbytes:cpu"]
    m = SessionStateManager(
        max_bytes={"cpu": nbytes * 5 // 2},  # two records resident
        host_pool_bytes=2 * nbytes + 256,  # two parked (or kept) records
        spool_dir=tmp_path,
    )
    for sid in ("a", "b", "c"):
        m.put(sid, _record(float(ord(sid))))  # parks "a"
    assert m.get("a") is not None  # parks "b"; "a"'s copy kept: the pool is full
    assert m.stats()["nbytes_kept:host"] == nbytes
    m.put("d", _record(float(ord("d"))))  # parks "c", which needs the room "a"'s copy holds
    stats = m.stats()
    assert stats["host_pool_spills"] == 0
    assert stats["nbytes_kept:host"] == 0
    assert stats["nbytes_parked:host"] == 2 * nbytes
    for sid in ("a", "b", "c", "d"):
        got = m.get(sid)
        assert got is not None
        assert tree_equal(got, _record(float(ord(sid))))


def test_keep_parked_copies_false_copies_every_park(tmp_path: Path) -> None:
    m = _manager(tmp_path, keep_parked_copies=False)
    expect = _robin(m, 4)
    stats = m.stats()
    assert (stats["reparks"], stats["nbytes_reparked"], stats["nbytes_kept:host"]) == (0, 0, 0)
    for sid, record in expect.items():
        got = m.get(sid)
        assert got is not None
        assert tree_equal(got, record)


def test_keep_parked_copies_takes_a_bool() -> None:
    with pytest.raises(TypeError, match="keep_parked_copies"):
        SessionStateManager(keep_parked_copies="yes")  # type: ignore[arg-type]
