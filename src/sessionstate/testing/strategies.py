"""Hypothesis strategies with knobs for tensors, pools of aliased tensors, chunks and sessions.

Every argument forces an option (``devices=("meta",)``) or, left at its default, randomises
it. `tensors` draws one tensor; `tensor_pools` draws a few base allocations and derives
views, aliases and clones from them, recording which allocation each tensor lives in;
`chunks` draws tensors that one `LatentBuffer` accepts; and `session_states` draws
`SessionState` records whose buckets alias each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from hypothesis import strategies as st

from sessionstate._checks import describe, is_int
from sessionstate._objects import LatentBuffer
from sessionstate._session import SessionState
from sessionstate._stateobject import StateObject
from sessionstate.testing._common import (
    DEFAULT_MAXLENS,
    as_maxlen_strategy,
    check_choices,
    check_devices,
    check_non_negative,
    check_positive,
)
from sessionstate.testing._pools import PoolTensor, TensorPool, applicable, derive

__all__ = [
    "CHUNK_DERIVATIONS",
    "DEFAULT_DEVICES",
    "DEFAULT_DTYPES",
    "POOL_DERIVATIONS",
    "PoolTensor",
    "TensorPool",
    "chunks",
    "session_states",
    "tensor_pools",
    "tensors",
]

DEFAULT_DEVICES: tuple[str, ...] = ("cpu", "meta")
"""Devices `tensors` draws from by default: the host and the allocation-free meta device."""

DEFAULT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
)
"""Dtypes `tensors` draws from by default (element sizes 1, 2, 4 and 8 bytes)."""

POOL_DERIVATIONS: tuple[str, ...] = (
    "alias",
    "clone",
    "detach",
    "empty_view",
    "expand",
    "slice",
    "strided",
    "transpose",
    "view",
)
"""How `tensor_pools` derives a tensor from one already in the pool.

