"""Byte accounting: how many bytes a pytree keeps alive, per device.

Bytes are counted per storage, never as ``numel() * element_size()``: a narrow slice keeps its
whole allocation alive, so it reports all of it. Each storage is counted once per walk, however
many views, aliases or records reach it.

Storages with memory are counted as address ranges per device, and a device's total is the
size of the union of its ranges: two storage objects over the same memory (a NumPy array and
`torch.from_numpy` of it, a storage re-wrapped with `Tensor.set_`) count once, whichever is
seen first. Storages without memory (every storage on the ``meta`` device, where each data
pointer is 0) are identified by their storage object, the C++ ``StorageImpl``, and given a
private address range of their own above every real address, so part of such a storage (an
engine pool's block) and the whole of it still count once.

A leaf may report its own storages: a class defining ``__sessionstate_storage_entries__``
returns `StorageEntry` tuples whose identity is an `EngineBlock`. That is how memory owned by
an engine (a paged KV pool's blocks, reached through an immutable handle) enters the same
accounting, deduplicated per (pool, block) and against any tensor view of the pool.

A transition that builds a record from its input by keeping a run of the input's leaves and
adding new ones (a buffer's commit) may say so: the record declares `DerivesFromBase`, and its
transition records the claim (`note_derived`); an accounting of the successor that already
holds the input's entries then counts only the leaves that were added (`derivation`), so its
cost does not grow with the record's history.
"""

from __future__ import annotations

import bisect
import operator
import sys
import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from sessionstate._errors import UnsupportedTensorError
from sessionstate._protocols import (
    DERIVATION_HOOK,
    STORAGE_ENTRIES_HOOK,
    Derivation,
    StorageEntry,
)
from sessionstate._tree import PyTree, tree_flatten_with_keys, tree_leaves

__all__ = [
    "ByteCounter",
    "EngineBlock",
    "StorageEntry",
    "count_entries",
    "derivation",
    "engine_entries",
    "leaf_entries",
    "nbytes_by_device",
    "nbytes_by_key",
    "note_derived",
    "noted_derivation",
    "storage_entries",
    "union_size",
]

_HOST = "cpu"


class EngineBlock(NamedTuple):
    """The identity of one block of an engine-owned pool in a `StorageEntry`.

    ``pool`` identifies the pool's storage, ``block`` the block. Entries with this identity
    are engine bytes: counted like any storage, reported apart, never moved by the library.

    >>> EngineBlock(pool=7, block=2)
    EngineBlock(pool=7, block=2)
    """

    pool: int
    block: int


# Per successor (weakly held, so a record's entry goes with it): how it was derived. Keys are
# records compared by identity (`eq=False`), never tensors.
_DERIVED: weakref.WeakKeyDictionary[Any, Derivation] = weakref.WeakKeyDictionary()


def note_derived(new: object, base: object, dropped: int, leaves: Sequence[Any], /) -> None:
    """Record that ``new``'s leaves are ``base``'s without the first ``dropped``, then others.

    ``leaves`` is ``new``'s whole leaf sequence (what `tree_leaves` returns, in order; a
    tuple the record already holds costs nothing). The caller states only what it built: the
    claim must be exact, because an accounting that holds ``base``'s entries trusts it
    instead of walking ``new``. ``new`` must be weakly referenceable and hashed by identity.

    >>> import torch
    >>> from sessionstate import LatentBuffer
    >>> buf = LatentBuffer(dim=0).allocate().commit(torch.zeros(1))
    >>> bigger = buf.commit(torch.ones(1))
    >>> noted_derivation(bigger).base() is buf, noted_derivation(bigger).dropped
    (True, 0)
    """
    if torch.compiler.is_compiling():
        # A traced step's records are rebuilt after the graph runs: a note taken while
        # tracing would name the tracer's objects, and a missing note only costs a walk.
        return
    _DERIVED[new] = Derivation(weakref.ref(base), dropped, leaves)


def noted_derivation(new: object, /) -> Derivation | None:
    """What `note_derived` recorded for ``new``, or None (for a `DerivesFromBase` hook).

    >>> noted_derivation(object()) is None
    True
    """
    try:
        return _DERIVED.get(new)
    except TypeError:  # not weakly referenceable: never noted
        return None


def derivation(new: object, /) -> Derivation | None:
    """How ``new`` says it derives from its base (`DerivesFromBase`), or None.

    >>> derivation(object()) is None
    True
    """
    hook = getattr(type(new), DERIVATION_HOOK, None)
    return None if hook is None else hook(new)


