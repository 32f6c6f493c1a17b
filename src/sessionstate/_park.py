"""Parking: moving a tree's bytes out of residence and back, without losing a bit.

Both tiers move each distinct *storage* once (never each leaf) and describe every tensor leaf
as a view of one (the snapshot format's storage walk, `collect_storages`, and its rebuild,
`rebuild_views`). Unparking allocates one storage per parked storage on the device it came
from, copies the bytes back and rebuilds every leaf as the same view: two views of one storage
are views of one storage again, and `nbytes_by_device` of the rebuilt tree equals the
original's.

- ``"host"``: host memory. A CUDA storage is copied into pinned memory with a non-blocking
  copy, and the devices are synchronised before `park_tree` returns, so the caller may release
  the device memory as soon as it holds the handle (a device-to-host copy is not valid on the
  host until synchronised).
- ``"disk"``: one snapshot file per parked tree (`save_state`) in a spool directory; unparking
  loads it (`load_state`, checksummed) and `ParkedBytes.release` deletes it.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from sessionstate._checks import describe
from sessionstate._errors import UnsupportedTensorError
from sessionstate._snapshot import (
    ViewSpec,
    collect_storages,
    load_state,
    rebuild_views,
    save_state,
    storage_bytes,
)
from sessionstate._tree import PyTree, PyTreeSpec, tree_flatten_with_keys, tree_unflatten

__all__ = ["TIERS", "ParkedBytes", "Tier", "check_tier", "park_tree"]

Tier = Literal["host", "disk"]
TIERS: tuple[Tier, ...] = ("host", "disk")

_names = itertools.count()
_TENSOR: Any = object()  # marks a tensor leaf's place among the kept leaves


def check_tier(tier: object) -> Tier:
    """``tier`` if it names a parking tier; otherwise a `ValueError` naming the choices.

    >>> check_tier("disk")
    'disk'
    """
    if tier == "host" or tier == "disk":
        return tier
    msg = f"`tier` must be 'host' or 'disk', got {describe(tier)}."
    raise ValueError(msg)


class ParkedBytes:
    """The bytes of one parked tree, held by a tier, and how to rebuild the tree from them.

    `restore` may run any number of times (each builds fresh storages) until `release`.

    Attributes:
        tier: ``"host"`` or ``"disk"``.
        label: What was parked, for messages (e.g. ``"object `cache` of session 'a'"``).
        nbytes: Bytes the tier holds (each storage once).
        nbytes_by_device: Bytes that unparking makes resident again, per device.
    """

    tier: Tier

    def __init__(self, *, label: str, storages: Sequence[torch.UntypedStorage]) -> None:
        self.label = label
        by_device: dict[str, int] = {}
        for storage in storages:
            device = str(storage.device)
            by_device[device] = by_device.get(device, 0) + storage.nbytes()
        self.nbytes_by_device = {d: n for d, n in by_device.items() if n}
        self.nbytes = sum(self.nbytes_by_device.values())
        self.released = False

    def __repr__(self) -> str:
        return f"ParkedBytes(tier={self.tier!r}, label={self.label!r}, nbytes={self.nbytes})"

    def restore(self) -> PyTree:
        """Rebuild the parked tree: fresh storages on their devices, every leaf a view of one.

        Raises:
            RuntimeError: if the bytes were released by their owner.
        """
        if self.released:
            msg = (
                f"The parked bytes of {self.label} were released by their owner (the session "
                "was dropped, replaced or unparked since); read the session from its manager "
                "again."
            )
            raise RuntimeError(msg)
        return self._restore()

    def release(self) -> None:
        """Give the bytes back to the tier; `restore` refuses afterwards."""
        self.released = True

    def _restore(self) -> PyTree:
        raise NotImplementedError


class _HostBytes(ParkedBytes):
    tier: Tier = "host"

    def __init__(self, tree: PyTree, *, label: str) -> None:
        keys, leaves, treespec = tree_flatten_with_keys(tree)
        tensors = [(k, x) for k, x in zip(keys, leaves, strict=True) if isinstance(x, torch.Tensor)]
        storages, views = _collect(tensors, label)
        super().__init__(label=label, storages=storages)
        self._treespec: PyTreeSpec = treespec
        self._leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        self._views: list[ViewSpec] = views
        self._devices = [s.device for s in storages]
        self._buffers = copy_storages_to_host(storages)

    def _restore(self) -> PyTree:
        storages = copy_storages_to_devices(self._buffers, self._devices)
        tensors = iter(rebuild_views(storages, self._views))
        leaves = [next(tensors) if x is _TENSOR else x for x in self._leaves]
        return tree_unflatten(self._treespec, leaves)


class _DiskBytes(ParkedBytes):
    tier: Tier = "disk"

    def __init__(self, tree: PyTree, *, label: str, spool_dir: str | os.PathLike[str]) -> None:
        keys, leaves, _ = tree_flatten_with_keys(tree)
        tensors = [(k, x) for k, x in zip(keys, leaves, strict=True) if isinstance(x, torch.Tensor)]
        storages, _ = _collect(tensors, label)
        super().__init__(label=label, storages=storages)
        directory = Path(spool_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"parked-{os.getpid()}-{next(_names)}.safetensors"
        try:
            save_state(tree, self.path)
        except OSError as exc:
            msg = (
                f"Cannot park {label} to disk: writing `{self.path}` failed ({exc}). Free space "
                "in the spool directory, point the manager at another one, or use the host tier."
            )
            raise OSError(msg) from exc
        except TypeError as exc:
            msg = f"Cannot park {label} to disk: {exc}"
            raise TypeError(msg) from None

    def _restore(self) -> PyTree:
        return load_state(self.path)

    def release(self) -> None:
        super().release()
        self.path.unlink(missing_ok=True)


def _collect(
    tensors: list[tuple[str, torch.Tensor]], label: str
) -> tuple[list[torch.UntypedStorage], list[ViewSpec]]:
    try:
        return collect_storages(tensors)
    except UnsupportedTensorError as exc:
        msg = f"Cannot park {label}: {exc}"
        raise UnsupportedTensorError(msg) from None


def copy_storages_to_host(storages: Sequence[torch.UntypedStorage], /) -> list[torch.Tensor]:
    """Copy each storage into a new host byte tensor (pinned for CUDA sources), synchronised.

    CUDA copies are issued non-blocking into pinned memory and each device is synchronised once
    at the end, so the copies are complete when this returns.

    >>> import torch
    >>> x = torch.arange(4, dtype=torch.int32)
    >>> copy_storages_to_host([x.untyped_storage()])[0].numel()
    16
    """
    out: list[torch.Tensor] = []
    synchronise: set[torch.device] = set()
    for storage in storages:
        cuda = storage.device.type == "cuda"
        buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=cuda)
        buffer.copy_(storage_bytes(storage), non_blocking=cuda)
        if cuda:
            synchronise.add(storage.device)
        out.append(buffer)
    for device in synchronise:
        torch.cuda.synchronize(device)
    return out


def copy_storages_to_devices(
    buffers: Sequence[torch.Tensor], devices: Sequence[torch.device], /
) -> list[torch.UntypedStorage]:
    """New storages, one on each of ``devices``, holding ``buffers``' bytes; synchronised.

    >>> import torch
    >>> buf = torch.arange(4, dtype=torch.uint8)
    >>> copy_storages_to_devices([buf], [torch.device("cpu")])[0].nbytes()
    4
    """
    out: list[torch.UntypedStorage] = []
    synchronise: set[torch.device] = set()
    for buffer, device in zip(buffers, devices, strict=True):
        cuda = device.type == "cuda"
        target = torch.empty(buffer.numel(), dtype=torch.uint8, device=device)
        target.copy_(buffer, non_blocking=cuda and buffer.is_pinned())
        if cuda:
            synchronise.add(device)
        out.append(target.untyped_storage())
    for device in synchronise:
        torch.cuda.synchronize(device)
    return out


def default_spool_dir() -> str:
    """A new private temporary directory for disk-tier files.

    >>> import os
    >>> os.path.isdir(default_spool_dir())
    True
    """
    return tempfile.mkdtemp(prefix="sessionstate-park-")


def park_tree(
    tree: PyTree,
    tier: Tier = "host",
    /,
    *,
    label: str = "the tree",
    spool_dir: str | os.PathLike[str] | None = None,
) -> ParkedBytes:
    """Move ``tree``'s storages to ``tier``, each once; return the handle that rebuilds it.

    Pure: ``tree`` is left unchanged (its storages are freed once nothing else holds them).

    Args:
        tree: A pytree of plain dense tensors and other leaves (JSON values for the disk tier).
        tier: ``"host"`` or ``"disk"``.
        label: Names what is parked in error messages.
        spool_dir: The directory the disk tier writes to (a new temporary one when None).

    Raises:
        UnsupportedTensorError: for a meta, sparse, nested or subclass tensor, naming its key.
        OSError: if the disk tier cannot write its file (the message names the file).

    >>> import torch
    >>> from sessionstate import tree_equal
    >>> x = torch.arange(6.0)
    >>> handle = park_tree((x, x[2:]), "host")
    >>> a, b = handle.restore()
    >>> shared = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    >>> tree_equal((a, b), (x, x[2:])), shared
    (True, True)
    """
    tier = check_tier(tier)
    if tier == "host":
        return _HostBytes(tree, label=label)
    return _DiskBytes(tree, label=label, spool_dir=spool_dir or default_spool_dir())
