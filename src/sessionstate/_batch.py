"""Batches: many records of one structure stepped in one forward, the JAX way.

`stack` gathers N records into a `Batch`: each tensor leaf stacked along a new leading
dimension, except a leaf that is the same tensor in every record (what forks share), which
stays one tensor, unbatched. `vmap` runs a pure step ``step(state, x) -> (state, out)`` over the
batch with `torch.func.vmap`: inside, each example sees an ordinary record (its leaves at their
per-example shapes, so the records' own checks hold), and the step is written for one session.
`unstack` gives the N records back; what stayed unbatched is shared again.

A batch keeps its leaves flat rather than as one stacked record: a record checks its leaves'
shapes (a buffer's chunks must agree), and a record mixing stacked and shared leaves would not
pass. Non-tensor leaves (counters, flags) must be equal across the records; engine handles
(`KVHandle`) are not batched yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs
import torch

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
    """

    leaves: tuple[Any, ...]
    dims: tuple[int | None, ...]
    spec: PyTreeSpec
    size: int
    paths: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...] = ()
    """Batched leaves that are views of one storage in every record, as their positions:
    `unstack` gives each record one copy of that storage and rebuilds the views on it."""

    @property
    def shared(self) -> int:
        """How many tensor leaves are one tensor for the whole batch (not stacked).

        >>> import torch
        >>> from sessionstate import LatentBuffer, SessionState
        >>> history = LatentBuffer(dim=0).allocate().commit(torch.zeros(3))
        >>> a = SessionState(objects={"h": history}, attrs={"x": torch.ones(2)})
        >>> b = a.with_attrs(x=torch.zeros(2))
        >>> stack([a, b]).shared
        1
        """
        return sum(
            d is None and isinstance(x, torch.Tensor)
            for d, x in zip(self.dims, self.leaves, strict=True)
        )


def stack(records: Sequence[R], /) -> Batch[R]:
    """Stack records of one structure into a `Batch` (nothing shared is copied).

    Records must have the same tree structure (classes, object names, static fields such as
    a ring's ``maxlen``) and, leaf by leaf, tensors of one shape, dtype and device, or equal
    non-tensor values. A tensor leaf that is the same tensor in every record (a fork's
    history) stays one tensor, unbatched; the others are stacked (a copy). Leaves that are
    views of one storage in each record (a slice beside its tensor, an alias), laid out
    alike in every record, are stacked as their storage, so `unstack` gives each record its
    views of one copy again: the records' sharing survives the batch.

    Raises:
        ValueError: for no records, or records that differ in structure, in a tensor leaf's
            shape, dtype or device, or in a non-tensor leaf, naming the first difference
            and its key path.
        TypeError: for an engine handle leaf (`KVHandle`), which cannot be batched yet.

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
    groups = _storage_groups(columns)
    grouped = {j for g in groups for j in g}
    for j, (path, column) in enumerate(zip(keys, columns, strict=True)):
        value, dim = _stack_leaf(path, column, stacked=j not in grouped)
        out.append(value)
        dims.append(dim)
    for members in groups:
        _stack_storage(columns, members, out)
    return Batch(
        tuple(out), tuple(dims), spec, len(records), tuple(keys), tuple(map(tuple, groups))
    )


def unstack(batch: Batch[R], /, *, copy: bool = True) -> list[R]:
    """The records of a batch, one per example; what was shared is shared again.

    With ``copy`` (the default) each record's batched leaves are its own tensors (a copy of
    its slice), so a record keeps alive only its own bytes; ``copy=False`` gives views into
    the stacked tensors (each record then reaches the whole stacked storage).

    >>> import torch
    >>> from sessionstate import SessionState, tree_equal
    >>> records = [SessionState(attrs={"x": torch.full((2,), float(i))}) for i in range(3)]
    >>> all(tree_equal(a, b) for a, b in zip(unstack(stack(records)), records))
    True
    """
    out = []
    grouped = {j: g for g in batch.groups for j in g}
    for i in range(batch.size):
        leaves: list[Any] = []
        owned: dict[int, torch.Tensor] = {}  # one copy per batched leaf (by id)
        bases: dict[int, torch.Tensor] = {}  # one copy per storage group (by first leaf)
        for j, (x, d) in enumerate(zip(batch.leaves, batch.dims, strict=True)):
            if d != 0:
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
        tensors = [i for i, x in enumerate(batch.leaves) if isinstance(x, torch.Tensor)]
        fixed = list(batch.leaves)
        result: dict[str, Any] = {}

        def one(tensor_leaves: list[torch.Tensor], x: Any) -> tuple[list[torch.Tensor], Any]:
            leaves = list(fixed)
            for i, leaf in zip(tensors, tensor_leaves, strict=True):
                leaves[i] = leaf
            new, out = step(tree_unflatten(batch.spec, leaves), x)
            keys, new_leaves, new_spec = tree_flatten_with_keys(new)
            result["spec"], result["keys"], result["leaves"] = new_spec, keys, new_leaves
            return [leaf for leaf in new_leaves if isinstance(leaf, torch.Tensor)], out

        dims = [batch.dims[i] for i in tensors]
        stepped, out = torch.func.vmap(one, in_dims=(dims, in_dims))(
            [batch.leaves[i] for i in tensors], inputs
        )
        leaves: list[Any] = []
        new_dims: list[int | None] = []
        produced = iter(stepped)
        for leaf in result["leaves"]:
            if isinstance(leaf, torch.Tensor):
                value = next(produced)
                # vmap returns an output that no batched input reached expanded along the
                # batch (stride 0): one tensor again, shared by every record.
                if batch.size > 1 and value.stride(0) == 0:
                    leaves.append(value[0])
                    new_dims.append(None)
                else:
                    leaves.append(value)
                    new_dims.append(0)
            else:
                leaves.append(leaf)
                new_dims.append(None)
        new_batch: Batch[R] = Batch(
            tuple(leaves), tuple(new_dims), result["spec"], batch.size, tuple(result["keys"])
        )
        return new_batch, out

    return run


def _stack_leaf(path: str, column: list[Any], *, stacked: bool = True) -> tuple[Any, int | None]:
    # The column checked and stacked (``stacked=False``: checked only, a storage group's).
    first = column[0]
    if not isinstance(first, torch.Tensor):
        if type(first).__name__ == "KVHandle":
            msg = (
                f"Cannot stack the engine handle at {path}: `KVHandle`s are not batched yet. "
                "Step sessions holding KV one by one."
            )
            raise TypeError(msg)
        for i, value in enumerate(column[1:], start=1):
            if type(value) is not type(first) or value != first:
                msg = (
                    f"Cannot stack the records: {path} is {first!r} in record 0 but {value!r} "
                    f"in record {i}; a batch needs equal non-tensor values. Group sessions by "
                    "it, or keep it in a tensor."
                )
                raise ValueError(msg)
        return first, None
    if all(leaf is first for leaf in column):
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
            and not all(leaf is x for leaf in column)
            and all(isinstance(leaf, torch.Tensor) for leaf in column)
            and x.untyped_storage().nbytes() > 0
        ):
            by_storage.setdefault(x.untyped_storage().data_ptr(), []).append(j)
    return [
        members
        for members in by_storage.values()
        if len(members) > 1 and _laid_out_alike([columns[j] for j in members])
    ]


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