def virtual_address(storage: torch.UntypedStorage) -> int:
    """The address a storage is counted at: its data pointer, or a private range if it has none.

    Storages without memory (``meta``) get ``id << 64``: above every real address and
    disjoint from every other storage's range, so sub-ranges of one storage dedup against it.

    >>> import torch
    >>> s = torch.zeros(2, device="meta").untyped_storage()
    >>> virtual_address(s) == s._cdata << 64
    True
    """
    return storage.data_ptr() or (storage._cdata << 64)


class _RangeUnion:
    """Disjoint, sorted address ranges; `add` returns how many bytes were not yet covered."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> int:
        starts, ends = self._starts, self._ends
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and ends[i] >= end:
            return 0  # fully inside a counted range: the common case of a repeated storage
        if i < 0 or ends[i] < start:
            i += 1  # the first range that may overlap starts after `start`
        j = i
        covered = 0
        merged_start, merged_end = start, end
        while j < len(starts) and starts[j] <= end:
            covered += max(0, min(ends[j], end) - max(starts[j], start))
            merged_start = min(merged_start, starts[j])
            merged_end = max(merged_end, ends[j])
            j += 1
        starts[i:j] = [merged_start]
        ends[i:j] = [merged_end]
        return (end - start) - covered


class ByteCounter:
    """Counts each byte of storage once across any number of `add` calls.

    The counter keeps a reference to every storage it has seen, so a storage cannot be freed
    and its address reused by a new allocation while the count is in progress.

    >>> import torch
    >>> base = torch.zeros(16)
    >>> counter = ByteCounter()
    >>> counter.add(base[:4])
    {'cpu': 64}
    >>> counter.add(base[8:])  # same storage: already counted
    {}
    >>> counter.totals
    {'cpu': 64}
    """

    def __init__(self) -> None:
        self._seen: dict[Hashable, object] = {}
        self._ranges: dict[str, _RangeUnion] = {}
        self.totals: dict[str, int] = {}

    def add(self, leaf: Any, /, *, path: str = "<root>") -> dict[str, int]:
        """Count ``leaf``'s storages not seen before; return the bytes newly counted, by device.

        Raises:
            UnsupportedTensorError: as `nbytes_by_device`, naming ``path`` (the leaf's key
                path) when given.
        """
        try:
            entries = list(_storages(leaf))
        except RefusedError as refused:
            raise _refuse(path, refused) from None
        return self.add_entries(entries)

    def add_entries(self, entries: Iterable[StorageEntry], /) -> dict[str, int]:
        """Like `add`, for entries computed earlier by `storage_entries`.

        >>> import torch
        >>> x = torch.zeros(4)
        >>> ByteCounter().add_entries(storage_entries([x, x[1:]]))
        {'cpu': 16}
        """
        new: dict[str, int] = {}
        seen, totals = self._seen, self.totals
        for device, identity, pointer, nbytes, keepalive in entries:
            if identity in seen:
                continue
            seen[identity] = keepalive
            if nbytes == 0:
                continue
            if pointer:
                ranges = self._ranges.get(device)
                if ranges is None:
                    ranges = self._ranges[device] = _RangeUnion()
                nbytes = ranges.add(pointer, pointer + nbytes)
                if nbytes == 0:
                    continue
            new[device] = new.get(device, 0) + nbytes
            totals[device] = totals.get(device, 0) + nbytes
        return new


def count_entries(entries: Iterable[StorageEntry], /) -> dict[str, int]:
    """Bytes per device of many storage entries at once (what `add_entries` totals).

    Sorts each device's address ranges once and sweeps them, instead of keeping a sorted
    union up to date after every entry; use it when no per-entry attribution is needed.

    >>> import torch
    >>> x = torch.zeros(8)
    >>> count_entries(storage_entries([x, x[2:], torch.zeros(2, device="meta")]))
    {'cpu': 32, 'meta': 8}
    """
    tally = _Tally()
    tally.add(entries)
    return tally.totals()


class _Tally:
    """Storages by identity, and per device the bytes without an address and the ranges."""

    __slots__ = ("flat", "seen", "spans")

    def __init__(self) -> None:
        self.seen: set[Hashable] = set()
        self.flat: dict[str, int] = {}  # devices in order of first appearance, as `ByteCounter`
        self.spans: dict[str, dict[int, int]] = {}  # per device, start -> furthest end

    def add(self, entries: Iterable[StorageEntry], /) -> None:
        seen, flat, spans = self.seen, self.flat, self.spans
        for device, identity, pointer, nbytes, _ in entries:
            if identity in seen or nbytes == 0:
                continue
            seen.add(identity)
            flat.setdefault(device, 0)
            if pointer:
                ends = spans.get(device)
                if ends is None:
                    ends = spans[device] = {}
                if ends.get(pointer, 0) < pointer + nbytes:
                    ends[pointer] = pointer + nbytes
            else:
                flat[device] += nbytes

    def totals(self) -> dict[str, int]:
        totals = self.flat
        for device, ranges in self.spans.items():
            starts = sorted(ranges)
            totals[device] += union_size(starts, [ranges[start] for start in starts])[0]
        return totals


def union_size(starts: Sequence[int], ends: Sequence[int], /) -> tuple[int, bool]:
    """The size of the union of ranges ``[starts[i], ends[i])`` sorted by start, and whether
    they are disjoint (no range reaches into the next).

    >>> union_size([0, 4, 10], [4, 8, 12]), union_size([0, 2], [5, 3])
    ((10, True), (5, False))
    """
    if not any(map(operator.gt, ends, starts[1:])):
        # No range reaches into the next (distinct storages, the common case): the union is
        # the sum of the lengths, added up without a Python-level loop.
        return sum(ends) - sum(starts), True
    covered, reach = 0, 0
    for start, end in zip(starts, ends, strict=True):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered, False


def engine_entries(entries: Iterable[StorageEntry], /) -> list[StorageEntry]:
    """The entries among ``entries`` that are engine-owned blocks (identity an `EngineBlock`).

    >>> import torch
    >>> engine_entries(storage_entries([torch.zeros(2)]))
    []
    """
    return [entry for entry in entries if isinstance(entry[1], EngineBlock)]


def storage_entries(tree: PyTree, /) -> list[StorageEntry]:
    """The dense storages ``tree`` reaches, one entry per (leaf, storage), for `ByteCounter`.

    A record's entries never change (records are immutable and entries hold the storages),
    so a caller that counts the same records repeatedly can compute them once.

    Raises:
        UnsupportedTensorError: as `nbytes_by_device`.

    >>> import torch
    >>> len(storage_entries({"a": torch.zeros(2), "n": 1}))
    1
    """
    leaves = tree_leaves(tree)
    out: list[StorageEntry] = []
    for index, leaf in enumerate(leaves):
        try:
            out.extend(_storages(leaf))
        except RefusedError as refused:
            # Key paths are costly to render; render the one at fault.
            keys, _, _ = tree_flatten_with_keys(tree)
            raise _refuse(keys[index], refused) from None
    return out


def leaf_entries(leaf: Any, /) -> list[StorageEntry]:
    """The storage entries of one leaf: what `storage_entries` lists for it, in order.

    A plain dense tensor, the common leaf, is read inline (no generators), as in
    `nbytes_by_device`; the manager's ledger walks changed leaves with it.

    Raises:
        RefusedError: for a leaf that cannot be counted (the caller names its key path).

    >>> import torch
    >>> [entry[3] for entry in leaf_entries(torch.zeros(2))], leaf_entries(3)
    ([8], [])
    """
    if (
        type(leaf) is torch.Tensor
        and leaf.layout is _STRIDED
        and not leaf.is_nested
        and not leaf.is_quantized
    ):
        try:
            storage = leaf.untyped_storage()
        except _TORCH_ERRORS as exc:
            raise _no_storage(leaf, exc) from None
        device = _DEVICE_NAMES.get(leaf.device)
        if device is None:
            device = _DEVICE_NAMES[leaf.device] = str(leaf.device)
        identity = storage._cdata
        return [
            (device, identity, storage.data_ptr() or (identity << 64), storage.nbytes(), storage)
        ]
    if type(leaf) in _SCALARS:
        return []
    if not isinstance(leaf, torch.Tensor):
        report = getattr(type(leaf), STORAGE_ENTRIES_HOOK, None)
        if report is not None:  # a leaf reporting its own storages (a `KVHandle`)
            return list(report(leaf))
    return list(_storages(leaf))


def nbytes_by_device(tree: PyTree, /) -> dict[str, int]:
    """Bytes held by ``tree``, keyed by device string (``"cpu"``, ``"cuda:0"``, ``"meta"``).

    Walks every leaf (records, containers, tensors). Each storage is counted once, in full:
    views and aliases of one allocation count once; a slice counts the allocation it keeps
    alive. NumPy arrays count on the host; other non-tensor leaves count 0. Devices holding
    nothing are absent from the result.

    Raises:
        UnsupportedTensorError: for a tensor whose storages cannot be attributed (an opaque
            tensor subclass, a vmap batched tensor, an uninitialized parameter, a fake
            tensor), naming its key path, its type and what to store instead.

    >>> import torch
    >>> x = torch.zeros(64)  # 256 bytes
    >>> nbytes_by_device({"a": x, "b": x[1:3], "c": x.view(8, 8), "n": 3})
    {'cpu': 256}
    >>> nbytes_by_device(torch.empty(2, 3, device="meta", dtype=torch.bfloat16))
    {'meta': 12}
    """
    # The common leaf (a plain dense tensor) is counted inline rather than through
    # `storage_entries` and its generators, and address ranges sum without a Python loop
    # when none overlap: about 1.6x faster at 438 leaves, near 2x a hand-written walk
    # (`accounting/nbytes_by_device` over `accounting/floor_walk` in benchmarks/micro.py).
    # Every other leaf takes the general path (`_Tally.add`, as `count_entries`).
    tally = _Tally()
    seen, flat, spans = tally.seen, tally.flat, tally.spans
    names = _DEVICE_NAMES
    leaves = tree_leaves(tree)
    for index, leaf in enumerate(leaves):
        if (
            type(leaf) is torch.Tensor
            and leaf.layout is _STRIDED
            and not leaf.is_nested
            and not leaf.is_quantized
        ):
            try:
                storage = leaf.untyped_storage()
            except _TORCH_ERRORS:
                storage_entries(tree)  # raises, naming the leaf's key path
                raise
            identity = storage._cdata
            if identity in seen:
                continue
            seen.add(identity)
            nbytes = storage.nbytes()
            if nbytes == 0:
                continue
            device = names.get(leaf.device)
            if device is None:
                device = names[leaf.device] = str(leaf.device)
            flat.setdefault(device, 0)
            pointer = storage.data_ptr() or (identity << 64)
            ends = spans.get(device)
            if ends is None:
                ends = spans[device] = {}
            if ends.get(pointer, 0) < pointer + nbytes:
                ends[pointer] = pointer + nbytes
        elif type(leaf) not in _SCALARS:
            try:
                tally.add(list(_storages(leaf)))
            except RefusedError as refused:
                keys, _, _ = tree_flatten_with_keys(tree)
                raise _refuse(keys[index], refused) from None
    return tally.totals()


_STRIDED = torch.strided
_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})  # leaves holding no storage


def nbytes_by_key(tree: PyTree, /) -> dict[str, dict[str, int]]:
    """Bytes by device for every leaf of ``tree``, keyed by the leaf's path.

    Deduplication runs across the whole tree in traversal order: a storage reached by two leaves
    is attributed to the first, and the second reports ``{}``. The values therefore sum to
    `nbytes_by_device` of the same tree.

    >>> import torch
    >>> x = torch.zeros(4)
    >>> nbytes_by_key({"a": x, "b": x[:2], "c": 1})
    {"['a']": {'cpu': 16}, "['b']": {}, "['c']": {}}
    """
    counter = ByteCounter()
    keys, leaves, _ = tree_flatten_with_keys(tree)
    return {key: counter.add(leaf, path=key) for key, leaf in zip(keys, leaves, strict=True)}


class RefusedError(Exception):
    """An unsupported tensor, before its key path is known: ``detail`` follows "the tensor"."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def _refuse(path: str, refused: RefusedError) -> UnsupportedTensorError:
    where = "" if path == "<root>" else f" at `{path}`"
    msg = f"Cannot count the bytes of the tensor{where}{refused.detail}"
    return UnsupportedTensorError(msg)


