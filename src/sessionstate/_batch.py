"""Batches: many records of one structure stepped in one forward, the JAX way.

`stack` gathers N records into a `Batch`: each tensor leaf stacked along a new leading
dimension, except a leaf that is the same tensor in every record (what forks share), or the
same view of one storage in every record, which stays one tensor, unbatched. `vmap` runs a
pure step ``step(state, x) -> (state, out)`` over the batch with `torch.func.vmap`: inside,
each example sees an ordinary record (its leaves at their per-example shapes, so the records'
own checks hold), and the step is written for one session.
`unstack` gives the N records back; what stayed unbatched is shared again.

A batch keeps its leaves flat rather than as one stacked record: a record checks its leaves'
shapes (a buffer's chunks must agree), and a record mixing stacked and shared leaves would not
pass. Non-tensor leaves (counters, flags) must be equal across the records.

Engine handles (`KVHandle`, in a `KVCache`) are gathered: `stack` reads every session's blocks
in one gather per leaf (`read_many`) and puts a `GatheredKV` (the tokens as a plain tensor) in
the handle's place, so a step reads and appends KV as tensors, purely, under `vmap`; `unstack`
appends each session's new tokens to its own handle, all sessions or none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import attrs
import torch

from sessionstate._kv._cache import GatheredKV
from sessionstate._kv._pool import KVHandle, KVPool, read_many
from sessionstate._tree import PyTreeSpec, tree_flatten, tree_flatten_with_keys, tree_unflatten

__all__ = ["Batch", "stack", "unstack", "vmap"]

R = TypeVar("R")


@attrs.frozen(eq=False)
class Batch(Generic[R]):
    """N records of one structure, stacked: build it with `stack`, step it with `vmap`.

    Args:
        leaves: The records' leaves in tree order: a tensor stacked along a new leading
            dimension of ``size`` where ``dims`` says 0, the one shared tensor (or equal
            non-tensor value) where it says None.
        dims: Per leaf, 0 (batched) or None (one value for every record).
        spec: The records' tree structure (static fields included).
        size: How many records.
        paths: Each leaf's key path, for messages.
        groups: See the attribute.
        handles: See the attribute.
    """

    leaves: tuple[Any, ...]
    dims: tuple[int | None, ...]
    spec: PyTreeSpec
    size: int
    paths: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...] = ()
    """Batched leaves that are views of one storage in every record, as their positions:
    `unstack` gives each record one copy of that storage and rebuilds the views on it."""
    handles: Mapping[str, tuple[KVHandle, ...]] = attrs.field(factory=dict, kw_only=True)
    """Per path of a `GatheredKV` leaf, the records' handles its tokens were gathered from:
    `unstack` appends each record's new tokens to its own."""

    @property
    def shared(self) -> int:
        """How many tensor leaves (gathered KV included) are one tensor for the whole batch.

        >>> import torch
        >>> from sessionstate import LatentBuffer, SessionState
        >>> history = LatentBuffer(dim=0).allocate().commit(torch.zeros(3))
        >>> a = SessionState(objects={"h": history}, attrs={"x": torch.ones(2)})
        >>> b = a.with_attrs(x=torch.zeros(2))
        >>> stack([a, b]).shared
        1
        """
        return sum(
            d is None and isinstance(x, (torch.Tensor, GatheredKV))
            for d, x in zip(self.dims, self.leaves, strict=True)
        )


