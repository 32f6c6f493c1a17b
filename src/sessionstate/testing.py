"""Hypothesis strategies and contract state machines for code built on sessionstate.

Two kinds of tools, both public so a downstream model can test its own state the way this
library tests itself:

- Strategies with knobs. Every argument forces an option (``devices=("meta",)``) or, left at
  its default, randomises it. `tensors` draws one tensor; `tensor_pools` draws a few base
  allocations and derives views, aliases and clones from them, recording which allocation
  each tensor lives in; `chunks` draws tensors that one `LatentBuffer` accepts; and
  `session_states` draws `SessionState` records whose buckets alias each other.
- Model-based state machines. `RingContractMachine` runs a `LatentBuffer`-like state object
  against a ``collections.deque``; `ManagerContractMachine` runs a `SessionStateManager`
  against an ``OrderedDict`` LRU. Both keep every record they produced and check after every
  step that none of them changed. `ring_contract_machine` and `manager_contract_machine`
  configure them in one line; assign the result's ``.TestCase`` in a test module.
- An independent byte count, `recount_nbytes_by_device`, to check `nbytes_by_device` and
  `SessionStateManager.stats` against.

hypothesis is an optional dependency: install ``sessionstate[testing]``.

>>> from sessionstate import LatentBuffer
>>> from sessionstate.testing import ring_contract_machine
>>> TestLatentRing = ring_contract_machine(lambda: LatentBuffer(dim=0), maxlen=2).TestCase
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NoReturn, TypeVar

import attrs
import torch
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sessionstate._accounting import nbytes_by_device
from sessionstate._checks import describe, is_int
from sessionstate._errors import NotAllocatedError, SessionAdmissionError, SessionStateLostError
from sessionstate._manager import OnFull, SessionStateManager
from sessionstate._objects import LatentBuffer, StateObject
from sessionstate._session import SessionState
from sessionstate._tree import (
    PyTree,
    PyTreeSpec,
    tree_equal,
    tree_flatten,
    tree_leaves,
    tree_unflatten,
)

__all__ = [
    "CHUNK_DERIVATIONS",
    "DEFAULT_DEVICES",
    "DEFAULT_DTYPES",
    "POOL_DERIVATIONS",
    "ManagerContractMachine",
    "PoolTensor",
    "RingContractMachine",
    "TensorPool",
    "chunks",
    "manager_contract_machine",
    "recount_nbytes_by_device",
    "ring_contract_machine",
    "session_states",
    "tensor_pools",
    "tensors",
]

_T = TypeVar("_T")

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

_DEFAULT_MAXLENS: st.SearchStrategy[int | None] = st.one_of(st.none(), st.integers(1, 4))
_DEFAULT_CAPS: st.SearchStrategy[int] = st.integers(1, 4)
_DEFAULT_SESSION_IDS: st.SearchStrategy[str] = st.sampled_from(("a", "b", "c", "d", "e", "f"))


def _fail(msg: str) -> NoReturn:
    # Contract checks raise explicitly rather than `assert`, so they survive `python -O`.
    raise AssertionError(msg)


def _expect_raises(exc_type: type[BaseException], action: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except exc_type:
        return
    _fail(f"{action} should raise {exc_type.__name__}, but it returned normally.")


def _check_positive(name: str, value: object) -> int:
    if not is_int(value) or value <= 0:
        msg = f"`{name}` must be a positive int, got {describe(value)}."
        raise ValueError(msg)
    return value


def _check_non_negative(name: str, value: object) -> int:
    if not is_int(value) or value < 0:
        msg = f"`{name}` must be a non-negative int, got {describe(value)}."
        raise ValueError(msg)
    return value


def _check_choices(
    name: str, values: Sequence[_T], allowed: Sequence[_T] | None = None
) -> list[_T]:
    chosen = list(values)
    if not chosen:
        msg = f"`{name}` must name at least one option, got {describe(values)}."
        raise ValueError(msg)
    if allowed is not None:
        unknown = [v for v in chosen if v not in allowed]
        if unknown:
            msg = f"`{name}` has unknown options {unknown}; choose from {list(allowed)}."
            raise ValueError(msg)
    return chosen


def _check_devices(devices: Sequence[str]) -> list[str]:
    chosen = _check_choices("devices", devices)
    for device in chosen:
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            msg = (
                f"`devices` must hold device strings such as 'cpu', 'meta' or 'cuda:0', got "
                f"{describe(device)}."
            )
            raise ValueError(msg) from None
    return chosen


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
    chosen_devices = _check_devices(devices)
    chosen_dtypes = _check_choices("dtypes", dtypes)
    _check_non_negative("min_dims", min_dims)
    _check_non_negative("max_dims", max_dims)
    _check_non_negative("max_side", max_side)
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


def _applicable(derivation: str, t: torch.Tensor) -> bool:
    if derivation in ("slice", "strided", "empty_view"):
        return t.ndim >= 1
    if derivation == "view":
        return t.is_contiguous()
    return True


def _derive(derivation: str, t: torch.Tensor, k: int) -> torch.Tensor:
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
    chosen = _check_choices("derivations", derivations, POOL_DERIVATIONS)
    _check_positive("min_bases", min_bases)
    _check_non_negative("max_derived", max_derived)
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
        options = [d for d in derivations if _applicable(d, src.tensor)]
        if not options:
            continue
        how = draw(st.sampled_from(options))
        t = _derive(how, src.tensor, draw(st.integers(0, 2)))
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
        _check_non_negative("feature_shape", side)
    if not is_int(dim) or not 0 <= dim <= len(features):
        msg = (
            f"`dim` must be an int in 0..{len(features)} (a position in `feature_shape` "
            f"{features}), got {describe(dim)}."
        )
        raise ValueError(msg)
    _check_devices([device])
    _check_non_negative("max_len", max_len)
    if not allow_empty and max_len == 0:
        msg = "`max_len=0` makes every chunk empty; pass `allow_empty=True` or a larger `max_len`."
        raise ValueError(msg)
    chosen = _check_choices("derivations", derivations, CHUNK_DERIVATIONS)
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
    maxlen: int | st.SearchStrategy[int | None] | None = _DEFAULT_MAXLENS,
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
    _check_non_negative("max_objects", max_objects)
    if max_objects > len(_OBJECT_NAMES):
        msg = f"`max_objects` must be at most {len(_OBJECT_NAMES)}, got {max_objects}."
        raise ValueError(msg)
    _check_non_negative("max_attrs", max_attrs)
    _check_non_negative("max_commits", max_commits)
    return _session_states(
        pools if pools is not None else tensor_pools(),
        max_objects,
        max_attrs,
        _as_maxlen_strategy(maxlen),
        max_commits,
        allow_unallocated,
    )


def _as_maxlen_strategy(
    maxlen: int | st.SearchStrategy[int | None] | None,
) -> st.SearchStrategy[int | None]:
    if isinstance(maxlen, st.SearchStrategy):
        return maxlen
    if maxlen is not None:
        _check_positive("maxlen", maxlen)
    return st.just(maxlen)


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


def _dense_parts(leaf: torch.Tensor) -> list[torch.Tensor]:
    if leaf.layout == torch.sparse_coo:
        return [leaf._indices(), leaf._values()]
    if leaf.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [leaf.crow_indices(), leaf.col_indices(), leaf.values()]
    if leaf.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [leaf.ccol_indices(), leaf.row_indices(), leaf.values()]
    if leaf.layout != torch.strided or leaf.is_nested or type(leaf) is not torch.Tensor:
        kind = "a nested tensor" if leaf.is_nested else f"a `{type(leaf).__qualname__}`"
        msg = (
            f"`recount_nbytes_by_device` recounts plain dense and sparse tensors, got {kind} "
            f"(layout={leaf.layout}); check such leaves with `nbytes_by_device` against a "
            "count you know."
        )
        raise TypeError(msg)
    return [leaf]


def recount_nbytes_by_device(tree: PyTree, /) -> dict[str, int]:
    """Bytes per device that ``tree`` keeps alive, recounted without the library's accounting.

    An independent check for `nbytes_by_device` and `SessionStateManager.stats`, so a test
    that compares them with it can catch a counting bug: for each device, the size of the
    union of the address ranges ``[data_ptr, data_ptr + nbytes)`` of every storage that a
    tensor leaf's ``untyped_storage()`` reports (sparse tensors through their component
    tensors), and of the pool blocks each live `KVHandle` holds. Storages without memory
    (every ``meta`` storage has data pointer 0) count once per storage object (a pool block
    once per block). Other non-tensor leaves count 0; devices holding nothing are absent.

    Raises:
        TypeError: for a tensor subclass, a nested tensor, or another layout it cannot read.

    >>> import torch
    >>> x = torch.zeros(8)
    >>> meta = torch.empty(3, device="meta")
    >>> recount_nbytes_by_device({"a": x[2:], "b": x.view(2, 4), "m": meta})
    {'cpu': 32, 'meta': 12}
    """
    from sessionstate._kvpool import KVHandle

    spans: dict[str, list[tuple[int, int]]] = {}
    unaddressed: dict[str, dict[object, int]] = {}
    keepalive: list[torch.UntypedStorage] = []  # no address is freed and reused mid-count
    for leaf in tree_leaves(tree):
        if isinstance(leaf, KVHandle):
            # Engine-owned: the blocks the handle holds, as slices of its pool's tensor.
            if not leaf.alive:
                continue
            for b in leaf.blocks:
                block = leaf.pool.storage[b]
                keepalive.append(block.untyped_storage())
                device, start = str(block.device), block.data_ptr()
                size = block.numel() * block.element_size()
                if start:
                    spans.setdefault(device, []).append((start, start + size))
                else:
                    unaddressed.setdefault(device, {})[(block.untyped_storage()._cdata, b)] = size
            continue
        if not isinstance(leaf, torch.Tensor):
            continue
        for part in _dense_parts(leaf):
            storage = part.untyped_storage()
            keepalive.append(storage)
            device, start, size = str(part.device), storage.data_ptr(), storage.nbytes()
            if start:
                spans.setdefault(device, []).append((start, start + size))
            else:
                unaddressed.setdefault(device, {})[storage._cdata] = size
    out: dict[str, int] = {}
    for device, ranges in spans.items():
        covered, reach = 0, 0
        for start, end in sorted(ranges):
            covered += max(0, end - max(start, reach))
            reach = max(reach, end)
        out[device] = covered
    for device, sizes in unaddressed.items():
        out[device] = out.get(device, 0) + sum(sizes.values())
    return {device: n for device, n in out.items() if n}


def _stats_bytes(recount: dict[str, int]) -> dict[str, int]:
    """The byte keys that `SessionStateManager.stats` reports for a recount."""
    return {
        "total_nbytes": sum(recount.values()),
        **{f"nbytes:{device}": n for device, n in sorted(recount.items())},
    }


def _nbytes_of(record: Any) -> dict[str, int]:
    if isinstance(record, StateObject):
        return record.nbytes_by_device()
    return nbytes_by_device(record)


class _VersionLog:
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
                _fail(
                    f"A tensor first held by a record made by `{t.label}` changed after it was "
                    f"made: it was written in place (layout, storage and version were "
                    f"{t.layout}, now {_layout(t.tensor)}). No transition may write into a "
                    "tensor that an existing record can reach."
                )
            if not tree_equal(t.tensor, t.clone):
                _fail(
                    f"A tensor first held by a record made by `{t.label}` changed after it was "
                    "made: its values no longer match the snapshot taken then."
                )
        for i, v in enumerate(self._versions):
            leaves, spec = tree_flatten(v.record)
            if spec != v.spec or any(a is not b for a, b in zip(leaves, v.leaves, strict=True)):
                _fail(
                    f"Record #{i} (made by `{v.label}`) changed after it was made: its "
                    "structure, configuration or leaves are not the ones it was made with."
                )

    def check_all(self) -> None:
        for i, v in enumerate(self._versions):
            if not tree_equal(v.record, v.snapshot):
                _fail(
                    f"Record #{i} (made by `{v.label}`) changed after it was made: it no longer "
                    "matches the snapshot taken then. A later transition wrote into a tensor "
                    "this record can reach, or changed its configuration."
                )
            now = _nbytes_of(v.record)
            if now != v.nbytes:
                _fail(
                    f"Record #{i} (made by `{v.label}`) reported {v.nbytes} bytes when it was "
                    f"made and {now} now; an immutable record keeps the same storages."
                )


def _require_record(obj: object, origin: str) -> None:
    leaves = tree_leaves(obj)
    if len(leaves) == 1 and leaves[0] is obj:
        msg = (
            f"{origin} returned a {type(obj).__name__}, which is not a pytree record, so its "
            "tensors cannot be snapshotted and compared. Decorate the class with "
            "`@sessionstate.record`, or call `sessionstate.register_record` on it."
        )
        raise TypeError(msg)


def _time_major_buffer() -> LatentBuffer:
    return LatentBuffer(dim=0)


def _view_last(obj: Any, last: int) -> tuple[Any, ...]:
    # `StateObject.view` takes no arguments; a ring-like object also accepts `last=`.
    return tuple(obj.view(last=last))


def _len(obj: Any) -> int | None:
    return len(obj) if hasattr(obj, "__len__") else None


class RingContractMachine(RuleBasedStateMachine):
    """The `LatentBuffer` contract, checked against a ``collections.deque(maxlen=k)``.

    Runs sequences of ``allocate(maxlen=k)`` (k drawn from `maxlen_strategy`), ``commit``
    (fresh chunks from `chunk_strategy`, runs of them, and re-commits of earlier chunks),
    ``view()``, ``view(last=n)``, ``reset()`` and ``evict()`` on the object `make_object`
    builds, and after every step checks that:

    - the object retains what the deque retains, oldest to newest (the very tensor objects,
      when `holds_by_reference`), and reports the bytes its retained chunks keep alive;
    - ``view(last=n)`` returns the newest ``min(n, len)`` chunks, and raises `ValueError` for
      ``n > maxlen`` and for negative ``n``; ``allocate`` refuses a non-positive ``maxlen``;
    - ``commit``, ``view`` and ``reset`` before ``allocate`` (or after ``evict``) raise
      `NotAllocatedError`, and an evicted object holds no bytes;
    - no record the machine produced has changed since: every tensor any of them holds still
      matches its snapshot clone (`tree_equal`), layout, storage and version counter, and every
      record has the structure and leaves it was made with; at the end of each run every record
      is compared whole with `tree_equal` against its snapshot, and its `nbytes_by_device`
      against the count taken when it was made.

    The object must be a pytree record (see `record`). Configure a subclass with
    `ring_contract_machine` rather than by hand.

    >>> from hypothesis import settings
    >>> from hypothesis.stateful import run_state_machine_as_test
    >>> quick = settings(max_examples=3, stateful_step_count=5, database=None, deadline=None)
    >>> run_state_machine_as_test(RingContractMachine, settings=quick)
    """

    make_object: ClassVar[Callable[[], StateObject]] = _time_major_buffer
    """Builds the unallocated object under test."""
    chunk_strategy: ClassVar[st.SearchStrategy[torch.Tensor]] = chunks()
    """Chunks to commit; every sequence of them must be accepted by the object."""
    maxlen_strategy: ClassVar[st.SearchStrategy[int | None]] = _DEFAULT_MAXLENS
    """Ring sizes to allocate with (None: unbounded)."""
    holds_by_reference: ClassVar[bool] = True
    """Whether ``view()`` returns the committed tensor objects themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.obj: StateObject = type(self).make_object()
        _require_record(self.obj, "`make_object()`")
        self.model: deque[torch.Tensor] | None = None
        self.committed: list[torch.Tensor] = []
        self.versions = _VersionLog()
        self.versions.keep(self.obj, "make_object()")

    def _advance(self, obj: StateObject, label: str) -> None:
        self.obj = obj
        self.versions.keep(obj, label)

    @property
    def _maxlen(self) -> int | None:
        return None if self.model is None else self.model.maxlen

    @initialize(allocated=st.sampled_from((True, True, True, False)), data=st.data())
    def begin(self, allocated: bool, data: st.DataObject) -> None:
        """Start allocated (most runs) or not (so use before allocate is checked early)."""
        if allocated:
            self.allocate(data)

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        """Allocate afresh with a drawn ring size; the model becomes an empty deque."""
        maxlen = data.draw(type(self).maxlen_strategy, label="maxlen")
        self._advance(self.obj.allocate(maxlen=maxlen), f"allocate(maxlen={maxlen})")
        self.model = deque(maxlen=maxlen)

    @rule(maxlen=st.integers(-2, 0))
    def allocate_invalid(self, maxlen: int) -> None:
        """A non-positive ``maxlen`` raises `ValueError`."""
        _expect_raises(
            ValueError, f"allocate(maxlen={maxlen})", lambda: self.obj.allocate(maxlen=maxlen)
        )

    def _commit(self, chunk: torch.Tensor, label: str) -> None:
        if self.model is None:
            event("ring: commit before allocate")
            _expect_raises(
                NotAllocatedError, "commit before allocate", lambda: self.obj.commit(chunk)
            )
            return
        if len(self.model) == self.model.maxlen:
            event("ring: commit dropped the oldest chunk")
        self._advance(self.obj.commit(chunk), label)
        self.model.append(chunk)
        self.committed.append(chunk)

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """Commit a fresh chunk (or check that an unallocated object refuses it)."""
        chunk = data.draw(type(self).chunk_strategy, label="chunk")
        self._commit(chunk, f"commit(<{tuple(chunk.shape)} chunk>)")

    @rule(data=st.data())
    def commit_many(self, data: st.DataObject) -> None:
        """Commit several fresh chunks in a row (enough to wrap a small ring)."""
        model = self.model
        most = (model.maxlen if model is not None and model.maxlen is not None else 2) + 2
        payloads = data.draw(
            st.lists(type(self).chunk_strategy, min_size=1, max_size=most), label="chunks"
        )
        for chunk in payloads:
            self._commit(chunk, f"commit(<{tuple(chunk.shape)} chunk>)")

    @precondition(lambda self: bool(self.committed))
    @rule(data=st.data())
    def recommit(self, data: st.DataObject) -> None:
        """Commit a chunk committed before, so versions alias each other's tensors."""
        i = data.draw(st.integers(0, len(self.committed) - 1), label="earlier chunk")
        self._commit(self.committed[i], f"commit(<earlier chunk {i}>)")

    @rule()
    def reset(self) -> None:
        """Reset: empty, same configuration (the deque is cleared, its maxlen kept)."""
        if self.model is None:
            _expect_raises(NotAllocatedError, "reset before allocate", self.obj.reset)
            return
        self._advance(self.obj.reset(), "reset()")
        self.model.clear()

    @rule()
    def evict(self) -> None:
        """Evict: storage released; the object must be allocated again before use."""
        self._advance(self.obj.evict(), "evict()")
        self.model = None
        if self.obj.is_allocated:
            _fail("An evicted object reports `is_allocated`; eviction makes it non-resident.")
        if self.obj.nbytes_by_device():
            _fail(f"An evicted object still holds {self.obj.nbytes_by_device()} bytes.")

    @rule(data=st.data())
    def view_last(self, data: st.DataObject) -> None:
        """``view(last=n)`` for n from -1 to past the ring size (or past the length)."""
        model = self.model
        if model is None:
            _expect_raises(NotAllocatedError, "view before allocate", self.obj.view)
            return
        bound = model.maxlen if model.maxlen is not None else len(model)
        n = data.draw(st.integers(-1, bound + 2), label="last")
        if n < 0 or (model.maxlen is not None and n > model.maxlen):
            event("ring: view(last=n) out of range")
            _expect_raises(
                ValueError,
                f"view(last={n}) on a ring of {model.maxlen}",
                lambda: _view_last(self.obj, n),
            )
            return
        got = _view_last(self.obj, n)
        expected = tuple(model)[len(model) - min(n, len(model)) :]
        self._check_chunks(got, expected, f"view(last={n})")

    def _check_chunks(
        self, got: tuple[Any, ...], expected: tuple[torch.Tensor, ...], action: str
    ) -> None:
        if not tree_equal(got, expected):
            _fail(
                f"`{action}` returned {len(got)} chunks that differ from the {len(expected)} the "
                f"model retains (ring size {self._maxlen})."
            )
        if type(self).holds_by_reference and any(
            g is not e for g, e in zip(got, expected, strict=True)
        ):
            _fail(f"`{action}` returned copies; the object should hold chunks by reference.")

    @invariant()
    def agrees_with_model(self) -> None:
        """The current object retains what the deque retains, and the bytes they keep alive."""
        model = self.model
        if model is None:
            return
        if not self.obj.is_allocated:
            _fail("An allocated object reports `is_allocated == False`.")
        expected = tuple(model)
        self._check_chunks(tuple(self.obj.view()), expected, "view()")
        length = _len(self.obj)
        if length is not None and length != len(model):
            _fail(f"`len()` is {length}, the model retains {len(model)}.")
        # An object holding references keeps exactly the committed storages alive; one that
        # copies keeps whatever its views reach.
        retained = expected if type(self).holds_by_reference else tuple(self.obj.view())
        if self.obj.nbytes_by_device() != nbytes_by_device(retained):
            _fail(
                f"`nbytes_by_device()` is {self.obj.nbytes_by_device()}, but its retained chunks "
                f"keep {nbytes_by_device(retained)} alive."
            )

    @invariant()
    def earlier_versions_unchanged(self) -> None:
        """No record produced so far has changed (each tensor once, each record's leaves)."""
        self.versions.check()

    def teardown(self) -> None:
        """At the end of a run, compare every record as a whole with its snapshot and bytes."""
        self.versions.check_all()


