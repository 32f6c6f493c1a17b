"""Park and unpark: the lifecycle transition, both tiers, the budget, faults and threads."""

from __future__ import annotations

import itertools
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import sessionstate as ss
import sessionstate._storage._park as park_module
from sessionstate import (
    ParkedError,
    ParkingError,
    SessionAdmissionError,
    SessionState,
    SessionStateManager,
    TensorCache,
    nbytes_by_device,
    tree_equal,
)
from sessionstate._manager import parse_nbytes
from tests.support import alias_graph, parkable_record

TIERS = ["host", "disk"]


# -- the transition ------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", TIERS)
def test_round_trip_keeps_bits_aliases_and_bytes(tier: str, tmp_path: Path) -> None:
    state = parkable_record()
    parked = state.park(tier, spool_dir=tmp_path)  # type: ignore[arg-type]
    assert parked.parked == ("cache", "ring")
    assert nbytes_by_device(parked) == {}
    back = parked.unpark()
    assert tree_equal(back, state)
    assert alias_graph(back) == alias_graph(state)
    assert nbytes_by_device(back) == nbytes_by_device(state)
    assert tree_equal(state, parkable_record())  # the original is unchanged


def test_objects_parked_together_keep_a_shared_storage_shared() -> None:
    base = torch.arange(8.0)
    state = SessionState(
        objects={
            "a": TensorCache(name="a").allocate().commit(base),
            "b": TensorCache(name="b").allocate().commit(base[4:]),
        }
    )
    back = state.park("host").unpark()
    a, b = back.object("a").view(), back.object("b").view()
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert nbytes_by_device(back) == {"cpu": 32}


