"""Byte accounting: how many bytes a pytree keeps alive, per device.

Bytes are counted per storage, never as ``numel() * element_size()``: a narrow slice keeps its
whole allocation alive, so it reports all of it. Each storage is counted once per walk, however
many views, aliases or records reach it.

A storage is identified by its memory where it has some (device and data pointer: this also
joins a NumPy array and the tensor `torch.from_numpy` made of it), and by its storage object
(the C++ ``StorageImpl``) where it has none: on the ``meta`` device, and for empty storages,
every data pointer is 0.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from sessionstate._errors import UnsupportedTensorError
from sessionstate._tree import PyTree, tree_flatten_with_keys, tree_leaves

__all__ = ["ByteCounter", "nbytes_by_device", "nbytes_by_key"]

_HOST = "cpu"


class ByteCounter:
    """Counts storages once across any number of `add` calls.

    The counter keeps a reference to every storage it has seen, so a storage cannot be freed
    and its identity reused by a new allocation while the count is in progress.

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
        self._seen: dict[tuple[str, int], object] = {}
        self.totals: dict[str, int] = {}

    def add(self, leaf: Any, /) -> dict[str, int]:
        """Count ``leaf``'s storages not seen before; return the bytes newly counted, by device."""
        new: dict[str, int] = {}
        for device, key, nbytes, keepalive in _storages(leaf):
            if key in self._seen:
                continue
            self._seen[key] = keepalive
            if nbytes == 0:
                continue
            new[device] = new.get(device, 0) + nbytes
            self.totals[device] = self.totals.get(device, 0) + nbytes
        return new


def nbytes_by_device(tree: PyTree, /) -> dict[str, int]:
    """Bytes held by ``tree``, keyed by device string (``"cpu"``, ``"cuda:0"``, ``"meta"``).

    Walks every leaf (records, containers, tensors). Each storage is counted once, in full:
    views and aliases of one allocation count once; a slice counts the allocation it keeps
    alive. NumPy arrays count on the host; other non-tensor leaves count 0. Devices holding
    nothing are absent from the result.

    Raises:
        UnsupportedTensorError: for a tensor whose storages cannot be attributed (an opaque
            tensor subclass), naming its type and what is supported.

    >>> import torch
    >>> x = torch.zeros(64)  # 256 bytes
    >>> nbytes_by_device({"a": x, "b": x[1:3], "c": x.view(8, 8), "n": 3})
    {'cpu': 256}
    >>> nbytes_by_device(torch.empty(2, 3, device="meta", dtype=torch.bfloat16))
    {'meta': 12}
    """
    counter = ByteCounter()
    for leaf in tree_leaves(tree):
        counter.add(leaf)
    return counter.totals


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
    return {key: counter.add(leaf) for key, leaf in zip(keys, leaves, strict=True)}


_Key = tuple[str, int]


def _storages(leaf: Any) -> Iterator[tuple[str, _Key, int, Any]]:
    """Yield ``(device, identity, nbytes, keepalive)`` for each dense storage ``leaf`` owns."""
    if isinstance(leaf, torch.Tensor):
        yield from _tensor_storages(leaf)
        return
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(leaf, numpy.ndarray):
        yield from _array_storages(leaf, numpy)


def _array_storages(array: Any, numpy: Any) -> Iterator[tuple[str, _Key, int, Any]]:
    base = array
    while isinstance(base.base, numpy.ndarray):
        base = base.base
    if isinstance(base.base, torch.Tensor):  # `tensor.numpy()`: the tensor owns the memory
        yield from _tensor_storages(base.base)
        return
    pointer = int(base.__array_interface__["data"][0])
    key = (f"{_HOST}:ptr", pointer) if pointer else ("id", id(base))
    yield _HOST, key, int(base.nbytes), base


def _tensor_storages(t: torch.Tensor) -> Iterator[tuple[str, _Key, int, Any]]:
    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        for name in attrs:
            yield from _tensor_storages(getattr(t, name))
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
            f"Cannot count the bytes of a strided nested tensor ({type(t).__name__}, "
            f"layout={t.layout}): its storage is private to torch. Store the component tensors "
            "(`t.unbind()`) or a jagged nested tensor (`layout=torch.jagged`) instead."
        )
        raise UnsupportedTensorError(msg)
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        msg = (
            f"Cannot count the bytes of a tensor of type `{type(t).__qualname__}` "
            f"(layout={t.layout}, device={t.device}): it has no storage torch can report "
            f"({exc}). Store plain dense tensors, sparse tensors, or traceable wrapper "
            "subclasses (those defining `__tensor_flatten__`)."
        )
        raise UnsupportedTensorError(msg) from None
    device = str(t.device)
    pointer = storage.data_ptr()
    key = (f"{device}:ptr", pointer) if pointer else ("id", storage._cdata)
    yield device, key, int(storage.nbytes()), storage
