"""A host buffer pool: one preallocated, pre-touched host byte buffer that parks copy into.

Parking to the host tier without a pool allocates a fresh host tensor per parked storage, and
the kernel faults its pages in on the first copy (about 25 ms per fresh 64 MiB): the round
trip costs several times the copy itself. A `HostBufferPool` allocates its buffer once (pinned
when the parked storages are on CUDA devices, so device-to-host copies are asynchronous),
writes it once so every page is resident, and hands out aligned byte ranges of it: a park
copies into memory that is already there.

The allocator is a first-fit free list with coalescing, under a lock. A range is a view of the
buffer (``buffer[offset:offset + n]``); `free` gives it back. What to do when the pool is full
is the caller's choice: `try_allocate` returns None, `allocate` raises `HostPoolFullError`
naming the bytes asked and free (a manager spills to disk or refuses).

Ranges are also given back from finalizers (a parked handle collected without `release`), which
may run inside the garbage collector while this thread holds the pool's lock: such returns are
queued and applied by the next call that takes the lock, never under it.
"""

from __future__ import annotations

import bisect
import collections
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from sessionstate._checks import describe
from sessionstate._errors import HostPoolFullError

__all__ = ["HostBufferPool", "HostPoolFullError"]


def _register(buffer: torch.Tensor) -> int:
    """Page-lock ``buffer``'s memory with CUDA (unregistered when the buffer is collected);
    return the bytes locked.

    Raises:
        RuntimeError: naming CUDA's error, if the registration fails.
    """
    nbytes = buffer.numel() * buffer.element_size()
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(code) != 0:
        msg = (
            f"Cannot page-lock the host pool's {nbytes} bytes with CUDA (cudaHostRegister "
            f"returned {code}). Make `host_pool_bytes` smaller, raise the locked-memory limit "
            "(`ulimit -l`), or pass `pin_memory=False`."
        )
        raise RuntimeError(msg)
    return nbytes


