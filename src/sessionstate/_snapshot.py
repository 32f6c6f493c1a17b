"""Snapshots: a record to one safetensors file (or bytes) and back, bit-identical, no pickle.

The format stores each distinct *storage* once, as a raw ``uint8`` tensor named
``storage.<i>``, and describes every tensor leaf as a view of one of them (storage index,
dtype, shape, stride, storage offset). Two leaves that shared a storage share one again after
loading, so `nbytes_by_device` is unchanged by a round trip. The structure (record classes by
registered name, static fields, containers, JSON leaves), a format version, the library and
torch versions and a CRC-32 per storage go in the safetensors metadata as one JSON document
under the key ``sessionstate``.

Loading never unpickles: records are rebuilt through their constructors (their validators
run), and only classes registered as records in this process are used. The one import a
loader may make is of a module under ``sessionstate.`` named in the file (the library's own
models); any other record class must have been imported by the caller first.

A leaf that is neither a tensor nor a JSON value (an engine's handle to memory it owns, such
as a `KVHandle`) is saved by value when its class is registered with `register_snapshot_leaf`:
the class turns all its leaves in one snapshot into one payload of tensors and JSON values,
stored like the rest, and rebuilds them from it at load. Such a file is format version 2; a
file without one stays version 1, which older libraries read.

The storage walk (`collect_storages`) and the rebuild (`rebuild_views`) are the library's one
way to move a record's bytes: whatever moves storages elsewhere and back uses them.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar, overload

import attrs
import optree
import torch
from safetensors.torch import save as _st_save
from safetensors.torch import save_file as _st_save_file

from sessionstate._checks import describe, is_int
from sessionstate._errors import SnapshotError, UnsupportedTensorError
from sessionstate._tree import NAMESPACE, PyTree

__all__ = [
    "FORMAT_VERSION",
    "ViewSpec",
    "collect_storages",
    "dumps_state",
    "inspect_snapshot",
    "load_state",
    "loads_state",
    "read_header",
    "rebuild_views",
    "record_name",
    "register_snapshot_leaf",
    "resolve_leaf_class",
    "resolve_record",
    "save_state",
    "storage_bytes",
]

FORMAT_VERSION = 2
"""The newest snapshot format this library writes; it reads this version and older ones.

Version 2 adds leaves saved by a registered class (`register_snapshot_leaf`); a snapshot
without one is written as version 1.
"""

_PLAIN_FORMAT_VERSION = 1

METADATA_KEY = "sessionstate"
"""The safetensors metadata key holding the snapshot's JSON document."""

_IMPORTABLE_PREFIX = "sessionstate."
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
_CHUNK = 16 * 1024 * 1024

_R = TypeVar("_R")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    )
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPES.items()}


# -- the storage walk and the rebuild -------------------------------------------------------------


