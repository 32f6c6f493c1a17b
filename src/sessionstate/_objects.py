"""State objects: units of session state with a lifecycle the manager can act on.

`LatentBuffer` and `TensorCache` are defined here; the `StateObject` contract they implement,
and the `ParkedObject` that stands in for a parked one, live in `_stateobject`. A snapshot
names these classes by their stable names (`SNAPSHOT_NAMES`), so they may move to another
module with their table entry.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, final, overload

import attrs
import torch

from sessionstate._accounting import note_derived, noted_derivation
from sessionstate._checks import describe, is_int
from sessionstate._errors import NotAllocatedError
from sessionstate._protocols import Derivation
from sessionstate._stateobject import SingleValueObject, StateObject
from sessionstate._tree import field, register_record, static_field

__all__ = ["LatentBuffer", "TensorCache"]


# -- the checks a LatentBuffer runs on its configuration and on every chunk it is given --


def _check_dim(instance: object, attribute: attrs.Attribute[int], dim: object) -> None:
    if not is_int(dim) or dim < 0:
        msg = (
            f"`dim` must be a non-negative int (the chunks' time dimension), got "
            f"{describe(dim)}; count it from the front, e.g. `dim=2` for (B, C, T, H, W)."
        )
        raise ValueError(msg)


def _check_maxlen(maxlen: object) -> int | None:
    if maxlen is None:
        return None
    if not is_int(maxlen) or maxlen <= 0:
        msg = (
            f"`maxlen` must be a positive int or None, got {describe(maxlen)}. "
            "Use `maxlen=None` to keep every chunk, or `maxlen=k` for a ring of the last k."
        )
        raise ValueError(msg)
    return maxlen


def _as_chunks(value: object) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        # `tuple(tensor)` would split it into rows silently.
        msg = (
            f"LatentBuffer `chunks` must be a sequence of tensors, got one tensor of shape "
            f"{tuple(value.shape)}; pass `chunks=(t,)`, or build the buffer with "
            "`.allocate(...)` and `.commit(t)`."
        )
        raise TypeError(msg)
    return tuple(value)  # type: ignore[arg-type]


def _check_chunk(name: str, dim: int, chunk: object, ref: torch.Tensor | None) -> None:
    """Check that ``chunk`` may follow ``ref`` (the newest held chunk) in a buffer."""
    if not isinstance(chunk, torch.Tensor):
        msg = (
            f"LatentBuffer `{name}` holds tensors, got {type(chunk).__name__}; "
            "commit a torch.Tensor."
        )
        raise TypeError(msg)
    if chunk.dim() <= dim:
        msg = (
            f"LatentBuffer `{name}` concatenates along dim {dim}, so a chunk needs "
            f"at least {dim + 1} dims; got shape {tuple(chunk.shape)}. Commit chunks "
            "with the time axis at `dim`, or build the buffer with a matching `dim=`."
        )
        raise ValueError(msg)
    if ref is None:
        return
    if chunk.layout != ref.layout or chunk.is_nested != ref.is_nested:
        msg = (
            f"LatentBuffer `{name}` holds chunks of layout {_layout(ref)}; got layout "
            f"{_layout(chunk)}, which `torch.cat` cannot join with them. Convert the chunk "
            "(`.to_dense()`, `.to_sparse()`) or `reset()` the buffer to change its layout."
        )
        raise ValueError(msg)
    shape, held = chunk.shape, ref.shape
    if (
        chunk.dtype != ref.dtype
        or chunk.device != ref.device
        # Equal shapes (chunks of one length, the common case) cost one comparison.
        or (
            shape != held
            and (
                len(shape) != len(held)
                or shape[:dim] != held[:dim]
                or shape[dim + 1 :] != held[dim + 1 :]
            )
        )
    ):
        msg = (
            f"LatentBuffer `{name}` holds chunks of dtype {ref.dtype} on {ref.device} "
            f"with shape {_shape_pattern(ref.shape, dim)}; got dtype {chunk.dtype} on "
            f"{chunk.device} with shape {tuple(chunk.shape)}. Convert the chunk "
            "(`.to(dtype=..., device=...)`) or `reset()` the buffer to change its layout."
        )
        raise ValueError(msg)


# -- the chunks a LatentBuffer holds: one immutable sequence, shared block by block -------------

_BLOCK = 64  # chunks per shared block: a commit copies at most this many references


@final
class _Chunks(Sequence[torch.Tensor]):
    """A long buffer's chunks, oldest first, in blocks of ``_BLOCK`` shared between versions.

    A buffer holds up to ``_BLOCK`` chunks as one tuple, and this beyond.

    A commit builds a new ``tail`` (at most ``_BLOCK`` references) and, once the tail is full,
    a new tuple of block references; every block a version holds is shared with the version it
    came from. So a commit, and dropping the version before it, cost a block, not the
    history. A ring that drops its oldest chunk rebuilds only the first block. Every chunk a
    block holds is in the sequence: nothing dropped stays referenced, so the bytes a buffer
    keeps alive are the bytes of its chunks.

    Blocks after the first hold exactly ``_BLOCK`` chunks; the first holds 1 to ``_BLOCK``.

    >>> seq = _Chunks.of(tuple(range(70)))
    >>> len(seq), seq[0], seq[-1], seq[63:66], len(seq.extend((70,))._blocks)
    (70, 0, 69, (63, 64, 65), 1)
    >>> seq.drop_front(3)[0], len(seq.drop_front(3)._blocks[0])
    (3, 61)
    """

    __slots__ = ("_blocks", "_len", "_tail")

    def __init__(
        self, blocks: tuple[tuple[Any, ...], ...], tail: tuple[Any, ...], length: int
    ) -> None:
        self._blocks = blocks
        self._tail = tail
        self._len = length

    @classmethod
    def of(cls, items: tuple[Any, ...]) -> _Chunks:
        """The sequence of ``items``, in full blocks and a tail."""
        whole = len(items) - len(items) % _BLOCK
        blocks = tuple(items[i : i + _BLOCK] for i in range(0, whole, _BLOCK))
        return cls(blocks, items[whole:], len(items))

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain(itertools.chain.from_iterable(self._blocks), self._tail)

    def __reduce__(self) -> tuple[Any, tuple[tuple[Any, ...]]]:
        return _Chunks.of, (self.as_tuple(),)

    @overload
    def __getitem__(self, index: int) -> Any: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Any, ...]: ...
    def __getitem__(self, index: int | slice) -> Any:
        n, tail = self._len, self._tail
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            head = n - len(tail)
            if step == 1 and start >= head:  # the newest chunks (a ledger's added, a view)
                return tail[start - head : max(start, stop) - head]
            return self.as_tuple()[index]
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(index)  # (private: a buffer asks only for chunks it holds)
        head = n - len(tail)
        if i >= head:
            return tail[i - head]
        first = len(self._blocks[0])
        if i < first:
            return self._blocks[0][i]
        block, offset = divmod(i - first, _BLOCK)
        return self._blocks[block + 1][offset]

    def as_tuple(self) -> tuple[Any, ...]:
        """Every chunk in one tuple (the tail itself while there are no blocks)."""
        if not self._blocks:
            return self._tail
        return (*itertools.chain.from_iterable(self._blocks), *self._tail)

    def extend(self, chunks: tuple[Any, ...]) -> _Chunks:
        """This sequence with ``chunks`` after its last, in order.

        Builds a new tail and, once the tail outgrows a block, the blocks it fills: this
        sequence's blocks are kept as they are.
        """
        tail = (*self._tail, *chunks)
        if len(tail) <= _BLOCK:
            return _Chunks(self._blocks, tail, self._len + len(chunks))
        sealed = _Chunks.of(tail)
        return _Chunks((*self._blocks, *sealed._blocks), sealed._tail, self._len + len(chunks))

    def drop_front(self, count: int) -> _Chunks:
        """This sequence without its first ``count`` chunks (``0 <= count <= len``)."""
        blocks, tail, left = self._blocks, self._tail, count
        while left and blocks:
            first = blocks[0]
            if left < len(first):
                blocks, left = (first[left:], *blocks[1:]), 0
            else:
                blocks, left = blocks[1:], left - len(first)
        if left:
            tail = tail[left:]
        return _Chunks(blocks, tail, self._len - count)


_Seq = tuple[torch.Tensor, ...] | _Chunks
"""How a buffer keeps its chunks: a tuple up to a block's worth, then `_Chunks`."""