``alias``: the same object again. ``clone``: a contiguous copy (a new allocation).
``detach``: ``t.detach()``. ``empty_view``: ``t[:0]``, empty but keeping the allocation
alive. ``expand``: ``t.expand(k, *t.shape)``, overlapping strides. ``slice``: ``t[1:]``.
``strided``: ``t[::2]``. ``transpose``: ``t.t()``, or ``t.transpose(-2, -1)`` above two
dims. ``view``: ``t.view(-1)`` of a contiguous tensor. All but ``clone`` share the source's
allocation.
"""

CHUNK_DERIVATIONS: tuple[str, ...] = ("detach", "expand", "fresh", "slice", "strided", "transpose")
"""How `chunks` builds a chunk: a fresh tensor, or a view of a larger or differently laid out
allocation (``slice`` and ``strided`` keep a bigger allocation alive than they show;
``expand`` and ``transpose`` are non-contiguous)."""


def _materialise(
    shape: Sequence[int], dtype: torch.dtype, device: str, offset: int, step: int
) -> torch.Tensor:
    """A fresh contiguous allocation of exactly ``numel * element_size`` bytes."""
    if torch.device(device).type == "meta":
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    modulus = 2 if dtype == torch.bool else 7
    values = torch.arange(math.prod(shape), dtype=torch.int64).mul_(step).add_(offset)
    return values.remainder_(modulus).to(dtype=dtype, device=device).reshape(tuple(shape))


@st.composite
def _fresh(draw: st.DrawFn, shape: Sequence[int], dtype: torch.dtype, device: str) -> torch.Tensor:
    offset = draw(st.integers(0, 6))
    step = draw(st.integers(1, 3))
    return _materialise(shape, dtype, device, offset, step)


def tensors(
    *,
    devices: Sequence[str] = DEFAULT_DEVICES,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    min_dims: int = 0,
    max_dims: int = 3,
    max_side: int = 4,
    allow_empty: bool = True,
) -> st.SearchStrategy[torch.Tensor]:
    """A strategy for fresh dense tensors, each its own contiguous allocation.

    Host tensors hold small deterministic values (so a changed element is visible); meta
    tensors hold none. Every option is drawn from the given choices; pass one choice to force
    it.

    Args:
        devices: Devices to draw from (``("meta",)`` forces meta tensors).
        dtypes: Dtypes to draw from.
        min_dims: Fewest dimensions (0 allows scalars).
        max_dims: Most dimensions.
        max_side: Largest size of any dimension.
        allow_empty: Whether a dimension may have size 0 (an empty tensor, 0 bytes).

    Raises:
        ValueError: for an empty choice, an unknown device, or inconsistent bounds.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10, database=None)
    ... @given(tensors(devices=("meta",), min_dims=1, allow_empty=False))
    ... def check(t):
    ...     assert t.is_meta and t.ndim >= 1 and t.numel() > 0
    >>> check()
    """
    chosen_devices = check_devices(devices)
    chosen_dtypes = check_choices("dtypes", dtypes)
    check_non_negative("min_dims", min_dims)
    check_non_negative("max_dims", max_dims)
    check_non_negative("max_side", max_side)
    if max_dims < min_dims:
        msg = f"`max_dims` must be >= `min_dims`, got max_dims={max_dims}, min_dims={min_dims}."
        raise ValueError(msg)
    if not allow_empty and max_side == 0:
        msg = "`max_side=0` makes every tensor with a dimension empty; pass `allow_empty=True`."
        raise ValueError(msg)
    return _tensors(chosen_devices, chosen_dtypes, min_dims, max_dims, max_side, allow_empty)


@st.composite
def _tensors(
    draw: st.DrawFn,
    devices: list[str],
    dtypes: list[torch.dtype],
    min_dims: int,
    max_dims: int,
    max_side: int,
    allow_empty: bool,
) -> torch.Tensor:
    device = draw(st.sampled_from(devices))
    dtype = draw(st.sampled_from(dtypes))
    side = st.integers(0 if allow_empty else 1, max_side)
    shape = draw(st.lists(side, min_size=min_dims, max_size=max_dims))
    return draw(_fresh(shape, dtype, device))


def tensor_pools(
    *,
    devices: Sequence[str] = DEFAULT_DEVICES,
    dtypes: Sequence[torch.dtype] = DEFAULT_DTYPES,
    max_dims: int = 3,
    max_side: int = 4,
    allow_empty: bool = True,
    min_bases: int = 1,
    max_bases: int = 3,
    max_derived: int = 6,
    derivations: Sequence[str] = POOL_DERIVATIONS,
) -> st.SearchStrategy[TensorPool]:
    """A strategy for a small `TensorPool`: base allocations, then tensors derived from them.

    Each derived tensor comes from any earlier entry (so views of views occur) by one of
    ``derivations``, which the pool records with the allocation it shares. Drawing payloads
    from one pool makes aliases, overlapping views and duplicates common.

    Args:
        devices: Devices of the base tensors (derived tensors stay on their source's).
        dtypes: Dtypes of the base tensors.
        max_dims: Most dimensions of a base tensor.
        max_side: Largest size of any dimension of a base tensor.
        allow_empty: Whether base tensors may be empty.
        min_bases: Fewest base allocations.
        max_bases: Most base allocations.
        max_derived: Most derived entries.
        derivations: Which of `POOL_DERIVATIONS` to use (``("alias",)`` forces aliases).

    Raises:
        ValueError: for an unknown derivation, an empty choice or inconsistent bounds.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=10, database=None)
    ... @given(tensor_pools(derivations=("alias",)))
    ... def check(pool):
    ...     for entry in pool.entries:
    ...         assert entry.derivation == "base" or entry.tensor is pool.tensors[entry.source]
    >>> check()
    """
    base = tensors(
        devices=devices,
        dtypes=dtypes,
        max_dims=max_dims,
        max_side=max_side,
        allow_empty=allow_empty,
    )
    chosen = check_choices("derivations", derivations, POOL_DERIVATIONS)
    check_positive("min_bases", min_bases)
    check_non_negative("max_derived", max_derived)
    if max_bases < min_bases:
        msg = (
            f"`max_bases` must be >= `min_bases`, got max_bases={max_bases!r}, "
            f"min_bases={min_bases}."
        )
        raise ValueError(msg)
    return _tensor_pools(base, min_bases, max_bases, max_derived, chosen)


@st.composite
def _tensor_pools(
    draw: st.DrawFn,
    base: st.SearchStrategy[torch.Tensor],
    min_bases: int,
    max_bases: int,
    max_derived: int,
    derivations: list[str],
) -> TensorPool:
    entries: list[PoolTensor] = []
    nbytes: list[int] = []
    devices: list[str] = []

    def allocate(t: torch.Tensor) -> int:
        # A fresh contiguous allocation holds exactly numel * element_size bytes.
        nbytes.append(t.numel() * t.element_size())
        devices.append(str(t.device))
        return len(nbytes) - 1

    for _ in range(draw(st.integers(min_bases, max_bases))):
        t = draw(base)
        entries.append(PoolTensor(t, allocate(t), "base"))
    for _ in range(draw(st.integers(0, max_derived))):
        source = draw(st.integers(0, len(entries) - 1))
        src = entries[source]
        options = [d for d in derivations if applicable(d, src.tensor)]
        if not options:
            continue
        how = draw(st.sampled_from(options))
        t = derive(how, src.tensor, draw(st.integers(0, 2)))
        allocation = allocate(t) if how == "clone" else src.allocation
        entries.append(PoolTensor(t, allocation, how, source))
    return TensorPool(tuple(entries), tuple(nbytes), tuple(devices))


def chunks(
    *,
    dim: int = 0,
    feature_shape: Sequence[int] = (2,),
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    max_len: int = 3,
    allow_empty: bool = True,
    derivations: Sequence[str] = CHUNK_DERIVATIONS,
) -> st.SearchStrategy[torch.Tensor]:
    """A strategy for chunks that one `LatentBuffer` accepts: one layout, varying length.

    Every chunk has ``feature_shape`` with a time dimension of length 0 to ``max_len``
    inserted at ``dim``, and the given dtype and device, so any sequence of them can be
    committed to ``LatentBuffer(dim=dim)``. Chunks are fresh tensors or views of larger or
    transposed allocations (see `CHUNK_DERIVATIONS`).

    Args:
        dim: The time dimension (the buffer's ``dim``).
        feature_shape: The chunk's shape without its time dimension.
        dtype: The chunks' dtype.
        device: The chunks' device.
        max_len: Longest time length.
        allow_empty: Whether a chunk may have time length 0.
        derivations: Which of `CHUNK_DERIVATIONS` to use.

    Raises:
        ValueError: if ``dim`` is outside ``0..len(feature_shape)``, or as `tensors`.

    >>> from hypothesis import given, settings
    >>> from sessionstate import LatentBuffer
    >>> @settings(max_examples=10, database=None)
    ... @given(st.lists(chunks(dim=1, feature_shape=(2, 3)), max_size=4))
    ... def check(payloads):
    ...     buf = LatentBuffer(dim=1).allocate()
    ...     for chunk in payloads:
    ...         buf = buf.commit(chunk)
    ...     assert len(buf) == len(payloads)
    >>> check()
    """
    features = tuple(feature_shape)
    for side in features:
        check_non_negative("feature_shape", side)
    if not is_int(dim) or not 0 <= dim <= len(features):
        msg = (
            f"`dim` must be an int in 0..{len(features)} (a position in `feature_shape` "
            f"{features}), got {describe(dim)}."
        )
        raise ValueError(msg)
    check_devices([device])
    check_non_negative("max_len", max_len)
    if not allow_empty and max_len == 0:
        msg = "`max_len=0` makes every chunk empty; pass `allow_empty=True` or a larger `max_len`."
        raise ValueError(msg)
    chosen = check_choices("derivations", derivations, CHUNK_DERIVATIONS)
    return _chunks(dim, features, dtype, device, max_len, allow_empty, chosen)


@st.composite
def _chunks(
    draw: st.DrawFn,
    dim: int,
    features: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    max_len: int,
    allow_empty: bool,
    derivations: list[str],
) -> torch.Tensor:
    length = draw(st.integers(0 if allow_empty else 1, max_len))

    def shape(n: int) -> list[int]:
        return [*features[:dim], n, *features[dim:]]

    def fresh(s: Sequence[int]) -> torch.Tensor:
        return draw(_fresh(s, dtype, device))

    how = draw(st.sampled_from(derivations))
    if how == "detach":
        return fresh(shape(length)).detach()
    if how == "expand":
        return fresh(shape(1)).expand(*shape(length))
    if how == "slice":
        extra = draw(st.integers(1, 2))
        start = draw(st.integers(0, extra))
        return fresh(shape(length + extra)).narrow(dim, start, length)
    if how == "strided":
        index = (slice(None),) * dim + (slice(None, None, 2),)
        return fresh(shape(2 * length))[index]
    if how == "transpose" and features:
        other = 1 if dim == 0 else 0
        swapped = shape(length)
        swapped[dim], swapped[other] = swapped[other], swapped[dim]
        return fresh(swapped).transpose(dim, other)
    return fresh(shape(length))


_OBJECT_NAMES = ("frames", "latents", "encoder_out", "actions")


def session_states(
    *,
    pools: st.SearchStrategy[TensorPool] | None = None,
    max_objects: int = 2,
    max_attrs: int = 3,
    maxlen: int | st.SearchStrategy[int | None] | None = DEFAULT_MAXLENS,
    max_commits: int = 4,
    allow_unallocated: bool = True,
) -> st.SearchStrategy[SessionState]:
    """A strategy for `SessionState` records whose buckets share tensors from one pool.

    Objects are `LatentBuffer` s (``dim=0``) named ``frames``, ``latents``, ... holding chunks
    of one layout drawn from the pool. Attrs hold a pool tensor, an alias of a committed chunk
    (an alias across buckets), a list of pool tensors, an int, or None. Every tensor in the
    record is one of the pool's tensor objects, so ``pool.allocation_of`` finds each.

    Args:
        pools: Where tensors come from (default `tensor_pools()`; ``st.just(pool)`` to fix
            the pool).
        max_objects: Most state objects (at most 4).
        max_attrs: Most attrs.
        maxlen: Ring size of each buffer: an int forces a ring, None forces unbounded, a
            strategy draws each buffer's (default: unbounded or 1..4).
        max_commits: Most chunks committed to one buffer.
        allow_unallocated: Whether a buffer may be never allocated or evicted.

    Raises:
        ValueError: for out-of-range bounds.

    >>> from hypothesis import given, settings
    >>> from sessionstate import LatentBuffer
    >>> @settings(max_examples=10, database=None)
    ... @given(session_states(maxlen=None, allow_unallocated=False))
    ... def check(state):
    ...     for buf in state.objects.values():
    ...         assert isinstance(buf, LatentBuffer) and buf.is_allocated and buf.maxlen is None
    >>> check()
    """
    check_non_negative("max_objects", max_objects)
    if max_objects > len(_OBJECT_NAMES):
        msg = f"`max_objects` must be at most {len(_OBJECT_NAMES)}, got {max_objects}."
        raise ValueError(msg)
    check_non_negative("max_attrs", max_attrs)
    check_non_negative("max_commits", max_commits)
    return _session_states(
        pools if pools is not None else tensor_pools(),
        max_objects,
        max_attrs,
        as_maxlen_strategy(maxlen),
        max_commits,
        allow_unallocated,
    )


@st.composite
def _session_states(
    draw: st.DrawFn,
    pools: st.SearchStrategy[TensorPool],
    max_objects: int,
    max_attrs: int,
    maxlens: st.SearchStrategy[int | None],
    max_commits: int,
    allow_unallocated: bool,
) -> SessionState:
    pool = draw(pools)
    layouts: dict[tuple[torch.dtype, str, tuple[int, ...]], list[torch.Tensor]] = {}
    for t in pool.tensors:
        if t.ndim >= 1:
            layouts.setdefault((t.dtype, str(t.device), tuple(t.shape[1:])), []).append(t)
    groups = list(layouts.values())
    lifecycles = ["allocated", "unallocated", "evicted"] if allow_unallocated else ["allocated"]

    objects: dict[str, StateObject] = {}
    committed: list[torch.Tensor] = []
    for name in _OBJECT_NAMES[: draw(st.integers(0, max_objects))]:
        buf = LatentBuffer(name=name, dim=0)
        lifecycle = draw(st.sampled_from(lifecycles))
        if lifecycle != "unallocated":
            buf = buf.allocate(maxlen=draw(maxlens))
            if groups:
                group = draw(st.sampled_from(groups))
                for chunk in draw(st.lists(st.sampled_from(group), max_size=max_commits)):
                    buf = buf.commit(chunk)
                committed.extend(buf.view())
            if lifecycle == "evicted":
                buf = buf.evict()
        objects[name] = buf

    attrs_: dict[str, Any] = {}
    tensor_choice = st.sampled_from(pool.tensors) if pool.tensors else st.none()
    kinds = ["tensor", "list", "int", "none"] + (["alias"] * 2 if committed else [])
    for i in range(draw(st.integers(0, max_attrs))):
        kind = draw(st.sampled_from(kinds))
        value: Any
        if kind == "tensor":
            value = draw(tensor_choice)
        elif kind == "alias":
            value = draw(st.sampled_from(committed))
        elif kind == "list":
            value = draw(st.lists(tensor_choice, max_size=3))
        elif kind == "int":
            value = draw(st.integers(-3, 100))
        else:
            value = None
        attrs_[f"attr{i}"] = value
    return SessionState(objects=objects, attrs=attrs_)
