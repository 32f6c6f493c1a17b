"""Snapshots in parts (`dumps_parts` / `loads_parts`): the out-of-band form migration ships.

The parts are the bytes of `dumps_state` split at the storages, the storages as NumPy views
of the record's memory; loading them copies each storage once and keeps every check the bytes
path has. Hostile parts (corrupt, resized, reordered, missing, extra, of the wrong type, or with
a header an attacker rewrote) get a `SnapshotError` naming the problem, pinned here.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import xxhash

from sessionstate import SessionState, SnapshotError, dumps_state, loads_state, tree_equal
from sessionstate._storage import SnapshotParts, dumps_parts, loads_parts


def _state() -> dict[str, Any]:
    a = torch.arange(6.0)
    return {"a": a, "alias": a[2:].view(2, 2), "b": torch.ones(3, dtype=torch.int16), "n": 7}


def _refused(parts: Any, msg: str) -> None:
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_parts(parts)


def _with_storages(parts: SnapshotParts, *storages: Any) -> SnapshotParts:
    return attrs.evolve(parts, storages=tuple(storages))


def _rewrite_header(parts: SnapshotParts, edit: Callable[[dict[str, Any]], None]) -> SnapshotParts:
    """``parts`` with its safetensors header edited (its JSON document untouched, so signed)."""
    (n,) = struct.unpack("<Q", parts.header[:8])
    header = json.loads(parts.header[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    return attrs.evolve(parts, header=struct.pack("<Q", len(text)) + text)


# -- the same snapshot, in parts ------------------------------------------------------------------


def test_parts_are_the_bytes_of_dumps_state_split_at_the_storages() -> None:
    state = _state()
    parts = dumps_parts(state, metadata={"who": "test"})
    data = dumps_state(state, metadata={"who": "test"})
    assert b"".join((parts.header, *(a.tobytes() for a in parts.storages))) == data
    assert parts.nbytes == len(data)
    assert tree_equal(loads_parts(parts), loads_state(data))


def test_cpu_storages_are_views_of_the_record_and_the_load_owns_its_memory() -> None:
    state = _state()
    parts = dumps_parts(state)
    assert [a.ctypes.data for a in parts.storages] == [
        state["a"].data_ptr(),
        state["b"].data_ptr(),
    ]
    for a in parts.storages:
        a.setflags(write=False)  # as `ray.get` returns them
    loaded = loads_parts(parts)
    assert torch.equal(loaded["a"], state["a"])
    assert torch.equal(loaded["b"], state["b"])
    assert torch.equal(loaded["alias"], state["alias"])
    assert loaded["alias"].untyped_storage().data_ptr() == loaded["a"].data_ptr()  # alias kept
    owned = {loaded["a"].data_ptr(), loaded["b"].data_ptr()}
    assert owned.isdisjoint(a.ctypes.data for a in parts.storages)
    loaded["a"].add_(1)  # the record's memory is its own and writable
    assert torch.equal(state["a"], torch.arange(6.0))


def test_an_empty_storage_and_expect_load_as_on_the_bytes_path() -> None:
    state = SessionState(attrs={"e": torch.zeros(0), "x": torch.ones(2)})
    loaded = loads_parts(dumps_parts(state), expect=SessionState)
    assert tree_equal(loaded, state)
    assert torch.equal(loaded.attrs["x"], state.attrs["x"])


def test_a_dict_is_refused_where_a_session_is_expected() -> None:
    with pytest.raises(SnapshotError, match=re.escape("(parts) holds a `dict`, not the expected")):
        loads_parts(dumps_parts({"n": 1}), expect=SessionState)


# -- hostile parts ---------------------------------------------------------------------------------


def test_a_flipped_storage_byte_fails_its_checksum() -> None:
    parts = dumps_parts(_state())
    a = parts.storages[0].copy()
    a[5] ^= 0x01
    _refused(
        _with_storages(parts, a, parts.storages[1]),
        "Snapshot (parts) is corrupt: storage 0 (24 bytes) fails its xxh3-64 check; restore it "
        "from an intact copy.",
    )


def test_swapped_storages_are_refused() -> None:
    parts = dumps_parts(_state())
    _refused(
        _with_storages(parts, parts.storages[1], parts.storages[0]),
        "Snapshot (parts) is inconsistent: its header places storage 0 (24 bytes) at offset 0, "
        "but part 0 is 6 bytes at offset 0; send the parts `dumps_parts` made unchanged.",
    )
    same = dumps_parts({"x": torch.zeros(4), "y": torch.ones(4)})
    _refused(_with_storages(same, *reversed(same.storages)), "storage 0 (16 bytes) fails its")


def test_a_flipped_document_byte_fails_the_document_checksum() -> None:
    parts = dumps_parts(_state())
    header = bytearray(parts.header)
    at = header.index(b":7}") + 1  # the int 7 (the document is JSON inside the header's JSON)
    header[at] = ord("8")
    _refused(
        attrs.evolve(parts, header=bytes(header)),
        "Snapshot (parts) is corrupt: its JSON document fails its xxh3-64 check",
    )


@pytest.mark.parametrize("count", [0, 1, 3])
def test_a_missing_or_extra_part_is_refused(count: int) -> None:
    parts = dumps_parts(_state())
    storages = (*parts.storages, parts.storages[0])[:count]
    _refused(
        _with_storages(parts, *storages),
        f"Snapshot (parts) has {count} storage parts for the 2 storages its header describes",
    )


def test_a_resized_part_is_refused() -> None:
    parts = dumps_parts(_state())
    longer = np.concatenate([parts.storages[1], np.zeros(2, dtype=np.uint8)])
    _refused(
        _with_storages(parts, parts.storages[0], longer),
        "its header places storage 1 (6 bytes) at offset 24, but part 1 is 8 bytes at offset 24",
    )
    _refused(
        _with_storages(parts, parts.storages[0][:-1], parts.storages[1]),
        "its header places storage 0 (24 bytes) at offset 0, but part 0 is 23 bytes",
    )


@pytest.mark.parametrize(
    ("part", "got"),
    [
        (b"\x00" * 6, "a bytes"),
        (np.zeros(3, dtype=np.int16), "a int16 array of shape (3,)"),
        (np.zeros((2, 3), dtype=np.uint8), "a uint8 array of shape (2, 3)"),
        (np.zeros(12, dtype=np.uint8)[::2], "a uint8 array of shape (6,)"),
    ],
)
def test_a_part_that_is_not_a_flat_uint8_array_is_refused(part: Any, got: str) -> None:
    parts = dumps_parts(_state())
    _refused(
        _with_storages(parts, parts.storages[0], part),
        f"Snapshot (parts) has a part for storage 1 that is not a 1-D contiguous uint8 array "
        f"(got {got})",
    )


@pytest.mark.parametrize("value", [b"not parts", None, (b"", ())])
def test_something_other_than_parts_is_refused(value: Any) -> None:
    _refused(value, "not a `SnapshotParts` of a header (bytes) and a tuple of storages")


def test_a_header_whose_length_prefix_lies_is_refused() -> None:
    parts = dumps_parts(_state())
    _refused(
        attrs.evolve(parts, header=parts.header + b"    "),
        f"has a header of {len(parts.header) + 4} bytes where its length prefix declares "
        f"{len(parts.header)}",
    )
    _refused(attrs.evolve(parts, header=parts.header[:-1]), "where its length prefix declares")
    _refused(
        attrs.evolve(parts, header=b"\x01"),
        "has a header of 1 bytes, too short for its 8-byte length prefix",
    )


def test_a_huge_declared_storage_is_refused_before_anything_is_allocated() -> None:
    parts = dumps_parts(_state())

    def huge(header: dict[str, Any]) -> None:
        header["storage.1"]["data_offsets"] = [24, 24 + 2**40]
        header["storage.1"]["shape"] = [2**40]

    # The document still says 6 bytes: the entry no longer matches it.
    _refused(_rewrite_header(parts, huge), "has no valid tensor `storage.1` for storage 1")


def test_storages_placed_at_other_offsets_are_refused() -> None:
    parts = dumps_parts(_state())

    def overlap(header: dict[str, Any]) -> None:
        header["storage.1"]["data_offsets"] = [20, 26]

    def gap(header: dict[str, Any]) -> None:
        header["storage.1"]["data_offsets"] = [26, 32]

    _refused(_rewrite_header(parts, overlap), "storages 0 and 1 overlap in its data section")
    _refused(
        _rewrite_header(parts, gap),
        "its header places storage 1 (6 bytes) at offset 26, but part 1 is 6 bytes at offset 24",
    )


def _forge(parts: SnapshotParts, edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> Any:
    """``parts`` with header and document edited, and the document's checksum signed again."""
    (n,) = struct.unpack("<Q", parts.header[:8])
    header = json.loads(parts.header[8 : 8 + n])
    document = json.loads(header["__metadata__"]["sessionstate"])
    edit(header, document)
    text = json.dumps(document)
    header["__metadata__"]["sessionstate"] = text
    header["__metadata__"]["sessionstate.xxh3"] = f"{xxhash.xxh3_64_intdigest(text.encode()):016x}"
    encoded = json.dumps(header).encode()
    return attrs.evolve(parts, header=struct.pack("<Q", len(encoded)) + encoded)


def test_a_signed_header_cannot_make_a_storage_match_bytes_it_did_not_describe() -> None:
    def other_checksum(header: dict[str, Any], document: dict[str, Any]) -> None:
        document["storages"][0]["xxh3"] = f"{xxhash.xxh3_64_intdigest(b'other'):016x}"

    forged = _forge(dumps_parts(_state()), other_checksum)
    _refused(forged, "is corrupt: storage 0 (24 bytes) fails its xxh3-64 check")


def test_a_signed_huge_storage_is_refused_before_anything_is_allocated() -> None:
    def huge(header: dict[str, Any], document: dict[str, Any]) -> None:
        header["storage.1"]["data_offsets"] = [24, 24 + 2**40]
        header["storage.1"]["shape"] = [2**40]
        document["storages"][1]["nbytes"] = 2**40

    _refused(
        _forge(dumps_parts(_state()), huge),
        "its header places storage 1 (1099511627776 bytes) at offset 24, but part 1 is 6 bytes",
    )