def _storages(leaf: Any) -> Iterator[StorageEntry]:
    """Yield ``(device, identity, data pointer, nbytes, keepalive)`` per dense storage."""
    if isinstance(leaf, torch.Tensor):
        yield from _tensor_storages(leaf)
        return
    report = getattr(type(leaf), STORAGE_ENTRIES_HOOK, None)
    if report is not None:
        yield from report(leaf)
        return
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(leaf, numpy.ndarray):
        yield from _array_storages(leaf, numpy)


def _array_storages(array: Any, numpy: Any) -> Iterator[StorageEntry]:
    base = array
    while isinstance(base.base, numpy.ndarray):
        base = base.base
    if isinstance(base.base, torch.Tensor):  # `tensor.numpy()`: the tensor owns the memory
        yield from _tensor_storages(base.base)
        return
    pointer = int(base.__array_interface__["data"][0])
    yield _HOST, id(base), pointer, int(base.nbytes), base


_DEVICE_NAMES: dict[torch.device, str] = {}

# What torch raises when a tensor has no storage it can report (wrapper subclasses, vmap's
# batched tensors, lazy modules' uninitialized parameters, ...).
_TORCH_ERRORS = (RuntimeError, NotImplementedError, TypeError, ValueError, AttributeError)

# Lazy modules' placeholders (the mixin is not in torch's typed public surface).
_UNINITIALIZED: type = torch.nn.parameter.UninitializedTensorMixin  # type: ignore[attr-defined]

