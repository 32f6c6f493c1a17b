"""The library's extension points, declared once as `typing.Protocol`s.

Each hook is a method or attribute a class defines to take part in one of the library's
mechanisms; the modules that call a hook look it up by the name declared here, and the
Extending page shows each with a runnable example.

- `ReportsStorages`: a leaf that is not a tensor reports the memory it keeps alive to the byte
  accounting, the ledger and the budget (an engine's handle to blocks it owns: `KVHandle`).
- `SnapshotLeaf`: a leaf class that snapshots save by value (`register_snapshot_leaf`).
- `OffloadsStorages`: an engine-owned leaf class whose memory parking may move: it copies
  what its leaves hold out of its engine, and back into the same engine (`KVHandle`).
- `DerivesFromBase`: a record that says how its leaves derive from the record a transition
  built it from, so the ledger counts only the leaves it added (`LatentBuffer`, `KVCache`).
- `NamesItsTransition`: a record that names, in the error for an assignment to one of its
  fields, the transition that makes the change instead.

Two more extension points are classes rather than hooks, and are documented with them: a
`StateObject` subclass (with its ``parkable`` class attribute: whether the budget may park
it), and `sessionstate.distributed.SessionPipeline`, what a Ray worker needs of a pipeline.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Self, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

__all__ = [
    "ASSIGNMENT_FIX_HOOK",
    "DERIVATION_HOOK",
    "OFFLOAD_HOOKS",
    "SNAPSHOT_HOOKS",
    "STANDALONE_HOOK",
    "STORAGE_ENTRIES_HOOK",
    "DeferredRead",
    "DerivesFromBase",
    "EnginePool",
    "NamesItsTransition",
    "OffloadsStorages",
    "ReportsStorages",
    "SnapshotLeaf",
    "StorageEntry",
]

StorageEntry = tuple[str, Hashable, int, int, Any]
"""``(device, identity, address, nbytes, keepalive)``: one storage a leaf keeps alive.

``identity`` is the same for every leaf that reaches the storage (so it is counted once),
``address`` its first byte (so views of one allocation that partly overlap are told apart),
``keepalive`` an object that keeps the memory alive while the entry is held.
"""

STORAGE_ENTRIES_HOOK = "__sessionstate_storage_entries__"
"""The name the byte accounting looks up on a leaf's class (see `ReportsStorages`)."""

ASSIGNMENT_FIX_HOOK = "__assignment_fix__"
"""The name a record's refused assignment looks up on the record (see `NamesItsTransition`)."""

SNAPSHOT_HOOKS = ("__sessionstate_snapshot__", "__sessionstate_restore__")
"""The class methods a snapshot leaf class defines (see `SnapshotLeaf`)."""

OFFLOAD_HOOKS = ("__sessionstate_offload__", "__sessionstate_reload__")
"""The class methods an engine leaf class defines so that parking moves it (`OffloadsStorages`)."""

DERIVATION_HOOK = "__sessionstate_derivation__"
"""The method the ledger looks up on a record's class (see `DerivesFromBase`)."""

STANDALONE_HOOK = "__sessionstate_standalone__"
"""The optional class method that reads an offload payload without its engine (see
`OffloadsStorages`)."""


@runtime_checkable
class ReportsStorages(Protocol):
    """A leaf that reports the storages it keeps alive, for the byte accounting.

    Its bytes are then counted like a tensor's: once per storage across a session and across
    the manager, per device, and held to the byte budget. Parking leaves such a leaf where it
    is (its owner moves its memory, not the library), unless its class also implements
    `OffloadsStorages`.

    >>> import torch
    >>> class Handle:
    ...     def __init__(self, block):
    ...         self.block = block
    ...     def __sessionstate_storage_entries__(self):
    ...         s = self.block.untyped_storage()
    ...         return [("cpu", s._cdata, s.data_ptr(), s.nbytes(), s)]
    >>> isinstance(Handle(torch.zeros(4)), ReportsStorages)
    True
    """

    def __sessionstate_storage_entries__(self) -> list[StorageEntry]: ...


