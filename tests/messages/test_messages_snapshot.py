"""Every snapshot message, pinned: what is refused at save, and each bad file at load."""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from sessionstate import (
    LatentBuffer,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
    SnapshotError,
    UnsupportedTensorError,
    dumps_state,
    load_state,
    loads_state,
    record,
    save_state,
    static_field,
)
from tests.support import rewrite


def _ring_state() -> SessionState:
    ring = LatentBuffer(name="ring", dim=0).allocate(maxlen=2).commit(torch.arange(4.0)[None])
    return SessionState(objects={"ring": ring})


def _written(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "s.safetensors"
    path.write_bytes(data)
    return path


# -- bad files -------------------------------------------------------------------------------------


def test_not_a_safetensors_file(tmp_path: Path) -> None:
    path = _written(tmp_path, b"hello world garbage")
    msg = (
        f"Snapshot `{path}` is not a safetensors file (its header length is implausible); save "
        "one with `sessionstate.save_state`."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        load_state(path)


def test_too_short_for_a_safetensors_file(tmp_path: Path) -> None:
    path = _written(tmp_path, b"abcd")
    msg = (
        f"Snapshot `{path}` is 4 bytes, too short for a safetensors file; save one with "
        "`sessionstate.save_state`."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        load_state(path)


def test_truncated_header(tmp_path: Path) -> None:
    path = _written(tmp_path, dumps_state(_ring_state())[:40])
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    msg = (
        f"Snapshot `{path}` is truncated: its header needs {8 + n} bytes but it has 40; write "
        "it again (an interrupted copy leaves a short file)."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        load_state(path)


def test_truncated_storage(tmp_path: Path) -> None:
    data = dumps_state(_ring_state())
    path = _written(tmp_path, data[:-2])
    msg = (
        f"Snapshot `{path}` is truncated: storage 0 ends at byte {len(data)} but the file has "
        f"{len(data) - 2} bytes; write it again (an interrupted copy leaves a short file)."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        load_state(path)


def test_plain_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    msg = (
        f"Snapshot `{path}` is a safetensors file without a `sessionstate` metadata entry, so "
        "not a session snapshot; load plain safetensors files with "
        "`safetensors.torch.load_file`."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        load_state(path)


def test_newer_format_version() -> None:
    def newer(doc: dict[str, Any]) -> None:
        doc["format_version"] = 5
        doc["library_version"] = "9.0"

    msg = (
        "Snapshot (bytes) uses snapshot format version 5, newer than this library reads (4; it "
        "was written by sessionstate 9.0); upgrade sessionstate to load it."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(rewrite(dumps_state(_ring_state()), newer))


def test_missing_format_version() -> None:
    data = rewrite(dumps_state(_ring_state()), lambda doc: doc.pop("format_version"))
    msg = "Snapshot (bytes) has no valid `format_version` (got None); write it again."
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(data)


def test_unknown_record_class() -> None:
    def rename(doc: dict[str, Any]) -> None:
        doc["tree"]["fields"]["objects"]["items"][0][1]["class"] = "elsewhere:Unknown"

    msg = (
        "Snapshot (bytes) holds a record of class `elsewhere:Unknown` at `objects['ring']`, "
        "which is not registered in this process; import the module that defines it before "
        "loading (only registered record classes are rebuilt; a loader imports no module "
        "outside `sessionstate`)."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(rewrite(dumps_state(_ring_state()), rename))


def test_unknown_class_under_the_library_is_refused_too() -> None:
    def rename(doc: dict[str, Any]) -> None:
        doc["tree"]["class"] = "sessionstate.no_such_module:Session"

    msg = (
        "Snapshot (bytes) holds a record of class `sessionstate.no_such_module:Session` at `<root>`"
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(rewrite(dumps_state(_ring_state()), rename))


def test_checksum_mismatch(tmp_path: Path) -> None:
    data = bytearray(dumps_state(_ring_state()))
    data[-1] ^= 0x01
    path = _written(tmp_path, bytes(data))
    msg = (
        f"Snapshot `{path}` is corrupt: storage 0 (16 bytes) fails its xxh3-64 check; restore "
        "it from an intact copy."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        load_state(path)


def test_storage_too_short_for_a_view() -> None:
    def longer(doc: dict[str, Any]) -> None:
        doc["views"][0]["shape"] = [1, 5]

    msg = (
        "Snapshot (bytes) is inconsistent: view 0 (shape (1, 5), stride (4, 1), offset 0, "
        "float32) needs 20 bytes of storage 0, which holds 16; write it again."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(rewrite(dumps_state(_ring_state()), longer))


def test_record_constructor_refuses_stored_values() -> None:
    def bad_maxlen(doc: dict[str, Any]) -> None:
        ring = doc["tree"]["fields"]["objects"]["items"][0][1]
        ring["static"]["maxlen"] = {"type": "int", "value": 0}

    msg = (
        "Snapshot (bytes) holds a `LatentBuffer` at `objects['ring']` that its constructor "
        "refuses (ValueError: `maxlen` must be a positive int or None, got 0 (int)."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(rewrite(dumps_state(_ring_state()), bad_maxlen))


def test_unexpected_root_type() -> None:
    msg = (
        "Snapshot (bytes) holds a `dict`, not the expected `SessionState`; pass the matching "
        "class as `expect=`, or load a snapshot of that class."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(dumps_state({"n": 1}), expect=SessionState)


def test_device_this_process_cannot_use() -> None:
    msg = "Snapshot (bytes) holds storage 0 for device cuda:99, which this process cannot use ("
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(dumps_state(torch.zeros(2)), device="cuda:99")


# -- refused at save -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "msg"),
    [
        (
            lambda: torch.zeros(2, device="meta"),
            "Cannot snapshot the tensor at `attrs['v']`: it is a meta tensor, which has no data "
            "(shape (2,), device meta); materialise it on a real device first, or leave it out "
            "of the snapshot.",
        ),
        (
            lambda: torch.eye(2).to_sparse(),
            "Cannot snapshot the tensor at `attrs['v']`: it is a sparse tensor "
            "(layout=torch.sparse_coo) (shape (2, 2), device cpu); store its dense components "
            "(e.g. `t.indices()` and `t.values()`) or `t.to_dense()`.",
        ),
        (
            lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
            "Cannot snapshot the tensor at `attrs['v']`: it is a nested tensor (device cpu); "
            "store its component tensors (`list(t.unbind())`).",
        ),
        (
            lambda: torch.nn.Parameter(torch.zeros(2)),
            "Cannot snapshot the tensor at `attrs['v']`: it is a tensor subclass `Parameter` "
            "(shape (2,), device cpu); store a plain tensor (`t.as_subclass(torch.Tensor)`) or "
            "its component tensors.",
        ),
    ],
    ids=["meta", "sparse", "nested", "subclass"],
)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_unsupported_tensor(make: Callable[[], torch.Tensor], msg: str) -> None:
    with pytest.raises(UnsupportedTensorError, match=re.escape(msg)):
        dumps_state(SessionState(attrs={"v": make()}))


def test_non_json_leaf() -> None:
    msg = (
        "Cannot snapshot the leaf at `attrs['d']`: device(type='cpu') is a device; a snapshot "
        "holds a tensor, a JSON value (None, bool, int, float, str), a tuple, list or dict, or "
        "a registered record. Convert it (e.g. to an int or a tensor) or keep it out of the "
        "record."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dumps_state(SessionState(attrs={"d": torch.device("cpu")}))


@record
class _Typed:
    value: Any
    dtype: Any = static_field(default=torch.float32)


def test_non_json_static_field() -> None:
    msg = (
        "Cannot snapshot the static field at `dtype`: torch.float32 is a dtype; a snapshot "
        "holds a JSON value (None, bool, int, float, str) or a tuple, list or dict of them. "
        "Convert it (e.g. to an int or a tensor) or keep it out of the record."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dumps_state(_Typed(torch.zeros(1)))


def test_dict_key_that_is_not_json() -> None:
    msg = (
        "Cannot snapshot the dict at `<root>`: its key (1, 2) is a tuple; snapshot dict keys "
        "must be str, int or bool."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dumps_state({(1, 2): 3})


def test_metadata_that_is_not_str() -> None:
    msg = (
        "Snapshot `metadata` maps str to str, got 'n' (str) -> 3 (int); convert the value with "
        "`str(...)`."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        dumps_state({}, metadata={"n": 3})  # type: ignore[dict-item]


def test_refused_save_writes_no_file(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"
    with pytest.raises(UnsupportedTensorError):
        save_state(SessionState(attrs={"v": torch.zeros(1, device="meta")}), path)
    assert list(tmp_path.iterdir()) == []


def test_manager_snapshot_of_a_session_it_does_not_hold(tmp_path: Path) -> None:
    msg = (
        "Cannot snapshot session 'zz': this manager does not hold it (never created, dropped, "
        "or evicted). `session_ids()` lists the held ones."
    )
    with pytest.raises(SessionStateLostError, match=re.escape(msg)):
        SessionStateManager().snapshot("zz", tmp_path / "zz.safetensors")
