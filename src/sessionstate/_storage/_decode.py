"""Reading a snapshot: the header checked, the storages read and every record rebuilt."""

from __future__ import annotations

import io
import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, TypeGuard, overload

import attrs
import numpy as np
import torch

from sessionstate._errors import SnapshotError
from sessionstate._frozen import CONTAINERS_BY_TAG
from sessionstate._storage._format import (
    CHUNK,
    CRC32,
    DTYPES,
    FORMAT_VERSION,
    MAX_DEPTH,
    MAX_DIMS,
    MAX_HEADER,
    MAX_INT,
    METADATA_KEY,
    XXH3,
    Checksum,
    R,
    SnapshotParts,
    StreamHash,
    ViewSpec,
    checksum_of_version,
    rebuild_views,
    refusal,
    resolve_leaf_class,
    resolve_record,
    root,
)

# -- decoding -------------------------------------------------------------------------------------


def _fail(source: str, problem: str, fix: str) -> SnapshotError:
    return SnapshotError(f"Snapshot {source} {problem}; {fix}.")


_WRITE_AGAIN = "write it again"


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _parse_json(source: str, text: str | bytes, what: str, not_json: tuple[str, str]) -> Any:
    """``text`` parsed, refusing what `json.loads` would take loosely or crash on."""
    try:
        return json.loads(text, object_pairs_hook=_unique)
    except _DuplicateKeyError as exc:
        raise _fail(
            source,
            f"has the key {exc.key[:60]!r} twice in one object of its {what}, so it is "
            "ambiguous which one holds",
            _WRITE_AGAIN,
        ) from None
    except RecursionError:
        raise _fail(source, f"has a {what} nested too deeply to read", _WRITE_AGAIN) from None
    except json.JSONDecodeError:
        raise _fail(source, *not_json) from None
    except (UnicodeDecodeError, ValueError) as exc:  # e.g. an int of 5,000 digits
        raise _fail(source, f"has a {what} that cannot be read ({exc})", _WRITE_AGAIN) from None


def _is_count(value: Any) -> TypeGuard[int]:
    """An exact int in ``[0, 2**62]``: never a bool, a float or a string."""
    return type(value) is int and 0 <= value <= MAX_INT


@attrs.frozen
class _Storage:
    nbytes: int
    device: str
    checksum: int  # of the file's format version (`Document.checksum`)
    start: int  # of its bytes, relative to the data section


@attrs.frozen
class Document:
    """A snapshot's header, checked: every number in range, every reference valid.

    Attributes:
        raw: The JSON document as parsed.
        checksum: The checksum of the file's format version (xxh3-64 from 4 on, else CRC-32).
        storages: Per storage: its size, device, checksum and place in the data section.
        views: Each tensor leaf as a view of one storage, checked to fit it.
        data_start: The offset of the data section in the file.
    """

    raw: dict[str, Any]
    checksum: Checksum
    storages: tuple[_Storage, ...]
    views: tuple[ViewSpec, ...]
    data_start: int


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
        if n > MAX_HEADER:
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
            text = self.stream.read(n).decode()
        except UnicodeDecodeError:
            text = "\x00"  # not JSON either
        header = _parse_json(
            self.source,
            text,
            "safetensors header",
            ("is not a safetensors file (its header is not JSON)", not_snapshot),
        )
        if not isinstance(header, dict):
            raise _fail(
                self.source,
                "is not a safetensors file (its header is not a JSON object)",
                not_snapshot,
            )
        return header, 8 + n

    def read_into(self, start: int, out: torch.Tensor, hasher: StreamHash) -> None:
        """Fill ``out`` with the bytes at ``start``, feeding each chunk to ``hasher`` as read.

        Hashing a chunk right after reading it finds it in cache: one pass over memory, not two.
        """
        self.stream.seek(start)
        if out.numel() == 0:
            return
        view = out.numpy().data
        done = 0
        while done < len(view):
            got = self.stream.readinto(view[done : done + CHUNK])  # type: ignore[attr-defined]
            if not got:
                raise _fail(self.source, "is truncated", "write it again")
            hasher.update(view[done : done + got])
            done += got