def _joined(seq: _Seq, new: tuple[torch.Tensor, ...], maxlen: int | None) -> _Seq:
    """``seq`` then ``new``, less the oldest beyond ``maxlen``: a tuple up to `_BLOCK`, then blocks.

    >>> _joined((1, 2), (3,), 2), type(_joined(tuple(range(64)), (64,), None)).__name__
    ((2, 3), '_Chunks')
    """
    if type(seq) is tuple:  # a ring or a short buffer: one tuple, as cheap as it gets
        joined = (*seq, *new)
        if maxlen is not None and len(joined) > maxlen:
            joined = joined[len(joined) - maxlen :]
        return joined if len(joined) <= _BLOCK else _Chunks.of(joined)
    assert isinstance(seq, _Chunks)
    out = seq.extend(new)
    if maxlen is not None and len(out) > maxlen:
        out = out.drop_front(len(out) - maxlen)
    return out


def _layout(t: torch.Tensor) -> str:
    return f"{t.layout} (nested)" if t.is_nested else str(t.layout)


def _shape_pattern(shape: torch.Size, dim: int) -> str:
    parts = ["T" if i == dim else str(s) for i, s in enumerate(shape)]
    return f"({', '.join(parts)})"


@register_record
@attrs.frozen(eq=False, slots=False)
class LatentBuffer(StateObject):
    """A sequence of tensor chunks along a time dimension: accumulating, or a bounded ring.

    ``allocate(maxlen=None)`` keeps every committed chunk; ``allocate(maxlen=k)`` keeps the
    last ``k`` (the oldest is dropped). Chunks are held by reference, never copied, and no
    method writes into a tensor. A commit shares the previous buffer's chunks block by block
    (blocks of 64), so it costs the same at any length, and the previous buffer stays valid
    and unchanged. ``chunks`` is a tuple, built the first time it is read.

    Chunks must agree with the ones already held on dtype, device and every dimension except
    ``dim`` (the time dimension readers concatenate along).

    Args:
        name: Used in error messages (e.g. the session value the buffer holds).
        dim: The time dimension of each chunk; `concat` joins chunks along it.
        maxlen: Ring size, or None to accumulate. Set through `allocate`.
        chunks: Retained chunks, oldest first. Set through `commit`.

    >>> import torch
    >>> ring = LatentBuffer(name="latents", dim=0).allocate(maxlen=2)
    >>> for i in range(3):
    ...     ring = ring.commit(torch.full((1, 2), float(i)))
    >>> len(ring), ring.concat()
    (2, tensor([[1., 1.],
            [2., 2.]]))
    >>> ring.view(last=1)
    (tensor([[2., 2.]]),)
    """

    chunks: tuple[torch.Tensor, ...] = field(default=(), converter=_as_chunks)
    name: str = static_field(default="buffer", kw_only=True)
    dim: int = static_field(default=2, kw_only=True, validator=_check_dim)
    maxlen: int | None = static_field(default=None, kw_only=True, converter=_check_maxlen)
    allocated: bool = static_field(default=False, kw_only=True)
    # The chunks as the buffer keeps them: the `chunks` tuple itself up to a block's worth,
    # then shared blocks, from which `chunks` is built when read (`_BuiltOnRead`).
    _seq: _Seq = static_field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        chunks = self.chunks
        object.__setattr__(self, "_seq", chunks if len(chunks) <= _BLOCK else _Chunks.of(chunks))
        for i, chunk in enumerate(self.chunks):
            _check_chunk(self.name, self.dim, chunk, self.chunks[i - 1] if i else None)
        if self.chunks and not self.allocated:
            msg = (
                f"LatentBuffer `{self.name}` holds {len(self.chunks)} chunks but is not "
                "allocated; build it with `.allocate(...)` and `.commit(chunk)`."
            )
            raise ValueError(msg)
        if self.maxlen is not None and len(self.chunks) > self.maxlen:
            msg = (
                f"LatentBuffer `{self.name}` holds {len(self.chunks)} chunks but its ring "
                f"retains at most {self.maxlen}; build it with `.commit(chunk)`, which drops "
                "the oldest."
            )
            raise ValueError(msg)

    @property
    def is_allocated(self) -> bool:
        """Whether the buffer was allocated (and not evicted since).

        >>> LatentBuffer().is_allocated, LatentBuffer().allocate().is_allocated
        (False, True)
        """
        return self.allocated

    def __len__(self) -> int:
        """The number of retained chunks.

        >>> len(LatentBuffer().allocate())
        0
        """
        return len(self._seq)

    def allocate(self, *, maxlen: int | None = None) -> LatentBuffer:  # type: ignore[override]
        """Return an empty, allocated buffer: a ring of ``maxlen`` chunks, or unbounded if None.

        Raises:
            ValueError: if ``maxlen`` is not None or a positive int.

        >>> LatentBuffer().allocate(maxlen=2).maxlen
        2
        """
        maxlen = _check_maxlen(maxlen)
        return attrs.evolve(self, chunks=(), maxlen=maxlen, allocated=True)

    def commit(self, chunk: torch.Tensor, /) -> LatentBuffer:
        """Return a buffer that also holds ``chunk`` (a ring drops its oldest when full).

        The buffer holds ``chunk`` itself, not a copy: a loop that reuses one input tensor
        (``frame.copy_(next_frame)``) rewrites every buffer that holds it. Commit a fresh
        tensor (or ``frame.clone()``); ``check_immutable=True`` on the manager reports such a
        write, naming the session and the buffer.

        Raises:
            NotAllocatedError: if the buffer is not allocated.
            TypeError: if ``chunk`` is not a tensor.
            ValueError: if ``chunk`` disagrees with the held chunks on dtype, device, rank or a
                dimension other than ``dim``.

        >>> import torch
        >>> buf = LatentBuffer(dim=0).allocate()
        >>> bigger = buf.commit(torch.zeros(1, 3))
        >>> len(buf), len(bigger)
        (0, 1)
        """
        if not self.allocated:
            self._require_allocated("commit to")
        seq = self._seq
        _check_chunk(self.name, self.dim, chunk, seq[-1] if seq else None)
        return self._with_chunks(_joined(seq, (chunk,), self.maxlen), 1)

    def extend(self, chunks: Iterable[torch.Tensor], /) -> LatentBuffer:
        """Return a buffer that also holds ``chunks``, in order, built in one transition.

        The result equals committing the chunks one by one (a ring keeps the newest
        ``maxlen``), but only one new tuple is built. Each chunk is checked as `commit` checks
        it, against the chunks before it; if any fails, nothing is built.

        Raises:
            NotAllocatedError: if the buffer is not allocated.
            TypeError: if ``chunks`` is a single tensor or not iterable, or holds a non-tensor.
            ValueError: as `commit`, for the first chunk that disagrees.

        >>> import torch
        >>> ring = LatentBuffer(dim=0).allocate(maxlen=2)
        >>> ring = ring.extend([torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)])
        >>> len(ring), ring.concat()
        (2, tensor([1., 2.]))
        """
        self._require_allocated("extend")
        if isinstance(chunks, torch.Tensor) or not isinstance(chunks, Iterable):
            hint = (
                "use `commit(chunk)` for one chunk"
                if isinstance(chunks, torch.Tensor)
                else "pass a list or tuple of tensors"
            )
            msg = (
                f"LatentBuffer `{self.name}`: `extend` takes an iterable of tensors, got "
                f"{type(chunks).__name__}; {hint}."
            )
            raise TypeError(msg)
        new = tuple(chunks)
        seq = self._seq
        ref = seq[-1] if seq else None
        for chunk in new:
            _check_chunk(self.name, self.dim, chunk, ref)
            ref = chunk
        if not new:
            return self._with_chunks(seq, 0)
        return self._with_chunks(_joined(seq, new, self.maxlen), len(new))

    def view(self, *, last: int | None = None) -> tuple[torch.Tensor, ...]:
        """The retained chunks, oldest to newest; with ``last=n``, the newest ``min(n, len)``.

        Raises:
            NotAllocatedError: if the buffer is not allocated.
            ValueError: if ``last`` is negative, or exceeds a ring's ``maxlen`` (asking a ring
                for more than it can ever retain is a bug, never a silently shorter window).

        >>> import torch
        >>> ring = LatentBuffer(dim=0).allocate(maxlen=3).commit(torch.zeros(1))
        >>> len(ring.view(last=3))
        1
        """
        self._require_allocated("view")
        if last is None:
            return self.chunks
        if not is_int(last) or last < 0:
            msg = (
                f"`last` must be a non-negative int or None, got {describe(last)}; pass "
                "`last=None` for every retained chunk."
            )
            raise ValueError(msg)
        if self.maxlen is not None and last > self.maxlen:
            msg = (
                f"Requested {last} chunks but the ring `{self.name}` retains at most "
                f"{self.maxlen}; ask for at most {self.maxlen}, or allocate a larger ring."
            )
            raise ValueError(msg)
        seq = self._seq
        return seq[len(seq) - min(last, len(seq)) :]

    def concat(self, *, last: int | None = None) -> torch.Tensor:
        """The retained chunks (or the newest ``last``) joined along ``dim`` into one tensor.

        Always a new tensor, so writing to it cannot reach the buffer.

        Raises:
            ValueError: if there is nothing to join (check ``len(buf)`` first), or as `view`.

        >>> import torch
        >>> buf = LatentBuffer(dim=0).allocate().commit(torch.ones(1)).commit(torch.zeros(2))
        >>> buf.concat()
        tensor([1., 0., 0.])
        """
        chunks = self.view(last=last)
        if not chunks and len(self):  # `last=0` on a buffer that holds chunks
            msg = (
                f"`last=0` selects no chunks of LatentBuffer `{self.name}` (it holds "
                f"{len(self)}), and there is nothing to join; pass `last` >= 1, or "
                "`last=None` for every chunk."
            )
            raise ValueError(msg)
        if not chunks:
            msg = f"LatentBuffer `{self.name}` is empty; check `len(buffer)` before `concat()`."
            raise ValueError(msg)
        return torch.cat(chunks, dim=self.dim)

    def reset(self) -> LatentBuffer:
        """Return an empty buffer with the same configuration (still allocated).

        >>> import torch
        >>> buf = LatentBuffer(dim=0).allocate(maxlen=2).commit(torch.ones(1)).reset()
        >>> len(buf), buf.maxlen, buf.is_allocated
        (0, 2, True)
        """
        self._require_allocated("reset")
        return self._with_chunks(())

    def evict(self) -> LatentBuffer:
        """Return a buffer with its chunks released and not resident; `allocate` to reuse it.

        >>> import torch
        >>> buf = LatentBuffer(dim=0).allocate().commit(torch.ones(4)).evict()
        >>> buf.is_allocated, buf.nbytes_by_device()
        (False, {})
        """
        return attrs.evolve(self, chunks=(), maxlen=None, allocated=False)

    def _with_chunks(self, seq: _Seq, added: int = 0) -> LatentBuffer:
        # `attrs.evolve` re-runs every converter and validator; a commit only swaps the chunks.
        if type(self) is not LatentBuffer:  # a subclass may carry fields of its own
            return attrs.evolve(self, chunks=tuple(seq))
        new = object.__new__(LatentBuffer)
        if type(seq) is tuple:
            object.__setattr__(new, "chunks", seq)
        object.__setattr__(new, "_seq", seq)  # `chunks` is built from it when read
        object.__setattr__(new, "name", self.name)
        object.__setattr__(new, "dim", self.dim)
        object.__setattr__(new, "maxlen", self.maxlen)
        object.__setattr__(new, "allocated", self.allocated)
        if added:  # the chunks are the leaves: the old ones less those a ring dropped, then new
            note_derived(new, self, len(self._seq) + added - len(seq), seq)
        return new

    def __sessionstate_derivation__(self) -> Derivation | None:
        """How a commit built this buffer's chunks from its input's (`DerivesFromBase`)."""
        return noted_derivation(self)

    def _require_allocated(self, action: str) -> None:
        if not self.allocated:
            msg = (
                f"Cannot {action} LatentBuffer `{self.name}`: it is not allocated; "
                "call `.allocate(maxlen=...)` first."
            )
            raise NotAllocatedError(msg)