def _as_strategy(value: _T | st.SearchStrategy[_T]) -> st.SearchStrategy[_T]:
    return value if isinstance(value, st.SearchStrategy) else st.just(value)


def ring_contract_machine(
    factory: Callable[[], StateObject] = _time_major_buffer,
    *,
    chunk_strategy: st.SearchStrategy[torch.Tensor] | None = None,
    maxlen: int | st.SearchStrategy[int | None] | None = _DEFAULT_MAXLENS,
    holds_by_reference: bool = True,
    name: str | None = None,
) -> type[RingContractMachine]:
    """A `RingContractMachine` for the object ``factory`` builds.

    Args:
        factory: Builds the unallocated object under test (a `StateObject` record with
            ``allocate(maxlen=...)`` and ``view(last=...)``).
        chunk_strategy: Payloads to commit, all acceptable to the object (default `chunks()`,
            matching ``LatentBuffer(dim=0)``).
        maxlen: Ring size to allocate with: an int forces a ring, None forces unbounded, a
            strategy draws one at each ``allocate`` (default: unbounded or 1..4).
        holds_by_reference: Whether ``view()`` returns the committed tensors themselves.
        name: The class name (shows in test reports).

    Raises:
        ValueError: if ``maxlen`` is an int that is not positive.

    >>> from sessionstate import LatentBuffer
    >>> Machine = ring_contract_machine(lambda: LatentBuffer(dim=1), maxlen=3,
    ...                                 chunk_strategy=chunks(dim=1, feature_shape=(2, 2)))
    >>> Machine.__name__
    'RingContractMachine'
    >>> TestRing3 = Machine.TestCase  # assign in a test module to run it under pytest
    """
    maxlens = _as_maxlen_strategy(maxlen)

    class Configured(RingContractMachine):
        pass

    # Set after the class statement: a class body cannot see the function's arguments
    # under the same names.
    Configured.make_object = factory
    if chunk_strategy is not None:
        Configured.chunk_strategy = chunk_strategy
    Configured.maxlen_strategy = maxlens
    Configured.holds_by_reference = holds_by_reference
    Configured.__name__ = Configured.__qualname__ = name or RingContractMachine.__name__
    return Configured


