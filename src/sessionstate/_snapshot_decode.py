"""Reading a snapshot: the header checked, the storages read and every record rebuilt."""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import IO, Any, overload

import torch

from sessionstate._checks import is_int
from sessionstate._errors import SnapshotError
from sessionstate._snapshot_format import (
    _CHUNK,
    _DTYPES,
    _MAX_HEADER,
    _R,
    FORMAT_VERSION,
    METADATA_KEY,
    ViewSpec,
    _checksum,
    _root,
    rebuild_views,
    resolve_leaf_class,
    resolve_record,
)

# -- decoding -------------------------------------------------------------------------------------


def _fail(source: str, problem: str, fix: str) -> SnapshotError:
    return SnapshotError(f"Snapshot {source} {problem}; {fix}.")


class _Reader:
    """Reads a safetensors container from a file or bytes.

    The library parses the container itself rather than through ``safe_open``: that API maps
    the file into memory (a tensor it returns changes if the file is rewritten, and its
    alignment is the file's), while a snapshot must load into fresh, aligned memory, and name
    a truncated file as such.
    """

    def __init__(self, source: str, stream: IO[bytes], size: int) -> None:
        self.source = source
        self.stream = stream
        self.size = size

    def header(self) -> tuple[dict[str, Any], int]:
        not_snapshot = "save one with `sessionstate.save_state`"
        head = self.stream.read(8)
        if len(head) < 8:
            raise _fail(
                self.source, f"is {self.size} bytes, too short for a safetensors file", not_snapshot
            )
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise _fail(
                self.source,
                "is not a safetensors file (its header length is implausible)",
                not_snapshot,
            )
        if 8 + n > self.size:
            raise _fail(
                self.source,
                f"is truncated: its header needs {8 + n} bytes but it has {self.size}",
                "write it again (an interrupted copy leaves a short file)",
            )
        try:
            header = json.loads(self.stream.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _fail(
                self.source, "is not a safetensors file (its header is not JSON)", not_snapshot
            ) from None
        if not isinstance(header, dict):
            raise _fail(
                self.source,
                "is not a safetensors file (its header is not a JSON object)",
                not_snapshot,
            )
        return header, 8 + n

    def read_into(self, start: int, out: torch.Tensor) -> None:
        self.stream.seek(start)
        if out.numel() == 0:
            return
        view = out.numpy().data
        done = 0
        while done < len(view):
            got = self.stream.readinto(view[done : done + _CHUNK])  # type: ignore[attr-defined]
            if not got:
                raise _fail(self.source, "is truncated", "write it again")
            done += got


def read_header(
    source: str, stream: IO[bytes], size: int
) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Parse and validate a snapshot's container header and JSON document.

    Returns:
        ``(document, tensor entries, data start)``: the JSON document, the safetensors entry of
        each storage tensor by name, and the offset of the data section.

    Raises:
        SnapshotError: for a file that is not a snapshot, a newer format version, or one that
            is truncated.
    """
    reader = _Reader(source, stream, size)
    header, data_start = reader.header()
    meta = header.get("__metadata__")
    text = meta.get(METADATA_KEY) if isinstance(meta, dict) else None
    if not isinstance(text, str):
        raise _fail(
            source,
            f"is a safetensors file without a `{METADATA_KEY}` metadata entry, so not a "
            "session snapshot",
            "load plain safetensors files with `safetensors.torch.load_file`",
        )
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        raise _fail(
            source, f"has a `{METADATA_KEY}` metadata entry that is not JSON", "write it again"
        ) from None
    version = document.get("format_version") if isinstance(document, dict) else None
    if not is_int(version):
        raise _fail(source, f"has no valid `format_version` (got {version!r})", "write it again")
    if version > FORMAT_VERSION:
        writer = document.get("library_version", "unknown")
        raise _fail(
            source,
            f"uses snapshot format version {version}, newer than this library reads "
            f"({FORMAT_VERSION}; it was written by sessionstate {writer})",
            "upgrade sessionstate to load it",
        )
    storages = document.get("storages")
    if not isinstance(storages, list):
        raise _fail(source, "has no storage list in its document", "write it again")
    entries: dict[str, Any] = {}
    data_size = size - data_start
    for i, described in enumerate(storages):
        name = f"storage.{i}"
        entry = header.get(name)
        nbytes = described.get("nbytes") if isinstance(described, dict) else None
        ok = (
            isinstance(entry, dict)
            and entry.get("dtype") == "U8"
            and isinstance(nbytes, int)
            and entry.get("shape") == [nbytes]
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and entry["data_offsets"][1] - entry["data_offsets"][0] == nbytes
        )
        if not ok:
            raise _fail(source, f"has no valid tensor `{name}` for storage {i}", "write it again")
        assert isinstance(entry, dict)
        end = entry["data_offsets"][1]
        if end > data_size:
            raise _fail(
                source,
                f"is truncated: storage {i} ends at byte {data_start + end} but the file has "
                f"{size} bytes",
                "write it again (an interrupted copy leaves a short file)",
            )
        entries[name] = entry
    return document, entries, data_start


def _load(
    source: str,
    stream: IO[bytes],
    size: int,
    device: torch.device | str | None,
    expect: type | None,
) -> Any:
    document, entries, data_start = read_header(source, stream, size)
    reader = _Reader(source, stream, size)
    storages: list[torch.UntypedStorage] = []
    for i, described in enumerate(document["storages"]):
        entry = entries[f"storage.{i}"]
        data = torch.empty(described["nbytes"], dtype=torch.uint8)
        reader.read_into(data_start + entry["data_offsets"][0], data)
        if _checksum(data) != described.get("crc32"):
            raise _fail(
                source,
                f"is corrupt: storage {i} ({described['nbytes']} bytes) fails its CRC-32 check",
                "restore it from an intact copy",
            )
        target = (
            torch.device(device)
            if device is not None
            else torch.device(described.get("device", "cpu"))
        )
        if target.type != "cpu":
            try:
                data = data.to(target)
            except (RuntimeError, AssertionError) as exc:
                raise _fail(
                    source,
                    f"holds storage {i} for device {target}, which this process cannot use ({exc})",
                    "pass `device=` to load it elsewhere, e.g. `device='cpu'`",
                ) from None
        storages.append(data.untyped_storage())
    views = [_view(source, i, v, storages) for i, v in enumerate(document.get("views", []))]
    tensors = rebuild_views(storages, views)
    leaves = document.get("leaves", {})
    if not isinstance(leaves, dict):
        raise _fail(source, f"has an invalid leaf section {leaves!r:.60}", "write it again")
    root = _Decoder(source, tensors, leaves).node(document.get("tree"), "")
    if expect is not None and not isinstance(root, expect):
        raise _fail(
            source,
            f"holds a `{type(root).__qualname__}`, not the expected `{expect.__qualname__}`",
            "pass the matching class as `expect=`, or load a snapshot of that class",
        )
    return root


def _view(source: str, i: int, raw: Any, storages: Sequence[torch.UntypedStorage]) -> ViewSpec:
    try:
        view = ViewSpec(
            storage=int(raw["storage"]),
            dtype=_DTYPES[raw["dtype"]],
            shape=tuple(int(n) for n in raw["shape"]),
            stride=tuple(int(s) for s in raw["stride"]),
            offset=int(raw["offset"]),
            conj=bool(raw.get("conj", False)),
            neg=bool(raw.get("neg", False)),
        )
    except (KeyError, TypeError, ValueError):
        raise _fail(
            source, f"has an invalid description of view {i}: {raw!r:.120}", "write it again"
        ) from None
    valid = (
        0 <= view.storage < len(storages)
        and len(view.shape) == len(view.stride)
        and view.offset >= 0
        and all(n >= 0 for n in view.shape)
        and all(s >= 0 for s in view.stride)
    )
    if not valid:
        raise _fail(
            source, f"has an invalid description of view {i}: {raw!r:.120}", "write it again"
        )
    needed, held = view.nbytes_needed(), storages[view.storage].nbytes()
    if needed > held:
        raise _fail(
            source,
            f"is inconsistent: view {i} (shape {view.shape}, stride {view.stride}, offset "
            f"{view.offset}, {raw['dtype']}) needs {needed} bytes of storage {view.storage}, "
            f"which holds {held}",
            "write it again",
        )
    return view


class _Decoder:
    def __init__(
        self, source: str, tensors: list[torch.Tensor], leaves: Mapping[str, Any] | None = None
    ) -> None:
        self.source = source
        self.tensors = tensors
        self.payloads = dict(leaves or {})
        self.restored: dict[str, list[Any]] = {}

    def bad(self, key: str, what: str) -> SnapshotError:
        return _fail(
            self.source, f"has an invalid node at `{_root(key)}` ({what})", "write it again"
        )

    def node(self, node: Any, key: str) -> Any:
        if not isinstance(node, dict):
            raise self.bad(key, f"{node!r:.60}")
        kind = node.get("type")
        if kind == "none":
            return None
        if kind in ("bool", "int", "str"):
            value = node.get("value")
            if type(value).__name__ != kind:
                raise self.bad(key, f"{kind} holding {value!r:.60}")
            return value
        if kind == "float":
            value = node.get("value")
            if is_int(value) or isinstance(value, float):
                return float(value)
            if value in ("nan", "inf", "-inf"):
                return float(value)
            raise self.bad(key, f"float holding {value!r:.60}")
        if kind == "tensor":
            i = node.get("view")
            if not isinstance(i, int) or not 0 <= i < len(self.tensors):
                raise self.bad(key, f"tensor view {i!r}")
            return self.tensors[i]
        if kind in ("tuple", "list"):
            items = node.get("items")
            if not isinstance(items, list):
                raise self.bad(key, f"{kind} without items")
            values = [self.node(v, f"{key}[{i}]") for i, v in enumerate(items)]
            return tuple(values) if kind == "tuple" else values
        if kind == "dict":
            pairs = node.get("items")
            if not isinstance(pairs, list):
                raise self.bad(key, "dict without items")
            out: dict[Any, Any] = {}
            for pair in pairs:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise self.bad(key, f"dict item {pair!r:.60}")
                out[pair[0]] = self.node(pair[1], f"{key}[{pair[0]!r}]")
            return out
        if kind == "record":
            return self.record(node, key)
        if kind == "leaf":
            return self.leaf(node, key)
        raise self.bad(key, f"unknown node type {kind!r}")

    def leaf(self, node: dict[str, Any], key: str) -> Any:
        name, i = node.get("class"), node.get("index")
        if not isinstance(name, str) or name not in self.payloads:
            raise self.bad(key, f"leaf of class {name!r:.60} without a payload")
        restored = self.restored.get(name)
        if restored is None:
            restored = self.restored[name] = self.restore(name)
        if type(i) is not int or not 0 <= i < len(restored):
            raise self.bad(key, f"leaf index {i!r:.60} of class `{name}`")
        return restored[i]

    def restore(self, name: str) -> list[Any]:
        cls = resolve_leaf_class(name)
        if cls is None:
            raise _fail(
                self.source,
                f"holds leaves of class `{name}`, which is not registered as a snapshot leaf in "
                "this process",
                "import the module that defines it before loading (only classes registered "
                "with `register_snapshot_leaf` are rebuilt; a loader imports no module outside "
                "`sessionstate`)",
            )
        payload = self.node(self.payloads[name], f"<{name}>")
        try:
            decode: Any = cls.__sessionstate_restore__  # type: ignore[attr-defined]
            restored = list(decode(payload))
        except (TypeError, ValueError) as exc:
            raise _fail(
                self.source,
                f"holds `{cls.__qualname__}` leaves that their class refuses to restore "
                f"({type(exc).__name__}: {exc})",
                "load it with the library version that wrote it, or write it again",
            ) from exc
        if not all(isinstance(leaf, cls) for leaf in restored):
            raise _fail(
                self.source,
                f"holds `{cls.__qualname__}` leaves that their class restored as other types",
                "fix `__sessionstate_restore__` to return instances of its class",
            )
        return restored

    def record(self, node: dict[str, Any], key: str) -> Any:
        name = node.get("class")
        cls = resolve_record(name) if isinstance(name, str) else None
        if cls is None:
            raise _fail(
                self.source,
                f"holds a record of class `{name}` at `{_root(key)}`, which is not registered "
                "in this process",
                "import the module that defines it before loading (only registered record "
                "classes are rebuilt; a loader imports no module outside `sessionstate`)",
            )
        fields, statics = node.get("fields"), node.get("static")
        if not isinstance(fields, dict) or not isinstance(statics, dict):
            raise self.bad(key, f"record `{name}` without fields")
        kwargs: dict[str, Any] = {}
        for field_name, child in fields.items():
            kwargs[field_name] = self.node(child, f"{key}.{field_name}")
        for field_name, child in statics.items():
            kwargs[field_name] = self.node(child, f"{key}.{field_name}")
        try:
            return cls(**kwargs)
        except Exception as exc:  # a validator or converter refused the stored values
            raise _fail(
                self.source,
                f"holds a `{cls.__qualname__}` at `{_root(key)}` that its constructor refuses "
                f"({type(exc).__name__}: {exc})",
                "load it with the library version that wrote it, or write it again",
            ) from exc


@overload
def load_state(
    path: str | os.PathLike[str], /, *, device: torch.device | str | None = None, expect: type[_R]
) -> _R: ...
@overload
def load_state(
    path: str | os.PathLike[str],
    /,
    *,
    device: torch.device | str | None = None,
    expect: None = None,
) -> Any: ...


def load_state(
    path: str | os.PathLike[str],
    /,
    *,
    device: torch.device | str | None = None,
    expect: type | None = None,
) -> Any:
    """Read a snapshot written by `save_state`: the same tree, bit-identical, aliases kept.

    Records are rebuilt through their constructors and only classes registered as records in
    this process are used (a module under ``sessionstate.`` named in the file may be imported;
    import any other record class's module first). Nothing is unpickled. Every storage is
    checked against its CRC-32 before anything is returned.

    Args:
        path: The snapshot file.
        device: Where to put every tensor (e.g. ``"cuda:0"``); None restores each storage to
            the device it was saved from.
        expect: The class the root must be an instance of (e.g. your `SessionState` subclass).

    Raises:
        SnapshotError: naming the file and the problem, for a file that is not a snapshot,
            from a newer format version, truncated, corrupt (checksum), inconsistent (a view
            longer than its storage), holding an unregistered record class, or not an
            ``expect``.
        FileNotFoundError: if ``path`` does not exist.

    >>> import os, tempfile, torch
    >>> from sessionstate import LatentBuffer, SessionState, save_state
    >>> ring = LatentBuffer(dim=0).allocate(maxlen=2).commit(torch.ones(1, 3))
    >>> path = os.path.join(tempfile.mkdtemp(), "s.safetensors")
    >>> save_state(SessionState(objects={"ring": ring}), path)
    >>> load_state(path, expect=SessionState).object("ring").maxlen
    2
    """
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        return _load(f"`{os.fspath(path)}`", stream, size, device, expect)


@overload
def loads_state(
    data: bytes | bytearray | memoryview,
    /,
    *,
    device: torch.device | str | None = None,
    expect: type[_R],
) -> _R: ...
@overload
def loads_state(
    data: bytes | bytearray | memoryview,
    /,
    *,
    device: torch.device | str | None = None,
    expect: None = None,
) -> Any: ...


def loads_state(
    data: bytes | bytearray | memoryview,
    /,
    *,
    device: torch.device | str | None = None,
    expect: type | None = None,
) -> Any:
    """Read a snapshot from bytes written by `dumps_state`; see `load_state`.

    Raises:
        SnapshotError: as `load_state` (the message says "(bytes)" where a path would be).

    >>> import torch
    >>> from sessionstate import dumps_state
    >>> loads_state(dumps_state({"step": 3, "x": torch.zeros(2)}))
    {'step': 3, 'x': tensor([0., 0.])}
    """
    # `BytesIO` shares a `bytes` object's buffer instead of copying it.
    buffer = data if isinstance(data, bytes) else bytes(data)
    return _load("(bytes)", io.BytesIO(buffer), len(buffer), device, expect)
