"""Independent byte counts to check the library's accounting against.

`recount_nbytes_by_device` walks a tree with nothing but torch's own storage and layout
queries, so a test that compares `nbytes_by_device` and `SessionStateManager.stats` with it
can catch a counting bug. `EagerLedger` is the reference the manager's lazy ledger is tested
against: the same references, every address range placed as it comes.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable
from typing import Any

import torch

from sessionstate._accounting import EngineBlock, StorageEntry, nbytes_by_device
from sessionstate._stateobject import StateObject
from sessionstate._tree import PyTree, tree_leaves

__all__ = ["EagerLedger", "recount_nbytes_by_device"]


def _dense_parts(leaf: torch.Tensor) -> list[torch.Tensor]:
    if leaf.layout == torch.sparse_coo:
        return [leaf._indices(), leaf._values()]
    if leaf.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [leaf.crow_indices(), leaf.col_indices(), leaf.values()]
    if leaf.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [leaf.ccol_indices(), leaf.row_indices(), leaf.values()]
    if leaf.layout != torch.strided or leaf.is_nested or type(leaf) is not torch.Tensor:
        kind = "a nested tensor" if leaf.is_nested else f"a `{type(leaf).__qualname__}`"
        msg = (
            f"`recount_nbytes_by_device` recounts plain dense and sparse tensors, got {kind} "
            f"(layout={leaf.layout}); check such leaves with `nbytes_by_device` against a "
            "count you know."
        )
        raise TypeError(msg)
    return [leaf]


def recount_nbytes_by_device(tree: PyTree, /) -> dict[str, int]:
    """Bytes per device that ``tree`` keeps alive, recounted without the library's accounting.

    An independent check for `nbytes_by_device` and `SessionStateManager.stats`, so a test
    that compares them with it can catch a counting bug: for each device, the size of the
    union of the address ranges ``[data_ptr, data_ptr + nbytes)`` of every storage that a
    tensor leaf's ``untyped_storage()`` reports (sparse tensors through their component
    tensors), and of the pool blocks each live `KVHandle` holds. Storages without memory
    (every ``meta`` storage has data pointer 0) count once per storage object (a pool block
    once per block). Other non-tensor leaves count 0; devices holding nothing are absent.

    Raises:
        TypeError: for a tensor subclass, a nested tensor, or another layout it cannot read.

    >>> import torch
    >>> x = torch.zeros(8)
    >>> meta = torch.empty(3, device="meta")
    >>> recount_nbytes_by_device({"a": x[2:], "b": x.view(2, 4), "m": meta})
    {'cpu': 32, 'meta': 12}
    """
    from sessionstate._kv import KVHandle

    spans: dict[str, list[tuple[int, int]]] = {}
    unaddressed: dict[str, dict[object, int]] = {}
    keepalive: list[torch.UntypedStorage] = []  # no address is freed and reused mid-count
    for leaf in tree_leaves(tree):
        if isinstance(leaf, KVHandle):
            # Engine-owned: the blocks the handle holds, as slices of its pool's tensor.
            if not leaf.alive:
                continue
            for b in leaf.blocks:
                block = leaf.pool.storage[b]
                keepalive.append(block.untyped_storage())
                device, start = str(block.device), block.data_ptr()
                size = block.numel() * block.element_size()
                if start:
                    spans.setdefault(device, []).append((start, start + size))
                else:
                    unaddressed.setdefault(device, {})[(block.untyped_storage()._cdata, b)] = size
            continue
        if not isinstance(leaf, torch.Tensor):
            continue
        for part in _dense_parts(leaf):
            storage = part.untyped_storage()
            keepalive.append(storage)
            device, start, size = str(part.device), storage.data_ptr(), storage.nbytes()
            if start:
                spans.setdefault(device, []).append((start, start + size))
            else:
                unaddressed.setdefault(device, {})[storage._cdata] = size
    out: dict[str, int] = {}
    for device, ranges in spans.items():
        covered, reach = 0, 0
        for start, end in sorted(ranges):
            covered += max(0, end - max(start, reach))
            reach = max(reach, end)
        out[device] = covered
    for device, sizes in unaddressed.items():
        out[device] = out.get(device, 0) + sum(sizes.values())
    return {device: n for device, n in out.items() if n}


def _stats_bytes(recount: dict[str, int]) -> dict[str, int]:
    """The byte keys that `SessionStateManager.stats` reports for a recount."""
    return {
        "total_nbytes": sum(recount.values()),
        **{f"nbytes:{device}": n for device, n in sorted(recount.items())},
    }


def _nbytes_of(record: Any) -> dict[str, int]:
    if isinstance(record, StateObject):
        return record.nbytes_by_device()
    return nbytes_by_device(record)


class EagerLedger:
    """Resident bytes per device from per-storage reference counts, every range placed eagerly.

    The reference the manager's ledger (lazy: it counts a storage that owns its memory by its
    size, and measures the union of the other ranges only when a total is read) is tested
    against: it takes the same `add` and `remove` of storage entries and answers the same
    `total`, `totals` and `engine_totals`, keeping each device's union of address ranges up to
    date on every change. Storages without memory (``meta``) count by their size, once each.

    >>> import torch
    >>> from sessionstate._accounting import storage_entries
    >>> x, m = torch.zeros(8), torch.empty(4, device="meta")
    >>> ledger = EagerLedger()
    >>> for t in (x, x[2:], m, m):
    ...     ledger.add(storage_entries(t))
    >>> ledger.totals()
    {'cpu': 32, 'meta': 16}
    >>> ledger.remove(storage_entries(x)); ledger.total("cpu")
    32
    >>> for t in (x[2:], m, m):
    ...     ledger.remove(storage_entries(t))
    >>> ledger.totals()
    {}
    """

    def __init__(self) -> None:
        self._refs: dict[Hashable, int] = {}  # storage identity -> references
        self._engine: dict[str, int] = {}  # bytes of engine-owned blocks, per device
        self._ranges: dict[str, _Ranges] = {}  # every range, per device
        self._unmapped: dict[str, int] = {}  # bytes of storages without memory (meta)

    def add(self, entries: Iterable[StorageEntry], /) -> None:
        """Add one reference to each entry's storage."""
        born = []
        for entry in entries:
            count = self._refs.get(entry[1], 0)
            self._refs[entry[1]] = count + 1
            if not count and entry[3]:
                born.append(entry)
        self._count(born, add=True)

    def remove(self, entries: Iterable[StorageEntry], /) -> None:
        """Remove one reference from each entry's storage (added before)."""
        died = []
        for entry in entries:
            count = self._refs[entry[1]] - 1
            if count:
                self._refs[entry[1]] = count
                continue
            del self._refs[entry[1]]
            if entry[3]:
                died.append(entry)
        self._count(died, add=False)

    def _count(self, entries: list[StorageEntry], *, add: bool) -> None:
        for device, identity, pointer, nbytes, _ in entries:
            signed = nbytes if add else -nbytes
            if isinstance(identity, EngineBlock):
                self._engine[device] = self._engine.get(device, 0) + signed
            if not pointer:
                self._unmapped[device] = self._unmapped.get(device, 0) + signed
                continue
            ranges = self._ranges.get(device)
            if ranges is None:
                ranges = self._ranges[device] = _Ranges()
            if add:
                ranges.add(pointer, pointer + nbytes)
            else:
                ranges.remove(pointer, pointer + nbytes)

    def total(self, device: str, /) -> int:
        """Resident bytes on ``device``."""
        ranges = self._ranges.get(device)
        return (ranges.total if ranges is not None else 0) + self._unmapped.get(device, 0)

    def engine_totals(self) -> dict[str, int]:
        """Bytes of engine-owned blocks per device (each block once), for devices holding any."""
        return {d: n for d, n in sorted(self._engine.items()) if n}

    def totals(self) -> dict[str, int]:
        """Resident bytes per device, for devices holding any."""
        out = {d: self.total(d) for d in {*self._ranges, *self._unmapped}}
        return {d: n for d, n in sorted(out.items()) if n}


