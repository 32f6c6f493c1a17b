"""The snapshot format: versions, dtypes, checksums, the storage walk and rebuild, names."""

from __future__ import annotations

import importlib
import re
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np
import optree
import torch
import xxhash

from sessionstate._checks import describe
from sessionstate._errors import UnsupportedTensorError
from sessionstate._protocols import SNAPSHOT_HOOKS, SnapshotLeaf
from sessionstate._tree import NAMESPACE

FORMAT_VERSION = 4
"""The snapshot format this library writes; it reads this version and every older one.

Version 1 holds the structure and a CRC-32 per storage. Version 2 adds leaves saved by a
registered class (`register_snapshot_leaf`). Version 3 adds a CRC-32 of the JSON document
itself (under `CRC32_KEY`) and `FrozenDict` nodes (a session's dict attributes). Version 4
replaces every CRC-32 by an xxh3-64 (about four times faster), per storage and for the document
(under `CHECKSUM_KEY`); every snapshot this library writes is version 4.
"""

METADATA_KEY = "sessionstate"
"""The safetensors metadata key holding the snapshot's JSON document."""

CHECKSUM_KEY = "sessionstate.xxh3"
"""The safetensors metadata key holding the xxh3-64 of the JSON document (version 4 on)."""

CRC32_KEY = "sessionstate.crc32"
"""The safetensors metadata key holding the CRC-32 of the JSON document (version 3)."""

MAX_DEPTH = 200
"""The deepest nesting of containers and records a snapshot may hold (written or read)."""

MAX_INT = 2**62  # sizes, offsets, strides and element counts: far below torch's int64
MAX_DIMS = 64

_IMPORTABLE_PREFIX = "sessionstate."
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on the JSON header
CHUNK = 1024 * 1024  # read, then hashed while still in cache (`_Reader.read_into`)

R = TypeVar("R")