def stack(records: Sequence[R], /) -> Batch[R]:
    """Stack records of one structure into a `Batch` (nothing shared is copied).

    Records must have the same tree structure (classes, object names, static fields such as
    a ring's ``maxlen``) and, leaf by leaf, tensors of one shape, dtype and device, or equal
    non-tensor values. A tensor leaf that is the same tensor in every record (a fork's
    history), or in every record a view of one storage with the same offset, shape and
    stride, stays one tensor, unbatched; the others are stacked (a copy). Leaves that are
    views of one storage in each record (a slice beside its tensor, an alias), laid out
    alike in every record, are stacked as their storage, so `unstack` gives each record its
    views of one copy again: the records' sharing survives the batch.

    A `KVHandle` leaf (a `KVCache`'s) is gathered: the records' handles, of one pool and one
    token count, are read in one gather (`read_many`) into a `GatheredKV` holding the tokens
    stacked (a copy, counted as tensor bytes); a handle every record holds (forks not yet
    stepped) is read once and stays unbatched. The batch remembers the handles for `unstack`.

    Raises:
        ValueError: for no records, or records that differ in structure, in a tensor leaf's
            shape, dtype or device, in a non-tensor leaf, or in the pool or token count of
            a `KVHandle`, naming the first difference and its key path.
        StaleKVHandleError: for a handle made by a step that was rolled back.

    >>> import torch
    >>> from sessionstate import LatentBuffer, SessionState
    >>> ring = LatentBuffer(name="r", dim=0).allocate(maxlen=2)
    >>> records = [SessionState(objects={"r": ring.commit(torch.full((1, 2), float(i)))})
    ...            for i in range(3)]
    >>> batch = stack(records)
    >>> batch.size, [tuple(x.shape) for x in batch.leaves]
    (3, [(3, 1, 2)])
    """
    if not records:
        msg = "`stack` needs at least one record; pass the records of the sessions to batch."
        raise ValueError(msg)
    keys, first, spec = tree_flatten_with_keys(records[0])
    columns: list[list[Any]] = [[leaf] for leaf in first]
    for i, record in enumerate(records[1:], start=1):
        leaves, other = tree_flatten(record)
        if other != spec:
            msg = (
                f"Cannot stack record {i} with record 0: their structures differ "
                f"({_first_difference(records[0], record)}). A batch holds records of one "
                "structure: group sessions by it (`forward_many` does) or reset the difference."
            )
            raise ValueError(msg)
        for column, leaf in zip(columns, leaves, strict=True):
            column.append(leaf)
    out: list[Any] = []
    dims: list[int | None] = []
    handles: dict[str, tuple[KVHandle, ...]] = {}
    groups = _storage_groups(columns)
    grouped = {j for g in groups for j in g}
    for j, (path, column) in enumerate(zip(keys, columns, strict=True)):
        if all(isinstance(leaf, KVHandle) for leaf in column):
            value, dim = _gather_kv(path, column)
            handles[path] = tuple(column)
        else:
            value, dim = _stack_leaf(path, column, stacked=j not in grouped)
        out.append(value)
        dims.append(dim)
    for members in groups:
        _stack_storage(columns, members, out)
    return Batch(
        tuple(out),
        tuple(dims),
        spec,
        len(records),
        tuple(keys),
        tuple(map(tuple, groups)),
        handles=handles,
    )


def unstack(batch: Batch[R], /, *, copy: bool = True) -> list[R]:
    """The records of a batch, one per example; what was shared is shared again.

    With ``copy`` (the default) each record's batched leaves are its own tensors (a copy of
    its slice), so a record keeps alive only its own bytes; ``copy=False`` gives views into
    the stacked tensors (each record then reaches the whole stacked storage).

    Gathered KV (`GatheredKV`) goes back into the records' handles: a record whose tokens are
    the gathered ones gets its handle back; one whose step appended gets a new handle, its
    handle with the new tokens appended in the pool (trimmed as a windowed append trims).
    The appends are all made or none (inside the pools' transactions): a pool that cannot
    hold them all raises `KVPoolExhaustedError` with every block given back.

    Raises:
        ValueError: for gathered KV whose tokens no longer begin with those gathered (KV
            is append-only) or that the step moved to another path, naming the path.
        KVPoolExhaustedError: if a pool has too few free blocks for the new tokens.

    >>> import torch
    >>> from sessionstate import SessionState, tree_equal
    >>> records = [SessionState(attrs={"x": torch.full((2,), float(i))}) for i in range(3)]
    >>> all(tree_equal(a, b) for a, b in zip(unstack(stack(records)), records))
    True
    """
    out = []
    grouped = {j: g for g in batch.groups for j in g}
    committed = _commit_kv(batch)
    for i in range(batch.size):
        leaves: list[Any] = []
        owned: dict[int, torch.Tensor] = {}  # one copy per batched leaf (by id)
        bases: dict[int, torch.Tensor] = {}  # one copy per storage group (by first leaf)
        for j, (x, d) in enumerate(zip(batch.leaves, batch.dims, strict=True)):
            if j in committed:
                leaves.append(committed[j][i])
            elif d != 0:
                leaves.append(x)
            elif not copy:
                leaves.append(x[i])
            elif j in grouped:
                leaves.append(_rebuilt(batch.leaves, grouped[j], j, i, bases))
            else:
                mine = owned.get(id(x))
                if mine is None:
                    mine = owned[id(x)] = x[i].clone()
                leaves.append(mine)
        out.append(tree_unflatten(batch.spec, leaves))
    return out


