"""Writing a snapshot: a record's structure to JSON and its storages to safetensors.

The safetensors container is written here rather than by ``safetensors.torch``: its ``save``
copies every byte twice (into a Rust buffer, then into ``bytes``) where one copy suffices, and
it orders the metadata keys at random, so one record would give different bytes from one save
to the next. Here each storage's bytes are copied once at most (for a file, never), and the
bytes are a function of the record alone; safetensors reads them (tested).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import math
import os
import secrets
import struct
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from sessionstate._checks import describe
from sessionstate._frozen import CONTAINERS_BY_CLASS
from sessionstate._storage._format import (
    FORMAT_VERSION,
    MAX_DEPTH,
    METADATA_KEY,
    XXH3,
    SnapshotParts,
    collect_storages,
    is_record,
    is_snapshot_leaf,
    record_name,
    refusal,
    root,
    storage_bytes,
)
from sessionstate._tree import PyTree

_LIBRARY_VERSION = importlib.metadata.version("sessionstate")  # one place: pyproject.toml

# -- encoding -------------------------------------------------------------------------------------


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self._index: dict[int, int] = {}
        # Leaves saved by their class: per class, (key path, leaf) in tree order.
        self.leaves: dict[type, list[tuple[str, Any]]] = {}
        self._leaf_index: dict[int, int] = {}
        self.sealed = False

    def payloads(self) -> dict[str, Any]:
        """Each registered leaf class's payload, encoded (after the whole tree is walked)."""
        self.sealed = True
        out: dict[str, Any] = {}
        for cls, leaves in self.leaves.items():
            name = record_name(cls)
            encode: Any = cls.__sessionstate_snapshot__  # type: ignore[attr-defined]
            payload = encode(list(leaves))
            out[name] = self.node(payload, f"<{name}>")
        return out

    def node(self, value: Any, key: str, *, statics: bool = False, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            msg = (
                f"Cannot snapshot the value at `{root(key)[:200]}`: it is nested deeper than "
                f"{MAX_DEPTH} levels of containers and records, the most a snapshot holds. "
                "Flatten the structure (e.g. a dict of tensors instead of nested lists)."
            )
            raise ValueError(msg)
        if value is None:
            return {"type": "none"}
        cls = type(value)
        if cls is bool or cls is int or cls is str:
            return {"type": cls.__name__, "value": value}
        if cls is float:
            return {"type": "float", "value": value if math.isfinite(value) else str(value)}
        if isinstance(value, torch.Tensor) and not statics:
            i = self._index.get(id(value))
            if i is None:
                i = self._index[id(value)] = len(self.tensors)
                self.tensors.append((key, value))
            return {"type": "tensor", "view": i}
        container = CONTAINERS_BY_CLASS.get(cls)
        if container is not None and not container.mapping:
            items = [
                self.node(v, f"{key}[{i}]", statics=statics, depth=depth + 1)
                for i, v in enumerate(value)
            ]
            return {"type": container.tag, "items": items}
        if container is not None:
            pairs = []
            for k, v in value.items():
                if type(k) not in (str, int, bool):
                    msg = (
                        f"Cannot snapshot the dict at `{root(key)}`: its key {k!r} is a "
                        f"{type(k).__name__}; snapshot dict keys must be str, int or bool."
                    )
                    raise TypeError(msg)
                pairs.append([k, self.node(v, f"{key}[{k!r}]", statics=statics, depth=depth + 1)])
            return {"type": container.tag, "items": pairs}
        if is_record(cls):
            refused = refusal(cls)
            if refused is not None:
                msg = (
                    f"Cannot snapshot the {cls.__qualname__} at `{root(key)}`, which is never "
                    f"valid snapshot content: {refused}. Unpark it first (`obj.unpark()`; "
                    "`SessionStateManager.snapshot` unparks a session)."
                )
                raise TypeError(msg)
            return self.record(value, key, depth)
        if not statics and not self.sealed and is_snapshot_leaf(cls):
            i = self._leaf_index.get(id(value))
            if i is None:
                leaves = self.leaves.setdefault(cls, [])
                i = self._leaf_index[id(value)] = len(leaves)
                leaves.append((root(key), value))
            return {"type": "leaf", "class": record_name(cls), "index": i}
        what = "static field" if statics else "leaf"
        allowed = (
            "a JSON value (None, bool, int, float, str) or a tuple, list or dict of them"
            if statics
            else "a tensor, a JSON value (None, bool, int, float, str), a tuple, list or dict, "
            "or a registered record"
        )
        msg = (
            f"Cannot snapshot the {what} at `{root(key)}`: {value!r:.80} is a "
            f"{cls.__qualname__}; a snapshot holds {allowed}. Convert it (e.g. to an int or a "
            "tensor) or keep it out of the record."
        )
        raise TypeError(msg)

    def record(self, value: Any, key: str, depth: int) -> dict[str, Any]:
        cls = type(value)
        fields: dict[str, Any] = {}
        statics: dict[str, Any] = {}
        for a in attrs.fields(cls):
            if not a.init:
                continue
            name = str(a.alias)
            path = f"{key}.{a.name.lstrip('_') or a.name}"
            child = getattr(value, a.name)
            if a.metadata.get("pytree_node", True):
                fields[name] = self.node(child, path, depth=depth + 1)
            else:
                statics[name] = self.node(child, path, statics=True, depth=depth + 1)
        return {"type": "record", "class": record_name(cls), "fields": fields, "static": statics}


# Per storage key: the device to record, and the storage (held, so the key is not reused).
_RECORDED: ContextVar[dict[int, tuple[str, torch.UntypedStorage]] | None] = ContextVar(
    "sessionstate_recorded", default=None
)


@contextlib.contextmanager
def recorded_devices() -> Iterator[None]:
    """Within: a storage marked with `record_device` is saved as if it lived on that device.

    A parked record read into host memory (`SessionState.unpark_on_host`) holds CPU copies of
    storages that live on a device; a snapshot of it records the device they came from, so it
    loads where a snapshot of the resident record would.
    """
    token = _RECORDED.set({})
    try:
        yield
    finally:
        _RECORDED.reset(token)


def record_device(storage: torch.UntypedStorage, device: str, /) -> None:
    """Within `recorded_devices`, save ``storage`` as a storage of ``device``; else nothing.

    The storage is held until the block ends, so its key is not reused by another.
    """
    table = _RECORDED.get()
    if table is not None and device != str(storage.device):
        table[storage._cdata] = (device, storage)


def recording() -> object | None:
    """The current `recorded_devices` block (an opaque token), or None outside one."""
    return _RECORDED.get()


def _encode(state: PyTree, metadata: Mapping[str, str] | None) -> tuple[bytes, list[memoryview]]:
    """The snapshot of ``state``: its container header, and each storage's bytes in file order."""
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                msg = (
                    f"Snapshot `metadata` maps str to str, got {describe(k)} -> "
                    f"{v!r:.60} ({type(v).__name__}); convert the value with `str(...)`."
                )
                raise TypeError(msg)
    encoder = _Encoder()
    tree = encoder.node(state, "")
    leaves = encoder.payloads()
    storages, views = collect_storages(encoder.tensors)
    data: list[memoryview] = []
    described = []
    recorded = _RECORDED.get() or {}
    for storage in storages:
        tensor = storage_bytes(storage)
        marked = recorded.get(storage._cdata)
        device = marked[0] if marked is not None else str(tensor.device)
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        raw = tensor.numpy().data  # the storage's own memory: a CPU storage is not copied
        data.append(raw)
        described.append(
            {"nbytes": len(raw), "device": device, XXH3.field: XXH3.to_json(XXH3.of(raw))}
        )
    document = {
        "format": "sessionstate.snapshot",
        "format_version": FORMAT_VERSION,
        "library_version": _LIBRARY_VERSION,
        "torch_version": torch.__version__,
        "metadata": dict(metadata or {}),
        "storages": described,
        "views": [v.to_json() for v in views],
        "tree": tree,
    }
    if leaves:
        document["leaves"] = leaves
    text = json.dumps(document, separators=(",", ":"))
    header = _container_header({METADATA_KEY: text, XXH3.key: XXH3.of_document(text)}, data)
    return header, data


def _container_header(metadata: Mapping[str, str], data: Sequence[memoryview]) -> bytes:
    """The safetensors header: ``metadata``, then ``data[i]`` as the ``U8`` tensor ``storage.<i>``.

    The storages follow the header in index order. The header is padded with spaces to a
    multiple of 8 bytes, as safetensors pads it, so that the data section starts aligned.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    start = 0
    for i, raw in enumerate(data):
        end = start + len(raw)
        header[f"storage.{i}"] = {"dtype": "U8", "shape": [len(raw)], "data_offsets": [start, end]}
        start = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_file(path: Path, header: bytes, data: Sequence[memoryview], *, durable: bool) -> None:
    # Each storage goes from its own memory to the file: a buffered file hands a write larger
    # than its buffer straight to the system.
    with open(path, "wb") as f:
        f.write(header)
        for raw in data:
            f.write(raw)
        if durable:
            f.flush()
            os.fsync(f.fileno())


def _sync_directory(directory: Path) -> None:
    # A rename is on disk once its directory is; Windows cannot open a directory to sync it
    # (and its rename is not made durable this way).
    if os.name != "posix":  # pragma: no cover - the tests run on POSIX
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_snapshot(
    state: PyTree,
    path: str | os.PathLike[str],
    /,
    *,
    metadata: Mapping[str, str] | None = None,
    durable: bool,
) -> None:
    """`save_state`, durable or not: the disk tier's spool files need not outlive the process.

    ``durable``: the file's bytes reach the disk before it is renamed into place (``fsync``),
    and the rename before this returns (``fsync`` of the directory). Besides surviving a
    crash, it keeps a save over an existing file steady (`benchmarks/snapshot.py`): without
    it, a rename over a file starts the write-back of the new one's delayed blocks (ext4's
    ``auto_da_alloc``), and a 150 MiB save took 160-250 ms or 700-970 ms, by turns.
    """
    header, data = _encode(state, metadata)
    target = Path(path)
    # A name no other save uses (two threads or processes saving to one path must not share
    # a partial file), created with the usual permissions.
    partial = target.with_name(f".{target.name}.{secrets.token_hex(8)}.partial")
    try:
        _write_file(partial, header, data, durable=durable)
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    if durable:
        _sync_directory(target.parent)


def save_state(
    state: PyTree, path: str | os.PathLike[str], /, *, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``state`` to ``path`` as one safetensors snapshot file.

    Each distinct storage is written once; every tensor leaf is recorded as a view of one, so
    aliases survive a round trip. The file is written under a name of its own next to ``path``
    and renamed into place, so ``path`` holds either its previous content or the whole new
    snapshot, never a partial one, even if the save fails midway; saves to one path from
    several threads or processes each write their own file, and the last rename wins. It is
    durable: the file is synced to disk (``fsync``) before the rename, and its directory
    after, so once this returns the snapshot survives a crash or a power loss. Tensors
    on any real device are saved (their device is recorded); autograd history and
    ``requires_grad`` are not.

    A record is immutable: a tensor it holds must not be written in place while it is saved.
    Such a write races the save, and the file then fails its checksum at load (`SnapshotError`)
    instead of holding a torn record.

    Args:
        state: A record (a `SessionState`, any `record`), or a tuple, list or dict of them,
            tensors and JSON values.
        path: The file to write (replaced if it exists).
        metadata: Strings to store alongside (read back with `sessionstate inspect`).

    Raises:
        UnsupportedTensorError: for a meta, sparse, nested or subclass tensor.
        TypeError: for a leaf that is neither a tensor nor a JSON value, naming its key path,
            or a `ParkedObject` (unpark it first).
        ValueError: for a tree nested deeper than `MAX_DEPTH` levels.
        StaleKVHandleError: for a `KVHandle` made by a step that was rolled back.
        OSError: if the file cannot be written (``path`` is then left as it was).

    >>> import os, tempfile, torch
    >>> from sessionstate import SessionState, load_state, tree_equal
    >>> state = SessionState(attrs={"x": torch.arange(4.0), "step": 3})
    >>> path = os.path.join(tempfile.mkdtemp(), "session.safetensors")
    >>> save_state(state, path)
    >>> tree_equal(load_state(path), state)
    True
    """
    write_snapshot(state, path, metadata=metadata, durable=True)


