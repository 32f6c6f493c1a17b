"""Snapshots attacked: files an attacker writes, bytes corrupted in flight, saves that fail.

Every hostile input gets a `SnapshotError` naming the value and the fix (pinned here), never a
raw error from deep inside json or torch, and never a different record loaded silently; a
loader allocates no more than the file's storages hold. A save that fails midway leaves the
previous file loadable and nothing else behind; saves racing to one path never collide.
"""

from __future__ import annotations

import json
import os
import random
import re
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import sessionstate as ss
from sessionstate import (
    KVPool,
    LatentBuffer,
    SessionState,
    SessionStateManager,
    SnapshotError,
    dumps_state,
    load_state,
    loads_state,
    save_state,
    tree_equal,
)
from sessionstate._frozen import FrozenDict
from sessionstate._storage import _decode as decode
from sessionstate._storage import inspect_snapshot
from sessionstate._storage._format import MAX_DEPTH
from sessionstate.cli import main
from tests.support import (
    DATA,
    join_header,
    rewrite,
    rewrite_header,
    rewrite_text,
    split_header,
    xxh3_hex,
)


def _state() -> SessionState:
    ring = LatentBuffer(name="ring", dim=0).allocate(maxlen=2).commit(torch.arange(4.0)[None])
    return SessionState(objects={"ring": ring}, attrs={"step": 7, "x": torch.zeros(2)})


def _refused(data: bytes, msg: str) -> None:
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(data)


# -- the document's checksum (format 3: CRC-32; format 4 on: xxh3-64) -----------------------------

V3 = DATA / "snapshots" / "0.1.0.dev0" / "plain_v3.safetensors"
"""A committed format-3 file (CRC-32 checksums): the checks of older files stay in force."""


def test_a_changed_value_in_the_header_fails_its_checksum() -> None:
    data = dumps_state(_state())
    header, _ = split_header(data)
    stored = header["__metadata__"]["sessionstate.xxh3"]
    forged = rewrite_text(data, lambda t: t.replace('"value":7', '"value":3'), sign_it=False)
    text = split_header(forged)[0]["__metadata__"]["sessionstate"]
    _refused(
        forged,
        f"Snapshot (bytes) is corrupt: its JSON document fails its xxh3-64 check (stored "
        f"{stored!r}, computed {xxh3_hex(text.encode())}); restore it from an intact copy.",
    )


def test_a_changed_value_in_a_format_3_header_fails_its_crc32() -> None:
    data = V3.read_bytes()
    stored = split_header(data)[0]["__metadata__"]["sessionstate.crc32"]
    forged = rewrite_text(data, lambda t: t.replace('"value":7', '"value":3'), sign_it=False)
    text = split_header(forged)[0]["__metadata__"]["sessionstate"]
    _refused(
        forged,
        f"Snapshot (bytes) is corrupt: its JSON document fails its CRC-32 check (stored "
        f"{stored!r}, computed {zlib.crc32(text.encode())}); restore it from an intact copy.",
    )


def test_a_lowered_format_version_is_still_checked() -> None:
    # A flip that lowered the version to one using CRC-32 still meets the xxh3-64 it carries.
    data = dumps_state(_state())
    forged = rewrite_text(
        data, lambda t: t.replace('"format_version":4', '"format_version":3'), sign_it=False
    )
    with pytest.raises(SnapshotError, match=re.escape("fails its xxh3-64 check")):
        loads_state(forged)


@pytest.mark.parametrize(
    ("source", "key", "version"),
    [("v4", "sessionstate.xxh3", 4), ("v3", "sessionstate.crc32", 3)],
)
def test_a_file_without_its_versions_document_checksum_is_refused(
    source: str, key: str, version: int
) -> None:
    original = dumps_state(_state()) if source == "v4" else V3.read_bytes()
    data = rewrite_header(original, lambda h: h["__metadata__"].pop(key))
    _refused(
        data,
        f"Snapshot (bytes) has no `{key}` checksum of its document, which format version "
        f"{version} requires; restore it from an intact copy, or write it again.",
    )


def test_a_format_4_file_signed_with_a_crc32_instead_is_refused() -> None:
    def downgrade(h: dict[str, Any]) -> None:
        meta = h["__metadata__"]
        del meta["sessionstate.xxh3"]
        meta["sessionstate.crc32"] = str(zlib.crc32(meta["sessionstate"].encode()))

    _refused(
        rewrite_header(dumps_state(_state()), downgrade),
        "Snapshot (bytes) has no `sessionstate.xxh3` checksum of its document, which format "
        "version 4 requires; restore it from an intact copy, or write it again.",
    )