@attrs.frozen
class ViewSpec:
    """One tensor leaf as a view of a stored storage.

    Args:
        storage: Index of the storage in the walk's storage list.
        dtype: The leaf's dtype.
        shape: The leaf's shape.
        stride: The leaf's strides, in elements.
        offset: The leaf's storage offset, in elements.
        conj: Whether the leaf carries torch's lazy conjugation bit.
        neg: Whether the leaf carries torch's lazy negation bit.
    """

    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    conj: bool = False
    neg: bool = False

    def nbytes_needed(self) -> int:
        """Bytes of storage the view reaches: 0 for an empty view.

        >>> ViewSpec(0, torch.float32, (2, 3), (3, 1), 1).nbytes_needed()
        28
        """
        if any(s == 0 for s in self.shape):
            return 0
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        return (last + 1) * _itemsize(self.dtype)

    def to_json(self) -> dict[str, Any]:
        """The view as a JSON object (dtype by name)."""
        out: dict[str, Any] = {
            "storage": self.storage,
            "dtype": _DTYPE_NAMES[self.dtype],
            "shape": list(self.shape),
            "stride": list(self.stride),
            "offset": self.offset,
        }
        if self.conj:
            out["conj"] = True
        if self.neg:
            out["neg"] = True
        return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _check_tensor(t: torch.Tensor, key: str) -> None:
    """Refuse a tensor whose bytes cannot be stored as one dense storage plus a view."""
    problem = None
    if type(t) is not torch.Tensor:
        problem = f"a tensor subclass `{type(t).__qualname__}`"
        fix = "store a plain tensor (`t.as_subclass(torch.Tensor)`) or its component tensors"
    elif t.is_nested:
        problem = "a nested tensor"
        fix = "store its component tensors (`list(t.unbind())`)"
    elif t.layout != torch.strided:
        problem = f"a sparse tensor (layout={t.layout})"
        fix = "store its dense components (e.g. `t.indices()` and `t.values()`) or `t.to_dense()`"
    elif t.is_meta:
        problem = "a meta tensor, which has no data"
        fix = "materialise it on a real device first, or leave it out of the snapshot"
    elif t.dtype not in _DTYPE_NAMES:
        problem = f"of dtype {t.dtype}, which the snapshot format does not support"
        fix = f"convert it to one of {sorted(_DTYPES)}"
    if problem is None:
        return
    try:
        shape = f"shape {tuple(t.shape)}, "
    except RuntimeError:  # a strided nested tensor has no single shape
        shape = ""
    msg = (
        f"Cannot snapshot the tensor at `{_root(key)}`: it is {problem} ({shape}device "
        f"{t.device}); {fix}."
    )
    raise UnsupportedTensorError(msg)


def collect_storages(
    tensors: Sequence[tuple[str, torch.Tensor]], /
) -> tuple[list[torch.UntypedStorage], list[ViewSpec]]:
    """Walk tensors once: their distinct storages, and each tensor as a view of one of them.

    Storages are identified by device and address range (two storage objects over the same
    memory are one storage), or, without memory, by the storage object.

    Args:
        tensors: ``(key path, tensor)`` pairs; the key path names a refused tensor.

    Raises:
        UnsupportedTensorError: for a meta, sparse, nested or subclass tensor, naming its key.

    >>> x = torch.arange(6.0)
    >>> storages, views = collect_storages([("a", x), ("b", x[2:].view(2, 2))])
    >>> len(storages), views[1].storage, views[1].offset, views[1].shape
    (1, 0, 2, (2, 2))
    """
    storages: list[torch.UntypedStorage] = []
    index: dict[tuple[Any, ...], int] = {}
    views: list[ViewSpec] = []
    for key, t in tensors:
        _check_tensor(t, key)
        storage = t.untyped_storage()
        pointer = storage.data_ptr()
        identity: tuple[Any, ...] = (
            (str(t.device), pointer, storage.nbytes()) if pointer else ("object", storage._cdata)
        )
        i = index.get(identity)
        if i is None:
            i = index[identity] = len(storages)
            storages.append(storage)
        views.append(
            ViewSpec(
                storage=i,
                dtype=t.dtype,
                shape=tuple(t.shape),
                stride=tuple(t.stride()),
                offset=int(t.storage_offset()),
                conj=t.is_conj(),
                neg=t.is_neg(),
            )
        )
    return storages, views


def storage_bytes(storage: torch.UntypedStorage, /) -> torch.Tensor:
    """The whole of ``storage`` as a 1-D ``uint8`` tensor (a view: no copy).

    >>> x = torch.tensor([1], dtype=torch.int16)
    >>> storage_bytes(x.untyped_storage()).tolist()
    [1, 0]
    """
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (storage.nbytes(),), (1,))