def read_header(source: str, stream: IO[bytes], size: int) -> Document:
    """Parse and check a snapshot's container header and JSON document; read no storage.

    Everything a loader later trusts is checked here: the document's checksum (a CRC-32 in
    version 3, an xxh3-64 from version 4 on), the version, every storage's size, device and
    place in the file (inside it, not overlapping another), every view (it fits its storage)
    and the structure of the tree (node kinds, references, nesting depth). A loader therefore
    never allocates more than the file's storages hold.

    Raises:
        SnapshotError: for a file that is not a snapshot, from a newer format version,
            truncated, corrupt, or malformed in any way, naming the value and the fix.
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
    assert isinstance(meta, dict)
    document = _parse_json(
        source,
        text,
        f"`{METADATA_KEY}` document",
        (f"has a `{METADATA_KEY}` metadata entry that is not JSON", "write it again"),
    )
    version = document.get("format_version") if isinstance(document, dict) else None
    if not _is_count(version) or version < 1:
        raise _fail(source, f"has no valid `format_version` (got {version!r:.60})", _WRITE_AGAIN)
    assert isinstance(document, dict)
    if version > FORMAT_VERSION:
        writer = document.get("library_version", "unknown")
        raise _fail(
            source,
            f"uses snapshot format version {version}, newer than this library reads "
            f"({FORMAT_VERSION}; it was written by sessionstate {writer!s:.40})",
            "upgrade sessionstate to load it",
        )
    checksum = checksum_of_version(version)
    # Each checksum of the document is checked whenever present (a flipped bit may have lowered
    # the version); the version's own is required from version 3 on.
    for kind in (XXH3, CRC32):
        stored = meta.get(kind.key)
        if stored is None and kind is checksum and version >= 3:
            raise _fail(
                source,
                f"has no `{kind.key}` checksum of its document, which format version "
                f"{version} requires",
                "restore it from an intact copy, or write it again",
            )
        if stored is not None and stored != kind.of_document(text):
            raise _fail(
                source,
                f"is corrupt: its JSON document fails its {kind.name} check (stored "
                f"{stored!r:.20}, computed {kind.of_document(text)})",
                "restore it from an intact copy",
            )
    storages = _storages(source, document, header, data_start, size, checksum)
    views = _views(source, document, storages)
    _check_tree(source, document, len(views))
    return Document(document, checksum, storages, views, data_start)


def _storages(
    source: str,
    document: dict[str, Any],
    header: dict[str, Any],
    data_start: int,
    size: int,
    checksum: Checksum,
) -> tuple[_Storage, ...]:
    described = document.get("storages")
    if not isinstance(described, list):
        raise _fail(
            source, f"has no storage list in its document (got {described!r:.60})", _WRITE_AGAIN
        )
    out: list[_Storage] = []
    for i, d in enumerate(described):
        name = f"storage.{i}"
        entry = header.get(name)
        nbytes = d.get("nbytes") if isinstance(d, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        ok = (
            isinstance(entry, dict)
            and entry.get("dtype") == "U8"
            and _is_count(nbytes)
            and isinstance(shape, list)
            and len(shape) == 1
            and _is_count(shape[0])
            and shape[0] == nbytes
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_count(o) for o in offsets)
            and offsets[1] - offsets[0] == nbytes
        )
        if not ok:
            raise _fail(
                source,
                f"has no valid tensor `{name}` for storage {i} (entry {entry!r:.80}, "
                f"described as {d!r:.80}): sizes and offsets must be ints from 0",
                _WRITE_AGAIN,
            )
        assert isinstance(d, dict)
        assert isinstance(offsets, list)
        assert isinstance(nbytes, int)
        start, end = offsets
        if data_start + end > size:
            raise _fail(
                source,
                f"is truncated: storage {i} ends at byte {data_start + end} but the file has "
                f"{size} bytes",
                "write it again (an interrupted copy leaves a short file)",
            )
        device = d.get("device")
        problem = _device_problem(device)
        if problem is not None:
            raise _fail(
                source,
                f"holds storage {i} for device {device!r:.40}, {problem}",
                "write it again, or pass `device=` only at load",
            )
        stored = d.get(checksum.field)
        value = checksum.from_json(stored)
        if value is None:
            expected = (
                "16 lowercase hex digits" if checksum is XXH3 else "an int from 0 to 2**32 - 1"
            )
            raise _fail(
                source,
                f"has no valid {checksum.name} checksum for storage {i} (got {stored!r:.40}; "
                f"it must be {expected})",
                _WRITE_AGAIN,
            )
        assert isinstance(device, str)
        out.append(_Storage(nbytes=nbytes, device=device, checksum=value, start=start))
    # Disjoint ranges: a file's bytes back one storage at most, so what is allocated is at most
    # the file's size.
    ranges = sorted((s.start, s.start + s.nbytes, i) for i, s in enumerate(out) if s.nbytes)
    for (_, end, i), (start, _, j) in itertools.pairwise(ranges):
        if start < end:
            raise _fail(
                source,
                f"is inconsistent: storages {min(i, j)} and {max(i, j)} overlap in its data "
                "section (each byte of the file backs one storage at most)",
                _WRITE_AGAIN,
            )
    return tuple(out)


def _views(
    source: str, document: dict[str, Any], storages: Sequence[_Storage]
) -> tuple[ViewSpec, ...]:
    raw = document.get("views")
    if not isinstance(raw, list):
        raise _fail(source, f"has no view list in its document (got {raw!r:.60})", _WRITE_AGAIN)
    return tuple(_view(source, i, v, storages) for i, v in enumerate(raw))


def _view(source: str, i: int, raw: Any, storages: Sequence[_Storage]) -> ViewSpec:
    def invalid(why: str) -> SnapshotError:
        return _fail(
            source, f"has an invalid description of view {i}: {raw!r:.120} ({why})", _WRITE_AGAIN
        )

    if not isinstance(raw, dict):
        raise invalid("not an object")
    storage, dtype = raw.get("storage"), raw.get("dtype")
    shape, stride, offset = raw.get("shape"), raw.get("stride"), raw.get("offset")
    conj, neg = raw.get("conj", False), raw.get("neg", False)
    if type(storage) is not int or not 0 <= storage < len(storages):
        raise invalid(f"`storage` must be the index of one of its {len(storages)} storages")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise invalid(f"`dtype` must be one of {sorted(DTYPES)}")
    for name, dims in (("shape", shape), ("stride", stride)):
        if not isinstance(dims, list) or len(dims) > MAX_DIMS:
            raise invalid(f"`{name}` must be a list of at most {MAX_DIMS} ints")
        if not all(_is_count(n) for n in dims):
            raise invalid(f"`{name}` must hold ints from 0 to 2**62")
    assert isinstance(shape, list)
    assert isinstance(stride, list)
    if len(shape) != len(stride):
        raise invalid("`shape` and `stride` differ in length")
    if not _is_count(offset):
        raise invalid("`offset` must be an int from 0 to 2**62")
    if type(conj) is not bool or type(neg) is not bool:
        raise invalid("`conj` and `neg` must be true or false")
    if math.prod(shape) > MAX_INT:
        raise invalid("it holds more than 2**62 elements")
    view = ViewSpec(
        storage=storage,
        dtype=DTYPES[dtype],
        shape=tuple(shape),
        stride=tuple(stride),
        offset=offset,
        conj=conj,
        neg=neg,
    )
    needed, held = view.nbytes_needed(), storages[storage].nbytes
    if needed > held:
        raise _fail(
            source,
            f"is inconsistent: view {i} (shape {view.shape}, stride {view.stride}, offset "
            f"{view.offset}, {dtype}) needs {needed} bytes of storage {storage}, "
            f"which holds {held}",
            _WRITE_AGAIN,
        )
    return view


_JSON_KINDS = {"bool": bool, "int": int, "str": str}
_DICT_KEYS = (str, int, bool)


class _TreeCheck:
    """Checks the structure of a document's tree and leaf payloads before anything is built."""

    def __init__(self, source: str, views: int, version: int) -> None:
        self.source = source
        self.views = views
        self.version = version

    def bad(self, key: str, what: str) -> SnapshotError:
        return _fail(self.source, f"has an invalid node at `{root(key)}` ({what})", _WRITE_AGAIN)

    def node(self, node: Any, key: str, depth: int = 0) -> None:
        if depth > MAX_DEPTH:
            raise self.bad(key[:200], f"nested deeper than {MAX_DEPTH} levels")
        if not isinstance(node, dict):
            raise self.bad(key, f"{node!r:.60}")
        kind = node.get("type")
        if kind == "none":
            return
        if kind in _JSON_KINDS:
            value = node.get("value")
            if type(value) is not _JSON_KINDS[kind]:
                raise self.bad(key, f"{kind} holding {value!r:.60}")
            return
        if kind == "float":
            value = node.get("value")
            if type(value) not in (int, float) and value not in ("nan", "inf", "-inf"):
                raise self.bad(key, f"float holding {value!r:.60}")
            return
        if kind == "tensor":
            i = node.get("view")
            if type(i) is not int or not 0 <= i < self.views:
                raise self.bad(key, f"tensor view {i!r:.60} of {self.views}")
            return
        container = CONTAINERS_BY_TAG.get(kind) if isinstance(kind, str) else None
        if container is not None and self.version >= container.since:
            if container.mapping:
                self.pairs(node, key, depth)
                return
            items = node.get("items")
            if not isinstance(items, list):
                raise self.bad(key, f"{kind} without items")
            for i, child in enumerate(items):
                self.node(child, f"{key}[{i}]", depth + 1)
            return
        if kind == "record":
            name, fields, statics = node.get("class"), node.get("fields"), node.get("static")
            if not isinstance(name, str):
                raise self.bad(key, f"record of class {name!r:.60}")
            if not isinstance(fields, dict) or not isinstance(statics, dict):
                raise self.bad(key, f"record `{name:.80}` without fields")
            twice = fields.keys() & statics.keys()
            if twice:
                raise self.bad(key, f"record `{name:.80}` gives field `{min(twice):.40}` twice")
            for field_name, child in (*fields.items(), *statics.items()):
                self.node(child, f"{key}.{field_name}", depth + 1)
            return
        if kind == "leaf":
            name, i = node.get("class"), node.get("index")
            if not isinstance(name, str) or type(i) is not int or i < 0:
                raise self.bad(key, f"leaf of class {name!r:.60} at index {i!r:.20}")
            return
        raise self.bad(key, f"unknown node type {kind!r:.40}")

    def pairs(self, node: dict[str, Any], key: str, depth: int) -> None:
        pairs = node.get("items")
        if not isinstance(pairs, list):
            raise self.bad(key, f"{node.get('type')} without items")
        seen: set[Any] = set()
        for pair in pairs:
            if not isinstance(pair, list) or len(pair) != 2:
                raise self.bad(key, f"dict item {pair!r:.60}")
            k = pair[0]
            if type(k) not in _DICT_KEYS:
                raise self.bad(key, f"dict key {k!r:.60}, which is not a str, int or bool")
            if k in seen:
                raise self.bad(key, f"dict key {k!r:.60} given twice")
            seen.add(k)
            self.node(pair[1], f"{key}[{k!r}]", depth + 1)


