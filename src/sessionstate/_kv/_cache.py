"""`KVCache`: a session's handle to an engine's paged KV, as a state object the manager parks.

A `KVHandle` in a record's attributes is carried, never acted on: the byte budget cannot park
an attribute. Held in a `KVCache` (a `StateObject`, parkable), the handle's blocks move to the
park tier with the session's other objects, go back to their `KVPool`, and come back on fresh
blocks of the same pool when the session is unparked (see `KVHandle.__sessionstate_offload__`).
Its bytes are still the pool's: the accounting reports them as engine bytes.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch

from sessionstate._accounting import note_derived, noted_derivation
from sessionstate._kv._pool import KVHandle, KVPool
from sessionstate._protocols import Derivation
from sessionstate._stateobject import SingleValueObject
from sessionstate._tree import field, register_record, static_field

__all__ = ["KVCache"]


@register_record
@attrs.frozen(eq=False)
class KVCache(SingleValueObject[KVHandle]):
    """A handle to an engine's paged KV (`KVHandle`), replaced wholesale, parkable.

    `commit` replaces the handle, `view` returns it (None while empty), `append` appends to it
    in a pool (adopting a handle of another pool first) and commits the result. Parking moves
    the handle's blocks (only its tokens) to the tier and gives them back to the pool;
    unparking takes fresh blocks from the same pool (block ids may differ, reads are
    bit-identical).

    Args:
        handle: The held handle (None while empty). Set through `commit` or `append`.
        name: Used in error messages.
        allocated: Set through `allocate`.

    >>> import torch
    >>> pool = KVPool(4, block_tokens=2, token_shape=())
    >>> cache = KVCache(name="kv").allocate().append(pool, torch.arange(3.0))
    >>> cache.view().tokens, cache.read()
    (3, tensor([0., 1., 2.]))
    >>> parked = cache.park("host"); del cache
    >>> pool.free_blocks, parked.unpark().read()
    (4, tensor([0., 1., 2.]))
    """

    handle: KVHandle | None = field(default=None)
    name: str = static_field(default="kv_cache", kw_only=True)
    allocated: bool = static_field(default=False, kw_only=True)

    value_field: ClassVar[str] = "handle"
    holds: ClassVar[str] = "a handle"
    commits: ClassVar[str] = "handle"

    def commit(self, handle: KVHandle | None, /) -> KVCache:
        """Return a cache holding ``handle`` instead of what it held (None empties it).

        Raises:
            NotAllocatedError: if the cache is not allocated.
            TypeError: if ``handle`` is not a `KVHandle` or None.
        """
        if not self.allocated:
            self._require_allocated("commit to")
        if handle is not None and not isinstance(handle, KVHandle):
            msg = (
                f"KVCache `{self.name}` holds a KVHandle (or None), got {handle!r:.80} "
                f"({type(handle).__name__}); build handles with `KVPool.empty` and "
                "`KVPool.append`."
            )
            raise TypeError(msg)
        if type(self) is not KVCache:  # a subclass may carry fields of its own
            return attrs.evolve(self, handle=handle)
        # `attrs.evolve` re-runs every converter and validator; a commit only swaps the handle.
        new = object.__new__(KVCache)
        object.__setattr__(new, "handle", handle)
        object.__setattr__(new, "name", self.name)
        object.__setattr__(new, "allocated", True)
        # The leaves are the handle alone: the old one (if any) goes, the new one (if any)
        # comes, so the accounting counts the new handle's blocks and nothing else.
        note_derived(
            new, self, 0 if self.handle is None else 1, () if handle is None else (handle,)
        )
        return new

    def append(self, pool: KVPool, kv: torch.Tensor, /, *, window: int | None = None) -> KVCache:
        """Return a cache whose handle is this one's tokens followed by ``kv``, in ``pool``.

        An empty cache starts from ``pool.empty()``; a handle of another pool (a record moved
        between pipelines, or loaded from a snapshot) is adopted into ``pool`` first. See
        `KVPool.append` for ``window`` and the errors.

        Raises:
            NotAllocatedError: if the cache is not allocated.
        """
        self._require_allocated("append to")
        start = pool.empty() if self.handle is None else pool.adopt(self.handle)
        return attrs.evolve(self, handle=pool.append(start, kv, window=window))

    def read(self) -> torch.Tensor | None:
        """The handle's tokens (see `KVHandle.read`), or None while empty.

        Raises:
            NotAllocatedError: if the cache is not allocated.
        """
        handle = self.view()
        return None if handle is None else handle.read()

    def __sessionstate_derivation__(self) -> Derivation | None:
        """How a commit built this cache's handle from its input's (`DerivesFromBase`)."""
        return noted_derivation(self)