def rebuild_views(
    storages: Sequence[torch.UntypedStorage], views: Sequence[ViewSpec], /
) -> list[torch.Tensor]:
    """Rebuild each view as a tensor over its storage (the inverse of `collect_storages`).

    The caller checks first that every view fits its storage (`ViewSpec.nbytes_needed`):
    ``Tensor.set_`` would grow a storage that is too short rather than refuse.

    >>> x = torch.arange(6.0)
    >>> storages, views = collect_storages([("a", x.view(2, 3).t())])
    >>> rebuilt = rebuild_views([s.clone() for s in storages], views)[0]
    >>> torch.equal(rebuilt, x.view(2, 3).t()), rebuilt.is_contiguous()
    (True, False)
    """
    out: list[torch.Tensor] = []
    for view in views:
        storage = storages[view.storage]
        t = torch.empty(0, dtype=view.dtype, device=storage.device)
        t = t.set_(storage, view.offset, view.shape, view.stride)
        if view.neg:
            t = torch._neg_view(t)
        if view.conj:
            t = t.conj()
        out.append(t)
    return out


def _checksum(data: torch.Tensor) -> int:
    if data.numel() == 0:
        return zlib.crc32(b"")
    return zlib.crc32(data.numpy().data)


# -- record names ---------------------------------------------------------------------------------


def record_name(cls: type, /) -> str:
    """The name a snapshot stores for a record class: ``module:qualname``.

    >>> from sessionstate import LatentBuffer
    >>> record_name(LatentBuffer)
    'sessionstate._objects:LatentBuffer'
    """
    return f"{cls.__module__}:{cls.__qualname__}"


def _is_record(cls: type) -> bool:
    entry = optree.register_pytree_node.get(cls, namespace=NAMESPACE)
    return entry is not None and entry.namespace == NAMESPACE and attrs.has(cls)


def _registered_records() -> dict[str, type]:
    # `get` without a class returns the whole registry; its stubs only describe the lookup.
    get_all: Any = optree.register_pytree_node.get
    registry: dict[type, Any] = get_all(namespace=NAMESPACE)
    return {
        record_name(cls): cls
        for cls, entry in registry.items()
        if isinstance(cls, type) and entry.namespace == NAMESPACE and attrs.has(cls)
    }


def resolve_record(name: str, /) -> type | None:
    """The record class registered in this process under ``name``, or None.

    Only classes registered as records (`record`, `register_record`, `SessionState`
    subclasses) are found. When none is registered under ``name`` and its module is under
    ``sessionstate.``, that module is imported once and the lookup repeated; no other module
    is ever imported.

    >>> resolve_record("sessionstate._session:SessionState").__name__
    'SessionState'
    >>> resolve_record("os:system") is None
    True
    """
    found = _registered_records().get(name)
    if found is not None:
        return found
    module, _, _ = name.partition(":")
    if not module.startswith(_IMPORTABLE_PREFIX):
        return None
    try:
        importlib.import_module(module)
    except ImportError:
        return None
    return _registered_records().get(name)


# -- leaves saved by their class ------------------------------------------------------------------

_LEAF_CLASSES: dict[str, type] = {}

_T = TypeVar("_T", bound=type)


def register_snapshot_leaf(cls: _T, /) -> _T:
    """Let snapshots hold leaves of ``cls``, saved by value through two class methods.

    A snapshot holds tensors, JSON values and records. A leaf of another class (an engine's
    handle to memory it owns, such as a `KVHandle`) joins them when its class defines:

    - ``__sessionstate_snapshot__(leaves)``: given every ``(key path, leaf)`` of the class in
      one snapshot, in tree order, one *payload* of tensors, JSON values, tuples, lists and
      dicts describing them all (leaves sharing memory can store it once). Its tensors are
      stored like any other (one storage each, with a CRC-32);
    - ``__sessionstate_restore__(payload)``: the leaves rebuilt from the payload as loaded,
      in the same order; raise ``ValueError`` or ``TypeError`` for a payload it refuses.

    A loader restores leaves only of classes registered in this process under their
    ``module:qualname`` (it may import a module under ``sessionstate.`` named in the file, as
    for records). Nothing is unpickled. Usable as a class decorator.

    Raises:
        TypeError: if ``cls`` is not a class defining both methods.

    >>> import torch
    >>> from sessionstate import dumps_state, loads_state
    >>> @register_snapshot_leaf
    ... class Offset:
    ...     def __init__(self, t):
    ...         self.t = t
    ...     @classmethod
    ...     def __sessionstate_snapshot__(cls, leaves):
    ...         return [leaf.t for _, leaf in leaves]
    ...     @classmethod
    ...     def __sessionstate_restore__(cls, payload):
    ...         return [cls(t) for t in payload]
    >>> loads_state(dumps_state({"o": Offset(torch.ones(2))}))["o"].t
    tensor([1., 1.])
    """
    methods = ("__sessionstate_snapshot__", "__sessionstate_restore__")
    missing = [
        m for m in methods if not isinstance(cls, type) or not callable(getattr(cls, m, None))
    ]
    if not isinstance(cls, type) or missing:
        msg = (
            f"Cannot register {describe(cls)} as a snapshot leaf: it must be a "
            f"class defining the class methods {' and '.join(f'`{m}`' for m in missing)}; "
            "define them (see `register_snapshot_leaf`) or keep its values out of snapshots."
        )
        raise TypeError(msg)
    _LEAF_CLASSES[record_name(cls)] = cls
    return cls