def _check_tree(source: str, document: dict[str, Any], views: int) -> None:
    check = _TreeCheck(source, views, document["format_version"])
    if "tree" not in document:
        raise _fail(source, "has no tree in its document", _WRITE_AGAIN)
    check.node(document["tree"], "")
    leaves = document.get("leaves", {})
    if not isinstance(leaves, dict):
        raise _fail(source, f"has an invalid leaf section {leaves!r:.60}", _WRITE_AGAIN)
    for name, payload in leaves.items():
        check.node(payload, f"<{name}>")
    metadata = document.get("metadata", {})
    if not isinstance(metadata, dict) or not all(type(v) is str for v in metadata.values()):
        raise _fail(
            source, f"has metadata that is not a map of strings: {metadata!r:.80}", _WRITE_AGAIN
        )


def _load(
    source: str,
    stream: IO[bytes],
    size: int,
    device: torch.device | str | None,
    expect: type | None,
) -> Any:
    header = read_header(source, stream, size)
    reader = _Reader(source, stream, size)

    def fill(i: int, described: _Storage, out: torch.Tensor, hasher: StreamHash) -> None:
        reader.read_into(header.data_start + described.start, out, hasher)

    return _build(source, header, fill, device, expect)


_Fill = Callable[[int, _Storage, torch.Tensor, StreamHash], None]