def vmap(
    step: Callable[[R, Any], tuple[R, Any]], /, *, in_dims: Any = 0
) -> Callable[[Batch[R], Any], tuple[Batch[R], Any]]:
    """A pure step over one record, run over a whole `Batch` with `torch.func.vmap`.

    ``step(state, x) -> (state, out)`` is written for one session. The returned function
    takes a batch and the inputs (batched along dimension 0, or as ``in_dims`` says, as
    `torch.func.vmap` takes them) and returns the stepped batch and the outputs (batched
    along dimension 0). Inside, each example is an ordinary record. A leaf the step leaves as
    it was (or computes from unbatched leaves alone) stays one shared tensor in the new batch.
    Non-tensor leaves the step returns (a counter it increments) must not depend on the
    batched inputs.

    Gathered KV is a tensor inside: `KVCache.read` returns the session's tokens and
    `KVCache.append` returns a cache holding them followed by the new ones, writing nothing
    to the pool (`unstack` does). An empty `KVCache` has nothing gathered: its first append
    needs the pool, so step such sessions one by one.

    Batched kernels may round differently from batch-1 kernels (a batched convolution against
    N single ones): compare a batch with its records stepped one by one before relying on
    bit-identity, and step them one by one where it is required.

    >>> import torch
    >>> from sessionstate import LatentBuffer, SessionState
    >>> def step(state, x):
    ...     state = state.update_object("r", lambda r: r.commit(x))
    ...     return state, state.object("r").concat().sum(dim=0)
    >>> ring = LatentBuffer(name="r", dim=0).allocate(maxlen=2)
    >>> batch = stack([SessionState(objects={"r": ring})] * 3)
    >>> batch, out = vmap(step)(batch, torch.ones(3, 1, 2))
    >>> out.shape, [len(r.object("r")) for r in unstack(batch)]
    (torch.Size([3, 2]), [1, 1, 1])
    """

    def run(batch: Batch[R], inputs: Any) -> tuple[Batch[R], Any]:
        # Tensor leaves and gathered KV's tokens go through `torch.func.vmap`; the rest is fixed.
        tensors = [i for i, x in enumerate(batch.leaves) if isinstance(x, _BATCHABLE)]
        fixed = list(batch.leaves)
        result: dict[str, Any] = {}

        def one(tensor_leaves: list[torch.Tensor], x: Any) -> tuple[list[torch.Tensor], Any]:
            leaves = list(fixed)
            for i, leaf in zip(tensors, tensor_leaves, strict=True):
                kv = fixed[i]
                leaves[i] = attrs.evolve(kv, tokens=leaf) if isinstance(kv, GatheredKV) else leaf
            new, out = step(tree_unflatten(batch.spec, leaves), x)
            keys, new_leaves, new_spec = tree_flatten_with_keys(new)
            result["spec"], result["keys"], result["leaves"] = new_spec, keys, new_leaves
            return [_tensor(leaf) for leaf in new_leaves if isinstance(leaf, _BATCHABLE)], out

        dims = [batch.dims[i] for i in tensors]
        stepped, out = torch.func.vmap(one, in_dims=(dims, in_dims))(
            [_tensor(batch.leaves[i]) for i in tensors], inputs
        )
        leaves: list[Any] = []
        new_dims: list[int | None] = []
        produced = iter(stepped)
        for leaf in result["leaves"]:
            if isinstance(leaf, _BATCHABLE):
                value = next(produced)
                # vmap returns an output that no batched input reached expanded along the
                # batch (stride 0): one tensor again, shared by every record.
                shared = batch.size > 1 and value.dim() > 0 and value.stride(0) == 0
                if shared:
                    value = value[0]
                leaves.append(
                    attrs.evolve(leaf, tokens=value) if isinstance(leaf, GatheredKV) else value
                )
                new_dims.append(None if shared else 0)
            else:
                leaves.append(leaf)
                new_dims.append(None)
        new_batch: Batch[R] = Batch(
            tuple(leaves),
            tuple(new_dims),
            result["spec"],
            batch.size,
            tuple(result["keys"]),
            handles=batch.handles,
        )
        return new_batch, out

    return run


_BATCHABLE = (torch.Tensor, GatheredKV)
"""Leaves `vmap` maps over: tensors, and gathered KV (through its tokens)."""


def _tensor(leaf: torch.Tensor | GatheredKV) -> torch.Tensor:
    return leaf.tokens if isinstance(leaf, GatheredKV) else leaf