def _unregister(buffer: torch.Tensor) -> None:
    # The pool is gone, and with it every parked handle that copied through it (each holds the
    # pool): nothing is in flight from the buffer. Not `contextlib.suppress`: at interpreter
    # shutdown module globals may already be gone.
    try:  # noqa: SIM105
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())  # type: ignore[no-untyped-call]
    except Exception:  # shutdown: CUDA is torn down already
        pass


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class HostBufferPool:
    """One preallocated host byte buffer, handed out as aligned ranges; thread-safe.

    Args:
        nbytes: The pool's size in bytes (rounded up to ``alignment``); allocated and written
            once, here.
        pin_memory: Allocate page-locked memory (what asynchronous CUDA device-to-host copies
            need). None (default): pinned when CUDA is available. True needs CUDA.
        alignment: Every range starts at a multiple of this many bytes from the buffer's
            start (a power of two; default 64, a cache line).
        cpu_restores: Unparking onto the CPU also takes its destination from the pool, so a
            restore copies into resident pages instead of faulting in a fresh allocation
            (which costs most of a large round trip on the CPU). A restored storage holds its
            range until the storage is freed, so resident CPU tensors then share the pool with
            parked bytes; a restore that does not fit gets a fresh allocation. Default False.

    >>> pool = HostBufferPool(1024, pin_memory=False)
    >>> a = pool.allocate(100)
    >>> a.numel(), pool.stats()["free"]
    (100, 896)
    >>> pool.free(a)
    >>> pool.stats()["free"] == pool.stats()["total"] == 1024
    True
    """

    def __init__(
        self,
        nbytes: int,
        *,
        pin_memory: bool | None = None,
        alignment: int = 64,
        cpu_restores: bool = False,
    ) -> None:
        if not _is_int(alignment) or alignment <= 0 or alignment & (alignment - 1):
            msg = f"`alignment` must be a power of two (bytes), got {describe(alignment)}."
            raise ValueError(msg)
        if not _is_int(nbytes) or nbytes <= 0:
            msg = f"`nbytes` must be a positive int (the pool's bytes), got {describe(nbytes)}."
            raise ValueError(msg)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        if pin_memory and not torch.cuda.is_available():
            msg = (
                "`pin_memory=True` needs CUDA (page-locked memory is CUDA's); pass "
                "`pin_memory=False` (or None: pinned when CUDA is available)."
            )
            raise ValueError(msg)
        total = -(-nbytes // alignment) * alignment
        # Pageable memory, registered with CUDA when pinned: `torch.empty(pin_memory=True)`
        # goes through the caching host allocator, which rounds a block up to a power of two
        # (a 40 GiB pool would pin 64 GiB). A registration pins exactly the buffer's pages.
        buffer = torch.empty(total, dtype=torch.uint8)
        buffer.zero_()  # pre-touch: every page is faulted in now, not on a park's copy
        self.pinned_nbytes = _register(buffer) if pin_memory else 0
        """Bytes page-locked for the pool (its whole buffer when pinned, else 0)."""
        if self.pinned_nbytes:
            # Holds the buffer: its memory is unregistered before it is freed.
            weakref.finalize(self, _unregister, buffer)
        self.buffer = buffer
        self.total = total
        self.alignment = alignment
        self.pinned = bool(pin_memory)
        self.cpu_restores = bool(cpu_restores)
        self._base = buffer.data_ptr()
        self._lock = threading.Lock()
        # Free runs sorted by offset (parallel lists for bisect), and the live ranges.
        self._free_offsets: list[int] = [0]
        self._free_sizes: list[int] = [total]
        self._live: dict[int, int] = {}
        self._pending: collections.deque[int] = collections.deque()
        self._refusals = 0
        self._array: Any = None  # a NumPy view of the buffer, made on the first CPU restore

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"HostBufferPool(total={s['total']}, free={s['free']}, "
            f"allocations={s['allocations']}, pinned={self.pinned})"
        )

    # -- allocation ---------------------------------------------------------------------------

    def try_allocate(self, nbytes: int) -> torch.Tensor | None:
        """A ``uint8`` view of ``nbytes`` free bytes of the buffer, or None if no run fits.

        Zero bytes get an empty tensor that holds no range (`free` accepts it).
        """
        offset = self._take(nbytes)
        if offset is None:
            return None
        if offset < 0:
            return torch.empty(0, dtype=torch.uint8)  # nothing to pin
        return self.buffer[offset : offset + nbytes]

    def allocate(self, nbytes: int, *, what: str = "the request") -> torch.Tensor:
        """Like `try_allocate`, but raise if the pool cannot hold ``nbytes``.

        Raises:
            HostPoolFullError: naming the bytes asked, free and the largest free run.
        """
        view = self.try_allocate(nbytes)
        if view is None:
            raise self.full_error(nbytes, what=what)
        return view

    def free(self, view: torch.Tensor) -> None:
        """Give back a range `allocate` or `try_allocate` returned (an empty one: nothing).

        Raises:
            ValueError: if ``view`` is not a live range of this pool (freed twice, or another
                tensor).
        """
        if view.numel() == 0:
            return
        offset = self.offset_of(view)
        with self._lock:
            self._drain()
            if self._live.get(offset) is None:
                msg = (
                    f"Cannot free a range at offset {offset} of the host buffer pool: no live "
                    "range starts there (freed already, or not one this pool handed out)."
                )
                raise ValueError(msg)
            self._give(offset)

    def offset_of(self, view: torch.Tensor) -> int:
        """Where ``view`` starts in the buffer, in bytes.

        Raises:
            ValueError: if ``view`` does not lie in this pool's buffer.
        """
        offset = view.data_ptr() - self._base
        if view.device.type != "cpu" or not 0 <= offset < self.total:
            msg = "The tensor does not lie in this host buffer pool's buffer."
            raise ValueError(msg)
        return offset

    def full_error(self, nbytes: int, *, what: str = "the request") -> HostPoolFullError:
        """The error for ``nbytes`` that do not fit (asked, free, largest run, the fixes)."""
        s = self.stats()
        msg = (
            f"The host buffer pool cannot hold {what}: {nbytes} bytes asked, {s['free']} of "
            f"{s['total']} bytes free (largest free run {s['largest_free']} bytes, "
            f"{s['allocations']} ranges held). Make the pool larger (its `nbytes`), release "
            "parked handles that are no longer needed, or park to the disk tier."
        )
        return HostPoolFullError(msg)

    def stats(self) -> dict[str, int]:
        """``total``, ``free``, ``used`` and ``largest_free`` bytes, live ``allocations``,
        ``refusals`` (requests that did not fit), ``pinned`` (1 or 0) and ``pinned_nbytes``
        (bytes page-locked for the pool: ``total`` when pinned)."""
        with self._lock:
            self._drain()
            free = sum(self._free_sizes)
            return {
                "total": self.total,
                "free": free,
                "used": self.total - free,
                "largest_free": max(self._free_sizes, default=0),
                "allocations": len(self._live),
                "refusals": self._refusals,
                "pinned": int(self.pinned),
                "pinned_nbytes": self.pinned_nbytes,
            }

    # -- what the park tiers use ----------------------------------------------------------------

    def give_back_later(self, offsets: Iterable[int]) -> None:
        """Return ranges by offset from a finalizer: queued, applied now if the lock is free."""
        self._pending.extend(offsets)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def resident(self, nbytes: int) -> torch.Tensor | None:
        """A ``uint8`` tensor over ``nbytes`` of the pool whose range returns when its storage
        is freed (its storage is exactly ``nbytes`` long, not the pool's), or None if no run
        fits. What `cpu_restores` uses for a restore's destination."""
        if nbytes == 0:
            return None
        offset = self._take(nbytes)
        if offset is None:
            return None
        if self._array is None:
            self._array = self.buffer.numpy()
        window = self._array[offset : offset + nbytes]
        # The tensor's storage holds the NumPy window; when the storage goes, so does the
        # window, and its finalizer gives the range back.
        weakref.finalize(window, self.give_back_later, (offset,))
        return torch.from_numpy(window)

    # -- the free list (callers hold the lock) --------------------------------------------------

    def _take(self, nbytes: int) -> int | None:
        # An offset, -1 for zero bytes (no range), or None when nothing fits.
        if not _is_int(nbytes) or nbytes < 0:
            msg = f"`nbytes` must be a non-negative int, got {describe(nbytes)}."
            raise ValueError(msg)
        if nbytes == 0:
            return -1
        size = -(-nbytes // self.alignment) * self.alignment
        with self._lock:
            self._drain()
            for i, run in enumerate(self._free_sizes):
                if run >= size:
                    offset = self._free_offsets[i]
                    if run == size:
                        del self._free_offsets[i], self._free_sizes[i]
                    else:
                        self._free_offsets[i] = offset + size
                        self._free_sizes[i] = run - size
                    self._live[offset] = size
                    return offset
            self._refusals += 1
            return None

    def _drain(self) -> None:
        while self._pending:
            offset = self._pending.popleft()
            if offset in self._live:
                self._give(offset)

    def _give(self, offset: int) -> None:
        size = self._live.pop(offset)
        offsets, sizes = self._free_offsets, self._free_sizes
        i = bisect.bisect_left(offsets, offset)
        if i > 0 and offsets[i - 1] + sizes[i - 1] == offset:  # joins the run before it
            i -= 1
            sizes[i] += size
        else:
            offsets.insert(i, offset)
            sizes.insert(i, size)
        if i + 1 < len(offsets) and offsets[i] + sizes[i] == offsets[i + 1]:  # and after it
            sizes[i] += sizes[i + 1]
            del offsets[i + 1], sizes[i + 1]