def _build(
    source: str,
    header: Document,
    fill: _Fill,
    device: torch.device | str | None,
    expect: type | None,
) -> Any:
    """The tree ``header`` describes, each storage filled (and hashed) by ``fill`` and checked."""
    storages: list[torch.UntypedStorage] = []
    for i, described in enumerate(header.storages):
        data = torch.empty(described.nbytes, dtype=torch.uint8)
        hasher = header.checksum.hasher()
        fill(i, described, data, hasher)
        if hasher.value() != described.checksum:
            raise _fail(
                source,
                f"is corrupt: storage {i} ({described.nbytes} bytes) fails its "
                f"{header.checksum.name} check",
                "restore it from an intact copy",
            )
        target = torch.device(device) if device is not None else torch.device(described.device)
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
    tensors = rebuild_views(storages, header.views)
    document = header.raw
    root = _Decoder(source, tensors, document.get("leaves", {})).node(document["tree"], "")
    if expect is not None and not isinstance(root, expect):
        raise _fail(
            source,
            f"holds a `{type(root).__qualname__}`, not the expected `{expect.__qualname__}`",
            "pass the matching class as `expect=`, or load a snapshot of that class",
        )
    return root


def _device_problem(device: Any) -> str | None:
    """Why ``device`` names no device a storage can be loaded to, or None."""
    if not isinstance(device, str):
        return "which is not a device string such as 'cpu' or 'cuda:0'"
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        return "which is not a device string such as 'cpu' or 'cuda:0'"
    if parsed.type == "meta":
        return "which holds no data, so no snapshot storage comes from it"
    return None


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
            self.source, f"has an invalid node at `{root(key)}` ({what})", "write it again"
        )

    def node(self, node: dict[str, Any], key: str) -> Any:
        # The structure was checked with the header (`_TreeCheck`): every node here is valid.
        kind = node["type"]
        if kind == "none":
            return None
        if kind in ("bool", "int", "str"):
            return node["value"]
        if kind == "float":
            return float(node["value"])
        if kind == "tensor":
            return self.tensors[node["view"]]
        container = CONTAINERS_BY_TAG.get(kind)
        if container is not None and container.mapping:
            return container.build({k: self.node(v, f"{key}[{k!r}]") for k, v in node["items"]})
        if container is not None:
            return container.build(
                [self.node(v, f"{key}[{i}]") for i, v in enumerate(node["items"])]
            )
        if kind == "record":
            return self.record(node, key)
        return self.leaf(node, key)

    def leaf(self, node: dict[str, Any], key: str) -> Any:
        name, i = node["class"], node["index"]
        if name not in self.payloads:
            raise self.bad(key, f"leaf of class {name!r:.60} without a payload")
        restored = self.restored.get(name)
        if restored is None:
            restored = self.restored[name] = self.restore(name)
        if not i < len(restored):
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
        name = node["class"]
        cls = resolve_record(name)
        refused = refusal(cls) if cls is not None else None
        if refused is not None:
            raise _fail(
                self.source,
                f"holds a `{name}` at `{root(key)}`, which is never valid snapshot content: "
                f"{refused}",
                "write the snapshot again from the unparked record",
            )
        if cls is None:
            raise _fail(
                self.source,
                f"holds a record of class `{name}` at `{root(key)}`, which is not registered "
                "in this process",
                "import the module that defines it before loading (only registered record "
                "classes are rebuilt; a loader imports no module outside `sessionstate`)",
            )
        kwargs: dict[str, Any] = {}
        for field_name, child in (*node["fields"].items(), *node["static"].items()):
            kwargs[field_name] = self.node(child, f"{key}.{field_name}")
        try:
            return cls(**kwargs)
        except Exception as exc:  # a validator or converter refused the stored values
            raise _fail(
                self.source,
                f"holds a `{cls.__qualname__}` at `{root(key)}` that its constructor refuses "
                f"({type(exc).__name__}: {exc})",
                "load it with the library version that wrote it, or write it again",
            ) from exc