def _gather_kv(path: str, column: list[KVHandle]) -> tuple[GatheredKV, int | None]:
    # The records' handles read into one tensor: one gather for the batch, or one read of the
    # handle every record holds (unbatched, as a shared tensor stays).
    first = column[0]
    if all(h is first for h in column):
        return GatheredKV(first.read(), pool=first.pool, gathered=first.tokens), None
    for i, h in enumerate(column[1:], start=1):
        if h.pool is not first.pool:
            msg = (
                f"Cannot stack the KV at {path}: record 0's handle is in KV pool "
                f"{first.pool.name!r} but record {i}'s is in pool {h.pool.name!r}. A batch "
                "reads its sessions' KV from one pool: step the sessions of each pool in "
                "separate batches."
            )
            raise ValueError(msg)
        if h.tokens != first.tokens:
            msg = (
                f"Cannot stack the KV at {path}: record 0 holds {first.tokens} tokens but "
                f"record {i} holds {h.tokens}. A batch needs one token count per KV (a shape "
                "bucket): step sessions of different lengths in separate batches."
            )
            raise ValueError(msg)
    return GatheredKV(read_many(column), pool=first.pool, gathered=first.tokens), 0


def _commit_kv(batch: Batch[Any]) -> dict[int, list[KVHandle]]:
    # Per gathered KV leaf, each record's handle: its own if its tokens are those gathered,
    # else a new one with the new tokens appended. Every check runs before the first append;
    # the appends run inside the pools' transactions, so a failure gives every block back.
    plans: list[tuple[int, int, KVHandle, torch.Tensor, int | None]] = []
    out: dict[int, list[KVHandle]] = {}
    for j, (x, d) in enumerate(zip(batch.leaves, batch.dims, strict=True)):
        if not isinstance(x, GatheredKV):
            continue
        path = batch.paths[j]
        handles = batch.handles.get(path)
        if handles is None:
            msg = (
                f"Cannot unstack the KV at {path}: the batch gathered KV at "
                f"{sorted(batch.handles)} only, and the step moved it. A batched step keeps "
                "each `KVCache` where it found it."
            )
            raise ValueError(msg)
        gathered = read_many(handles) if d == 0 else handles[0].read()
        out[j] = list(handles)
        overlap = x.gathered - x.dropped  # gathered tokens the step's KV still begins with
        for i, handle in enumerate(handles):
            tokens = x.tokens[i] if d == 0 else x.tokens
            before = gathered[i] if d == 0 else gathered
            if len(tokens) < overlap or (
                overlap > 0 and not torch.equal(tokens[:overlap], before[x.dropped :])
            ):
                msg = (
                    f"Cannot unstack the KV at {path} of record {i}: its {len(tokens)} tokens "
                    f"do not begin with the {x.gathered} gathered from its handle. KV is "
                    "append-only: a batched step extends it with `KVCache.append` and never "
                    "rewrites or drops tokens."
                )
                raise ValueError(msg)
            if len(tokens) == overlap and x.dropped == 0:
                continue  # unchanged: the record keeps its handle
            new = tokens[max(overlap, 0) :]
            if overlap < 0:  # the window left out tokens past the gathered ones too
                pad = tokens.new_zeros((-overlap, *tokens.shape[1:]))
                new = torch.cat([pad, new])
            # The window that leaves out exactly the tokens the batched appends left out.
            window = None if x.dropped == 0 else max(len(tokens) - x.pool.block_tokens + 1, 0)
            plans.append((j, i, handle, new, window))
    pools: list[KVPool] = []
    for _, _, handle, _, _ in plans:
        if all(handle.pool is not p for p in pools):
            pools.append(handle.pool)
    with contextlib.ExitStack() as transactions:
        for pool in pools:
            transactions.enter_context(pool.transaction())
        made = [handle.pool.append(handle, new, window=window) for *_, handle, new, window in plans]
    for (j, i, *_), handle in zip(plans, made, strict=True):
        out[j][i] = handle
    return out


def _stack_leaf(path: str, column: list[Any], *, stacked: bool = True) -> tuple[Any, int | None]:
    # The column checked and stacked (``stacked=False``: checked only, a storage group's).
    first = column[0]
    if not isinstance(first, torch.Tensor):
        for i, value in enumerate(column[1:], start=1):
            if type(value) is not type(first) or value != first:
                msg = (
                    f"Cannot stack the records: {path} is {first!r} in record 0 but {value!r} "
                    f"in record {i}; a batch needs equal non-tensor values. Group sessions by "
                    "it, or keep it in a tensor."
                )
                raise ValueError(msg)
        return first, None
    if _one_view(column):
        return first, None
    for i, leaf in enumerate(column[1:], start=1):
        if (
            not isinstance(leaf, torch.Tensor)
            or leaf.shape != first.shape
            or leaf.dtype != first.dtype
            or leaf.device != first.device
        ):
            got = (
                f"{tuple(leaf.shape)} {leaf.dtype} on {leaf.device}"
                if isinstance(leaf, torch.Tensor)
                else type(leaf).__name__
            )
            msg = (
                f"Cannot stack the records: {path} is {tuple(first.shape)} {first.dtype} on "
                f"{first.device} in record 0 but {got} in record {i}. A batch needs one shape, "
                "dtype and device per leaf: group sessions by shape."
            )
            raise ValueError(msg)
    return (torch.stack(column) if stacked else None), 0