@runtime_checkable
class SnapshotLeaf(Protocol):
    """A leaf class that snapshots save by value (register it with `register_snapshot_leaf`).

    ``__sessionstate_snapshot__(leaves)`` gets every ``(key path, leaf)`` of the class in one
    snapshot, in tree order, and returns one payload of tensors, JSON values, tuples, lists
    and dicts describing them all; ``__sessionstate_restore__(payload)`` rebuilds the leaves,
    in the same order, raising `ValueError` or `TypeError` for a payload it refuses.
    """

    @classmethod
    def __sessionstate_snapshot__(cls, leaves: Sequence[tuple[str, Self]], /) -> Any: ...

    @classmethod
    def __sessionstate_restore__(cls, payload: Any, /) -> Sequence[Self]: ...


@runtime_checkable
class OffloadsStorages(Protocol):
    """An engine-owned leaf class (`ReportsStorages`) whose memory parking moves and restores.

    ``__sessionstate_offload__(leaves)`` gets every ``(key path, leaf)`` of the class in one
    parked tree, in tree order, and returns one payload (tensors, JSON values, tuples, lists,
    dicts, and references to the engine) holding a copy of what the leaves hold, each storage
    they share once: parking moves its tensors to the tier, and the engine frees the leaves'
    memory once nothing holds them. ``__sessionstate_reload__(payload)`` takes fresh memory
    from the same engine, copies the bytes back and returns leaves that read bit-identically,
    in the same order and sharing what they shared; all or nothing: when the engine lacks
    room it raises (`KVPoolExhaustedError` for a `KVPool`) and takes nothing.

    The payload's tensors stay on the engine's device until the tier moves them, so the parked
    bytes report the device that unparking fills again. A payload may hold a `DeferredRead`
    in place of a tensor: the host tier then has the engine copy straight into the tier's
    host memory (no intermediate tensor), and ``__sessionstate_reload__`` gets that host
    memory as a contiguous CPU tensor to copy from (other tiers read it into a tensor first).

    Optionally, ``__sessionstate_standalone__(payload)`` returns leaves that read the same
    without the engine (holding their own copies, e.g. a `KVPool` of just the saved blocks on
    the payload's device): reading a parked record (a manager's `snapshot`, a migration's
    export) then takes none of the engine's memory. Without it such a read reloads the leaves
    into their engine.
    """

    @classmethod
    def __sessionstate_offload__(cls, leaves: Sequence[tuple[str, Self]], /) -> Any: ...

    @classmethod
    def __sessionstate_reload__(cls, payload: Any, /) -> Sequence[Self]: ...


@runtime_checkable
class EnginePool(Protocol):
    """An engine's pool of fixed-size blocks (a `KVPool`, or a real engine's own).

    A record reaches its blocks through engine leaves (`ReportsStorages`); the manager makes a
    pool's blocks free by parking the sessions holding entries the pool owns (`owns_entry`).
    Given the pool (``SessionStateManager(pools=...)``), a manager's `step` first makes the
    room a step can take, ``blocks_for_step(held)`` for a session holding ``held`` of the
    pool's blocks (0: the engine makes no such claim), and a prefetch starts only with room
    for the restored session (``session_blocks``, the most one session holds; None: no
    claim) beside a step's. A `KVPoolExhaustedError` names the pool
    (its ``pool``) and the blocks it lacked (its ``needed``), so a manager's `get` of a parked
    session makes room in any pool that says so. ``free_blocks`` and ``blocks_for_step`` are
    called under the manager's lock and must not call the manager.

    >>> from sessionstate import KVPool
    >>> isinstance(KVPool(2, block_tokens=1, token_shape=()), EnginePool)
    True
    """

    name: str
    block_nbytes: int

    @property
    def num_blocks(self) -> int: ...

    @property
    def free_blocks(self) -> int: ...

    @property
    def session_blocks(self) -> int | None: ...

    def owns_entry(self, entry: StorageEntry, /) -> bool: ...

    def blocks_for_step(self, held: int, /) -> int: ...