_PER_CHANNEL = (torch.per_channel_affine, torch.per_channel_affine_float_qparams)

_STORE_INSTEAD = (
    "Store plain dense tensors, sparse tensors, or traceable wrapper subclasses (those "
    "defining `__tensor_flatten__`)."
)


def _describe(t: torch.Tensor) -> str:
    return f", of type `{type(t).__qualname__}`"


def _tensor_storages(t: torch.Tensor) -> Iterator[StorageEntry]:
    if type(t) is torch.Tensor and t.layout == torch.strided and not t.is_nested:
        # The common case, first: a plain dense tensor.
        try:
            storage = t.untyped_storage()
            entry = (storage._cdata, virtual_address(storage), storage.nbytes(), storage)
        except _TORCH_ERRORS as exc:
            raise _no_storage(t, exc) from None
        if not t.is_quantized:
            device = _DEVICE_NAMES.get(t.device)
            if device is None:
                device = _DEVICE_NAMES[t.device] = str(t.device)
            yield (device, *entry)
            return
    yield from _other_storages(t)


def _no_storage(t: torch.Tensor, exc: BaseException) -> RefusedError:
    functorch = getattr(torch._C, "_functorch", None)
    if functorch is not None and functorch.is_batchedtensor(t):
        msg = (
            f"{_describe(t)}: it is a `torch.vmap` batched tensor, which exists only inside "
            "the vmapped function and has no storage of its own. Count the unbatched tensor "
            "outside `torch.vmap`."
        )
        return RefusedError(msg)
    msg = (
        f"{_describe(t)} (layout={t.layout}, device={t.device}): it has no storage torch can "
        f"report ({exc}). {_STORE_INSTEAD}"
    )
    return RefusedError(msg)