def _storage_groups(columns: list[list[Any]]) -> list[list[int]]:
    # Leaves that are views of one storage in record 0 (a slice beside its tensor, two
    # aliases), laid out alike in every record: they are stacked as their storage. Leaves
    # that are one tensor in every record (what forks share) stay unbatched instead.
    by_storage: dict[int, list[int]] = {}
    for j, column in enumerate(columns):
        x = column[0]
        if (
            isinstance(x, torch.Tensor)
            and not _one_view(column)
            and all(isinstance(leaf, torch.Tensor) for leaf in column)
            and x.untyped_storage().nbytes() > 0
        ):
            by_storage.setdefault(x.untyped_storage().data_ptr(), []).append(j)
    return [
        members
        for members in by_storage.values()
        if len(members) > 1 and _laid_out_alike([columns[j] for j in members])
    ]


def _one_view(column: list[Any]) -> bool:
    # Whether every record holds one view of one storage: the very tensor (what forks share),
    # or each its own tensor with the same storage, offset, shape, stride and dtype (a view a
    # record made again). It stays one tensor for the batch, never copied.
    first = column[0]
    if not isinstance(first, torch.Tensor):
        return False
    storage = first.untyped_storage()._cdata
    layout = _layout(first)
    return all(
        leaf is first
        or (
            isinstance(leaf, torch.Tensor)
            and leaf.untyped_storage()._cdata == storage
            and _layout(leaf) == layout
        )
        for leaf in column
    )


def _layout(x: torch.Tensor) -> tuple[Any, ...]:
    # How a view reads its storage (the conjugate and negative bits too: a lazy `conj()`).
    return (
        x.storage_offset(),
        x.shape,
        x.stride(),
        x.dtype,
        x.device,
        x.is_conj(),
        x.is_neg(),
    )


def _stack_storage(columns: list[list[Any]], members: list[int], out: list[Any]) -> None:
    # One copy of the group's storage per record, stacked; each leaf a view into it.
    first = columns[members[0]][0]
    n = first.untyped_storage().nbytes() // first.element_size()
    bases = torch.stack([torch.as_strided(x, (n,), (1,), 0) for x in columns[members[0]]])
    for j in members:
        x = columns[j][0]
        out[j] = bases.as_strided((bases.shape[0], *x.shape), (n, *x.stride()), x.storage_offset())


def _laid_out_alike(group: list[list[torch.Tensor]]) -> bool:
    # Every record holds these leaves as views of one storage of record 0's size, at the
    # same offsets and strides, all of one dtype (their shapes are checked leaf by leaf).
    first = group[0][0]
    nbytes = first.untyped_storage().nbytes()
    if nbytes % first.element_size():
        return False
    for r in range(len(group[0])):
        storage = group[0][r].untyped_storage()
        if storage.nbytes() != nbytes:
            return False
        for column in group:
            x, y = column[r], column[0]
            if (
                x.untyped_storage().data_ptr() != storage.data_ptr()
                or x.dtype != first.dtype
                or (x.storage_offset(), x.stride()) != (y.storage_offset(), y.stride())
            ):
                return False
    return True


def _rebuilt(
    leaves: tuple[Any, ...], group: tuple[int, ...], j: int, i: int, bases: dict[int, Any]
) -> torch.Tensor:
    # Record i's leaf j of a storage group: a view into the record's one copy of the storage
    # (the stacked storage holds record i's at [i * n, (i + 1) * n)).
    first = leaves[group[0]]
    n = first.stride(0)
    base = bases.get(group[0])
    if base is None:
        base = bases[group[0]] = torch.as_strided(first, (n,), (1,), i * n).clone()
    x = leaves[j]
    return base.as_strided(x.shape[1:], x.stride()[1:], x.storage_offset())


def _first_difference(a: Any, b: Any) -> str:
    keys_a, _, spec_a = tree_flatten_with_keys(a)
    keys_b, _, spec_b = tree_flatten_with_keys(b)
    for key_a, key_b in zip(keys_a, keys_b, strict=False):
        if key_a != key_b:
            return f"{key_a} against {key_b}"
    if len(keys_a) != len(keys_b):
        return f"{len(keys_a)} leaves against {len(keys_b)}"
    return f"static data: {spec_a} against {spec_b}"