@overload
def load_state(
    path: str | os.PathLike[str], /, *, device: torch.device | str | None = None, expect: type[R]
) -> R: ...
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
    checked against its checksum before anything is returned.

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
    expect: type[R],
) -> R: ...
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


_UNBOUNDED = 4 * MAX_INT  # a size no header's offsets reach (each is at most 2**62)


def _part_bytes(source: str, i: int, part: Any) -> memoryview:
    """Part ``i`` as flat bytes, refused unless it is a 1-D, C-contiguous ``uint8`` array."""
    ok = (
        isinstance(part, np.ndarray)
        and part.dtype == np.uint8
        and part.ndim == 1
        and part.flags.c_contiguous
    )
    if not ok:
        got = (
            f"a {part.dtype} array of shape {part.shape}"
            if isinstance(part, np.ndarray)
            else f"a {type(part).__qualname__}"
        )
        raise _fail(
            source,
            f"has a part for storage {i} that is not a 1-D contiguous uint8 array (got {got:.80})",
            "send the parts `dumps_parts` made unchanged",
        )
    return memoryview(part)


@overload
def loads_parts(
    parts: SnapshotParts, /, *, device: torch.device | str | None = None, expect: type[R]
) -> R: ...
@overload
def loads_parts(
    parts: SnapshotParts, /, *, device: torch.device | str | None = None, expect: None = None
) -> Any: ...