class _BuiltOnRead:
    """`LatentBuffer.chunks` of a buffer that holds only blocks: the tuple, built once.

    A non-data descriptor: once built, the tuple sits in the buffer's ``__dict__`` and is
    read from there, as attrs's own ``__init__`` leaves it for a buffer it built.
    """

    def __get__(self, buffer: LatentBuffer | None, owner: type) -> Any:
        if buffer is None:
            return self
        seq = buffer._seq
        chunks = seq.as_tuple() if isinstance(seq, _Chunks) else seq
        object.__setattr__(buffer, "chunks", chunks)
        return chunks


LatentBuffer.chunks = _BuiltOnRead()  # type: ignore[assignment]


@register_record
@attrs.frozen(eq=False)
class TensorCache(SingleValueObject[Any]):
    """A cache replaced wholesale: one tree of tensors, with no accumulate or ring semantics.

    For a value a model rebuilds in full every step and needs back exactly (a streaming
    encoder's causal-conv cache): `commit` replaces the contents, `view` returns them. It is a
    `StateObject` so a manager under a byte budget can park it (it has no recompute source,
    so evicting it mid-session would lose it; parking does not).

    Args:
        contents: The cached tree (None while empty). Set through `commit`.
        name: Used in error messages.
        allocated: Set through `allocate`.

    >>> import torch
    >>> cache = TensorCache(name="feat").allocate()
    >>> cache.view() is None
    True
    >>> cache.commit((torch.ones(2), None)).view()
    (tensor([1., 1.]), None)
    """

    contents: Any = field(default=None)
    name: str = static_field(default="cache", kw_only=True)
    allocated: bool = static_field(default=False, kw_only=True)

    value_field: ClassVar[str] = "contents"
    holds: ClassVar[str] = "contents"
    commits: ClassVar[str] = "tree"

    def commit(self, contents: Any, /) -> TensorCache:
        """Return a cache holding ``contents`` instead of what it held (nothing is copied).

        Committing the very contents held returns this cache itself (a step that left the
        cache as it was changes nothing, and costs the accounting nothing).

        Raises:
            NotAllocatedError: if the cache is not allocated.

        >>> import torch
        >>> cache = TensorCache().allocate().commit({"k": torch.zeros(1)})
        >>> cache.view(), cache.commit(cache.view()) is cache
        ({'k': tensor([0.])}, True)
        """
        self._require_allocated("commit to")
        # (dynamo cannot trace `is` between two tuples; a traced commit builds a new cache)
        if not torch.compiler.is_compiling() and contents is self.contents:
            return self
        return attrs.evolve(self, contents=contents)