@pytest.mark.parametrize("source", ["v4", "v3"])
def test_random_header_bit_flips_never_load_a_different_record(source: str) -> None:
    data = dumps_state(_state()) if source == "v4" else V3.read_bytes()
    state = loads_state(data)
    (n,) = struct.unpack("<Q", data[:8])
    rng = random.Random(0)
    refused = 0
    for _ in range(200):
        at = rng.randrange(8, 8 + n)
        flipped = bytearray(data)
        flipped[at] ^= 1 << rng.randrange(8)
        try:
            loaded = loads_state(bytes(flipped))
        except SnapshotError:
            refused += 1
            continue
        assert tree_equal(loaded, state), f"a flip at byte {at} loaded a different record"
    assert refused > 150


# -- storage checksums on the bytes path (issue 21, item 4) ---------------------------------------


def test_corrupt_storage_bytes_through_loads_state_give_snapshot_error() -> None:
    data = bytearray(dumps_state(_state()))
    data[-3] ^= 0x10  # inside storage 1, the attr `x`
    _refused(
        bytes(data),
        "Snapshot (bytes) is corrupt: storage 1 (8 bytes) fails its xxh3-64 check; restore it "
        "from an intact copy.",
    )


def test_corrupt_storage_bytes_of_a_format_3_file_fail_its_crc32() -> None:
    data = bytearray(V3.read_bytes())
    data[-3] ^= 0x10  # inside storage 3 (10 bytes), the last in the file
    _refused(
        bytes(data),
        "Snapshot (bytes) is corrupt: storage 3 (10 bytes) fails its CRC-32 check; restore it "
        "from an intact copy.",
    )


def test_corrupt_bytes_restored_into_a_manager_change_nothing() -> None:
    manager = SessionStateManager()
    path_state = _state()
    manager.put("s", path_state)
    data = bytearray(dumps_state(path_state.with_attrs(step=8)))
    data[-3] ^= 0x10
    with pytest.raises(SnapshotError, match=re.escape("fails its xxh3-64 check")):
        manager.put("s", loads_state(bytes(data)))
    assert manager.peek("s") is path_state


def test_a_long_storage_is_checked_across_read_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # A loader hashes a storage chunk by chunk as it reads it; a flip in any chunk is caught.
    monkeypatch.setattr(decode, "CHUNK", 64)
    x = torch.arange(100, dtype=torch.float32)
    data = dumps_state({"x": x})
    assert torch.equal(loads_state(data)["x"], x)
    for at in (len(data) - 400, len(data) - 200, len(data) - 1):
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        with pytest.raises(SnapshotError, match=re.escape("fails its xxh3-64 check")):
            loads_state(bytes(flipped))


# -- storages: sizes, offsets, devices -------------------------------------------------------------


def _entry_msg(data: bytes, i: int = 0) -> str:
    header, _ = split_header(data)
    document = json.loads(header["__metadata__"]["sessionstate"])
    entry, described = header[f"storage.{i}"], document["storages"][i]
    return (
        f"Snapshot (bytes) has no valid tensor `storage.{i}` for storage {i} (entry "
        f"{entry!r:.80}, described as {described!r:.80}): sizes and offsets must be ints from 0; "
        "write it again."
    )


def test_a_negative_data_offset_is_refused_before_anything_is_allocated() -> None:
    def negative(h: dict[str, Any]) -> None:
        h["storage.0"]["data_offsets"] = [-(2**40), 16]
        h["storage.0"]["shape"] = [2**40 + 16]

    data = rewrite(rewrite_header(dumps_state(_state()), negative), _nbytes(0, 2**40 + 16))
    _refused(data, _entry_msg(data))