def loads_parts(
    parts: SnapshotParts,
    /,
    *,
    device: torch.device | str | None = None,
    expect: type | None = None,
) -> Any:
    """Read a snapshot in parts (`dumps_parts`): each storage copied once, hashed as copied.

    The parts may be read-only views of memory the caller does not own (what ``ray.get``
    returns for NumPy arrays): nothing returned refers to them. The header is checked as a
    file's is (`read_header`), as if the storages followed it in order; then part ``i`` must
    be exactly storage ``i`` (its size, at its offset), and each storage's bytes are copied
    into memory of their own and checked against the header's checksum as they are copied.

    Raises:
        SnapshotError: as `loads_state` (the message says "(parts)"), and for parts that do
            not match the header (a count, a size, an offset, a part that is not a buffer).

    >>> import torch
    >>> from sessionstate._storage import dumps_parts
    >>> loads_parts(dumps_parts({"step": 3, "x": torch.zeros(2)}))
    {'step': 3, 'x': tensor([0., 0.])}
    """
    source = "(parts)"
    unchanged = "send the parts `dumps_parts` made unchanged"
    head, arrays = getattr(parts, "header", None), getattr(parts, "storages", None)
    if not isinstance(head, bytes) or not isinstance(arrays, tuple):
        raise _fail(
            source,
            f"is a {type(parts).__qualname__}, not a `SnapshotParts` of a header (bytes) and a "
            "tuple of storages",
            unchanged,
        )
    views = [_part_bytes(source, i, part) for i, part in enumerate(arrays)]
    declared = 8 + struct.unpack_from("<Q", head)[0] if len(head) >= 8 else None
    if declared != len(head):
        problem = (
            f" where its length prefix declares {declared}"
            if declared is not None
            else ", too short for its 8-byte length prefix"
        )
        raise _fail(source, f"has a header of {len(head)} bytes{problem}", unchanged)
    # No storage follows the header here: each is checked against its own part below, more
    # strictly than a file's (exactly its size, at its offset), before anything is allocated.
    header = read_header(source, io.BytesIO(head), _UNBOUNDED)
    if len(views) != len(header.storages):
        raise _fail(
            source,
            f"has {len(views)} storage parts for the {len(header.storages)} storages its "
            "header describes",
            unchanged,
        )
    start = 0
    for i, (described, view) in enumerate(zip(header.storages, views, strict=True)):
        if described.start != start or described.nbytes != len(view):
            raise _fail(
                source,
                f"is inconsistent: its header places storage {i} ({described.nbytes} bytes) "
                f"at offset {described.start}, but part {i} is {len(view)} bytes at offset "
                f"{start}",
                unchanged,
            )
        start += len(view)

    def fill(i: int, described: _Storage, out: torch.Tensor, hasher: StreamHash) -> None:
        # Copied a chunk at a time and hashed right after, while the chunk is in cache: one
        # pass over the bytes. The copy is what is hashed, so what is kept is what is checked.
        if out.numel() == 0:
            return
        dst, src = out.numpy().data, views[i]
        for a in range(0, len(src), CHUNK):
            dst[a : a + CHUNK] = src[a : a + CHUNK]
            hasher.update(dst[a : a + CHUNK])

    return _build(source, header, fill, device, expect)