def dumps_state(state: PyTree, /, *, metadata: Mapping[str, str] | None = None) -> bytes:
    """``state`` as the bytes of a snapshot file (for a wire); see `save_state`.

    >>> import torch
    >>> from sessionstate import loads_state
    >>> x = torch.arange(3)
    >>> a, b = loads_state(dumps_state((x, x[1:])))
    >>> b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    True
    """
    header, data = _encode(state, metadata)
    return b"".join((header, *data))  # each storage's bytes copied once


def dumps_parts(state: PyTree, /, *, metadata: Mapping[str, str] | None = None) -> SnapshotParts:
    """``state`` as a snapshot in parts, its storages not copied; see `SnapshotParts`.

    The parts are the bytes `dumps_state` would return, split at the storages: the header is
    byte for byte the same. A CPU storage's array is a view of the record's memory, which is
    immutable; a storage on another device is copied to the CPU once.

    >>> from sessionstate._storage import loads_parts
    >>> x = torch.arange(3)
    >>> parts = dumps_parts((x, x[1:]))
    >>> len(parts.storages), parts.storages[0].ctypes.data == x.data_ptr()
    (1, True)
    >>> a, b = loads_parts(parts)
    >>> torch.equal(b, x[1:]), a.data_ptr() != x.data_ptr()
    (True, True)
    """
    header, data = _encode(state, metadata)
    return SnapshotParts(header, tuple(np.frombuffer(raw, dtype=np.uint8) for raw in data))
