"""The version log: every record a machine produced, checked unchanged after every step."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from sessionstate._tree import PyTree, PyTreeSpec, tree_equal, tree_flatten, tree_unflatten
from sessionstate.testing._common import fail
from sessionstate.testing.recount import _nbytes_of


def _layout(t: torch.Tensor) -> tuple[Any, ...]:
    """What an in-place operation can change besides values: metadata, storage, version."""
    storage = t.untyped_storage()
    try:
        version: int | None = t._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        version = None
    return (
        t.dtype,
        t.device,
        tuple(t.shape),
        t.stride(),
        t.storage_offset(),
        storage.data_ptr(),
        storage.nbytes(),
        version,
    )


@attrs.frozen(eq=False)
class _TensorSnapshot:
    tensor: torch.Tensor
    clone: torch.Tensor
    layout: tuple[Any, ...]
    label: str


@attrs.frozen(eq=False)
class _Version:
    record: Any
    snapshot: Any
    spec: PyTreeSpec
    leaves: list[Any]
    nbytes: dict[str, int]
    label: str


class VersionLog:
    """Every record a machine produced, with a deep snapshot taken when it was produced.

    `check` runs after every step. Records share most of their tensors (structural sharing),
    so it checks each distinct tensor once against its snapshot (values with `tree_equal`,
    plus layout, storage and version counter), and each record's structure and leaf
    identities; together these determine each record's values and bytes. `check_all` runs at
    the end of a run and compares every record as a whole: `tree_equal` against its snapshot
    and `nbytes_by_device` against the count taken when it was made.
    """

    def __init__(self) -> None:
        self._versions: list[_Version] = []
        self._ids: set[int] = set()
        self._tensors: dict[int, _TensorSnapshot] = {}

    def __len__(self) -> int:
        return len(self._versions)

    def keep(self, record: PyTree, label: str) -> None:
        # Records and tensors are held here, so an id cannot be reused while the log lives.
        if id(record) in self._ids:
            return
        self._ids.add(id(record))
        leaves, spec = tree_flatten(record)
        snapshot_leaves = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                seen = self._tensors.get(id(leaf))
                if seen is None:
                    seen = _TensorSnapshot(leaf, leaf.clone(), _layout(leaf), label)
                    self._tensors[id(leaf)] = seen
                leaf = seen.clone
            snapshot_leaves.append(leaf)
        snapshot = tree_unflatten(spec, snapshot_leaves)
        self._versions.append(_Version(record, snapshot, spec, leaves, _nbytes_of(record), label))

    def check(self) -> None:
        for t in self._tensors.values():
            if _layout(t.tensor) != t.layout:
                fail(
                    f"A tensor first held by a record made by `{t.label}` changed after it was "
                    f"made: it was written in place (layout, storage and version were "
                    f"{t.layout}, now {_layout(t.tensor)}). No transition may write into a "
                    "tensor that an existing record can reach."
                )
            if not tree_equal(t.tensor, t.clone):
                fail(
                    f"A tensor first held by a record made by `{t.label}` changed after it was "
                    "made: its values no longer match the snapshot taken then."
                )
        for i, v in enumerate(self._versions):
            leaves, spec = tree_flatten(v.record)
            if spec != v.spec or any(a is not b for a, b in zip(leaves, v.leaves, strict=True)):
                fail(
                    f"Record #{i} (made by `{v.label}`) changed after it was made: its "
                    "structure, configuration or leaves are not the ones it was made with."
                )

    def check_all(self) -> None:
        for i, v in enumerate(self._versions):
            if not tree_equal(v.record, v.snapshot):
                fail(
                    f"Record #{i} (made by `{v.label}`) changed after it was made: it no longer "
                    "matches the snapshot taken then. A later transition wrote into a tensor "
                    "this record can reach, or changed its configuration."
                )
            now = _nbytes_of(v.record)
            if now != v.nbytes:
                fail(
                    f"Record #{i} (made by `{v.label}`) reported {v.nbytes} bytes when it was "
                    f"made and {now} now; an immutable record keeps the same storages."
                )
