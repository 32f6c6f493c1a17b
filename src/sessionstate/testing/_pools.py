"""The pools `tensor_pools` draws: tensors with the allocation each lives in."""

from __future__ import annotations

import attrs
import torch


@attrs.frozen(eq=False)
class PoolTensor:
    """One tensor of a `TensorPool` and where it came from.

    Args:
        tensor: The tensor.
        allocation: Index into `TensorPool.allocation_nbytes` of the allocation whose bytes
            this tensor uses (views share their source's; clones and bases have their own).
        derivation: ``"base"``, or the entry of `POOL_DERIVATIONS` that made it.
        source: Index of the pool entry it was derived from (None for a base).

    >>> import torch
    >>> PoolTensor(torch.zeros(2), allocation=0, derivation="base").source is None
    True
    """

    tensor: torch.Tensor
    allocation: int
    derivation: str
    source: int | None = None


@attrs.frozen(eq=False)
class TensorPool:
    """A few allocations and the tensors derived from them, with their provenance.

    Drawn by `tensor_pools`. The provenance is recorded while the pool is built, from the
    derivation used, so a test can count bytes without asking torch (or this library) which
    tensors share storage.

    Args:
        entries: The pool's tensors with their provenance (an alias appears twice).
        allocation_nbytes: Bytes of each allocation, by index.
        allocation_devices: Device string of each allocation, by index.

    >>> import torch
    >>> base = torch.zeros(4)
    >>> pool = TensorPool(
    ...     entries=(PoolTensor(base, 0, "base"), PoolTensor(base[1:], 0, "slice", 0)),
    ...     allocation_nbytes=(16,),
    ...     allocation_devices=("cpu",),
    ... )
    >>> len(pool), pool.allocation_of(pool.tensors[1])
    (2, 0)
    """

    entries: tuple[PoolTensor, ...]
    allocation_nbytes: tuple[int, ...]
    allocation_devices: tuple[str, ...]

    def __len__(self) -> int:
        """The number of entries (aliases counted each time).

        >>> len(TensorPool(entries=(), allocation_nbytes=(), allocation_devices=()))
        0
        """
        return len(self.entries)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The pool's tensors, in entry order.

        >>> TensorPool(entries=(), allocation_nbytes=(), allocation_devices=()).tensors
        ()
        """
        return tuple(entry.tensor for entry in self.entries)

    def allocation_of(self, tensor: torch.Tensor, /) -> int:
        """The allocation index of ``tensor``, found by identity among the entries.

        Raises:
            KeyError: if ``tensor`` is not one of the pool's tensor objects.

        >>> import torch
        >>> t = torch.zeros(1)
        >>> TensorPool((PoolTensor(t, 0, "base"),), (4,), ("cpu",)).allocation_of(t)
        0
        """
        for entry in self.entries:
            if entry.tensor is tensor:
                return entry.allocation
        msg = (
            f"Tensor of shape {tuple(tensor.shape)} on {tensor.device} is not in this pool; "
            "only the pool's own tensor objects (`pool.tensors`) have a known allocation."
        )
        raise KeyError(msg)


def applicable(derivation: str, t: torch.Tensor) -> bool:
    if derivation in ("slice", "strided", "empty_view"):
        return t.ndim >= 1
    if derivation == "view":
        return t.is_contiguous()
    return True


def derive(derivation: str, t: torch.Tensor, k: int) -> torch.Tensor:
    if derivation == "alias":
        return t
    if derivation == "clone":
        return t.clone(memory_format=torch.contiguous_format)
    if derivation == "detach":
        return t.detach()
    if derivation == "empty_view":
        return t[:0]
    if derivation == "expand":
        return t.expand(k, *t.shape)
    if derivation == "slice":
        return t[1:]
    if derivation == "strided":
        return t[::2]
    if derivation == "transpose":
        return t.t() if t.ndim <= 2 else t.transpose(-2, -1)
    return t.view(-1)