def _is_snapshot_leaf(cls: type) -> bool:
    return _LEAF_CLASSES.get(record_name(cls)) is cls


def resolve_leaf_class(name: str, /) -> type | None:
    """The class registered with `register_snapshot_leaf` under ``name``, or None.

    As `resolve_record`: a module under ``sessionstate.`` may be imported once; no other is.

    >>> resolve_leaf_class("sessionstate._kvpool:KVHandle").__name__
    'KVHandle'
    >>> resolve_leaf_class("os:system") is None
    True
    """
    found = _LEAF_CLASSES.get(name)
    if found is not None:
        return found
    module, _, _ = name.partition(":")
    if not module.startswith(_IMPORTABLE_PREFIX):
        return None
    try:
        importlib.import_module(module)
    except ImportError:
        return None
    return _LEAF_CLASSES.get(name)


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

    def node(self, value: Any, key: str, *, statics: bool = False) -> Any:
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
        if cls is tuple or cls is list:
            items = [self.node(v, f"{key}[{i}]", statics=statics) for i, v in enumerate(value)]
            return {"type": cls.__name__, "items": items}
        if cls is dict:
            pairs = []
            for k, v in value.items():
                if type(k) not in (str, int, bool):
                    msg = (
                        f"Cannot snapshot the dict at `{_root(key)}`: its key {k!r} is a "
                        f"{type(k).__name__}; snapshot dict keys must be str, int or bool."
                    )
                    raise TypeError(msg)
                pairs.append([k, self.node(v, f"{key}[{k!r}]", statics=statics)])
            return {"type": "dict", "items": pairs}
        if _is_record(cls):
            return self.record(value, key)
        if not statics and not self.sealed and _is_snapshot_leaf(cls):
            i = self._leaf_index.get(id(value))
            if i is None:
                leaves = self.leaves.setdefault(cls, [])
                i = self._leaf_index[id(value)] = len(leaves)
                leaves.append((_root(key), value))
            return {"type": "leaf", "class": record_name(cls), "index": i}
        what = "static field" if statics else "leaf"
        allowed = (
            "a JSON value (None, bool, int, float, str) or a tuple, list or dict of them"
            if statics
            else "a tensor, a JSON value (None, bool, int, float, str), a tuple, list or dict, "
            "or a registered record"
        )
        msg = (
            f"Cannot snapshot the {what} at `{_root(key)}`: {value!r:.80} is a "
            f"{cls.__qualname__}; a snapshot holds {allowed}. Convert it (e.g. to an int or a "
            "tensor) or keep it out of the record."
        )
        raise TypeError(msg)

    def record(self, value: Any, key: str) -> dict[str, Any]:
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
                fields[name] = self.node(child, path)
            else:
                statics[name] = self.node(child, path, statics=True)
        return {"type": "record", "class": record_name(cls), "fields": fields, "static": statics}


def _root(key: str) -> str:
    return key.lstrip(".") or "<root>"


