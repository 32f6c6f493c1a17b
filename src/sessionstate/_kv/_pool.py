"""One idea, a paged K/V pool's blocks and who holds them: the pool, and the immutable handle.

A session record holds the handle; the pool and its handles share one module because every
operation on either (append, copy on write, release, park, a transaction's undo) moves the
other's reference counts and free list.

A `KVPool` preallocates one tensor of fixed-size blocks on one device and hands blocks out
from a free list. A session record never holds the pool's memory as tensors: it holds a
`KVHandle`, an immutable leaf naming the pool, its block ids and the number of tokens
written. Appending returns a new handle and leaves the old one valid:

- **append-only**: a write only ever lands past every live handle's end in a block, so an
  older handle still reads exactly its own prefix; a handle whose last block was written past
  its end by another branch gets a copy of that block (copy on write);
- **reference counted**: each live handle holds one reference on each of its blocks; a block
  returns to the free list when its last handle is garbage-collected (CPython frees a record
  as soon as nothing references it: the manager dropping or evicting it, or replacing it with
  its successor). A caller that keeps an evicted session's record keeps its blocks until it
  lets go of the record;
- **transactional**: inside `KVPool.transaction`, a step that raises returns every block it
  took and undoes every write, so the pool is as it was before the step. Handles made by the
  failed step are dead: reading one raises `StaleKVHandleError`.

The handle reports its blocks to the byte accounting through ``__sessionstate_storage_entries__``
(one entry per block, identity `EngineBlock`), so a block reached from two handles counts once,
a handle and a tensor view of the pool count once, and free blocks count for nobody.

Parking moves handles (the offload protocol, `OffloadsStorages`): the blocks the parked
handles hold are copied once each, only their tokens, and go back to the pool once the
handles are gone; unparking takes fresh blocks from the same pool, all or nothing (raising
`KVPoolExhaustedError` with the bytes needed and free), and copies the bytes back, so the new
handles read bit-identically and share what they shared (block ids may differ). Restored
handles belong to no transaction: a step that fails never kills them.

A family's blocks come back shared across its sessions too. Every block the pool hands out
gets a content id, which a parked copy of it carries; a block restored from such a copy takes
the id on, for the tokens it was restored with. Unparking reuses, instead of a fresh block, a
live block of the same content id that holds at least the tokens the parked handles read
there: the block a sibling still holds, or the one a sibling unparked into. Tokens below a
block's fill never change while it is held (appends land past every live handle's end), so
the reused block reads exactly what the parked copy holds. A restored block written past its
restored tokens holds a new content from then on, as a block written afresh does, so a
family forked after that write parks it as one content and comes back sharing it.

A snapshot saves handles by value (`register_snapshot_leaf`): per pool, the blocks its handles
in the snapshot hold, once each, with only those handles' tokens (the rest of a block is
zeros), and per handle its block list and token count. Loading rebuilds the handles over a
standalone pool holding just those blocks, so blocks shared before are shared again and the
loaded record counts the same block bytes. A pipeline continues from such a handle by
`KVPool.adopt`-ing it into its own pool.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import attrs
import torch

from sessionstate._accounting import EngineBlock, StorageEntry, virtual_address
from sessionstate._checks import check_count, check_window
from sessionstate._errors import KVPoolExhaustedError, StaleKVHandleError
from sessionstate._protocols import DeferredRead
from sessionstate._storage import record_device, recording, register_snapshot_leaf
from sessionstate._tree import tree_equal

__all__ = ["KVHandle", "KVPool", "offload_payload", "reload_handles"]


class _Transaction:
    """`KVPool.transaction`: a plain context manager, as a step enters one every time.

    The outermost on a thread keeps the log of what the block did (handles made, first fills
    of blocks written) and undoes it if the block raises; nested ones leave it to that one.
    """

    __slots__ = ("log", "pool")

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.log: dict[str, Any] | None = None

    def __enter__(self) -> None:
        local = self.pool._local
        if getattr(local, "log", None) is None:  # else nested: the outermost decides
            self.log = local.log = {"leases": [], "filled": {}}

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        log = self.log
        if log is None:
            return
        pool = self.pool
        try:
            if kind is not None:
                with pool._lock:
                    for lease in reversed(log["leases"]):
                        lease.release()  # drops the handle's references, once
                    for block, (filled, taken) in log["filled"].items():
                        if not pool._refs[block]:
                            pool._filled[block] = 0
                        elif pool._takes[block] == taken and pool._filled[block] != filled:
                            # The tokens written past `filled` are forgotten and may be
                            # written again otherwise: the block's content is a new one.
                            pool._filled[block] = filled
                            pool._relabel(block)
                        # (a block taken again since, by a path that logs nothing (a reload
                        # on another thread), holds what that path wrote: left alone)
        finally:
            pool._local.log = None


class _Lease:
    """A handle's claim on its blocks: one reference per block, dropped once.

    The handle drops it when it is collected (`KVHandle.__del__`); a rolled-back step's
    transaction drops it early, which kills the handle. Cheaper than a `weakref.finalize` per
    handle, which a step would pay for every handle it makes.
    """

    __slots__ = ("blocks", "held", "pool")

    def __init__(self, pool: KVPool, blocks: tuple[int, ...]) -> None:
        self.pool: KVPool | None = pool
        self.blocks = blocks
        self.held = True

    @property
    def alive(self) -> bool:
        return self.held

    def release(self) -> None:
        """Drop the references (once; later calls do nothing)."""
        if not self.held:
            return
        self.held = False
        pool, self.pool = self.pool, None  # held, so the pool is set; not kept past release
        assert pool is not None
        pool._release(self.blocks)


@register_snapshot_leaf
@attrs.frozen(eq=False, repr=False)
class KVHandle:
    """An immutable reference to a prefix of KV tokens in a `KVPool`.

    Build handles with `KVPool.empty` and `KVPool.append`, never directly. The handle is a
    leaf of a session record: it holds no tensor, and its blocks' bytes are counted on the
    pool's device (see the module docstring for when they return to the pool).

    >>> import torch
    >>> pool = KVPool(4, block_tokens=2, token_shape=(3,))
    >>> h = pool.append(pool.empty(), torch.ones(3, 3))
    >>> h.blocks, h.tokens, h.nbytes_by_device()
    ((0, 1), 3, {'cpu': 48})
    """

    pool: KVPool
    blocks: tuple[int, ...]
    tokens: int
    _lease: _Lease = attrs.field(alias="lease")

    def __repr__(self) -> str:
        return f"KVHandle(pool={self.pool.name!r}, blocks={self.blocks}, tokens={self.tokens})"

    def __eq__(self, other: object) -> bool:
        """Equal when both read the same tokens, bitwise (`tree_equal` compares records so).

        Handles of one pool over the same blocks are equal without reading; a dead handle
        equals only itself.
        """
        if not isinstance(other, KVHandle):
            return NotImplemented
        if self is other:
            return True
        if not (self.alive and other.alive) or self.tokens != other.tokens:
            return False
        if self.pool is other.pool and self.blocks == other.blocks:
            return True
        return tree_equal(self.read(), other.read())

    __hash__ = None  # type: ignore[assignment]  # equal by value, and holds no hashable value

    def __copy__(self) -> KVHandle:
        # Immutable, and its lease is its own: a copy would share the lease and give the
        # blocks back when either is collected. So a copy is the handle itself, as for a tuple.
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> KVHandle:
        return self

    def __del__(self) -> None:
        # The handle's blocks go back to the pool once no record holds the handle. Not
        # `contextlib.suppress`: at interpreter shutdown module globals may already be gone.
        try:  # noqa: SIM105
            self._lease.release()
        except Exception:  # shutdown: nothing left to give the blocks back to
            pass

    @property
    def alive(self) -> bool:
        """Whether the handle still holds its blocks (False once its step was rolled back)."""
        return self._lease.alive

    def read(self) -> torch.Tensor:
        """The handle's tokens, gathered into a new tensor ``(tokens, *token_shape)``.

        Raises:
            StaleKVHandleError: if the handle was made by a step that was rolled back.

        >>> import torch
        >>> pool = KVPool(2, block_tokens=2, token_shape=())
        >>> pool.append(pool.empty(), torch.arange(3.0)).read()
        tensor([0., 1., 2.])
        """
        return self.pool.read(self)

    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes of the handle's blocks on the pool's device (``{}`` when it holds none).

        >>> KVPool(2, block_tokens=2, token_shape=()).empty().nbytes_by_device()
        {}
        """
        out: dict[str, int] = {}
        for device, _, _, nbytes, _ in self.__sessionstate_storage_entries__():
            out[device] = out.get(device, 0) + nbytes
        return out

    def __sessionstate_storage_entries__(self) -> list[StorageEntry]:
        """One storage entry per block held, keyed by (pool, block); none once dead."""
        if not self._lease.alive:
            return []
        return self.pool._entries(self.blocks)

    @classmethod
    def __sessionstate_snapshot__(cls, leaves: Sequence[tuple[str, KVHandle]]) -> dict[str, Any]:
        """The snapshot payload of ``leaves``: per pool its blocks' data, per handle its facts.

        A block reached by several handles is stored once, holding the tokens the longest of
        them reads; tokens past that (another branch's) are stored as zeros.

        Raises:
            StaleKVHandleError: for a handle made by a step that was rolled back.
        """
        return snapshot_payload(leaves)

    @classmethod
    def __sessionstate_restore__(cls, payload: Any) -> list[KVHandle]:
        """The handles a snapshot payload describes, over standalone pools of their blocks.

        Raises:
            ValueError: for a payload that does not describe valid handles.
        """
        return restore_handles(payload)

    @classmethod
    def __sessionstate_offload__(cls, leaves: Sequence[tuple[str, KVHandle]]) -> dict[str, Any]:
        """What parking moves for ``leaves``: per pool a copy of the blocks they reach (each
        once, only the tokens they read), and per handle its blocks and token count.

        The copy stays on the pool's device (the tier moves it); the pools' blocks return to
        them once nothing holds the handles.

        Raises:
            StaleKVHandleError: for a handle made by a step that was rolled back.
        """
        return offload_payload(leaves)

    @classmethod
    def __sessionstate_standalone__(cls, payload: Any) -> list[KVHandle]:
        """The handles an offload payload describes, over standalone pools of just their blocks.

        For reading a parked record: no block of the handles' own pools is taken (the new
        pools live where the payload's copy is, in host memory once parked), and a snapshot
        of them records their own pools' device.
        """
        return standalone_handles(payload)

    @classmethod
    def __sessionstate_reload__(cls, payload: Any) -> list[KVHandle]:
        """The handles an offload payload describes, on fresh blocks of their own pools.

        Block ids may differ from the offloaded ones; reads are bit-identical and blocks
        shared between the handles are shared again. A live block of the same content
        holding the tokens read (a sibling's) is taken back instead of a fresh one, so what
        a family shares is shared again across its sessions too. All or nothing.

        Raises:
            KVPoolExhaustedError: if a pool has fewer free blocks than the handles need
                (naming the bytes needed and free); no block is taken.
        """
        return reload_handles(payload)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class KVPool:
    """A preallocated tensor of ``num_blocks`` KV blocks on one device, with a free list.

    Every block holds ``block_tokens`` tokens of shape ``token_shape``. Blocks are handed out
    lowest id first. The pool is safe to use from several threads.

    Args:
        num_blocks: Blocks in the pool.
        block_tokens: Tokens per block.
        token_shape: The shape of one token's KV (e.g. ``(layers, 2, heads, head_dim)``).
        dtype: The KV dtype.
        device: Where the pool lives; ``meta`` counts bytes without allocating.
        name: A name for messages.
        step_tokens: The most tokens one step of a session appends, if the engine declares
            it: a manager given the pool (``pools=``) then makes the room a step can take
            before it runs (`blocks_for_step`). None: no room is made before a step.
        window_tokens: The newest tokens a session's handle keeps (its sliding window); None
            keeps every token.

    Raises:
        ValueError: for a negative ``num_blocks`` or a non-positive ``block_tokens``,
            ``step_tokens`` or ``window_tokens``.

    >>> import torch
    >>> pool = KVPool(8, block_tokens=4, token_shape=(2,), name="kv")
    >>> a = pool.append(pool.empty(), torch.zeros(6, 2))
    >>> b = pool.append(a, torch.ones(1, 2))  # fills block 1 further: a still reads 6 tokens
    >>> a.read().shape[0], b.read().shape[0], pool.free_blocks
    (6, 7, 6)
    >>> del a, b
    >>> pool.free_blocks
    8
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        block_tokens: int,
        token_shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        name: str = "kv_pool",
        step_tokens: int | None = None,
        window_tokens: int | None = None,
    ) -> None:
        check_count(num_blocks, "num_blocks", minimum=0)
        check_count(block_tokens, "block_tokens")
        if step_tokens is not None:
            check_count(step_tokens, "step_tokens")
        if window_tokens is not None:
            check_count(window_tokens, "window_tokens")
        self.name = name
        self.block_tokens = block_tokens
        self.step_tokens = step_tokens
        self.window_tokens = window_tokens
        self.token_shape = tuple(int(n) for n in token_shape)
        self.storage = torch.zeros(
            (num_blocks, block_tokens, *self.token_shape), dtype=dtype, device=device
        )
        untyped = self.storage.untyped_storage()
        self._device = str(self.storage.device)
        self._key = untyped._cdata
        self._base = virtual_address(untyped)
        # Not `nbytes() // num_blocks`: a pool of no blocks (a restored empty one) has a block size.
        self.block_nbytes = block_tokens * math.prod(self.token_shape) * self.storage.element_size()
        self._free = list(range(num_blocks))  # a heap: lowest id first
        self._refs = [0] * num_blocks
        self._filled = [0] * num_blocks  # tokens written into each block so far
        # Each block's content id (0: none, a restored standalone pool's), the tokens that
        # hold that content (-1: the block it was first written to, whose fill says), and
        # per content id a live block holding it (checked when read: entries may be stale).
        self._content = [0] * num_blocks
        self._valid = [-1] * num_blocks
        self._takes = [0] * num_blocks  # how many times each block was taken from the free list
        self._holder: dict[int, int] = {}
        self._contents = itertools.count(1)
        self.blocks_reused = 0
        """Blocks unparking took back from a live block of the same content (a sibling's)
        instead of a fresh one; never reset."""
        self._lock = threading.RLock()
        self._local = threading.local()
        self._block_entries: dict[int, StorageEntry] = {}  # see `_entries`
        self._block_views: dict[int, torch.Tensor] = {}  # see `_block_view`
        # A standalone pool read from a parked record stands in for a pool on this device,
        # within the `recorded_devices` block that read it: a snapshot taken there records
        # its blocks on that device (see `standalone_handles`).
        self._home: tuple[str, object] | None = None

    def __repr__(self) -> str:
        return (
            f"KVPool({self.name!r}, blocks={self.num_blocks}, free={self.free_blocks}, "
            f"block_tokens={self.block_tokens}, token_shape={self.token_shape}, "
            f"device={self._device!r})"
        )

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool.

        >>> KVPool(3, block_tokens=1, token_shape=()).num_blocks
        3
        """
        return len(self._refs)

    @property
    def free_blocks(self) -> int:
        """Blocks on the free list (held by no live handle).

        >>> KVPool(3, block_tokens=1, token_shape=()).free_blocks
        3
        """
        with self._lock:
            return len(self._free)

    @property
    def session_blocks(self) -> int | None:
        """The most blocks one session's handle holds at once (None: no ``step_tokens``).

        A full window, the partial block before it and a step's tokens; without a window, a
        step's new blocks and a partial one.

        >>> pool = KVPool(8, block_tokens=16, token_shape=(), step_tokens=8, window_tokens=24)
        >>> pool.session_blocks
        3
        """
        if self.step_tokens is None:
            return None
        return session_blocks(self.block_tokens, self.step_tokens, self.window_tokens)

    def blocks_for_step(self, held: int, /) -> int:
        """Free blocks a step of a session holding ``held`` of this pool's blocks can take.

        Its handle at its largest (`session_blocks`), less what it holds, and one more: a
        partial last block another branch wrote past is copied before it is written. 0 when
        the pool declares no ``step_tokens``.

        >>> pool = KVPool(8, block_tokens=16, token_shape=(), step_tokens=8, window_tokens=24)
        >>> undeclared = KVPool(1, block_tokens=1, token_shape=())
        >>> pool.blocks_for_step(0), pool.blocks_for_step(3), undeclared.blocks_for_step(0)
        (4, 1, 0)
        """
        most = self.session_blocks
        if most is None:
            return 0
        if self.window_tokens is None:
            return math.ceil(self.step_tokens / self.block_tokens) + 1  # type: ignore[operator]
        return max(most + 1 - held, 0)

    def owns_entry(self, entry: StorageEntry, /) -> bool:
        """Whether a storage entry (as the byte accounting reports one) is a block of this pool.

        A planner that needs free blocks here parks the sessions holding such entries.

        >>> import torch
        >>> pool = KVPool(2, block_tokens=1, token_shape=())
        >>> (entry,) = pool.append(pool.empty(), torch.zeros(1)).__sessionstate_storage_entries__()
        >>> pool.owns_entry(entry), KVPool(1, block_tokens=1, token_shape=()).owns_entry(entry)
        (True, False)
        """
        identity = entry[1]
        return isinstance(identity, EngineBlock) and identity.pool == self._key

    def empty(self) -> KVHandle:
        """A handle with no tokens (a fresh cache, as a window or session starts).

        >>> KVPool(1, block_tokens=1, token_shape=()).empty().tokens
        0
        """
        return self._handle((), 0)

    def append(
        self, handle: KVHandle, kv: torch.Tensor, /, *, window: int | None = None
    ) -> KVHandle:
        """A new handle: ``handle``'s tokens followed by ``kv`` ``(n, *token_shape)``.

        ``handle`` is left valid and unchanged. With ``window``, leading blocks that hold only
        tokens older than the newest ``window`` are left out of the new handle (a sliding
        window at block granularity).

        Raises:
            KVPoolExhaustedError: if the pool has no free block for the new tokens.
            ValueError: for a handle of another pool, ``kv`` of the wrong shape, or a
                negative ``window``.
            TypeError: for ``kv`` of another dtype than the pool's (never converted), or a
                ``window`` that is not an int.
            StaleKVHandleError: for a handle whose step was rolled back.

        >>> import torch
        >>> pool = KVPool(4, block_tokens=2, token_shape=())
        >>> h = pool.append(pool.empty(), torch.arange(5.0), window=2)
        >>> h.blocks, h.tokens, h.read()
        ((1, 2), 3, tensor([2., 3., 4.]))
        """
        # The checks a valid call passes at the cost of a comparison each; the full check
        # (and its message) only for what fails one.
        if type(handle) is not KVHandle or handle.pool is not self or not handle._lease.held:
            self._check(handle, "append to")
        if kv.shape[1:] != self.token_shape:
            msg = (
                f"KV pool {self.name!r} stores tokens of shape {self.token_shape}, got a `kv` "
                f"of shape {tuple(kv.shape)}; pass a tensor of shape (n, *{self.token_shape})."
            )
            raise ValueError(msg)
        if kv.dtype != self.storage.dtype:
            msg = (
                f"KV pool {self.name!r} stores {_dtype_name(self.storage.dtype)} tokens, got a "
                f"`kv` of dtype {_dtype_name(kv.dtype)}; the pool never converts dtypes. Cast "
                f"it first (`kv.to({self.storage.dtype})`), or build the pool with "
                f"`dtype={kv.dtype}`."
            )
            raise TypeError(msg)
        if window is not None and (type(window) is not int or window < 0):
            check_window(window)
        n, bt = int(kv.shape[0]), self.block_tokens
        filled = self._filled
        log = getattr(self._local, "log", None)
        # The first fill of each block written, and which taking of the block it was.
        changed = None if log is None else log["filled"]
        with self._lock:
            blocks = list(handle.blocks)
            tokens = handle.tokens
            fresh: list[int] = []  # taken here, referenced by no handle yet
            try:
                written = 0
                while written < n:
                    offset = tokens % bt
                    if offset == 0:
                        blocks.append(self._allocate(fresh, changed))
                    elif filled[blocks[-1]] != offset:
                        # Another branch wrote past this handle's end: copy the block's prefix.
                        old = blocks[-1]
                        copy = blocks[-1] = self._allocate(fresh, changed)
                        self.storage[copy, :offset].copy_(self.storage[old, :offset])
                        filled[copy] = offset
                    take = min(bt - offset, n - written)
                    end = offset + take
                    block = blocks[-1]
                    if self._valid[block] >= 0:
                        # A restored block written past its content's tokens: what it holds
                        # now is a new content (another block of the old one may hold other
                        # tokens there), which it holds first, as a block written afresh.
                        self._relabel(block)
                    # One view per side: the block's (kept by the pool), and all of `kv` when
                    # it fits.
                    dest = self._block_view(block)[offset:end]
                    dest.copy_(kv if take == n else kv[written : written + take])
                    if changed is not None:
                        changed.setdefault(block, (filled[block], self._takes[block]))
                    filled[block] = end
                    written += take
                    tokens += take
                if window is not None:
                    while blocks and tokens - bt >= window:
                        blocks.pop(0)
                        tokens -= bt
                new = self._handle(tuple(blocks), tokens)
            finally:
                for block in fresh:  # taken but left out (or failed): back to the free list
                    if self._refs[block] == 0:
                        filled[block] = 0
                        heapq.heappush(self._free, block)
            return new

    def adopt(self, handle: KVHandle, /) -> KVHandle:
        """``handle`` if it is of this pool, else this pool's handle to a copy of its tokens.

        A record made by another pipeline (another pool) continues here with the same KV.

        Raises:
            TypeError: for a handle of a pool of another dtype (never converted).

        >>> import torch
        >>> a = KVPool(2, block_tokens=2, token_shape=())
        >>> b = KVPool(2, block_tokens=2, token_shape=())
        >>> h = a.append(a.empty(), torch.arange(3.0))
        >>> copy = b.adopt(h)
        >>> copy.pool is b, copy == h, b.adopt(copy) is copy
        (True, True, True)
        """
        if isinstance(handle, KVHandle) and handle.pool is self:
            return handle
        if not isinstance(handle, KVHandle):
            self._check(handle, "adopt")
        source = handle.pool.storage.dtype
        if source != self.storage.dtype:
            msg = (
                f"Cannot adopt a handle of KV pool {handle.pool.name!r} "
                f"({_dtype_name(source)} tokens) into KV pool {self.name!r} "
                f"({_dtype_name(self.storage.dtype)} tokens): the pool never converts dtypes. "
                "Continue the record on a pool of its dtype."
            )
            raise TypeError(msg)
        return self.append(self.empty(), handle.read())

    def read(self, handle: KVHandle, /) -> torch.Tensor:
        """``handle``'s tokens gathered into a new tensor ``(tokens, *token_shape)``.

        Raises:
            StaleKVHandleError: for a handle whose step was rolled back.

        >>> import torch
        >>> pool = KVPool(1, block_tokens=2, token_shape=())
        >>> pool.read(pool.empty()).shape
        torch.Size([0])
        """
        if type(handle) is not KVHandle or handle.pool is not self or not handle._lease.held:
            self._check(handle, "read")
        blocks = handle.blocks
        if not blocks:
            return self.storage.new_empty((0, *self.token_shape))
        gathered = torch.cat([self._block_view(b) for b in blocks])
        tokens = handle.tokens
        return gathered if tokens == len(blocks) * self.block_tokens else gathered[:tokens]

    def transaction(self) -> AbstractContextManager[None]:
        """Undo everything done inside the block on this thread if it raises.

        Blocks taken are returned, writes past handles' ends are forgotten, and handles made
        inside are dead (`KVHandle.alive` is False; reading one raises). Nested transactions
        roll back with the outermost.

        >>> import torch
        >>> pool = KVPool(2, block_tokens=1, token_shape=())
        >>> try:
        ...     with pool.transaction():
        ...         h = pool.append(pool.empty(), torch.zeros(2))
        ...         raise RuntimeError("the step failed")
        ... except RuntimeError:
        ...     pass
        >>> pool.free_blocks, h.alive
        (2, False)
        """
        return _Transaction(self)

    # -- internals ---------------------------------------------------------------------------

    def _settle(self, filled: Mapping[int, int]) -> None:
        """After handles were made over saved blocks: take those blocks off the free list."""
        with self._lock:
            for block in range(self.num_blocks):
                self._filled[block] = filled.get(block, 0) if self._refs[block] else 0
            self._free = [b for b in range(self.num_blocks) if self._refs[b] == 0]
            heapq.heapify(self._free)

    def _check(self, handle: KVHandle, action: str) -> None:
        if not isinstance(handle, KVHandle) or handle.pool is not self:
            msg = (
                f"Cannot {action} {handle!r} ({type(handle).__name__}) with KV pool "
                f"{self.name!r}: it is not a handle of this pool. Use the handle stored in "
                "this pipeline's session record."
            )
            raise ValueError(msg)
        if not handle.alive:
            msg = (
                f"Cannot {action} {handle!r}: it was made by a step that failed and was rolled "
                f"back, and its blocks went back to KV pool {self.name!r}. Use the handle of "
                "the session's stored record."
            )
            raise StaleKVHandleError(msg)

    def _allocate(self, fresh: list[int], changed: dict[int, tuple[int, int]] | None) -> int:
        # Caller holds the lock; `changed`: the transaction's first fills (None: no transaction).
        if not self._free:
            msg = (
                f"KV pool {self.name!r} has no free block: all {self.num_blocks} blocks of "
                f"{self.block_tokens} tokens are held by live handles. Drop finished sessions "
                "(or records you keep), or build the pool with more blocks."
            )
            raise KVPoolExhaustedError(msg, pool=self, needed=1)
        block = heapq.heappop(self._free)
        fresh.append(block)
        self._new_content(block)
        if changed is not None:
            changed.setdefault(block, (self._filled[block], self._takes[block]))
        self._filled[block] = 0
        return block

    def _new_content(self, block: int) -> None:
        # Caller holds the lock: ``block`` was just taken, to be written afresh.
        self._takes[block] += 1
        self._relabel(block)

    def _relabel(self, block: int) -> None:
        # Caller holds the lock: ``block``'s tokens below its fill are a new content, of
        # which it is the first holder.
        self._unhold(block)
        content = self._content[block] = next(self._contents)
        self._valid[block] = -1
        self._holder[content] = block

    def _unhold(self, block: int) -> None:
        # Caller holds the lock: ``block`` no longer stands for its content.
        content = self._content[block]
        if content and self._holder.get(content) == block:
            del self._holder[content]

    def _live_holder(self, content: int) -> int | None:
        # Caller holds the lock: the live block that stands for ``content``, if any (an
        # entry left by a block freed or relabelled since is stale).
        block = self._holder.get(content) if content else None
        if block is None or self._content[block] != content or not self._refs[block]:
            return None
        return block

    def _content_tokens(self, block: int) -> int:
        # Caller holds the lock: the tokens of ``block`` that are its content's (the fill of
        # the block the content was first written to).
        valid = self._valid[block]
        return self._filled[block] if valid < 0 else valid

    def _reuse(
        self, contents: Sequence[int], fills: Sequence[int], data: object = None
    ) -> dict[int, int]:
        """Per saved block (its content id and the tokens read there) that a live block
        holds, that block, by the saved block's index; each referenced once more until the
        caller's handles hold it (`_release` drops these references).

        A block restored with fewer of the content's tokens than a saved block reads, and
        written no further since, is extended from ``data`` (the saved blocks, a tensor): the
        tokens land past every live handle's end there, as an append's would.
        """
        out: dict[int, int] = {}
        with self._lock:
            for slot, (content, fill) in enumerate(zip(contents, fills, strict=True)):
                block = self._live_holder(content)
                if block is None:
                    continue
                valid = self._content_tokens(block)
                # Extended only while its count of the content's tokens is its fill: a block
                # written past its restored tokens holds a new content (`append`'s relabel), so
                # this holds unless that count went stale, and then the block is not reused.
                if (
                    valid < fill
                    and self._valid[block] == self._filled[block]
                    and isinstance(data, torch.Tensor)
                ):
                    self.storage[block, valid:fill].copy_(data[slot, valid:fill])
                    self._filled[block] = self._valid[block] = valid = fill
                if valid >= fill:
                    out[slot] = block
                    self._refs[block] += 1
        return out

    def _restored(
        self, blocks: Sequence[int], contents: Sequence[int], fills: Sequence[int]
    ) -> None:
        """``blocks`` (fresh, filled) hold ``contents`` up to ``fills`` tokens."""
        with self._lock:
            for block, content, fill in zip(blocks, contents, fills, strict=True):
                if not content:
                    continue
                self._unhold(block)
                self._content[block] = content
                self._valid[block] = fill
                # The holder to reuse from now on: this block, unless a live one holds at
                # least as many of the content's tokens.
                held = self._live_holder(content)
                if held is None or self._content_tokens(held) < fill:
                    self._holder[content] = block

    def _handle(self, blocks: tuple[int, ...], tokens: int, *, logged: bool = True) -> KVHandle:
        if blocks:
            with self._lock:
                refs = self._refs
                for block in blocks:
                    refs[block] += 1
        lease = _Lease(self, blocks)
        handle = KVHandle(self, blocks, tokens, lease=lease)
        log = getattr(self._local, "log", None) if logged else None
        if log is not None:
            log["leases"].append(lease)
        return handle

    def _block_view(self, block: int) -> torch.Tensor:
        # Block `block` of the storage as a tensor: a view that never changes while the pool
        # lives, so it is made once (an index into the storage costs more than the copy a
        # step makes through it).
        view = self._block_views.get(block)
        if view is None:
            view = self._block_views[block] = self.storage[block]
        return view

    def _release(self, blocks: tuple[int, ...]) -> None:
        with self._lock:
            for block in blocks:
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._filled[block] = 0
                    heapq.heappush(self._free, block)

    def _take(self, n: int, /) -> list[int]:
        """``n`` free blocks, lowest id first, off the free list (none taken if fewer are free).

        Raises:
            KVPoolExhaustedError: naming the bytes needed and free.
        """
        with self._lock:
            if len(self._free) < n:
                size = self.block_nbytes
                free = len(self._free)
                msg = (
                    f"KV pool {self.name!r} cannot take back {n} blocks ({n * size} bytes): "
                    f"it has {free} free ({free * size} bytes) of {self.num_blocks}. Park or "
                    "drop other sessions first (a manager parks the least recently used), or "
                    "build the pool with more bytes."
                )
                raise KVPoolExhaustedError(msg, pool=self, needed=n)
            taken = [heapq.heappop(self._free) for _ in range(n)]
            for block in taken:
                self._filled[block] = 0
                self._new_content(block)
            return taken

    def _untake(self, blocks: Sequence[int], /) -> None:
        """Blocks `_take` took and no handle holds: back to the free list (each once: a block
        already back there is left alone)."""
        with self._lock:
            free = set(self._free)
            for block in blocks:
                if self._refs[block] == 0 and block not in free:
                    free.add(block)
                    self._filled[block] = 0
                    heapq.heappush(self._free, block)

    def _fill(
        self,
        taken: Sequence[int],
        data: torch.Tensor | DeferredRead,
        fills: Sequence[int],
        rows: Sequence[int] | None = None,
    ) -> None:
        """Write ``data`` into ``taken`` (from `_take`, held by no handle) and set their fills.

        ``rows``: the row of ``data`` each block takes (default: in order). Straight from
        ``data`` (the host tier's memory, or a tensor on any device) into the pool's storage,
        one copy per run of consecutive block ids and rows: no intermediate tensor. A copy
        that fails leaves only blocks that no handle holds written.
        """
        if isinstance(data, DeferredRead):
            data = data.read()
        with self._lock:
            for row, block, count in _runs(taken, rows):
                self.storage[block : block + count].copy_(data[row : row + count])
            for block, fill in zip(taken, fills, strict=True):
                self._filled[block] = fill

    def _adopt_blocks(self, taken: Sequence[int], facts: Sequence[Any]) -> list[KVHandle]:
        """Handles over ``taken`` (from `_take`, filled by `_fill`), per ``facts``.

        Not part of any transaction: a rolled-back step never kills restored handles.
        """
        return [
            self._handle(tuple(taken[i] for i in fact["blocks"]), fact["tokens"], logged=False)
            for fact in facts
        ]

    def _copy_blocks(self, blocks: Sequence[int]) -> torch.Tensor:
        """A copy of ``blocks``' data, in that order, taken under the pool's lock."""
        with self._lock:
            index = torch.tensor(list(blocks), dtype=torch.long, device=self.storage.device)
            return self.storage.index_select(0, index)

    def _entries(self, blocks: tuple[int, ...]) -> list[StorageEntry]:
        # A block's entry never changes while the pool lives: built once, on first use.
        known = self._block_entries
        out: list[StorageEntry] = []
        for b in blocks:
            entry = known.get(b)
            if entry is None:
                size = self.block_nbytes
                entry = known[b] = (
                    self._device,
                    EngineBlock(self._key, b),
                    self._base + b * size,
                    size,
                    self.storage,
                )
            out.append(entry)
        return out


# -- the snapshot codec of `KVHandle` leaves: the blocks they reach, saved once, and back ------
#
# What `KVHandle.__sessionstate_snapshot__` and `__sessionstate_restore__` return: a snapshot
# stores, per pool, only the blocks its handles reach, and restores them into standalone pools
# of just those blocks.


def _read_blocks(pool: KVPool, slot_of: Mapping[int, int], filled: Sequence[int]) -> torch.Tensor:
    """A copy of the blocks ``slot_of`` names, in slot order, zeroed past each one's fill."""
    data = pool._copy_blocks(list(slot_of))
    for slot, fill in enumerate(filled):
        data[slot, fill:].zero_()
    return data


def snapshot_payload(leaves: Sequence[tuple[str, KVHandle]]) -> dict[str, Any]:
    """The snapshot payload of ``leaves``: per pool its blocks' data, per handle its facts.

    A block reached by several handles is stored once, holding the tokens the longest of
    them reads; tokens past that (another branch's) are stored as zeros.

    Raises:
        StaleKVHandleError: for a handle made by a step that was rolled back.

    >>> pool = KVPool(4, block_tokens=2, token_shape=(3,))
    >>> handle = pool.append(pool.empty(), torch.ones(3, 3))
    >>> payload = snapshot_payload([("kv", handle)])
    >>> payload["handles"], tuple(payload["pools"][0]["blocks"].shape)
    ([{'pool': 0, 'blocks': [0, 1], 'tokens': 3}], (2, 2, 3))
    """
    pools, slots, fills, handles = _gather(leaves, "snapshot")
    saved = []
    for pool, slot_of, filled in zip(pools, slots, fills, strict=True):
        data = _read_blocks(pool, slot_of, filled)
        home = pool._home
        if home is not None and home[1] is recording():
            record_device(data.untyped_storage(), home[0])
        saved.append(
            {
                "name": pool.name,
                "block_tokens": pool.block_tokens,
                "token_shape": list(pool.token_shape),
                "dtype": str(pool.storage.dtype).removeprefix("torch."),
                "blocks": data,
            }
        )
    return {"pools": saved, "handles": handles}


# -- the offload codec of `KVHandle` leaves: parking moves their blocks, and back -------------
#
# What `KVHandle.__sessionstate_offload__` and `__sessionstate_reload__` return: per pool the
# blocks the handles reach, copied once each, and the handles' facts; reloading takes fresh
# blocks from the same pools (all or nothing) and copies the bytes back.


def offload_payload(leaves: Sequence[tuple[str, KVHandle]]) -> dict[str, Any]:
    """What parking moves for ``leaves``: per pool its blocks' data, per handle its facts.

    A block reached by several handles is copied once, with the tokens the longest of them
    reads (the rest of the block zeros). The copy is deferred (a `DeferredRead`): the host
    tier has it made straight into its host memory, other callers `read` it.

    Raises:
        StaleKVHandleError: for a handle made by a step that was rolled back.

    >>> pool = KVPool(4, block_tokens=2, token_shape=(3,))
    >>> a = pool.append(pool.empty(), torch.ones(3, 3))
    >>> b = pool.append(a, torch.zeros(1, 3))
    >>> payload = offload_payload([("a", a), ("b", b)])
    >>> payload["pools"][0]["blocks"].shape, payload["handles"][1]
    ((2, 2, 3), {'pool': 0, 'blocks': [0, 1], 'tokens': 4})
    >>> payload["pools"][0]["blocks"] = payload["pools"][0]["blocks"].read()  # as a tier does
    >>> del a, b
    >>> a, b = reload_handles(payload)
    >>> b.read()[-1].tolist(), a.blocks == b.blocks[:2], pool.free_blocks
    ([0.0, 0.0, 0.0], True, 2)
    """
    pools, slots, fills, handles = _gather(leaves, "park")
    saved = []
    for pool, slot_of, filled in zip(pools, slots, fills, strict=True):
        blocks = list(slot_of)
        shape = (len(blocks), pool.block_tokens, *pool.token_shape)
        data = DeferredRead(
            pool.storage.dtype,
            shape,
            pool.storage.device,
            functools.partial(_read_into, pool, blocks, filled),
        )
        with pool._lock:  # (held by the handles: their contents cannot change)
            # (A restored block written past its restored tokens holds a new content: see
            # `append`.)
            contents = [pool._content[block] for block in blocks]
        saved.append({"pool": pool, "blocks": data, "fills": filled, "contents": contents})
    return {"pools": saved, "handles": handles}


def _runs(
    blocks: Sequence[int], rows: Sequence[int] | None = None
) -> Iterator[tuple[int, int, int]]:
    """``(first row, first block, count)`` per run of consecutive block ids in ``blocks`` whose
    ``rows`` are consecutive too (default: each block's index)."""
    if rows is None:
        rows = range(len(blocks))
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1 or rows[i] != rows[i - 1] + 1:
            yield rows[start], blocks[start], i - start
            start = i


def _read_into(
    pool: KVPool, blocks: Sequence[int], filled: Sequence[int], out: torch.Tensor
) -> None:
    """Copy ``blocks`` of ``pool`` into ``out`` (host bytes, in that order), zeros past each
    block's fill: one copy per run of consecutive full blocks, under the pool's lock.

    The copies may be asynchronous (a CUDA pool into page-locked memory): a partial block's
    tokens and its zeros are disjoint ranges, so nothing here waits for them.
    """
    dest = out.view(pool.storage.dtype).view(len(blocks), pool.block_tokens, *pool.token_shape)
    cuda = pool.storage.device.type == "cuda"
    tokens, n = pool.block_tokens, len(blocks)
    with pool._lock:
        src = pool.storage
        slot = 0
        while slot < n:
            block, fill = blocks[slot], filled[slot]
            if fill < tokens:  # the tokens read, then zeros: disjoint, so no wait between
                dest[slot, :fill].copy_(src[block, :fill], non_blocking=cuda)
                dest[slot, fill:].zero_()
                slot += 1
                continue
            end = slot + 1
            while end < n and filled[end] == tokens and blocks[end] == block + end - slot:
                end += 1
            dest[slot:end].copy_(src[block : block + end - slot], non_blocking=cuda)
            slot = end


def reload_handles(payload: Any) -> list[KVHandle]:
    """The handles an offload payload describes (see `offload_payload`), on fresh blocks.

    A saved block whose content a live block holds with at least the tokens read there (a
    sibling's, or one a sibling was reloaded into) is taken back instead; only the others
    need fresh blocks. Each pool gives the blocks first, all of them or none: when one lacks
    room, the blocks already taken from the others go back and nothing changes.

    Raises:
        KVPoolExhaustedError: if a pool has fewer free blocks than its handles need, naming
            the bytes needed and free.
    """
    groups = payload["pools"]
    reused: list[dict[int, int]] = []  # per pool: saved block index -> live block taken back
    taken: list[list[int]] = []  # per pool: fresh blocks, for the saved blocks not reused
    rows: list[list[int]] = []  # per pool: the saved blocks the fresh ones hold, in order
    facts: list[list[Any]] = [[] for _ in groups]
    order: list[tuple[int, int]] = []  # per handle: its pool, its index there
    for fact in payload["handles"]:
        order.append((fact["pool"], len(facts[fact["pool"]])))
        facts[fact["pool"]].append(fact)
    # Every pool's blocks are taken (live ones of the same content held once more, fresh ones
    # for the rest) and filled before any handle is made: a failure (a pool short of blocks,
    # a copy that cannot allocate) leaves no handle whose collection would give its blocks
    # back a second time; the blocks go back once, here.
    try:
        for group in groups:
            pool, fills = group["pool"], group["fills"]
            contents = group.get("contents") or [0] * len(fills)
            reused.append(pool._reuse(contents, fills, group["blocks"]))
            rows.append([i for i in range(len(fills)) if i not in reused[-1]])
            taken.append(pool._take(len(rows[-1])))
        for group, blocks, fresh_rows in zip(groups, taken, rows, strict=True):
            if blocks:
                fills = [group["fills"][i] for i in fresh_rows]
                group["pool"]._fill(blocks, group["blocks"], fills, fresh_rows)
    except BaseException:
        for group, again, blocks in itertools.zip_longest(groups, reused, taken):
            if again:
                group["pool"]._release(tuple(again.values()))
            if blocks:
                group["pool"]._untake(blocks)
        raise
    made = []
    for g, (group, again, blocks) in enumerate(zip(groups, reused, taken, strict=True)):
        pool, fills = group["pool"], group["fills"]
        fresh = iter(blocks)
        placed = [again[i] if i in again else next(fresh) for i in range(len(fills))]
        made.append(pool._adopt_blocks(placed, facts[g]))
        if again:  # the handles hold them now
            pool._release(tuple(again.values()))
            with pool._lock:
                pool.blocks_reused += len(again)
        contents = group.get("contents")
        if contents:
            pool._restored(blocks, [contents[i] for i in rows[g]], [fills[i] for i in rows[g]])
    return [made[g][i] for g, i in order]


def session_blocks(block_tokens: int, step_tokens: int, window_tokens: int | None) -> int:
    """The most blocks one session's handle holds at once: a full window (none: no tokens
    kept), the partial block before it and a step's tokens.

    The one rule for it: `KVPool.session_blocks`, and what a model sizes its pool by.

    >>> session_blocks(16, 8, 24), session_blocks(16, 8, None)
    (3, 2)
    """
    window = 0 if window_tokens is None else window_tokens
    return math.ceil((window + block_tokens + step_tokens) / block_tokens)


def kv_shortfall(
    pool: Any, needed: int, session_id: object, /, *, label: str, fix: str
) -> KVPoolExhaustedError:
    """The error of a step of ``session_id`` that cannot get ``needed`` blocks of ``pool``.

    Names the blocks and bytes needed, free and held, and ``fix`` with ``{nbytes}`` replaced
    by the pool bytes the step needs (what is held now and ``needed`` more).

    >>> pool = KVPool(2, block_tokens=1, token_shape=(), name="kv")
    >>> print(kv_shortfall(pool, 3, "a", label="Session", fix="build it with {nbytes} bytes"))
    Session 'a': a step can need 3 KV blocks (12 bytes) of pool 'kv', which has 2 free (8 bytes); live handles hold the other 0 bytes, and no other session's KV the manager holds is left to park (records kept outside the manager hold their blocks). Drop finished sessions, or build it with 12 bytes.
    """  # noqa: E501 - a doctest line
    block, free = pool.block_nbytes, pool.free_blocks
    held = (pool.num_blocks - free) * block
    nbytes = (pool.num_blocks - free + needed) * block
    msg = (
        f"{label} {session_id!r}: a step can need {needed} KV blocks ({needed * block} bytes) "
        f"of pool {pool.name!r}, which has {free} free ({free * block} bytes); live handles "
        f"hold the other {held} bytes, and no other session's KV the manager holds is left to "
        "park (records kept outside the manager hold their blocks). Drop finished sessions, "
        f"or {fix.format(nbytes=nbytes)}."
    )
    return KVPoolExhaustedError(msg, pool=pool, needed=needed)


def standalone_handles(payload: Any) -> list[KVHandle]:
    """The handles an offload payload describes, over standalone pools of just their blocks.

    Each pool is built where the payload's copy of its blocks is; no block of the pools the
    handles came from is taken. A snapshot of the handles (within `recorded_devices`)
    records those pools' device.

    >>> pool = KVPool(2, block_tokens=2, token_shape=(3,))
    >>> payload = offload_payload([("kv", pool.append(pool.empty(), torch.ones(3, 3)))])
    >>> (copy,) = standalone_handles(payload)
    >>> copy.pool is pool, torch.equal(copy.read(), torch.ones(3, 3)), pool.free_blocks
    (False, True, 2)
    """
    groups = [
        {**g, "blocks": g["blocks"].read()} if isinstance(g["blocks"], DeferredRead) else g
        for g in payload["pools"]
    ]
    saved = [
        {
            "name": group["pool"].name,
            "block_tokens": group["pool"].block_tokens,
            "token_shape": list(group["pool"].token_shape),
            "dtype": _dtype_name(group["pool"].storage.dtype),
            "blocks": group["blocks"],
        }
        for group in groups
    ]
    handles = restore_handles({"pools": saved, "handles": payload["handles"]})
    block = recording()
    if block is not None:  # outside a recording block, the pools are plain CPU pools
        for handle, fact in zip(handles, payload["handles"], strict=True):
            handle.pool._home = (str(groups[fact["pool"]]["pool"].storage.device), block)
    return handles


def _gather(
    leaves: Sequence[tuple[str, KVHandle]], action: str
) -> tuple[list[KVPool], list[dict[int, int]], list[list[int]], list[dict[str, Any]]]:
    """Per pool the blocks ``leaves`` reach (each once, with the tokens the handles read),
    and per handle its pool, its blocks as indices into its pool's list, and its tokens.

    Raises:
        StaleKVHandleError: for a handle made by a step that was rolled back.
    """
    pools: list[KVPool] = []
    slots: list[dict[int, int]] = []  # per pool: block id -> index in its saved blocks
    fills: list[list[int]] = []  # per pool and saved block: tokens the handles read
    handles: list[dict[str, Any]] = []
    for key, handle in leaves:
        if not handle.alive:
            msg = (
                f"Cannot {action} the leaf at `{key}`: {handle!r} was made by a step that "
                f"failed and was rolled back, so its blocks went back to KV pool "
                f"{handle.pool.name!r}. {action.capitalize()} the session's stored record "
                "instead."
            )
            raise StaleKVHandleError(msg)
        pool = handle.pool
        g = next((i for i, p in enumerate(pools) if p is pool), None)
        if g is None:
            g = len(pools)
            pools.append(pool)
            slots.append({})
            fills.append([])
        local = []
        for j, block in enumerate(handle.blocks):
            fill = min(pool.block_tokens, handle.tokens - j * pool.block_tokens)
            slot = slots[g].setdefault(block, len(fills[g]))
            if slot == len(fills[g]):
                fills[g].append(fill)
            fills[g][slot] = max(fills[g][slot], fill)
            local.append(slot)
        handles.append({"pool": g, "blocks": local, "tokens": handle.tokens})
    return pools, slots, fills, handles


def restore_handles(payload: Any) -> list[KVHandle]:
    """The handles a snapshot payload describes, over standalone pools of their blocks.

    Raises:
        ValueError: for a payload that does not describe valid handles.

    >>> pool = KVPool(4, block_tokens=2, token_shape=(3,))
    >>> handle = pool.append(pool.empty(), torch.ones(3, 3))
    >>> (back,) = restore_handles(snapshot_payload([("kv", handle)]))
    >>> torch.equal(back.read(), handle.read())
    True
    """
    if not isinstance(payload, Mapping):
        raise ValueError(f"the payload is a {type(payload).__name__}, not a dict")
    saved = payload.get("pools")
    if not isinstance(saved, list):
        raise ValueError("the payload has no pool list")
    pools = [_pool_from_snapshot(i, p) for i, p in enumerate(saved)]
    held = [int(p["blocks"].shape[0]) for p in saved]
    out: list[KVHandle] = []
    claimed: list[dict[int, int]] = [{} for _ in pools]
    facts = payload.get("handles")
    if not isinstance(facts, list):
        raise ValueError("the payload has no handle list")
    for i, fact in enumerate(facts):
        problem = _handle_problem(fact, pools, held)
        if problem is not None:
            raise ValueError(f"handle {i} {problem}: {fact!r:.120}")
        pool = pools[fact["pool"]]
        bt = pool.block_tokens
        for j, block in enumerate(fact["blocks"]):
            fill = min(bt, fact["tokens"] - j * bt)
            claimed[fact["pool"]][block] = max(claimed[fact["pool"]].get(block, 0), fill)
        out.append(pool._handle(tuple(fact["blocks"]), fact["tokens"]))
    for pool, filled in zip(pools, claimed, strict=True):
        pool._settle(filled)
    return out


def _handle_problem(fact: Any, pools: Sequence[KVPool], held: Sequence[int]) -> str | None:
    """Why a saved handle's facts are invalid, or None."""
    if not isinstance(fact, Mapping):
        return "is not a dict"
    pool, blocks, tokens = fact.get("pool"), fact.get("blocks"), fact.get("tokens")
    if type(pool) is not int or not 0 <= pool < len(pools):
        return "names no saved pool"
    if type(tokens) is not int or tokens < 0 or not isinstance(blocks, list):
        return "has no valid token count or block list"
    bt = pools[pool].block_tokens
    if any(type(b) is not int or not 0 <= b < held[pool] for b in blocks):
        return "names a block its pool does not hold"
    if len(set(blocks)) != len(blocks) or len(blocks) != -(-tokens // bt):
        return f"holds {len(blocks)} blocks for {tokens} tokens of {bt} per block"
    return None


def _pool_from_snapshot(i: int, saved: Any) -> KVPool:
    """A standalone pool holding the saved blocks of pool ``i`` of a snapshot payload.

    The pool holds exactly the saved blocks, so it takes no more memory than the snapshot's
    storage of them (the blocks must not overlap: an expanded view of one block would declare
    blocks the file does not hold); a saved pool of no blocks restores as a pool of none.
    """
    data = saved.get("blocks") if isinstance(saved, Mapping) else None
    name, bt = (saved.get("name"), saved.get("block_tokens")) if data is not None else (0, 0)
    shape = saved.get("token_shape") if data is not None else None
    ok = (
        isinstance(data, torch.Tensor)
        and isinstance(name, str)
        and type(bt) is int
        and bt > 0
        and isinstance(shape, list)
        and all(type(n) is int and n >= 0 for n in shape)
        and data.dim() == 2 + len(shape)
        and tuple(data.shape[1:]) == (bt, *shape)
        and saved.get("dtype") == str(data.dtype).removeprefix("torch.")
    )
    if not ok:
        raise ValueError(f"pool {i} is not a valid saved KV pool: {_describe(saved)}")
    assert isinstance(data, torch.Tensor)
    assert isinstance(shape, list)
    assert isinstance(name, str)
    assert isinstance(bt, int)
    if not data.is_contiguous():
        msg = (
            f"pool {i} ({name!r}) declares {data.shape[0]} blocks as a view with strides "
            f"{data.stride()} that overlaps itself, more blocks than the file holds"
        )
        raise ValueError(msg)
    n = int(data.shape[0])
    pool = KVPool(
        n, block_tokens=bt, token_shape=shape, dtype=data.dtype, device=data.device, name=name
    )
    pool.storage[:n].copy_(data)
    return pool


def _describe(saved: Any) -> str:
    """A saved pool for a message: its keys and values, tensors by shape and dtype only."""
    if not isinstance(saved, Mapping):
        return f"{saved!r:.80}"
    parts = []
    for k, v in saved.items():
        shown = f"tensor{list(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else f"{v!r:.40}"
        parts.append(f"{k!r}: {shown}")
    return "{" + ", ".join(parts) + "}"


# -- a batch's read: the blocks of many handles gathered at once -------------------------------


def read_many(handles: Sequence[KVHandle], /) -> torch.Tensor:
    """The tokens of ``handles``, stacked: ``(len(handles), tokens, *token_shape)``.

    One gather for the whole batch (one `index_select` of every handle's blocks, under the
    pool's lock), not one read per handle: what `stack` does with a batch of records holding
    KV. The handles must be of one pool and read one number of tokens (a shape bucket); a
    handle may appear more than once.

    Raises:
        ValueError: for no handles, handles of several pools, or handles of different
            token counts.
        StaleKVHandleError: for a handle whose step was rolled back.

    >>> pool = KVPool(4, block_tokens=2, token_shape=())
    >>> a = pool.append(pool.empty(), torch.arange(3.0))
    >>> b = pool.append(pool.empty(), torch.arange(3.0) + 10)
    >>> read_many([a, b])
    tensor([[ 0.,  1.,  2.],
            [10., 11., 12.]])
    """
    if not handles:
        msg = "`read_many` needs at least one handle; pass the handles of the sessions to read."
        raise ValueError(msg)
    first = handles[0]
    pool, tokens = first.pool, first.tokens
    for i, handle in enumerate(handles):
        pool._check(handle, "read")
        if handle.tokens != tokens:
            msg = (
                f"`read_many` reads handles of one token count (a shape bucket): handle 0 "
                f"reads {tokens} tokens but handle {i} reads {handle.tokens}. Read the "
                "handles of each token count together."
            )
            raise ValueError(msg)
    # Token by token (each handle's first ``tokens`` rows of its blocks), so the result holds
    # exactly the tokens read. Equal token counts mean equal block counts.
    bt = pool.block_tokens
    blocks = torch.tensor([h.blocks for h in handles], dtype=torch.long).view(len(handles), -1)
    rows = (blocks[:, :, None] * bt + torch.arange(bt)).view(len(handles), -1)[:, :tokens]
    with pool._lock:
        index = rows.reshape(-1).to(pool.storage.device)
        flat = pool.storage.view(pool.num_blocks * bt, *pool.token_shape)
        gathered = flat.index_select(0, index)
    return gathered.view(len(handles), tokens, *pool.token_shape)
