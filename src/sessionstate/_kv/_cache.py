"""`KVCache`: a session's handle to an engine's paged KV, as a state object the manager parks.

A `KVHandle` in a record's attributes is carried, never acted on: the byte budget cannot park
an attribute. Held in a `KVCache` (a `StateObject`, parkable), the handle's blocks move to the
park tier with the session's other objects, go back to their `KVPool`, and come back on fresh
blocks of the same pool when the session is unparked (see `KVHandle.__sessionstate_offload__`).
Its bytes are still the pool's: the accounting reports them as engine bytes.

In a batch (`sessionstate.stack`), a `GatheredKV` stands in for the handle: the session's
tokens, gathered out of the pool into a plain tensor. Inside `sessionstate.vmap` the cache
reads it and appends to it without touching the pool (a pure concatenation); `unstack` then
appends each session's new tokens to its own handle.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from sessionstate._accounting import StorageEntry, leaf_entries, note_derived, noted_derivation
from sessionstate._checks import check_window
from sessionstate._kv._pool import KVHandle, KVPool
from sessionstate._protocols import Derivation
from sessionstate._stateobject import SingleValueObject
from sessionstate._tree import field, register_record, static_field, traceable_init

__all__ = ["GatheredKV", "KVCache"]


@traceable_init
@attrs.frozen(eq=False)
class GatheredKV:
    """A session's KV tokens gathered out of its pool, standing in for its handle in a batch.

    `sessionstate.stack` puts one in a `KVCache` in place of each `KVHandle` (the tokens are
    a copy: plain tensor bytes), so a step under `sessionstate.vmap` sees the session's KV as
    a tensor: `KVCache.read` returns ``tokens`` and `KVCache.append` concatenates, writing
    nothing to the pool. `sessionstate.unstack` appends the tokens past the gathered ones to
    the session's handle (all sessions or none) and puts the handle back.

    A leaf, as the handle it stands in for is (not a record: it lives only inside a batch and
    is never saved); it reports its tokens' storage to the byte accounting.

    Args:
        tokens: The tokens ``(n, *token_shape)``, oldest first.
        pool: The pool the tokens belong to (the one `unstack` appends them to).
        gathered: How many tokens were gathered from the handle.
        dropped: Leading tokens a windowed `append` has left out since (whole blocks, as
            `KVPool.append` leaves them out).

    >>> import torch
    >>> from sessionstate import KVPool
    >>> pool = KVPool(4, block_tokens=2, token_shape=())
    >>> kv = GatheredKV(torch.arange(3.0), pool=pool, gathered=3)
    >>> longer = kv.append(pool, torch.ones(2), window=2)  # as a handle's append trims
    >>> longer.tokens, longer.dropped
    (tensor([2., 1., 1.]), 2)
    """

    tokens: torch.Tensor
    pool: KVPool = attrs.field(kw_only=True)
    gathered: int = attrs.field(kw_only=True)
    dropped: int = attrs.field(default=0, kw_only=True)

    def __sessionstate_storage_entries__(self) -> list[StorageEntry]:
        """The tokens' storage, as a tensor leaf reports it (a copy: plain tensor bytes)."""
        return leaf_entries(self.tokens)

    def append(self, pool: KVPool, kv: torch.Tensor, /, *, window: int | None = None) -> GatheredKV:
        """Return these tokens followed by ``kv``, trimmed to ``window`` as `KVPool.append`
        trims a handle (whole leading blocks older than the newest ``window`` tokens).

        Raises:
            ValueError: for another pool than the one the tokens were gathered from, ``kv``
                of another token shape or dtype than the pool's, or a negative ``window``.
            TypeError: for a ``window`` that is not an int.
        """
        check_window(window)  # the pool's own rule and message for a window
        if pool is not self.pool:
            msg = (
                f"Cannot append to KV gathered from pool {self.pool.name!r} with pool "
                f"{pool.name!r} inside a batch: a batched step appends to the pool its "
                "sessions' KV is in. Step a session that moves to another pool on its own."
            )
            raise ValueError(msg)
        if tuple(kv.shape[1:]) != pool.token_shape or kv.dtype != pool.storage.dtype:
            msg = (
                f"KV pool {pool.name!r} stores tokens of shape {pool.token_shape} and dtype "
                f"{pool.storage.dtype}, got a `kv` of shape {tuple(kv.shape)} and dtype "
                f"{kv.dtype}; pass a tensor of shape (n, *{pool.token_shape}) of the pool's "
                "dtype."
            )
            raise ValueError(msg)
        tokens = torch.cat([self.tokens, kv])
        drop = 0
        if window is not None:
            bt = pool.block_tokens
            while len(tokens) - drop - bt >= window:
                drop += bt
        return attrs.evolve(self, tokens=tokens[drop:], dropped=self.dropped + drop)


@register_record
@attrs.frozen(eq=False)
class KVCache(SingleValueObject[KVHandle]):
    """A handle to an engine's paged KV (`KVHandle`), replaced wholesale, parkable.

    `commit` replaces the handle, `view` returns it (None while empty), `append` appends to it
    in a pool (adopting a handle of another pool first) and commits the result. Parking moves
    the handle's blocks (only its tokens) to the tier and gives them back to the pool;
    unparking takes fresh blocks from the same pool (block ids may differ, reads are
    bit-identical).

    In a batch (`sessionstate.stack`) the cache holds a `GatheredKV` in place of its handle:
    `read` returns the gathered tokens and `append` concatenates (pure: no pool write inside
    `sessionstate.vmap`); `sessionstate.unstack` commits the new tokens to the handle.

    Args:
        handle: The held handle (None while empty). Set through `commit` or `append`; a
            `GatheredKV` while the record is in a batch.
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
        `KVPool.append` for ``window`` and the errors. In a batch, the gathered tokens are
        extended instead (`GatheredKV.append`): the pool is written when the batch is
        unstacked.

        Raises:
            NotAllocatedError: if the cache is not allocated.
            ValueError: for an empty cache appended to inside `vmap` (nothing was gathered
                for it, and the pool cannot be written there).
        """
        self._require_allocated("append to")
        held: object = self.handle
        if isinstance(held, GatheredKV):
            extended: Any = held.append(pool, kv, window=window)  # the field's type omits it
            return attrs.evolve(self, handle=extended)
        if held is None and torch._C._functorch.is_batchedtensor(kv):
            msg = (
                f"Cannot append to the empty KV cache {self.name!r} inside `vmap`: an empty "
                "(or reset) cache has no tokens gathered for the batch, and its first append "
                "must write the pool. Step sessions whose KV cache is empty or reset one by "
                "one, then batch them."
            )
            raise ValueError(msg)
        start = pool.empty() if self.handle is None else pool.adopt(self.handle)
        return attrs.evolve(self, handle=pool.append(start, kv, window=window))

    def read(self) -> torch.Tensor | None:
        """The handle's tokens (see `KVHandle.read`), or None while empty.

        In a batch, the tokens gathered for this session (and appended since).

        Raises:
            NotAllocatedError: if the cache is not allocated.
        """
        handle = self.view()
        held: object = handle  # a `GatheredKV` while batched, which the field's type omits
        if isinstance(held, GatheredKV):
            return held.tokens
        return None if handle is None else handle.read()

    def __sessionstate_derivation__(self) -> Derivation | None:
        """How a commit built this cache's handle from its input's (`DerivesFromBase`)."""
        return noted_derivation(self)