class _Ranges:
    """A multiset of address ranges on one device and the size of their union."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, int]] = []  # distinct ranges, sorted
        self._counts: dict[tuple[int, int], int] = {}
        self._longest = 0
        self.total = 0

    def add(self, start: int, end: int) -> None:
        span = (start, end)
        count = self._counts.get(span, 0)
        self._counts[span] = count + 1
        if count:
            return
        spans = self._spans
        at = bisect.bisect_left(spans, span)
        self.total += (end - start) - self._covered(start, end, at)
        spans.insert(at, span)
        if end - start > self._longest:
            self._longest = end - start

    def remove(self, start: int, end: int) -> None:
        span = (start, end)
        count = self._counts[span] - 1
        if count:
            self._counts[span] = count
            return
        del self._counts[span]
        spans = self._spans
        at = bisect.bisect_left(spans, span)
        del spans[at]
        self.total -= (end - start) - self._covered(start, end, at)

    def _covered(self, start: int, end: int, at: int) -> int:
        """Bytes of ``[start, end)`` that the held ranges cover; ``at`` is where it sorts."""
        spans = self._spans
        # A range overlapping [start, end) starts after `start - longest` and before `end`.
        lo = bisect.bisect_left(spans, (start - self._longest, start - self._longest), 0, at)
        if lo == at and (at == len(spans) or spans[at][0] >= end):
            return 0  # no held range can reach it: distinct allocations, the common case
        hi = bisect.bisect_left(spans, (end, end), at)
        covered, reach = 0, start
        for s, e in sorted(spans[lo:hi]):
            if e <= reach:
                continue
            s = max(s, reach)
            e = min(e, end)
            if e > s:
                covered += e - s
                reach = e
        return covered