def _nbytes(i: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(doc: dict[str, Any]) -> None:
        doc["storages"][i]["nbytes"] = value

    return edit


@pytest.mark.parametrize("value", [-16, 16.0, "16", True, 2**70])
def test_a_storage_size_that_is_not_a_plain_int_is_refused(value: Any) -> None:
    data = rewrite(dumps_state(_state()), _nbytes(0, value))
    _refused(data, _entry_msg(data))


def test_storages_that_overlap_in_the_file_are_refused() -> None:
    state = SessionState(attrs={"a": torch.zeros(4), "b": torch.ones(4)})

    def same_bytes(h: dict[str, Any]) -> None:
        h["storage.1"]["data_offsets"] = h["storage.0"]["data_offsets"]

    _refused(
        rewrite_header(dumps_state(state), same_bytes),
        "Snapshot (bytes) is inconsistent: storages 0 and 1 overlap in its data section (each "
        "byte of the file backs one storage at most); write it again.",
    )


@pytest.mark.parametrize(
    ("device", "why"),
    [
        ("foo", "which is not a device string such as 'cpu' or 'cuda:0'"),
        ([1], "which is not a device string such as 'cpu' or 'cuda:0'"),
        (3, "which is not a device string such as 'cpu' or 'cuda:0'"),
        ("meta", "which holds no data, so no snapshot storage comes from it"),
    ],
)
def test_a_storage_device_that_names_no_real_device_is_refused(device: Any, why: str) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["storages"][0]["device"] = device

    _refused(
        rewrite(dumps_state(_state()), edit),
        f"Snapshot (bytes) holds storage 0 for device {device!r}, {why}; write it again, or "
        "pass `device=` only at load.",
    )


@pytest.mark.parametrize(
    "value", [123, "78AF5F94892F3950", "78af5f94892f395", "0x78af5f94892f39", None, True]
)
def test_a_storage_checksum_that_is_not_16_hex_digits_is_refused(value: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["storages"][0]["xxh3"] = value

    _refused(
        rewrite(dumps_state(_state()), edit),
        f"Snapshot (bytes) has no valid xxh3-64 checksum for storage 0 (got {value!r}; it must "
        "be 16 lowercase hex digits); write it again.",
    )


@pytest.mark.parametrize("value", [-1, 2**32, "627055499", None])
def test_a_format_3_storage_checksum_that_is_not_a_32_bit_int_is_refused(value: Any) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["storages"][0]["crc32"] = value

    _refused(
        rewrite(V3.read_bytes(), edit),
        f"Snapshot (bytes) has no valid CRC-32 checksum for storage 0 (got {value!r}; it must be "
        "an int from 0 to 2**32 - 1); write it again.",
    )


# -- views: every number exact and in range --------------------------------------------------------


_VIEW_EDITS: list[tuple[str, Any, str]] = [
    ("storage", 0.7, "`storage` must be the index of one of its 2 storages"),
    ("storage", True, "`storage` must be the index of one of its 2 storages"),
    ("storage", 2, "`storage` must be the index of one of its 2 storages"),
    ("storage", -1, "`storage` must be the index of one of its 2 storages"),
    ("dtype", "float128", "`dtype` must be one of "),
    ("shape", [2.9, 3.9], "`shape` must hold ints from 0 to 2**62"),
    ("shape", [-1, 4], "`shape` must hold ints from 0 to 2**62"),
    ("shape", [True, 4], "`shape` must hold ints from 0 to 2**62"),
    ("shape", {"a": 1}, "`shape` must be a list of at most 64 ints"),
    ("shape", [1] * 65, "`shape` must be a list of at most 64 ints"),
    ("stride", [4, -1], "`stride` must hold ints from 0 to 2**62"),
    ("stride", [4], "`shape` and `stride` differ in length"),
    ("offset", -4, "`offset` must be an int from 0 to 2**62"),
    ("offset", "0", "`offset` must be an int from 0 to 2**62"),
    ("offset", 0.0, "`offset` must be an int from 0 to 2**62"),
    ("conj", "yes", "`conj` and `neg` must be true or false"),
    ("neg", 1, "`conj` and `neg` must be true or false"),
]


@pytest.mark.parametrize(("key", "value", "why"), _VIEW_EDITS)
def test_a_view_with_a_loose_or_out_of_range_number_is_refused(
    key: str, value: Any, why: str
) -> None:
    seen: dict[str, Any] = {}

    def edit(doc: dict[str, Any]) -> None:
        doc["views"][0][key] = value
        seen.update(doc["views"][0])

    data = rewrite(dumps_state(_state()), edit)
    with pytest.raises(SnapshotError) as info:
        loads_state(data)
    prefix = f"Snapshot (bytes) has an invalid description of view 0: {seen!r:.120} ({why}"
    assert str(info.value).startswith(prefix)
    assert str(info.value).endswith("; write it again.")


def test_an_expanded_view_of_an_overflowing_element_count_is_refused() -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["views"][0].update(shape=[2**40, 2**40], stride=[0, 0])

    data = rewrite(dumps_state(_state()), edit)
    raw = {"storage": 0, "dtype": "float32", "shape": [2**40, 2**40], "stride": [0, 0]}
    raw["offset"] = 0
    _refused(
        data,
        f"Snapshot (bytes) has an invalid description of view 0: {raw!r:.120} (it holds more "
        "than 2**62 elements); write it again.",
    )


def test_the_view_list_must_be_a_list() -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["views"] = {"a": 1}

    _refused(
        rewrite(dumps_state(_state()), edit),
        "Snapshot (bytes) has no view list in its document (got {'a': 1}); write it again.",
    )


# -- the tree: nesting, keys, duplicates, huge numbers ---------------------------------------------


def test_a_nesting_bomb_deeper_than_json_can_parse_is_refused() -> None:
    bomb = "[" * 200_000 + "]" * 200_000

    def edit(text: str) -> str:
        return text.replace('{"type":"int","value":7}', bomb)

    _refused(
        rewrite_text(dumps_state(_state()), edit),
        "Snapshot (bytes) has a `sessionstate` document nested too deeply to read; write it again.",
    )


def test_a_tree_nested_deeper_than_the_limit_is_refused() -> None:
    deep: dict[str, Any] = {"type": "none"}
    for _ in range(MAX_DEPTH + 5):
        deep = {"type": "list", "items": [deep]}

    def edit(doc: dict[str, Any]) -> None:
        doc["tree"] = deep

    key = "[0]" * (MAX_DEPTH + 1)
    _refused(
        rewrite(dumps_state(_state()), edit),
        f"Snapshot (bytes) has an invalid node at `{key[:200]}` (nested deeper than 200 "
        "levels); write it again.",
    )


def test_saving_a_tree_nested_deeper_than_the_limit_is_refused() -> None:
    deep: Any = None
    for _ in range(MAX_DEPTH + 1):
        deep = [deep]
    key = "[0]" * (MAX_DEPTH + 1)
    msg = (
        f"Cannot snapshot the value at `{key[:200]}`: it is nested deeper than 200 levels of "
        "containers and records, the most a snapshot holds. Flatten the structure (e.g. a "
        "dict of tensors instead of nested lists)."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        dumps_state(deep)


def test_a_5000_digit_int_is_refused() -> None:
    data = rewrite_text(
        dumps_state(_state()), lambda t: t.replace('"value":7', '"value":' + "1" * 5000)
    )
    _refused(data, "Snapshot (bytes) has a `sessionstate` document that cannot be read (")


def test_an_unhashable_dict_key_is_refused() -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"]["fields"]["attrs"]["items"][0][0] = [1]

    _refused(
        rewrite(dumps_state(_state()), edit),
        "Snapshot (bytes) has an invalid node at `attrs` (dict key [1], which is not a str, int "
        "or bool); write it again.",
    )


def test_a_dict_key_given_twice_is_refused() -> None:
    def edit(doc: dict[str, Any]) -> None:
        items = doc["tree"]["fields"]["attrs"]["items"]
        items.append(["step", {"type": "int", "value": 3}])

    _refused(
        rewrite(dumps_state(_state()), edit),
        "Snapshot (bytes) has an invalid node at `attrs` (dict key 'step' given twice); write it "
        "again.",
    )


def test_a_second_metadata_entry_in_the_safetensors_header_is_refused() -> None:
    header, body = split_header(dumps_state(_state()))
    text = json.dumps(header)
    forged = text[:-1] + ', "__metadata__": {"sessionstate": "{}"}}'
    _refused(
        join_header(forged, body),
        "Snapshot (bytes) has the key '__metadata__' twice in one object of its safetensors "
        "header, so it is ambiguous which one holds; write it again.",
    )


def test_a_document_key_given_twice_is_refused() -> None:
    def edit(text: str) -> str:
        return text.replace('"metadata":{}', '"metadata":{},"metadata":{"x":"y"}')

    _refused(
        rewrite_text(dumps_state(_state()), edit),
        "Snapshot (bytes) has the key 'metadata' twice in one object of its `sessionstate` "
        "document, so it is ambiguous which one holds; write it again.",
    )


@pytest.mark.parametrize(
    ("node", "what"),
    [
        ({"type": "int", "value": 7.0}, "int holding 7.0"),
        ({"type": "int", "value": True}, "int holding True"),
        ({"type": "bool", "value": 1}, "bool holding 1"),
        ({"type": "float", "value": "1e3"}, "float holding '1e3'"),
        ({"type": "tensor", "view": True}, "tensor view True of 2"),
        ({"type": "tensor", "view": 0.0}, "tensor view 0.0 of 2"),
        ({"type": "list", "items": {}}, "list without items"),
        ({"type": "pickle"}, "unknown node type 'pickle'"),
    ],
)
def test_a_malformed_node_is_refused(node: dict[str, Any], what: str) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["tree"]["fields"]["attrs"]["items"][0][1] = node

    _refused(
        rewrite(dumps_state(_state()), edit),
        f"Snapshot (bytes) has an invalid node at `attrs['step']` ({what}); write it again.",
    )


# -- KV payloads: a loader allocates only what the file holds --------------------------------------


def _kv_snapshot() -> bytes:
    pool = KVPool(4, block_tokens=4, token_shape=(2,), name="kv")
    handle = pool.append(pool.empty(), torch.ones(6, 2))
    return dumps_state(SessionState(attrs={"kv": handle}))


@pytest.mark.parametrize("blocks", [2**46, 1000])
def test_an_expanded_block_view_declaring_more_blocks_than_the_file_holds_is_refused(
    blocks: int,
) -> None:
    def edit(doc: dict[str, Any]) -> None:
        doc["views"][0].update(shape=[blocks, 4, 2], stride=[0, 2, 1])

    _refused(
        rewrite(_kv_snapshot(), edit),
        "Snapshot (bytes) holds `KVHandle` leaves that their class refuses to restore "
        f"(ValueError: pool 0 ('kv') declares {blocks} blocks as a view with strides (0, 2, 1) "
        "that overlaps itself, more blocks than the file holds); load it with the library "
        "version that wrote it, or write it again.",
    )


# -- parked objects are never snapshot content (issue 20, item 4) ----------------------------------


def test_saving_a_parked_object_is_refused() -> None:
    parked = _state().object("ring").park()
    state = SessionState(objects={"ring": parked})
    msg = (
        "Cannot snapshot the ParkedObject at `objects['ring']`, which is never valid snapshot "
        "content: its bytes are held by a park tier, outside the record. Unpark it first "
        "(`obj.unpark()`; `SessionStateManager.snapshot` unparks a session)."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dumps_state(state)


def test_a_file_holding_a_parked_object_is_refused_and_restore_changes_nothing(
    tmp_path: Path,
) -> None:
    from sessionstate import ParkedObject
    from sessionstate._storage._format import record_name

    parked = record_name(ParkedObject)

    def edit(doc: dict[str, Any]) -> None:
        ring = doc["tree"]["fields"]["objects"]["items"][0][1]
        ring["class"] = parked
        ring["fields"] = {"handle": {"type": "int", "value": 12345}}
        ring["static"] = {"name": {"type": "str", "value": "ring"}}

    path = tmp_path / "parked.safetensors"
    path.write_bytes(rewrite(dumps_state(_state()), edit))
    manager = SessionStateManager()
    before = _state()
    manager.put("s", before)
    msg = (
        f"Snapshot `{path}` holds a `{parked}` at `objects['ring']`, "
        "which is never valid snapshot content: its bytes are held by a park tier, outside the "
        "record; write the snapshot again from the unparked record."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        manager.restore("s", path)
    assert manager.peek("s") is before


# -- dict attributes round-trip (issue 20, item 13) ------------------------------------------------


def test_a_session_with_a_dict_attribute_round_trips(tmp_path: Path) -> None:
    x = torch.arange(3.0)
    state = SessionState(attrs={"cfg": {"ids": [1, 2], "w": x, "nested": {"a": x[1:]}}})
    assert isinstance(state.attrs["cfg"], FrozenDict)
    loaded = loads_state(dumps_state(state))
    assert tree_equal(loaded, state)
    assert isinstance(loaded.attrs["cfg"], FrozenDict)
    assert isinstance(loaded.attrs["cfg"]["nested"], FrozenDict)
    w, a = loaded.attrs["cfg"]["w"], loaded.attrs["cfg"]["nested"]["a"]
    assert a.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()

    manager = SessionStateManager()
    manager.put("s", state)
    manager.snapshot("s", tmp_path / "s.safetensors")
    restored = SessionStateManager()
    assert tree_equal(restored.restore("s", tmp_path / "s.safetensors"), state)


def test_a_frozen_dict_node_in_a_format_2_file_is_refused() -> None:
    state = SessionState(attrs={"cfg": {"a": 1}})

    def older(doc: dict[str, Any]) -> None:
        doc["format_version"] = 2

    _refused(
        rewrite(dumps_state(state), older),
        "Snapshot (bytes) has an invalid node at `attrs['cfg']` (unknown node type "
        "'frozendict'); write it again.",
    )


# -- inspect (issue 20, item 16) -------------------------------------------------------------------


def test_inspect_prints_markup_in_a_file_as_plain_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "s.safetensors"
    state = SessionState(attrs={"[/bold]": torch.zeros(2), "[red]x[/red]": 1})
    save_state(state, path, metadata={"note": "[/bold] and [link=x]y[/link]"})
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    for text in ("[/bold]", "[red]x[/red]", "[/bold] and [link=x]y[/link]"):
        assert text in out


@pytest.mark.parametrize(
    "edit",
    [
        lambda doc: doc["views"][0].update(storage=9),
        lambda doc: doc.update(tree={"type": "tensor", "view": 5}),
        lambda doc: doc.update(tree={"type": "record", "class": 3}),
        lambda doc: doc.update(metadata={"a": 1}),
        lambda doc: doc.pop("tree"),
    ],
)
def test_inspect_of_a_malformed_header_raises_snapshot_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: Callable[[dict[str, Any]], None]
) -> None:
    path = tmp_path / "s.safetensors"
    path.write_bytes(rewrite(dumps_state(_state()), edit))
    with pytest.raises(SnapshotError, match=re.escape(f"Snapshot `{path}` ")):
        inspect_snapshot(path)
    assert main(["inspect", str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"sessionstate inspect: error: Snapshot `{path}` ")


# -- saving: atomic, and safe to race (issue 21 item 3, issue 20 item 17) --------------------------


def test_a_save_failing_midway_leaves_the_previous_file_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.safetensors"
    before = _state()
    save_state(before, path)

    def fail_midway(filename: Path, header: bytes, data: Any, *, durable: bool) -> None:
        with open(filename, "wb") as f:
            f.write(header[:20])  # a partial header
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ss._storage._encode, "_write_file", fail_midway)
    with pytest.raises(OSError, match=re.escape("No space left on device")):
        save_state(before.with_attrs(step=8), path)
    assert tree_equal(load_state(path), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


def test_a_save_syncs_the_file_before_the_rename_and_its_directory_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.safetensors"
    save_state(_state(), path)  # saved over an existing file below
    events: list[tuple[str, int]] = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd: int) -> None:
        events.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def recorded_replace(src: Any, dst: Any) -> None:
        events.append(("replace", os.stat(src).st_ino))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    save_state(_state().with_attrs(step=8), path)
    new_file, directory = path.stat().st_ino, tmp_path.stat().st_ino
    assert events == [("fsync", new_file), ("replace", new_file), ("fsync", directory)]
    assert load_state(path, expect=SessionState).attrs["step"] == 8


def test_a_disk_tier_spool_file_is_not_synced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", synced.append)
    parked = (
        ss.TensorCache(name="c")
        .allocate()
        .commit((torch.arange(8.0),))
        .park("disk", spool_dir=tmp_path)
    )
    assert synced == []
    (x,) = parked.unpark().view()
    assert torch.equal(x, torch.arange(8.0))


def test_threads_saving_to_one_path_never_collide(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    states = [_state().with_attrs(step=i) for i in range(8)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(states))

    def save(state: SessionState) -> None:
        barrier.wait()
        try:
            for _ in range(15):
                save_state(state, path)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=save, args=(s,)) for s in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    loaded = load_state(path, expect=SessionState)
    assert any(tree_equal(loaded, s) for s in states)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.safetensors"]


def test_a_tensor_written_in_place_during_a_save_fails_its_checksum_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The documented race: a record is immutable, so writing into one of its tensors while it
    # is saved is the caller's bug. The file then refuses to load; it never holds a torn record.
    path = tmp_path / "s.safetensors"
    x = torch.zeros(4)
    state = SessionState(attrs={"x": x})
    write = ss._storage._encode._write_file

    def racing_write(filename: Path, header: bytes, data: Any, *, durable: bool) -> None:
        x.add_(1)  # another thread, between the checksum and the write
        write(filename, header, data, durable=durable)

    monkeypatch.setattr(ss._storage._encode, "_write_file", racing_write)
    save_state(state, path)
    msg = (
        f"Snapshot `{path}` is corrupt: storage 0 (16 bytes) fails its xxh3-64 check; restore it "
        "from an intact copy."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        load_state(path)
