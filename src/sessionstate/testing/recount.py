"""An independent byte count to check `nbytes_by_device` and `SessionStateManager.stats` against.

`recount_nbytes_by_device` walks a tree with nothing but torch's own storage and layout
queries, so a test that compares the library's accounting with it can catch a counting bug.
"""

from __future__ import annotations

from typing import Any

import torch

from sessionstate._accounting import nbytes_by_device
from sessionstate._stateobject import StateObject
from sessionstate._tree import PyTree, tree_leaves

__all__ = ["recount_nbytes_by_device"]


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