DTYPES: dict[str, torch.dtype] = {
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
_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


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


def root(key: str) -> str:
    return key.lstrip(".") or "<root>"


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
        fix = f"convert it to one of {sorted(DTYPES)}"
    if problem is None:
        return
    try:
        shape = f"shape {tuple(t.shape)}, "
    except RuntimeError:  # a strided nested tensor has no single shape
        shape = ""
    msg = (
        f"Cannot snapshot the tensor at `{root(key)}`: it is {problem} ({shape}device "
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
        identity = storage_identity(t, storage)
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


def storage_identity(t: torch.Tensor, storage: torch.UntypedStorage, /) -> tuple[Any, ...]:
    """What identifies ``t``'s storage (``storage``) among a walk's: its device and address
    range (two storage objects over the same memory are one storage), or, without memory,
    the storage object.

    >>> x = torch.arange(4.0)
    >>> storage_identity(x, x.untyped_storage()) == storage_identity(x[1:], x[1:].untyped_storage())
    True
    """
    pointer = storage.data_ptr()
    if pointer:
        return (t.device, pointer, storage.nbytes())
    return ("object", storage._cdata)


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


# -- a snapshot in parts -------------------------------------------------------------------------


@attrs.frozen(eq=False)
class SnapshotParts:
    """A snapshot in parts: its container header, and each storage's bytes as a NumPy array.

    The bytes of `dumps_state` are ``header`` followed by every storage in order; here the
    storages stay apart, as ``uint8`` arrays over the record's own memory (no copy for a CPU
    storage), so a serialiser that passes NumPy arrays out of band (pickle protocol 5, as
    Ray's does) moves them without a copy of its own. The header holds the JSON document, its
    checksum and every storage's checksum: `loads_parts` checks each part against it.

    Attributes:
        header: The safetensors header (length prefix, JSON, padding), as in a file.
        storages: Storage ``i``'s bytes, one 1-D ``uint8`` array each.
    """

    header: bytes
    storages: tuple[np.ndarray[Any, np.dtype[np.uint8]], ...]

    @property
    def nbytes(self) -> int:
        """The size of the same snapshot as bytes: header and storages.

        >>> from sessionstate._storage import dumps_parts, dumps_state
        >>> dumps_parts({"x": torch.zeros(2)}).nbytes == len(dumps_state({"x": torch.zeros(2)}))
        True
        """
        return len(self.header) + sum(int(a.nbytes) for a in self.storages)


# -- checksums -----------------------------------------------------------------------------------


@attrs.frozen
class Checksum:
    """The checksum of one format version, for each storage and for the JSON document.

    Attributes:
        name: Its name in messages (``"xxh3-64"``, ``"CRC-32"``).
        field: The key of a storage's checksum in the document's storage list.
        key: The safetensors metadata key of the document's checksum.
    """

    name: str
    field: str
    key: str

    def hasher(self) -> StreamHash:
        """A running checksum of bytes fed in chunks (`StreamHash`)."""
        return StreamHash(self)

    def of(self, data: bytes | memoryview, /) -> int:
        """The checksum of ``data`` as an int.

        >>> XXH3.of(b"abc"), CRC32.of(b"abc")
        (8696274497037089104, 891568578)
        """
        if self is XXH3:
            return xxhash.xxh3_64_intdigest(data)
        return zlib.crc32(data)

    def to_json(self, value: int, /) -> int | str:
        """``value`` as stored for a storage: 16 lowercase hex digits (xxh3-64) or an int."""
        return f"{value:016x}" if self is XXH3 else value

    def from_json(self, stored: Any, /) -> int | None:
        """The checksum a storage entry holds, or None if ``stored`` is not a valid one.

        >>> XXH3.from_json("78af5f94892f3950"), XXH3.from_json(123), CRC32.from_json(True)
        (8696274497037089104, None, None)
        """
        if self is XXH3:
            if type(stored) is str and _HEX16.fullmatch(stored):
                return int(stored, 16)
            return None
        if type(stored) is int and 0 <= stored < 2**32:
            return stored
        return None

    def of_document(self, text: str, /) -> str:
        """The checksum of a snapshot's JSON document, as stored under `key`.

        >>> XXH3.of_document("{}"), CRC32.of_document("{}")
        ('1349cde127705c16', '2745614147')
        """
        value = self.of(text.encode())
        return f"{value:016x}" if self is XXH3 else str(value)


class StreamHash:
    """A running checksum over chunks of bytes, so a loader checks what it reads as it reads.

    >>> h = XXH3.hasher()
    >>> h.update(b"ab"); h.update(b"c")
    >>> h.value() == XXH3.of(b"abc")
    True
    """

    __slots__ = ("_crc", "_xxh")

    def __init__(self, checksum: Checksum, /) -> None:
        self._xxh = xxhash.xxh3_64() if checksum is XXH3 else None
        self._crc = 0

    def update(self, data: bytes | memoryview, /) -> None:
        """Feed the next bytes."""
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> int:
        """The checksum of every byte fed so far."""
        return self._xxh.intdigest() if self._xxh is not None else self._crc


XXH3 = Checksum(name="xxh3-64", field="xxh3", key=CHECKSUM_KEY)
"""The checksum of format version 4 on."""

CRC32 = Checksum(name="CRC-32", field="crc32", key=CRC32_KEY)
"""The checksum of format versions 1 to 3 (version 3 also for the document)."""

_HEX16 = re.compile("[0-9a-f]{16}")


def checksum_of_version(version: int, /) -> Checksum:
    """The checksum a file of format ``version`` uses.

    >>> checksum_of_version(3).name, checksum_of_version(4).name
    ('CRC-32', 'xxh3-64')
    """
    return XXH3 if version >= 4 else CRC32


# -- record names ---------------------------------------------------------------------------------


SNAPSHOT_NAMES: Mapping[str, str] = {
    # stable name stored in files -> where the class is defined now ("module:qualname").
    # Seeded with the classes' locations when the table was introduced, so files stay
    # byte-identical. A moved class keeps its stable name: update only its location here.
    # Never change or remove a stable name: files written with it must keep loading
    # (tests/storage/test_golden_snapshots.py loads committed ones).
    "sessionstate._session:SessionState": "sessionstate._session:SessionState",
    "sessionstate._objects:LatentBuffer": "sessionstate._objects:LatentBuffer",
    "sessionstate._objects:TensorCache": "sessionstate._objects:TensorCache",
    "sessionstate._kv:EncodeOnceKV": "sessionstate._kv._encode_once:EncodeOnceKV",
    "sessionstate._kv:KVPair": "sessionstate._kv._encode_once:KVPair",
    "sessionstate._kvpool:KVHandle": "sessionstate._kv._pool:KVHandle",
    "sessionstate._kv:KVCache": "sessionstate._kv._cache:KVCache",
    "sessionstate._random:RandomKey": "sessionstate._random:RandomKey",
    "sessionstate.models.dreamzero.state:DreamZeroSession": (
        "sessionstate.models.dreamzero.state:DreamZeroSession"
    ),
    "sessionstate.models.cosmos3.state:Cosmos3Session": (
        "sessionstate.models.cosmos3.state:Cosmos3Session"
    ),
    # Step inputs and outputs, records since they were made pytrees.
    "sessionstate.models.dreamzero:Observation": (
        "sessionstate.models.dreamzero.transform:Observation"
    ),
    "sessionstate.models.dreamzero:DreamZeroOutput": (
        "sessionstate.models.dreamzero._model:DreamZeroOutput"
    ),
    "sessionstate.models.cosmos3:Cosmos3Request": (
        "sessionstate.models.cosmos3._model:Cosmos3Request"
    ),
    "sessionstate.models.cosmos3:Cosmos3Output": "sessionstate.models.cosmos3._model:Cosmos3Output",
}
"""The stable snapshot name of every library class a snapshot may hold, and its location.

A snapshot names a class by its stable name, never by the private module it lives in, so the
library can move a class without breaking saved files. A class not in the table (a user's)
is named ``module:qualname``.
"""

_STABLE_BY_LOCATION: dict[str, str] = {where: name for name, where in SNAPSHOT_NAMES.items()}

NEVER_SNAPSHOTTED: Mapping[str, str] = {
    # location -> why (completes "... is never valid snapshot content: <why>").
    "sessionstate._stateobject:ParkedObject": (
        "its bytes are held by a park tier, outside the record"
    ),
}
"""Library record classes that are never valid snapshot content, by location, and why.

Saving one is refused with `TypeError`; a file naming one is refused with `SnapshotError`.
"""


def _location(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def record_name(cls: type, /) -> str:
    """The name a snapshot stores for a class: its stable name, or ``module:qualname``.

    A library class is named from `SNAPSHOT_NAMES` (stable across moves between modules);
    any other class by ``module:qualname``.

    >>> from sessionstate import LatentBuffer
    >>> record_name(LatentBuffer)
    'sessionstate._objects:LatentBuffer'
    """
    where = _location(cls)
    return _STABLE_BY_LOCATION.get(where, where)


def refusal(cls: type) -> str | None:
    """Why a record of ``cls`` can never be in a snapshot, or None."""
    return NEVER_SNAPSHOTTED.get(_location(cls))


def is_record(cls: type) -> bool:
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


def _resolve(name: str, registry: Callable[[], Mapping[str, type]]) -> type | None:
    # A class registered under `name`. When none is, the module to import is the table's
    # location for a stable name (so a moved class loads from its new module), else the
    # name's own module; only one under the library's package is ever imported, so a file
    # can never make the loader import anything else.
    found = registry().get(name)
    if found is not None:
        return found
    module, _, _ = SNAPSHOT_NAMES.get(name, name).partition(":")
    if not module.startswith(_IMPORTABLE_PREFIX):
        return None
    try:
        importlib.import_module(module)
    except ImportError:
        return None
    return registry().get(name)


def resolve_record(name: str, /) -> type | None:
    """The record class registered in this process under ``name``, or None.

    Only classes registered as records (`record`, `register_record`, `SessionState`
    subclasses) are found, by the name `record_name` gives them. When none is registered
    under ``name``, the module of its location in `SNAPSHOT_NAMES` (a library class), or
    else its own module if under ``sessionstate.``, is imported once and the lookup
    repeated; no other module is ever imported.

    >>> resolve_record("sessionstate._session:SessionState").__name__
    'SessionState'
    >>> resolve_record("os:system") is None
    True
    """
    return _resolve(name, _registered_records)


# -- leaves saved by their class ------------------------------------------------------------------

_LEAF_CLASSES: dict[str, type] = {}

_L = TypeVar("_L", bound=type[SnapshotLeaf])


def register_snapshot_leaf(cls: _L, /) -> _L:
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
    methods = SNAPSHOT_HOOKS
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


def is_snapshot_leaf(cls: type) -> bool:
    return _LEAF_CLASSES.get(record_name(cls)) is cls


def resolve_leaf_class(name: str, /) -> type | None:
    """The class registered with `register_snapshot_leaf` under ``name``, or None.

    As `resolve_record`: a module under ``sessionstate.`` may be imported once; no other is.

    >>> resolve_leaf_class("sessionstate._kvpool:KVHandle").__name__
    'KVHandle'
    >>> resolve_leaf_class("os:system") is None
    True
    """
    return _resolve(name, lambda: _LEAF_CLASSES)
