"""Storage movers: move each storage of a tree once and rebuild every leaf as a view of it.

Moving leaf by leaf (``tree_map(lambda t: t.to(device), tree)``) copies a storage once per view
that reaches it, so two views of one buffer become two buffers and the byte count grows. A
mover here moves each storage once and rebuilds every tensor on its moved storage with the
leaf's own dtype, shape, stride and storage offset, so aliasing survives the move and
`nbytes_by_device` reports the same bytes on the new device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sessionstate._tree import PyTree, tree_map

__all__ = ["map_storages", "to_device"]

StorageMover = Callable[[torch.UntypedStorage], torch.UntypedStorage]


def _is_plain(t: torch.Tensor) -> bool:
    # A dense tensor that is fully described by (storage, dtype, shape, stride, offset).
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_nested
        and not t.is_quantized
    )


def map_storages(
    tree: PyTree,
    move_storage: StorageMover,
    move_other: Callable[[torch.Tensor], torch.Tensor],
    /,
) -> PyTree:
    """Return ``tree`` with every storage moved once by ``move_storage``; leaves become views.

    Each distinct storage is passed to ``move_storage`` once; every dense tensor leaf is rebuilt
    on the moved storage with its dtype, shape, stride and storage offset, so two views of one
    storage stay two views of one storage. A leaf whose storage comes back unchanged (the same
    storage object) is kept as it is. Tensors that are not plain dense tensors (sparse,
    quantized, nested, subclasses) go through ``move_other`` one by one; other leaves are
    kept as they are.

    >>> import torch
    >>> base = torch.arange(4.0)
    >>> out = map_storages({"a": base, "b": base[1:]}, lambda s: s.clone(), lambda t: t)
    >>> out["b"].untyped_storage().data_ptr() == out["a"].untyped_storage().data_ptr()
    True
    >>> out["b"].tolist(), out["a"].untyped_storage().data_ptr() == base.data_ptr()
    ([1.0, 2.0, 3.0], False)
    """
    moved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def leaf(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        if not _is_plain(x):
            return move_other(x)
        storage = x.untyped_storage()
        entry = moved.get(storage._cdata)
        if entry is None:
            # Keep the source storage referenced so its identity cannot be reused mid-walk.
            entry = moved[storage._cdata] = (storage, move_storage(storage))
        new_storage = entry[1]
        if new_storage._cdata == storage._cdata:
            return x
        view = torch.empty(0, dtype=x.dtype, device=new_storage.device)
        view.set_(new_storage, x.storage_offset(), x.size(), x.stride())
        if x.requires_grad:
            view.requires_grad_(True)
        return view

    return tree_map(leaf, tree)


def to_device(tree: PyTree, device: torch.device | str, /, *, non_blocking: bool = False) -> PyTree:
    """Return ``tree`` with every tensor on ``device``, aliasing kept; other leaves unchanged.

    Each storage is copied to ``device`` once and every tensor is rebuilt as a view of its
    copy, so two views of one storage stay views of one storage and the byte count on the new
    device equals the old one. Tensors already on ``device`` are kept (not copied), as are
    ints, strings and other non-tensor leaves, and every record's configuration. Sparse,
    quantized, nested and subclass tensors (and parameters) are moved with ``Tensor.to`` one by one.

    Args:
        tree: A session record, state object or any pytree.
        device: The target device (``"cpu"``, ``"cuda:0"``, a `torch.device`).
        non_blocking: Passed to the copies (useful from pinned host memory).

    >>> import torch, sessionstate as ss
    >>> x = torch.zeros(8)
    >>> state = ss.SessionState(attrs={"x": x, "head": x[:2], "step": 3})
    >>> moved = ss.to_device(state, "meta")
    >>> moved.attrs["step"], ss.nbytes_by_device(moved)
    (3, {'meta': 32})
    """
    target = torch.device(device)

    def move_storage(storage: torch.UntypedStorage) -> torch.UntypedStorage:
        here = storage.device
        if here.type == target.type and target.index in (None, here.index):
            return storage
        if target.type == "meta":  # meta storages hold no data; copying would fail
            return torch.empty(storage.nbytes(), dtype=torch.uint8, device=target).untyped_storage()
        moved: torch.UntypedStorage = storage.to(device=target, non_blocking=non_blocking)
        return moved

    def move_other(t: torch.Tensor) -> torch.Tensor:
        return t.to(target, non_blocking=non_blocking)

    return map_storages(tree, move_storage, move_other)