def _default_advance(state: SessionState, step: int) -> SessionState:
    """One model step: note the step, and re-commit each buffer's newest chunk."""
    if not type(state).__session_attrs__:
        state = state.with_attrs(machine_step=step)
    for name, obj in state.objects.items():
        if isinstance(obj, LatentBuffer) and obj.is_allocated and len(obj):
            state = state.with_object(name, obj.commit(obj.view(last=1)[0]))
    return state


class ManagerContractMachine(RuleBasedStateMachine):
    """The `SessionStateManager` contract, checked against an ``OrderedDict`` LRU model.

    Creates a manager with a small cap (drawn from `max_sessions_strategy`) and runs ``put``,
    ``get``, ``get_or_create``, ``require``, ``peek``, ``drop``, ``in``, ``len``, ``clear``, a model
    step (get, advance the record, put it back) and a fork (a held record, advanced, put under
    another id, so sessions share storages) over a few session ids. After every step it
    checks that:

    - ``session_ids()`` is the model's order, least recently used first (so ``in``, ``len``
      and ``stats`` did not touch it), and ``len`` agrees;
    - the hits, misses and evictions counters match the model's, and ``stats()``'s byte keys
      equal `recount_nbytes_by_device` of the records the model holds (each storage once
      across sessions, counted without the library's accounting);
    - at the cap, a new session evicts the least recently used one (``on_full="evict"``), or
      raises `SessionAdmissionError` and changes nothing (``on_full="refuse"``); a refused
      ``get_or_create`` still counts its lookup as a miss;
    - every record the machine has held, evicted ones included, is unchanged (checked as in
      `RingContractMachine`);
    - ``peek`` returns the stored record and touches neither the order nor the counters.

    Configure a subclass with `manager_contract_machine`.

    >>> from hypothesis import settings
    >>> from hypothesis.stateful import run_state_machine_as_test
    >>> quick = settings(max_examples=3, stateful_step_count=5, database=None, deadline=None)
    >>> run_state_machine_as_test(ManagerContractMachine, settings=quick)
    """

    max_sessions_strategy: ClassVar[st.SearchStrategy[int]] = _DEFAULT_CAPS
    """Caps to create the manager with."""
    on_full: ClassVar[OnFull] = "evict"
    """What a new session does at the cap."""
    session_id_strategy: ClassVar[st.SearchStrategy[str]] = _DEFAULT_SESSION_IDS
    """Session ids; a few more than the cap, so sessions are evicted and come back."""
    state_strategy: ClassVar[st.SearchStrategy[SessionState]] = session_states()
    """Records to store."""
    manager_factory: ClassVar[Callable[..., SessionStateManager]] = SessionStateManager
    """Builds the manager under test: ``manager_factory(max_sessions, on_full=...)``."""
    advance: ClassVar[Callable[[SessionState, int], SessionState]] = _default_advance
    """One model step on a stored record: ``advance(state, step) -> state``."""

    def __init__(self) -> None:
        super().__init__()
        self._manager: SessionStateManager | None = None
        self.model: OrderedDict[str, SessionState] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.steps = 0
        self.held = _VersionLog()

    @property
    def manager(self) -> SessionStateManager:
        """The manager under test (created by the `create` rule)."""
        if self._manager is None:
            msg = "The manager is created by the `create` initialize rule; it has not run yet."
            raise RuntimeError(msg)
        return self._manager

    @initialize(data=st.data())
    def create(self, data: st.DataObject) -> None:
        """Create the manager with a drawn cap."""
        cap = data.draw(type(self).max_sessions_strategy, label="max_sessions")
        self._manager = type(self).manager_factory(cap, on_full=type(self).on_full)

    @property
    def _full(self) -> bool:
        return len(self.model) >= self.manager.max_sessions

    def _draw_id(self, data: st.DataObject) -> str:
        return data.draw(type(self).session_id_strategy, label="session_id")

    def _draw_state(self, data: st.DataObject) -> SessionState:
        state = data.draw(type(self).state_strategy, label="state")
        self.held.keep(state, "a drawn state")
        return state

    def _touch(self, sid: str) -> None:
        self.model.move_to_end(sid)

    def _admit(self, sid: str) -> None:
        """Model admission of a new session; evicts the LRU one when full (evict mode)."""
        if self._full:
            event("manager: evicted the least recently used session")
            evicted_id, evicted = self.model.popitem(last=False)
            self.evictions += 1
            self.held.keep(evicted, f"session {evicted_id!r}, evicted by {sid!r}")

    def _refused(self, sid: str) -> bool:
        return sid not in self.model and self._full and type(self).on_full == "refuse"

    @rule(data=st.data())
    def put(self, data: st.DataObject) -> None:
        """Store a drawn record under a drawn id."""
        sid, state = self._draw_id(data), self._draw_state(data)
        self._put(sid, state)

    def _put(self, sid: str, state: SessionState) -> None:
        if self._refused(sid):
            event("manager: refused a new session at the cap")
            _expect_raises(
                SessionAdmissionError,
                f"put({sid!r}) at the cap",
                lambda: self.manager.put(sid, state),
            )
            return
        self.manager.put(sid, state)
        if sid in self.model:
            self._touch(sid)
        else:
            self._admit(sid)
        self.model[sid] = state

    def _check_lookup(self, sid: str, got: SessionState | None, action: str) -> None:
        expected = self.model.get(sid)
        if got is not expected:
            _fail(
                f"`{action}` returned {'a record' if got is not None else 'None'}; the model "
                f"{'holds a different record' if expected is not None else 'holds no session'}"
                f" for {sid!r}."
            )

    @rule(data=st.data())
    def get(self, data: st.DataObject) -> None:
        """Look a session up: a hit touches it, a miss returns None."""
        sid = self._draw_id(data)
        got = self.manager.get(sid)
        self._check_lookup(sid, got, f"get({sid!r})")
        if sid in self.model:
            self.hits += 1
            self._touch(sid)
        else:
            self.misses += 1

    @rule(data=st.data())
    def require(self, data: st.DataObject) -> None:
        """Look a continuation up: a miss raises `SessionStateLostError`."""
        sid = self._draw_id(data)
        if sid in self.model:
            self._check_lookup(sid, self.manager.require(sid), f"require({sid!r})")
            self.hits += 1
            self._touch(sid)
        else:
            _expect_raises(
                SessionStateLostError,
                f"require({sid!r}) of an absent session",
                lambda: self.manager.require(sid),
            )
            self.misses += 1

    @rule(data=st.data())
    def get_or_create(self, data: st.DataObject) -> None:
        """Get a session, or create it from a factory (called once, only on a miss)."""
        sid, state = self._draw_id(data), self._draw_state(data)
        calls: list[None] = []

        def factory() -> SessionState:
            calls.append(None)
            return state

        action = f"get_or_create({sid!r}, factory)"
        if sid in self.model:
            self._check_lookup(sid, self.manager.get_or_create(sid, factory), action)
            self.hits += 1
            self._touch(sid)
            if calls:
                _fail(f"`{action}` called the factory for a session it holds.")
            return
        self.misses += 1
        if self._refused(sid):
            event("manager: refused a new session at the cap")
            _expect_raises(
                SessionAdmissionError,
                f"{action} at the cap",
                lambda: self.manager.get_or_create(sid, factory),
            )
            return
        got = self.manager.get_or_create(sid, factory)
        self._admit(sid)
        self.model[sid] = state
        if got is not state or len(calls) != 1:
            _fail(f"`{action}` for a new session must call the factory once and store its record.")

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A model step: get a held session, advance its record, put the new one back."""
        sid = data.draw(st.sampled_from(list(self.model)), label="held session_id")
        state = self.manager.get(sid)
        self._check_lookup(sid, state, f"get({sid!r})")
        self.hits += 1
        self._touch(sid)
        if state is None:
            _fail(f"`get({sid!r})` lost a session the model holds.")
        self.steps += 1
        new = type(self).advance(state, self.steps)
        self.held.keep(new, f"advance of session {sid!r}")
        self.manager.put(sid, new)
        self._touch(sid)
        self.model[sid] = new

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """Store a held record, advanced, under another id: two sessions share storages."""
        source = data.draw(st.sampled_from(list(self.model)), label="source session_id")
        sid = self._draw_id(data)
        self.steps += 1
        state = type(self).advance(self.model[source], self.steps)
        self.held.keep(state, f"fork of session {source!r}")
        self._put(sid, state)

    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """End a session; `drop` says whether it was held."""
        sid = self._draw_id(data)
        was_held = self.manager.drop(sid)
        if was_held != (sid in self.model):
            _fail(f"`drop({sid!r})` returned {was_held}; the model holds it: {sid in self.model}.")
        held = self.model.pop(sid, None)
        if held is not None:
            self.held.keep(held, f"session {sid!r}, dropped")

    @rule(data=st.data())
    def peek(self, data: st.DataObject) -> None:
        """Inspect a session: no LRU touch, no hit or miss (checked after the step)."""
        sid = self._draw_id(data)
        self._check_lookup(sid, self.manager.peek(sid), f"peek({sid!r})")

    @rule(data=st.data())
    def contains(self, data: st.DataObject) -> None:
        """``in`` agrees with the model (and, checked after the step, touches nothing)."""
        sid = self._draw_id(data)
        if (sid in self.manager) != (sid in self.model):
            _fail(f"`{sid!r} in manager` is {sid in self.manager}; the model: {sid in self.model}.")

    @rule()
    def length(self) -> None:
        """``len`` agrees with the model."""
        if len(self.manager) != len(self.model):
            _fail(f"`len(manager)` is {len(self.manager)}; the model holds {len(self.model)}.")

    @rule()
    def clear(self) -> None:
        """Drop every session; the counters are kept."""
        for sid, state in self.model.items():
            self.held.keep(state, f"session {sid!r}, cleared")
        self.manager.clear()
        self.model.clear()

    @invariant()
    def agrees_with_model(self) -> None:
        """Order, size, counters and bytes agree with the model."""
        if self._manager is None:
            return
        ids = self.manager.session_ids()
        if ids != list(self.model):
            _fail(
                f"`session_ids()` is {ids}; the LRU model (least recently used first) is "
                f"{list(self.model)}."
            )
        recount = recount_nbytes_by_device(list(self.model.values()))
        expected = {
            "sessions": len(self.model),
            "max_sessions": self.manager.max_sessions,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            **_stats_bytes(recount),
        }
        stats = self.manager.stats()
        if stats != expected:
            _fail(f"`stats()` is {stats}; the model expects {expected}.")

    @invariant()
    def held_records_unchanged(self) -> None:
        """Every record the machine has held, evicted ones included, is unchanged."""
        self.held.check()

    def teardown(self) -> None:
        """At the end of a run, compare every held record as a whole with its snapshot."""
        self.held.check_all()


def manager_contract_machine(
    *,
    max_sessions: int | st.SearchStrategy[int] = _DEFAULT_CAPS,
    on_full: OnFull = "evict",
    states: st.SearchStrategy[SessionState] | None = None,
    session_ids: st.SearchStrategy[str] = _DEFAULT_SESSION_IDS,
    manager_factory: Callable[..., SessionStateManager] = SessionStateManager,
    advance: Callable[[SessionState, int], SessionState] = _default_advance,
    name: str | None = None,
) -> type[ManagerContractMachine]:
    """A `ManagerContractMachine` with the given cap, full policy, records and manager.

    Args:
        max_sessions: The cap: an int forces it, a strategy draws one per run (default 1..4).
        on_full: ``"evict"`` or ``"refuse"``, passed to the manager.
        states: Records to store (default `session_states()`); a model passes a strategy
            for its own session class.
        session_ids: Session ids to use; keep a few more than the cap.
        manager_factory: Builds the manager: ``manager_factory(max_sessions, on_full=...)``
            (a `SessionStateManager` subclass or a wrapper with the same interface).
        advance: One model step, ``advance(state, step) -> state``, applied to a stored
            record before it is put back (default: set attr ``machine_step`` on undeclared
            sessions, and re-commit each buffer's newest chunk).
        name: The class name (shows in test reports).

    Raises:
        ValueError: for a non-positive int cap or an unknown ``on_full``.

    >>> Machine = manager_contract_machine(max_sessions=2, on_full="refuse")
    >>> Machine.on_full
    'refuse'
    >>> TestRefusingManager = Machine.TestCase  # assign in a test module to run it
    """
    if not isinstance(max_sessions, st.SearchStrategy):
        _check_positive("max_sessions", max_sessions)
    if on_full not in ("evict", "refuse"):
        msg = f"`on_full` must be 'evict' or 'refuse', got {describe(on_full)}."
        raise ValueError(msg)

    class Configured(ManagerContractMachine):
        pass

    # Set after the class statement: a class body cannot see the function's arguments
    # under the same names.
    Configured.max_sessions_strategy = _as_strategy(max_sessions)
    Configured.on_full = on_full
    if states is not None:
        Configured.state_strategy = states
    Configured.session_id_strategy = session_ids
    Configured.manager_factory = manager_factory
    Configured.advance = advance
    Configured.__name__ = Configured.__qualname__ = name or ManagerContractMachine.__name__
    return Configured
