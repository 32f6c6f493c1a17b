"""Snapshots: round trips are bit-identical, keep aliasing and bytes, and never unpickle."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load as safetensors_load

import sessionstate as ss
from sessionstate import (
    LatentBuffer,
    SessionState,
    SessionStateManager,
    dumps_state,
    load_state,
    loads_state,
    nbytes_by_device,
    record,
    save_state,
    static_field,
    tree_equal,
    tree_leaves,
)
from sessionstate.cli import main
from sessionstate.testing import DEFAULT_DTYPES, TensorPool, session_states, tensor_pools

# NaN with a payload, and -0.0, per float width: bits that a value-level copy could lose.
_SPECIAL_BITS = {
    torch.float16: (torch.int16, [0x7E01, -0x8000]),
    torch.bfloat16: (torch.int16, [0x7FC1, -0x8000]),
    torch.float32: (torch.int32, [0x7FC00001, -0x80000000]),
    torch.float64: (torch.int64, [0x7FF8000000000001, -0x8000000000000000]),
}


def _with_special_values(pool: TensorPool) -> TensorPool:
    """Write NaN payloads and -0.0 into the pool's float and complex base allocations.

    Views derived from a base share its allocation, so they see the values too.
    """
    for entry in pool.entries:
        t = entry.tensor
        if entry.derivation != "base" or t.numel() == 0:
            continue
        if t.is_complex():
            t = torch.view_as_real(t)
        if t.dtype in _SPECIAL_BITS:
            as_int, bits = _SPECIAL_BITS[t.dtype]
            flat = t.view(-1).view(as_int)
            for i, b in enumerate(bits[: flat.numel()]):
                flat[i] = b
    return pool


_POOLS = tensor_pools(
    devices=("cpu",),
    dtypes=(*DEFAULT_DTYPES, torch.complex64, torch.complex128),
).map(_with_special_values)


def alias_groups(tree: Any) -> list[int]:
    """For each tensor leaf, the index of the first tensor leaf sharing its storage."""
    first: dict[int, int] = {}
    out = []
    for i, leaf in enumerate(t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)):
        out.append(first.setdefault(leaf.untyped_storage()._cdata, i))
    return out


def assert_round_trip(original: Any, loaded: Any) -> None:
    assert tree_equal(loaded, original)
    assert nbytes_by_device(loaded) == nbytes_by_device(original)
    assert alias_groups(loaded) == alias_groups(original)
    for a, b in zip(tree_leaves(loaded), tree_leaves(original), strict=True):
        if isinstance(a, torch.Tensor):
            assert (a.stride(), a.storage_offset()) == (b.stride(), b.storage_offset())


@given(state=session_states(pools=_POOLS), in_file=st.booleans())
def test_round_trip_is_bit_identical_and_keeps_aliases(
    state: SessionState, in_file: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if in_file:
        path = tmp_path_factory.mktemp("snap") / "s.safetensors"
        save_state(state, path)
        loaded = load_state(path, expect=SessionState)
    else:
        loaded = loads_state(dumps_state(state), expect=SessionState)
    assert_round_trip(state, loaded)


@record
class Settings:
    """A record with a tensor child and static configuration of several JSON kinds."""

    weights: Any
    sizes: tuple[int, ...] = static_field(default=(1, 2))
    label: str | None = static_field(default=None)
    scale: float = static_field(default=-0.0)


def test_nested_containers_records_and_json_leaves_round_trip() -> None:
    x = torch.arange(12.0).view(3, 4)
    tree = {
        "settings": Settings(weights=[x, x.t()], sizes=(3, 4), label="w", scale=float("inf")),
        "values": (True, 2**70, -0.0, "text", None, [1.5, {"k": 3}]),
        7: torch.zeros(0, 5),
        False: x[1:, ::2],
    }
    loaded = loads_state(dumps_state(tree))
    assert_round_trip(tree, loaded)
    assert list(loaded) == list(tree)
    assert type(loaded["values"]) is tuple
    assert str(loaded["values"][2]) == "-0.0"
    assert loaded["settings"].sizes == (3, 4)
    assert loaded["settings"].scale == float("inf")


def test_one_tensor_object_twice_loads_as_one_object() -> None:
    x = torch.arange(4)
    a, b, c = loads_state(dumps_state((x, x, x.clone())))
    assert a is b
    assert c.untyped_storage()._cdata != a.untyped_storage()._cdata


def test_views_of_one_storage_with_different_dtypes_share_it_again() -> None:
    x = torch.arange(8, dtype=torch.float32)
    tree = [x, x.view(torch.int32)[2:], x.view(torch.uint8).view(8, 4)[:, 1]]
    loaded = loads_state(dumps_state(tree))
    assert_round_trip(tree, loaded)
    assert len({t.untyped_storage().data_ptr() for t in loaded}) == 1


def test_lazy_conjugate_and_negative_views_keep_their_bits() -> None:
    z = torch.complex(torch.arange(3.0), torch.arange(3.0) + 0.5)
    tree = [z, z.conj(), z.conj().imag]
    assert tree[2].is_neg()
    loaded = loads_state(dumps_state(tree))
    assert_round_trip(tree, loaded)
    assert [t.is_conj() for t in loaded] == [False, True, False]
    assert [t.is_neg() for t in loaded] == [False, False, True]


def test_loaded_tensors_own_fresh_memory(tmp_path: Path) -> None:
    x = torch.arange(16, dtype=torch.int64)
    data = bytearray(dumps_state({"x": x}))
    from_bytes = loads_state(data)["x"]
    data[-8:] = b"\xff" * 8
    path = tmp_path / "s.safetensors"
    save_state({"x": x}, path)
    from_file = load_state(path)["x"]
    with path.open("r+b") as f:
        f.seek(-8, 2)
        f.write(b"\xff" * 8)
    assert torch.equal(from_bytes, x)
    assert torch.equal(from_file, x)
    for t in (from_bytes, from_file):
        assert t.untyped_storage().data_ptr() % 16 == 0


def test_loading_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the snapshot loader unpickled")

    ring = LatentBuffer(name="frames", dim=0).allocate(maxlen=2)
    ring = ring.commit(torch.ones(1, 3)).commit(torch.zeros(1, 3))
    state = SessionState(objects={"frames": ring}, attrs={"alias": ring.view()[0], "n": 4})
    path = tmp_path / "s.safetensors"
    save_state(state, path)
    data = dumps_state(state)
    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    assert_round_trip(state, load_state(path))
    assert_round_trip(state, loads_state(data))


def test_file_opens_with_plain_safetensors(tmp_path: Path) -> None:
    x = torch.arange(6, dtype=torch.float16)
    state = SessionState(attrs={"x": x, "y": x[2:], "z": torch.ones(2, dtype=torch.bool)})
    path = tmp_path / "s.safetensors"
    save_state(state, path, metadata={"who": "test"})
    with safe_open(str(path), framework="pt") as f:
        assert sorted(f.keys()) == ["storage.0", "storage.1"]
        document = json.loads(f.metadata()["sessionstate"])
        stored = [f.get_tensor(f"storage.{i}") for i in range(2)]
    assert document["format_version"] == 4
    assert document["library_version"] == ss.__version__
    assert document["torch_version"] == torch.__version__
    assert document["metadata"] == {"who": "test"}
    assert [s["nbytes"] for s in document["storages"]] == [12, 2]
    assert torch.equal(stored[0], x.view(torch.uint8))
    assert torch.equal(stored[1], torch.ones(2, dtype=torch.uint8))
    assert [v["offset"] for v in document["views"]] == [0, 2, 0]


def test_bytes_and_file_are_one_safetensors_container_a_function_of_the_record(
    tmp_path: Path,
) -> None:
    # Twelve storages (names past `storage.9` sort differently as strings), one empty.
    tensors = [torch.arange(i, dtype=torch.int16) for i in range(12)]
    state = SessionState(attrs={f"t{i}": t for i, t in enumerate(tensors)})
    data = dumps_state(state, metadata={"who": "test"})
    path = tmp_path / "s.safetensors"
    save_state(state, path, metadata={"who": "test"})
    assert path.read_bytes() == data
    assert dumps_state(state, metadata={"who": "test"}) == data
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0  # the data section starts aligned, as safetensors aligns it
    stored = safetensors_load(data)
    assert sorted(stored) == sorted(f"storage.{i}" for i in range(12))
    for i, t in enumerate(tensors):
        assert torch.equal(stored[f"storage.{i}"], t.view(torch.uint8))
    assert tree_equal(loads_state(data), state)


def test_save_replaces_a_file_and_leaves_no_partial(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    save_state({"n": 1}, path)
    save_state({"n": 2}, path)
    assert load_state(path) == {"n": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]


def test_load_onto_a_device_moves_every_storage_once() -> None:
    x = torch.arange(4.0)
    a, b = loads_state(dumps_state((x, x[1:])), device="cpu")
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    assert a.device == torch.device("cpu")


def test_loader_imports_nothing_outside_the_library() -> None:
    import sys

    assert "this" not in sys.modules
    assert ss._storage.resolve_record("this:Zen") is None
    assert "this" not in sys.modules


# -- the manager ----------------------------------------------------------------------------------


def _state(value: float) -> SessionState:
    return SessionState(attrs={"x": torch.full((4,), value)})


def test_manager_snapshot_is_a_peek(tmp_path: Path) -> None:
    m = SessionStateManager(max_sessions=2)
    m.put("a", _state(1.0))
    m.put("b", _state(2.0))
    before = m.stats()
    m.snapshot("a", tmp_path / "a.safetensors")
    assert m.session_ids() == ["a", "b"]
    assert m.stats() == before
    restored = load_state(tmp_path / "a.safetensors", expect=SessionState)
    assert tree_equal(restored, _state(1.0))


def test_manager_restore_is_admitted_like_a_put(tmp_path: Path) -> None:
    path = tmp_path / "a.safetensors"
    save_state(_state(7.0), path)
    m = SessionStateManager(max_sessions=2)
    m.put("a", _state(1.0))
    m.put("b", _state(2.0))
    restored = m.restore("c", path)
    assert m.session_ids() == ["b", "c"]
    assert m.stats()["evictions"] == 1
    assert m.peek("c") is restored
    assert tree_equal(restored, _state(7.0))

    full = SessionStateManager(max_sessions=1, on_full="refuse")
    full.put("a", _state(1.0))
    with pytest.raises(ss.SessionAdmissionError):
        full.restore("c", path)
    assert full.session_ids() == ["a"]


def test_manager_restore_of_a_bad_file_keeps_the_stored_record(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"not a snapshot at all")
    m = SessionStateManager()
    stored = _state(1.0)
    m.put("a", stored)
    with pytest.raises(ss.SnapshotError):
        m.restore("a", path)
    assert m.peek("a") is stored
    assert tree_equal(stored, _state(1.0))


# -- sessionstate inspect -------------------------------------------------------------------------


def _inspected_state() -> SessionState:
    x = torch.zeros(8)
    ring = LatentBuffer(name="frames", dim=0).allocate(maxlen=2).commit(x.view(2, 4))
    return SessionState(objects={"frames": ring}, attrs={"alias": x[1:], "step": 3})


def test_inspect_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.safetensors"
    m = SessionStateManager()
    state = _inspected_state()
    m.put("cam-1", state)
    m.snapshot("cam-1", path, metadata={"note": "hello"})
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format_version"] == 4
    assert report["metadata"] == {"note": "hello", "session_id": "cam-1"}
    assert report["root"] == "SessionState()"
    rows = {row["name"]: row for row in report["values"]}
    assert list(rows) == ["frames", "alias", "step"]
    by_value = state.nbytes_by_value()
    assert {name: row["nbytes"] for name, row in rows.items()} == by_value
    assert rows["alias"]["structure"] == "float32[7]"
    assert rows["frames"]["bucket"] == "objects"
    assert report["nbytes"] == nbytes_by_device(state)


def test_inspect_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.safetensors"
    save_state(_inspected_state(), path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    for text in ("format_version", "frames", "alias", "step", "float32[7]"):
        assert text in out


def test_inspect_of_a_bad_file_fails_with_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 4))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sessionstate inspect: error: Snapshot `{path}` is truncated")