def _encode(
    state: PyTree, metadata: Mapping[str, str] | None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
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
    tensors: dict[str, torch.Tensor] = {}
    described = []
    for i, storage in enumerate(storages):
        data = storage_bytes(storage)
        device = str(data.device)
        if data.device.type != "cpu":
            data = data.cpu()
        tensors[f"storage.{i}"] = data
        described.append({"nbytes": data.numel(), "device": device, "crc32": _checksum(data)})
    import sessionstate

    document = {
        "format": "sessionstate.snapshot",
        "format_version": FORMAT_VERSION if leaves else _PLAIN_FORMAT_VERSION,
        "library_version": sessionstate.__version__,
        "torch_version": torch.__version__,
        "metadata": dict(metadata or {}),
        "storages": described,
        "views": [v.to_json() for v in views],
        "tree": tree,
    }
    if leaves:
        document["leaves"] = leaves
    return tensors, {METADATA_KEY: json.dumps(document, separators=(",", ":"))}


def save_state(
    state: PyTree, path: str | os.PathLike[str], /, *, metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``state`` to ``path`` as one safetensors snapshot file.

    Each distinct storage is written once; every tensor leaf is recorded as a view of one, so
    aliases survive a round trip. The file is written next to ``path`` and renamed into place,
    so ``path`` never holds a partial snapshot. Tensors on any real device are saved (their
    device is recorded); autograd history and ``requires_grad`` are not.

    Args:
        state: A record (a `SessionState`, any `record`), or a tuple, list or dict of them,
            tensors and JSON values.
        path: The file to write (replaced if it exists).
        metadata: Strings to store alongside (read back with `sessionstate inspect`).

    Raises:
        UnsupportedTensorError: for a meta, sparse, nested or subclass tensor.
        TypeError: for a leaf that is neither a tensor nor a JSON value, naming its key path.
        StaleKVHandleError: for a `KVHandle` made by a step that was rolled back.

    >>> import os, tempfile, torch
    >>> from sessionstate import SessionState, load_state, tree_equal
    >>> state = SessionState(attrs={"x": torch.arange(4.0), "step": 3})
    >>> path = os.path.join(tempfile.mkdtemp(), "session.safetensors")
    >>> save_state(state, path)
    >>> tree_equal(load_state(path), state)
    True
    """
    tensors, meta = _encode(state, metadata)
    target = Path(path)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        _st_save_file(tensors, str(partial), metadata=meta)
        os.replace(partial, target)
    finally:
        if partial.exists():
            partial.unlink()


def dumps_state(state: PyTree, /, *, metadata: Mapping[str, str] | None = None) -> bytes:
    """``state`` as the bytes of a snapshot file (for a wire); see `save_state`.

    >>> import torch
    >>> from sessionstate import loads_state
    >>> x = torch.arange(3)
    >>> a, b = loads_state(dumps_state((x, x[1:])))
    >>> b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    True
    """
    tensors, meta = _encode(state, metadata)
    return _st_save(tensors, metadata=meta)


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


# -- inspection -----------------------------------------------------------------------------------


def inspect_snapshot(path: str | os.PathLike[str], /) -> dict[str, Any]:
    """Describe a snapshot file from its header alone (no tensor bytes are read).

    Returns a JSON-ready dict: the format and versions, the caller's metadata, the storages,
    and one row per top-level value (a session's named objects and attrs, a record's fields,
    a dict's keys) with its structure and the bytes it holds per device. A storage reached by
    two values is counted for the first, as `SessionState.nbytes_by_value` does.

    Raises:
        SnapshotError: as `load_state`, for a file that is not a readable snapshot.

    >>> import os, tempfile, torch
    >>> from sessionstate import SessionState
    >>> path = os.path.join(tempfile.mkdtemp(), "s.safetensors")
    >>> save_state(SessionState(attrs={"x": torch.zeros(4), "step": 2}), path)
    >>> [(row["name"], row["nbytes"]) for row in inspect_snapshot(path)["values"]]
    [('x', {'cpu': 16}), ('step', {})]
    """
    with open(path, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        document, _, _ = read_header(f"`{os.fspath(path)}`", stream, size)
    storages = document["storages"]
    views = document.get("views", [])
    tree = document.get("tree", {})
    leaves = document.get("leaves", {})
    seen: set[int] = set()

    def row(name: str, bucket: str, node: Any) -> dict[str, Any]:
        nbytes: dict[str, int] = {}
        indices = [views[i]["storage"] for i in _view_indices(node, leaves)]
        for s in indices:
            if s in seen:
                continue
            seen.add(s)
            device = storages[s].get("device", "cpu")
            nbytes[device] = nbytes.get(device, 0) + int(storages[s]["nbytes"])
        return {
            "name": name,
            "bucket": bucket,
            "structure": _structure(node, views, leaves=leaves),
            "tensors": len(indices),
            "nbytes": nbytes,
        }

    rows: list[dict[str, Any]] = []
    fields = tree.get("fields", {}) if tree.get("type") == "record" else {}
    buckets = [
        (b, fields[b]) for b in ("objects", "attrs") if fields.get(b, {}).get("type") == "dict"
    ]
    if len(buckets) == 2:  # a SessionState: one row per named value
        for bucket, node in buckets:
            rows.extend(row(str(k), bucket, child) for k, child in node["items"])
    elif tree.get("type") == "record":
        rows.extend(row(k, "field", child) for k, child in fields.items())
    elif tree.get("type") == "dict":
        rows.extend(row(str(k), "key", child) for k, child in tree["items"])
    else:
        rows.append(row("<root>", "root", tree))
    totals: dict[str, int] = {}
    for described in storages:
        device = described.get("device", "cpu")
        totals[device] = totals.get(device, 0) + int(described["nbytes"])
    return {
        "file": os.fspath(path),
        "file_nbytes": size,
        "format_version": document["format_version"],
        "library_version": document.get("library_version"),
        "torch_version": document.get("torch_version"),
        "metadata": document.get("metadata", {}),
        "root": _structure(tree, views, depth=0),
        "storages": storages,
        "values": rows,
        "nbytes": totals,
    }


def _view_indices(node: Any, leaves: Mapping[str, Any] | None = None) -> list[int]:
    if not isinstance(node, dict):
        return []
    kind = node.get("type")
    if kind == "tensor":
        return [node["view"]]
    if kind in ("tuple", "list"):
        return [i for child in node["items"] for i in _view_indices(child, leaves)]
    if kind == "dict":
        return [i for _, child in node["items"] for i in _view_indices(child, leaves)]
    if kind == "record":
        return [i for child in node["fields"].values() for i in _view_indices(child, leaves)]
    if kind == "leaf" and leaves:  # every storage its class's payload holds
        return _view_indices(leaves.get(str(node.get("class"))), None)
    return []


def _structure(
    node: Any, views: Sequence[Any], depth: int = 1, leaves: Mapping[str, Any] | None = None
) -> str:
    kind = node.get("type") if isinstance(node, dict) else None
    if kind == "none":
        return "None"
    if kind in ("bool", "int", "float", "str"):
        return repr(node["value"])
    if kind == "tensor":
        view = views[node["view"]]
        return f"{view['dtype']}{list(view['shape'])}"
    if kind in ("tuple", "list"):
        items = node["items"]
        tensors = len(_view_indices(node, leaves))
        return f"{kind} of {len(items)}" + (f" ({tensors} tensors)" if tensors else "")
    if kind == "dict":
        return f"dict of {len(node['items'])}"
    if kind == "record":
        name = str(node["class"]).rpartition(":")[2]
        statics = ", ".join(f"{k}={_structure(v, views)}" for k, v in node["static"].items())
        tensors = len(_view_indices(node, leaves))
        return f"{name}({statics})" + (f" ({tensors} tensors)" if tensors and depth else "")
    if kind == "leaf":
        return str(node.get("class")).rpartition(":")[2]
    return "?"