@runtime_checkable
class NamesItsTransition(Protocol):
    """A record that says which transition to call instead of assigning to ``name``.

    The record's frozen ``__setattr__`` raises `ImmutableRecordError`; with this hook its
    message ends with the returned fix, e.g. ``"state = state.with_attrs(step=...)"``.
    """

    def __assignment_fix__(self, name: str, /) -> str: ...


class Derivation(NamedTuple):
    """How a record's leaves derive from its base's: a `DerivesFromBase` claim."""

    base: weakref.ref[Any]
    """A weak reference to the record the transition started from."""

    dropped: int
    """How many of the base's leading leaves are gone."""

    leaves: Sequence[Any]
    """The record's whole leaf sequence, as `tree_leaves` lists it."""


@runtime_checkable
class DerivesFromBase(Protocol):
    """A record that says how a transition built its leaves from those of its input.

    ``__sessionstate_derivation__()`` returns None (no claim: the ledger walks the record), or
    a `Derivation`: the record's leaves are its base's without the first ``dropped``, then
    new ones. A manager's ledger that holds the base's storages then counts only the new
    leaves instead of walking the record, so a commit to a long buffer costs the chunks it
    added. The contract:

    - The claim is exact: ``leaves`` is the record's whole leaf sequence in `tree_leaves`
      order, and its first ``len(base leaves) - dropped`` leaves are the base's last ones,
      the same objects. The ledger trusts it and does not check.
    - ``base`` is a weak reference, so a record never keeps its earlier versions alive.
    - The claim is the transition's: a record built any other way (a constructor,
      ``attrs.evolve``) returns None.

    `sessionstate._accounting.note_derived` records a claim for a transition to return here.

    >>> import torch
    >>> from sessionstate import LatentBuffer
    >>> buf = LatentBuffer(dim=0).allocate().commit(torch.zeros(1))
    >>> claim = buf.commit(torch.ones(1)).__sessionstate_derivation__()
    >>> isinstance(buf, DerivesFromBase), claim.base() is buf, claim.dropped, len(claim.leaves)
    (True, True, 0, 2)
    """

    def __sessionstate_derivation__(self) -> Derivation | None: ...


class DeferredRead:
    """A tensor an engine's offload payload has not copied yet: the tier says where it goes.

    ``nbytes``, ``dtype``, ``shape`` and ``device`` describe the contiguous tensor it stands
    for; ``copy_into(out)`` writes its bytes into ``out`` (a ``uint8`` CPU tensor of exactly
    ``nbytes``, page-locked when ``device`` is a CUDA device; the copy may be asynchronous:
    the tier synchronises ``device`` before it relies on the bytes). `read` makes the tensor
    on ``device``, for a tier without host memory of its own (disk) and for callers.

    >>> import torch
    >>> src = torch.arange(4.0)
    >>> d = DeferredRead(torch.float32, (4,), src.device, lambda out: out.copy_(src.view(torch.uint8)))
    >>> d.nbytes, d.read().tolist()
    (16, [0.0, 1.0, 2.0, 3.0])
    """  # noqa: E501 - a doctest line

    __slots__ = ("copy_into", "device", "dtype", "nbytes", "shape")

    def __init__(
        self,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        device: torch.device,
        copy_into: Callable[[torch.Tensor], object],
    ) -> None:
        import math

        self.dtype = dtype
        self.shape = tuple(shape)
        self.device = device
        self.copy_into = copy_into
        self.nbytes = math.prod(self.shape) * dtype.itemsize

    def read(self) -> torch.Tensor:
        """The tensor, on ``device`` (a fresh copy)."""
        import torch

        pinned = self.device.type == "cuda"
        out = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.copy_into(out)
        if pinned:
            torch.cuda.synchronize(self.device)
        return out.view(self.dtype).view(self.shape).to(self.device)