def _whole_and_partial_tensors() -> dict[str, Any]:
    # Tensors that are each the whole of their own storage, of several dtypes and shapes (a
    # scalar among them), beside ones that are not: a view pair whose first tensor is whole,
    # a slice keeping a longer storage alive, a transposed tensor and an empty one.
    base = torch.arange(12.0)
    return {
        "f32": torch.arange(6.0).view(2, 3) + 0.5,
        "i64": torch.arange(5) * 7,
        "bf16": torch.linspace(-1, 1, 7).to(torch.bfloat16),
        "u8": torch.arange(3, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "f32b": torch.full((4,), -3.0),
        "whole_then_view": (base, base.view(3, 4)[1:]),
        "slice": torch.arange(10.0)[2:5],
        "transposed": torch.arange(6.0).view(2, 3).t(),
        "empty": torch.empty(0),
    }


def _storages(tree: Any) -> list[torch.UntypedStorage]:
    return [t.untyped_storage() for t in ss.tree_leaves(tree) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("tier", TIERS)
def test_restored_tensors_each_own_a_storage_of_the_same_size(tier: str, tmp_path: Path) -> None:
    tree = _whole_and_partial_tensors()
    handle = park_module.park_tree(tree, tier, spool_dir=tmp_path)  # type: ignore[arg-type]
    for back in (handle.restore(), handle.restore(), handle.read()):
        assert tree_equal(back, tree)
        assert alias_graph(back) == alias_graph(tree)
        assert nbytes_by_device(back) == nbytes_by_device(tree)
        for old, new in zip(ss.tree_leaves(tree), ss.tree_leaves(back), strict=True):
            assert (new.shape, new.stride(), new.storage_offset()) == (
                old.shape,
                old.stride(),
                old.storage_offset(),
            )
            assert new.untyped_storage().nbytes() == old.untyped_storage().nbytes()
        # Every tensor that had a storage of its own has one of its own again: no restored
        # storage is shared by tensors that did not share one.
        pointers = {s.data_ptr() for s in _storages(back) if s.nbytes()}
        assert len(pointers) == len({s.data_ptr() for s in _storages(tree) if s.nbytes()})
        assert pointers.isdisjoint(s.data_ptr() for s in _storages(tree))
    assert handle.nbytes == sum(nbytes_by_device(tree).values())


def test_host_tier_moves_whole_tensors_as_one_run_per_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tree = _whole_and_partial_tensors()
    seen: dict[str, Any] = {}
    real = park_module.park_into_slots

    def spy(sources: Any, *args: Any, **kwargs: Any) -> Any:
        slots, views = real(sources, *args, **kwargs)
        seen.update(sources=sources, whole=kwargs.get("whole", ()), slots=slots, views=views)
        return slots, views

    monkeypatch.setattr(park_module, "park_into_slots", spy)
    back = park_module.park_tree(tree, "host").restore()
    assert tree_equal(back, tree)
    # One slot; the whole tensors go as runs, the rest storage by storage.
    assert len(seen["slots"]) == 1
    whole = seen["whole"]
    assert len(whole) == 7  # all but the view pair, the slice, the transposed and the empty
    assert len(seen["sources"]) == 4  # their storages
    shaped = seen["views"][len(seen["sources"]) :]
    for t, view in zip(whole, shaped, strict=True):
        assert torch.equal(view, t)
        assert view.shape == t.shape
    # Whole tensors of one dtype lie one after the other in the slot, in order.
    f32 = [(t, v) for t, v in zip(whole, shaped, strict=True) if t.dtype == torch.float32]
    assert len(f32) == 3
    for (t, v), (_, w) in itertools.pairwise(f32):
        assert w.data_ptr() - v.data_ptr() == t.nbytes


def test_parked_object_refuses_reads_with_a_clear_error() -> None:
    parked = parkable_record().object("ring").park("host", name="ring")
    assert not parked.is_allocated
    msg = (
        "Cannot view LatentBuffer `ring`: it is parked on the host tier and not resident. "
        "Call `.unpark()` first (a manager does so on `get`, `get_or_create` and `require`)."
    )
    with pytest.raises(ParkedError, match=re.escape(msg)):
        parked.view()
    with pytest.raises(ParkedError, match=re.escape("Cannot commit to LatentBuffer `ring`")):
        parked.commit(torch.zeros(1))


def test_disk_tier_release_deletes_the_file_and_refuses_restore(tmp_path: Path) -> None:
    parked = TensorCache(name="c").allocate().commit(torch.ones(3)).park("disk", spool_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1
    parked.handle.release()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match=re.escape("were released by their owner")):
        parked.unpark()


def test_unsupported_tensor_is_refused_naming_it() -> None:
    cache = TensorCache(name="m").allocate().commit(torch.zeros(2, device="meta"))
    with pytest.raises(ss.UnsupportedTensorError, match=re.escape("Cannot park TensorCache `m`")):
        cache.park("host")


def test_tensor_cache_lifecycle_messages() -> None:
    with pytest.raises(ss.NotAllocatedError, match=re.escape("Cannot view TensorCache `c`")):
        TensorCache(name="c").view()
    msg = (
        "TensorCache `c` holds contents but is not allocated; build it with `.allocate()` and "
        "`.commit(tree)`."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        TensorCache(torch.zeros(1), name="c")


def test_parse_nbytes() -> None:
    assert parse_nbytes("24GiB") == 24 * 2**30
    assert parse_nbytes(" 512 MiB ") == 512 * 2**20
    assert parse_nbytes("2kb") == 2000
    msg = (
        "`max_bytes` must be a byte count: a non-negative int or a string like '24GiB', "
        "'512MiB' or '1.5GB'; got 'lots' (str)."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        parse_nbytes("lots")
    with pytest.raises(ValueError, match=re.escape("got -1 (int)")):
        parse_nbytes(-1)


# -- the budget ------------------------------------------------------------------------------------


def _session_bytes() -> int:
    return nbytes_by_device(parkable_record())["cpu"]


@pytest.mark.parametrize("tier", TIERS)
def test_budget_parks_lru_and_unparks_on_get(tier: str, tmp_path: Path) -> None:
    size = _session_bytes()
    m = SessionStateManager(max_bytes={"cpu": 2 * size}, park_tier=tier, spool_dir=tmp_path)  # type: ignore[arg-type]
    records = {sid: parkable_record(fill=float(i)) for i, sid in enumerate("abc")}
    for sid, rec in records.items():
        m.put(sid, rec)
    stats = m.stats()
    assert stats["nbytes:cpu"] <= 2 * size
    assert (stats["parks"], stats["parked_sessions"], stats["evictions"]) == (1, 1, 0)
    assert stats[f"nbytes_parked:{tier}"] == size
    assert m.peek("a").parked == ("cache", "ring")  # type: ignore[union-attr]
    got = m.get("a")  # parks "b", the least recently used now
    assert got is not None
    assert got.parked == ()
    assert tree_equal(got, records["a"])
    stats = m.stats()
    assert (stats["parks"], stats["unparks"], stats["parked_sessions"]) == (2, 1, 1)
    assert m.peek("b").parked == ("cache", "ring")  # type: ignore[union-attr]
    assert stats["nbytes:cpu"] <= 2 * size
    m.clear()
    if tier == "disk":
        assert [p for p in tmp_path.rglob("*.safetensors")] == []


def test_peek_does_not_unpark_and_require_does() -> None:
    size = _session_bytes()
    m = SessionStateManager(max_bytes={"cpu": size})
    m.put("a", parkable_record())
    m.put("b", parkable_record(fill=2))
    assert m.peek("a").parked  # type: ignore[union-attr]
    assert m.stats()["unparks"] == 0
    assert m.require("a").parked == ()
    assert m.stats()["unparks"] == 1


def test_record_larger_than_the_whole_budget_is_always_refused() -> None:
    m = SessionStateManager(max_bytes={"cpu": 10})
    m.put("a", SessionState(attrs={"x": torch.zeros(1)}))
    msg = (
        "Cannot store session 'a': its record holds 64 bytes on cpu, more than the whole "
        "budget of 10 bytes there (`max_bytes`). Raise the budget for cpu, or keep less of the "
        "session on that device."
    )
    with pytest.raises(SessionAdmissionError, match=re.escape(msg)):
        m.put("a", SessionState(attrs={"x": torch.zeros(16)}))
    assert tree_equal(m.peek("a"), SessionState(attrs={"x": torch.zeros(1)}))


def test_refuse_when_parking_cannot_make_room() -> None:
    m = SessionStateManager(on_full="refuse", max_bytes={"cpu": 100})
    m.put("a", SessionState(attrs={"x": torch.zeros(20)}))  # attributes are never parked
    msg = (
        "Cannot make room for session 'b': cpu would hold 160 bytes, over its budget of 100 "
        "bytes, even after parking the other sessions' parkable objects (`on_full='refuse'`). "
        "Drop finished sessions, raise `max_bytes` for cpu, or keep large values in parkable "
        "state objects rather than attributes."
    )
    with pytest.raises(SessionAdmissionError, match=re.escape(msg)):
        m.put("b", SessionState(attrs={"x": torch.zeros(20)}))
    assert m.session_ids() == ["a"]
    assert m.stats()["nbytes:cpu"] == 80


def test_evict_when_parking_cannot_make_room() -> None:
    m = SessionStateManager(max_bytes={"cpu": 100})
    m.put("a", SessionState(attrs={"x": torch.zeros(20)}))
    m.put("b", SessionState(attrs={"x": torch.zeros(20)}))
    assert m.session_ids() == ["b"]
    assert m.stats()["evictions"] == 1


def test_object_aliasing_an_attribute_is_not_parked() -> None:
    x = torch.zeros(20)
    m = SessionStateManager(on_full="refuse", max_bytes={"cpu": 100})
    m.put("a", SessionState(objects={"c": TensorCache().allocate().commit(x)}, attrs={"x": x}))
    with pytest.raises(SessionAdmissionError):
        m.put("b", SessionState(attrs={"y": torch.zeros(20)}))
    assert m.peek("a").parked == ()  # type: ignore[union-attr]


def _chain(links: int) -> SessionState:
    # cache0 shares a storage with cache1, cache1 with cache2, ...; the last with attribute x.
    storages = [torch.full((8,), float(i)) for i in range(links + 1)]
    objects = {
        f"cache{i}": TensorCache(name=f"cache{i}").allocate().commit((storages[i], storages[i + 1]))
        for i in range(links)
    }
    return SessionState(objects=objects, attrs={"x": storages[links][4:]})


@pytest.mark.parametrize("links", [1, 2, 3])
@pytest.mark.parametrize("tier", TIERS)
def test_objects_linked_to_an_attribute_through_each_other_are_not_parked(
    links: int, tier: str, tmp_path: Path
) -> None:
    # Only the last object shares a storage with the attribute; the others reach it through
    # the objects after them. Parking any of them would free nothing of the storage it shares
    # with one that stays, and its unpark would split that alias into two copies.
    a = _chain(links)
    m = SessionStateManager(
        on_full="refuse", max_bytes={"cpu": 100 + 32 * links}, park_tier=tier, spool_dir=tmp_path
    )
    m.put("a", a)
    with pytest.raises(SessionAdmissionError):
        m.put("b", SessionState(attrs={"y": torch.zeros(25)}))
    assert m.peek("a").parked == ()  # type: ignore[union-attr]
    got = m.get("a")
    assert tree_equal(got, a)
    assert alias_graph(got) == alias_graph(a)
    assert nbytes_by_device(got) == nbytes_by_device(a)


@pytest.mark.parametrize("tier", TIERS)
def test_objects_sharing_storages_only_among_themselves_park_together(
    tier: str, tmp_path: Path
) -> None:
    # The chain's attribute is a storage of its own: every object is parked, in one handle,
    # and they come back sharing what they shared.
    a = _chain(3)
    a = a.with_attrs(x=torch.zeros(2))
    m = SessionStateManager(
        on_full="refuse", max_bytes={"cpu": 160}, park_tier=tier, spool_dir=tmp_path
    )
    m.put("a", a)
    m.put("b", SessionState(attrs={"y": torch.zeros(25)}))
    assert m.peek("a").parked == ("cache0", "cache1", "cache2")  # type: ignore[union-attr]
    m.drop("b")
    got = m.get("a")
    assert tree_equal(got, a)
    assert alias_graph(got) == alias_graph(a)
    assert nbytes_by_device(got) == nbytes_by_device(a)


def test_stats_keys_unchanged_without_a_budget() -> None:
    m = SessionStateManager()
    m.put("a", parkable_record())
    assert set(m.stats()) == {
        "sessions",
        "max_sessions",
        "hits",
        "misses",
        "evictions",
        "total_nbytes",
        "nbytes:cpu",
        "forks",
        "shared_sessions",
    }


def test_max_bytes_validation_messages() -> None:
    msg = (
        "`max_bytes` key 'cuda' (str) is not a device string with its index; name each "
        "budgeted device as tensors report it, e.g. 'cuda:0' or 'cpu'."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        SessionStateManager(max_bytes={"cuda": 1})
    with pytest.raises(TypeError, match=re.escape("`max_bytes` must map device strings")):
        SessionStateManager(max_bytes=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=re.escape("`park_tier` must be 'host' or 'disk', got")):
        SessionStateManager(park_tier="ssd")  # type: ignore[arg-type]


# -- faults ----------------------------------------------------------------------------------------


def test_park_failing_half_way_leaves_the_session_resident_and_intact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    size = _session_bytes()
    m = SessionStateManager(max_bytes={"cpu": size})
    a = parkable_record(fill=1)
    m.put("a", a)
    real = park_module.park_into_slots
    calls = {"n": 0}

    def failing(sources: Any, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        real(sources[:1])  # half the work done, then the failure
        raise OSError("injected: no memory for the host copy.")  # a message ends a sentence

    monkeypatch.setattr(park_module, "park_into_slots", failing)
    b = parkable_record(fill=2)
    with pytest.raises(ParkingError, match=re.escape("Cannot park session 'a' (objects")) as info:
        m.put("b", b)
    assert "host copy. The session is left resident and intact" in str(info.value)
    assert calls["n"] == 1
    assert m.session_ids() == ["a"]
    assert m.peek("a").parked == ()  # type: ignore[union-attr]
    assert tree_equal(m.peek("a"), a)
    monkeypatch.undo()
    m.put("b", b)  # the same put succeeds once parking works
    assert m.peek("a").parked  # type: ignore[union-attr]
    assert tree_equal(m.get("a"), a)


def test_disk_full_leaves_the_session_resident(tmp_path: Path) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the spool directory should be")
    size = _session_bytes()
    m = SessionStateManager(max_bytes={"cpu": size}, park_tier="disk", spool_dir=blocked)
    m.put("a", parkable_record(fill=1))
    with pytest.raises(ParkingError, match=re.escape("Cannot park session 'a'")):
        m.put("b", parkable_record(fill=2))
    assert m.session_ids() == ["a"]
    assert m.peek("a").parked == ()  # type: ignore[union-attr]


def test_unpark_failing_leaves_it_parked_and_a_retry_succeeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    size = _session_bytes()
    m = SessionStateManager(max_bytes={"cpu": size})
    a = parkable_record(fill=1)
    m.put("a", a)
    m.put("b", parkable_record(fill=2))
    real = park_module.copy_storages_to_devices

    def failing(buffers: Any, devices: Any) -> Any:
        real(buffers[:1], devices[:1])
        raise RuntimeError("injected: device allocation failed.")  # a message ends a sentence

    monkeypatch.setattr(park_module, "copy_storages_to_devices", failing)
    msg = "Cannot unpark session 'a' (objects ['cache', 'ring']) from the host tier: injected"
    with pytest.raises(ParkingError, match=re.escape(msg)) as info:
        m.get("a")
    assert "failed. The session stays parked and intact" in str(info.value)  # one period
    assert m.peek("a").parked == ("cache", "ring")  # type: ignore[union-attr]
    assert m.stats()["unparks"] == 0
    monkeypatch.undo()
    got = m.get("a")
    assert got is not None
    assert tree_equal(got, a)
    assert m.stats()["unparks"] == 1


def test_snapshot_of_a_parked_session_saves_its_values(tmp_path: Path) -> None:
    m = SessionStateManager(max_bytes={"cpu": _session_bytes()})
    a = parkable_record(fill=1)
    m.put("a", a)
    m.put("b", parkable_record(fill=2))
    assert m.peek("a").parked  # type: ignore[union-attr]
    m.snapshot("a", tmp_path / "a.safetensors")
    assert tree_equal(ss.load_state(tmp_path / "a.safetensors"), a)


# -- threads ---------------------------------------------------------------------------------------


def _advance(state: SessionState, k: int) -> SessionState:
    cache = state.object("cache")
    assert isinstance(cache, TensorCache)
    a, _, _ = cache.view()
    new = (a + k, (a + k)[2:], None)
    return state.update_object("cache", lambda c: c.commit(new)).with_attrs(step=k)


def test_threads_under_a_budget_match_a_serial_run() -> None:
    size = _session_bytes()
    sessions, steps = 6, 12

    def run(manager: SessionStateManager, sid: str) -> list[torch.Tensor]:
        outs = []
        for k in range(steps):
            state = manager.get_or_create(sid, lambda: parkable_record(fill=float(ord(sid[-1]))))
            state = _advance(state, k)
            manager.put(sid, state)
            outs.append(state.object("cache").view()[0].clone())
        return outs

    ids = [f"s{i}" for i in range(sessions)]
    serial_manager = SessionStateManager()
    serial = {sid: run(serial_manager, sid) for sid in ids}

    budgeted = SessionStateManager(max_bytes={"cpu": 3 * size})
    threaded: dict[str, list[torch.Tensor]] = {}
    errors: list[BaseException] = []

    def worker(sid: str) -> None:
        try:
            threaded[sid] = run(budgeted, sid)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(sid,)) for sid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for sid in ids:
        assert all(torch.equal(x, y) for x, y in zip(serial[sid], threaded[sid], strict=True))
        stored = budgeted.peek(sid)
        assert stored is not None
        assert tree_equal(stored.unpark(), serial_manager.peek(sid))
    stats = budgeted.stats()
    assert stats["evictions"] == 0
    assert stats["parks"] > 0
    assert stats["nbytes:cpu"] <= 3 * size
    recount = nbytes_by_device([budgeted.peek(sid) for sid in ids])
    assert stats["nbytes:cpu"] == recount["cpu"] == stats["total_nbytes"]


def test_spool_directory_is_removed_with_the_manager(tmp_path: Path) -> None:
    m = SessionStateManager(
        max_bytes={"cpu": _session_bytes()}, park_tier="disk", spool_dir=tmp_path
    )
    m.put("a", parkable_record(fill=1))
    m.put("b", parkable_record(fill=2))
    (spool,) = list(tmp_path.iterdir())
    assert any(spool.iterdir())
    del m
    import gc

    gc.collect()
    assert not os.path.exists(spool)


def test_a_disk_unpark_moves_each_storage_to_its_device_once() -> None:
    # The disk tier reads into host memory first (checked, no device memory), then copies
    # each storage to the device it came from; meta stands in for an accelerator here.
    x = torch.arange(8.0)
    host = [x, x[2:].view(2, 3), torch.ones(2)]
    moved = park_module._to_devices(host, [torch.device("meta")] * 2 + [torch.device("cpu")])
    assert [t.device.type for t in moved] == ["meta", "meta", "cpu"]
    assert moved[0].untyped_storage()._cdata == moved[1].untyped_storage()._cdata
    assert (moved[1].shape, moved[1].stride(), moved[1].storage_offset()) == ((2, 3), (3, 1), 2)
    assert moved[2] is host[2] or torch.equal(moved[2], host[2])


def test_a_cause_without_a_message_is_named_by_its_type(monkeypatch: pytest.MonkeyPatch) -> None:
    size = _session_bytes()
    m = SessionStateManager(max_bytes={"cpu": size})
    m.put("a", parkable_record(fill=1))

    def failing(sources: Any, *args: Any, **kwargs: Any) -> Any:
        raise MemoryError  # no message

    monkeypatch.setattr(park_module, "park_into_slots", failing)
    with pytest.raises(ParkingError) as info:
        m.put("b", parkable_record(fill=2))
    assert "on the host tier: MemoryError. The session is left resident" in str(info.value)