def _other_storages(t: torch.Tensor) -> Iterator[StorageEntry]:
    if isinstance(t, _UNINITIALIZED):
        msg = (
            f"{_describe(t)}: an uninitialized (lazy) parameter or buffer has no storage yet. "
            "Run the lazy module once to materialize it, then store the materialized tensor."
        )
        raise RefusedError(msg)
    fake = sys.modules.get("torch._subclasses.fake_tensor")
    if fake is not None and isinstance(t, fake.FakeTensor):
        msg = (
            f"{_describe(t)} (device={t.device}): a fake tensor describes a tensor without "
            "holding its memory, so counting it as real bytes would be wrong. Build the tree "
            "on the `meta` device to size it without allocating."
        )
        raise RefusedError(msg)
    if is_traceable_wrapper_subclass(t):
        try:
            names, _ = t.__tensor_flatten__()
        except _TORCH_ERRORS as exc:
            raise _no_storage(t, exc) from None
        if names:
            for name in names:
                yield from _tensor_storages(getattr(t, name))
            return
        # A subclass that names no inner tensors: count the storage it owns, if any.
        yield from _own_storage(t)
        return
    if t.layout == torch.sparse_coo:
        yield from _tensor_storages(t._indices())
        yield from _tensor_storages(t._values())
        return
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        yield from _tensor_storages(t.crow_indices())
        yield from _tensor_storages(t.col_indices())
        yield from _tensor_storages(t.values())
        return
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        yield from _tensor_storages(t.ccol_indices())
        yield from _tensor_storages(t.row_indices())
        yield from _tensor_storages(t.values())
        return
    if t.is_nested:
        # Jagged nested tensors are wrapper subclasses (handled above); strided ones are opaque.
        msg = (
            f"{_describe(t)}: a strided nested tensor (layout={t.layout}) keeps its storage "
            "private to torch. Store the component tensors (`t.unbind()`) or a jagged nested "
            "tensor (`layout=torch.jagged`) instead."
        )
        raise RefusedError(msg)
    yield from _own_storage(t)
    if t.is_quantized and t.qscheme() in _PER_CHANNEL:
        # Per-channel scales and zero points are tensors the quantized tensor keeps alive.
        yield from _tensor_storages(t.q_per_channel_scales())
        yield from _tensor_storages(t.q_per_channel_zero_points())


def _own_storage(t: torch.Tensor) -> Iterator[StorageEntry]:
    try:
        storage = t.untyped_storage()
        entry = (storage._cdata, virtual_address(storage), int(storage.nbytes()), storage)
    except _TORCH_ERRORS as exc:
        raise _no_storage(t, exc) from None
    yield (str(t.device), *entry)
