"""Encode-once per-layer K/V: one key/value pair per transformer layer and guidance branch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch

from sessionstate._accounting import nbytes_by_device
from sessionstate._checks import describe, is_int
from sessionstate._errors import IncompleteStateError, MissingKeyError, NotAllocatedError
from sessionstate._stateobject import StagedStateObject
from sessionstate._tree import field, register_record, static_field

__all__ = ["EncodeOnceKV", "KVPair"]


def _check_tensor(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, torch.Tensor):
        msg = (
            f"`KVPair.{attribute.name}` must be a torch.Tensor, got {type(value).__name__}; "
            "build the pair from the layer's key and value tensors."
        )
        raise TypeError(msg)


@register_record
@attrs.frozen(eq=False)
class KVPair:
    """One layer's attention key and value for one guidance branch: a typed pair of tensors.

    Both tensors agree on shape, dtype and device (``(batch, kv_heads, tokens, head_dim)``
    in the reference models).

    Args:
        key: The attention keys.
        value: The attention values.

    >>> import torch
    >>> pair = KVPair(torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    >>> tuple(pair.key.shape), pair.value.dtype
    ((1, 2, 3, 4), torch.float32)
    """

    key: torch.Tensor = field(validator=_check_tensor)
    value: torch.Tensor = field(validator=_check_tensor)

    def __attrs_post_init__(self) -> None:
        k, v = self.key, self.value
        if k.shape != v.shape or k.dtype != v.dtype or k.device != v.device:
            msg = (
                f"`KVPair` key and value must agree on shape, dtype and device; got key "
                f"{tuple(k.shape)} {k.dtype} on {k.device} and value {tuple(v.shape)} "
                f"{v.dtype} on {v.device}. Pass the key and value of the same layer."
            )
            raise ValueError(msg)


_Layers = tuple[tuple[KVPair | None, ...], ...]


def _format_layers(layers: Iterable[int]) -> str:
    """Layer indices as ranges: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(layers):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(parts)


def _missing(row: tuple[KVPair | None, ...]) -> list[int]:
    return [i for i, pair in enumerate(row) if pair is None]


def _empty(branches: int, num_layers: int) -> _Layers:
    return tuple((None,) * num_layers for _ in range(branches))


def _check_branches(branches: object) -> tuple[str, ...]:
    ok = (
        isinstance(branches, tuple)
        and len(branches) > 0
        and all(isinstance(b, str) for b in branches)
        and len(set(branches)) == len(branches)
    )
    if not ok:
        msg = (
            f"`branches` must be a non-empty tuple of distinct names, got {describe(branches)}; "
            "e.g. `branches=('cond', 'uncond')` for classifier-free guidance."
        )
        raise ValueError(msg)
    assert isinstance(branches, tuple)
    return branches


def _check_num_layers(num_layers: object) -> int:
    if not is_int(num_layers) or num_layers <= 0:
        msg = (
            f"`num_layers` must be a positive int (the transformer's layer count), got "
            f"{describe(num_layers)}."
        )
        raise ValueError(msg)
    return num_layers


@register_record
@attrs.frozen(eq=False)
class EncodeOnceKV(StagedStateObject):
    """Per-layer attention K/V of a conditioning input, computed once and reread every step.

    Holds one `KVPair` per transformer layer for each guidance branch (``cond`` and
    ``uncond`` for classifier-free guidance). A branch is all or nothing: a committed branch
    has every layer. Writes are two-phase: ``stage`` a few layers at a time (a forward pass
    computes them layer by layer), read them back with ``include_staged=True``, and
    ``commit()`` once the step succeeded; committing a branch with layers missing raises
    `IncompleteStateError` naming them, and leaves nothing half-written.

    Args:
        layers: Committed pairs, ``layers[branch][layer]`` (None where unset). Set through
            `commit`.
        staged: Staged pairs, same layout. Set through `stage`.
        name: Used in error messages (e.g. the session value the object holds).
        branches: The guidance branches, in order. Set through `allocate`.
        num_layers: Layers per branch. Set through `allocate`.
        allocated: Whether the object was allocated (and not evicted since).

    >>> import torch
    >>> kv = EncodeOnceKV(name="text_kv").allocate(num_layers=2, branches=("cond",))
    >>> pair = KVPair(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4))
    >>> kv = kv.stage({"cond": {0: pair}}).stage({"cond": {1: pair}})
    >>> kv.is_empty, kv.layer("cond", 1, include_staged=True) is pair
    (True, True)
    >>> kv = kv.commit()
    >>> kv.is_complete, kv.has_staged, len(kv.view("cond"))
    (True, False, 2)
    """

    layers: _Layers = field(default=(), converter=tuple)
    staged: _Layers = field(default=(), converter=tuple)
    name: str = static_field(default="kv", kw_only=True)
    branches: tuple[str, ...] = static_field(default=("cond", "uncond"), kw_only=True)
    num_layers: int = static_field(default=0, kw_only=True)
    allocated: bool = static_field(default=False, kw_only=True)

    def __attrs_post_init__(self) -> None:
        if not self.allocated:
            if self.layers or self.staged:
                msg = (
                    f"EncodeOnceKV `{self.name}` holds K/V but is not allocated; build it with "
                    "`.allocate(num_layers=...)`, `.stage(...)` and `.commit()`."
                )
                raise ValueError(msg)
            return
        for label, rows in (("layers", self.layers), ("staged", self.staged)):
            if len(rows) != len(self.branches) or any(len(row) != self.num_layers for row in rows):
                msg = (
                    f"EncodeOnceKV `{self.name}` `{label}` must be {len(self.branches)} rows "
                    f"(one per branch) of {self.num_layers} entries; build it with `.stage(...)` "
                    "and `.commit()`."
                )
                raise ValueError(msg)
        for branch, row in zip(self.branches, self.layers, strict=True):
            self._check_whole(branch, row, "holds")

    # -- queries -----------------------------------------------------------------------------

    @property
    def is_allocated(self) -> bool:
        """Whether the object was allocated (and not evicted since).

        >>> EncodeOnceKV().is_allocated, EncodeOnceKV().allocate(num_layers=1).is_allocated
        (False, True)
        """
        return self.allocated

    @property
    def is_empty(self) -> bool:
        """Whether no branch has committed K/V (the conditioning is not encoded yet).

        >>> EncodeOnceKV().allocate(num_layers=2).is_empty
        True
        """
        return all(pair is None for row in self.layers for pair in row)

    @property
    def is_complete(self) -> bool:
        """Whether every branch has committed K/V for every layer.

        >>> EncodeOnceKV().allocate(num_layers=2).is_complete
        False
        """
        return bool(self.layers) and all(pair is not None for row in self.layers for pair in row)

    @property
    def has_staged(self) -> bool:
        """Whether staged pairs wait for ``commit()`` or ``discard()``.

        >>> EncodeOnceKV().allocate(num_layers=1).has_staged
        False
        """
        return any(pair is not None for row in self.staged for pair in row)

    def missing_layers(self, branch: str, /, *, include_staged: bool = False) -> tuple[int, ...]:
        """The layers of ``branch`` that hold no pair (committed, or staged over committed).

        >>> EncodeOnceKV().allocate(num_layers=3).missing_layers("cond")
        (0, 1, 2)
        """
        self._require_allocated("read")
        return tuple(_missing(self._row(branch, include_staged)))

    def layer(self, branch: str, index: int, /, *, include_staged: bool = False) -> KVPair:
        """The pair of one layer of ``branch``.

        Raises:
            NotAllocatedError: if the object is not allocated.
            KeyError: for an unknown branch.
            IndexError: for a layer index out of range.
            IncompleteStateError: if that layer holds no pair.

        >>> import torch
        >>> pair = KVPair(torch.zeros(1), torch.zeros(1))
        >>> kv = EncodeOnceKV().allocate(num_layers=1, branches=("cond",))
        >>> kv.commit({"cond": [pair]}).layer("cond", 0) is pair
        True
        """
        self._require_allocated("read")
        row = self._row(branch, include_staged)
        self._check_index(index)
        pair = row[index]
        if pair is None:
            where = "committed or staged" if include_staged else "committed"
            msg = (
                f"EncodeOnceKV `{self.name}` has no {where} K/V for layer {index} of branch "
                f"`{branch}`; encode the conditioning and `stage(...)`/`commit()` it first."
            )
            raise IncompleteStateError(msg)
        return pair

    def view(self, branch: str | None = None, /, *, include_staged: bool = False) -> Any:
        """Every layer's pair of ``branch`` (a tuple), or of every branch (a dict) if None.

        Raises:
            NotAllocatedError: if the object is not allocated.
            KeyError: for an unknown branch.
            IncompleteStateError: if a requested branch is missing layers, naming them.

        >>> import torch
        >>> pair = KVPair(torch.zeros(1), torch.zeros(1))
        >>> kv = EncodeOnceKV().allocate(num_layers=1).commit({"cond": [pair], "uncond": [pair]})
        >>> sorted(kv.view()), len(kv.view("uncond"))
        (['cond', 'uncond'], 1)
        """
        self._require_allocated("view")
        names = self.branches if branch is None else (branch,)
        out: dict[str, tuple[KVPair, ...]] = {}
        for name in names:
            row = self._row(name, include_staged)
            self._check_whole(name, row, "has", allow_empty=False, include_staged=include_staged)
            out[name] = tuple(p for p in row if p is not None)
        return out if branch is None else out[branch]

    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes the committed pairs keep alive, per device (staged pairs excluded).

        >>> import torch
        >>> pair = KVPair(torch.zeros(4), torch.zeros(4))
        >>> kv = EncodeOnceKV().allocate(num_layers=1, branches=("cond",))
        >>> kv.stage({"cond": [pair]}).nbytes_by_device()
        {}
        >>> kv.commit({"cond": [pair]}).nbytes_by_device()
        {'cpu': 32}
        """
        return nbytes_by_device(self.layers)

    def staged_nbytes_by_device(self) -> dict[str, int]:
        """Bytes only the staged pairs keep alive, per device (storages the committed pairs
        share are counted there, not here).

        >>> import torch
        >>> pair = KVPair(torch.zeros(4), torch.zeros(4))
        >>> kv = EncodeOnceKV().allocate(num_layers=1).stage({"cond": [pair]})
        >>> kv.staged_nbytes_by_device(), kv.nbytes_by_device()
        ({'cpu': 32}, {})
        """
        both = nbytes_by_device((self.layers, self.staged))
        committed = nbytes_by_device(self.layers)
        out = {d: n - committed.get(d, 0) for d, n in both.items()}
        return {d: n for d, n in out.items() if n}

    # -- transitions ---------------------------------------------------------------------------

    def allocate(  # type: ignore[override]
        self, *, num_layers: int, branches: tuple[str, ...] = ("cond", "uncond")
    ) -> EncodeOnceKV:
        """Return an empty, allocated object for ``num_layers`` layers of each branch.

        Raises:
            ValueError: for a non-positive ``num_layers`` or malformed ``branches``.

        >>> EncodeOnceKV().allocate(num_layers=28).num_layers
        28
        """
        num_layers = _check_num_layers(num_layers)
        branches = _check_branches(branches)
        empty = _empty(len(branches), num_layers)
        return attrs.evolve(
            self,
            layers=empty,
            staged=empty,
            branches=branches,
            num_layers=num_layers,
            allocated=True,
        )

    def stage(self, payload: Mapping[str, Any], /) -> EncodeOnceKV:
        """Return an object with ``payload`` staged over the pairs already staged.

        ``payload`` maps a branch to its pairs: a sequence of every layer's pair in order, or
        a mapping from layer index to pair. A pair is a `KVPair` or a ``(key, value)`` tuple.

        Raises:
            NotAllocatedError: if the object is not allocated.
            TypeError: for a payload, branch entry or pair of the wrong type.
            KeyError: for an unknown branch.
            IndexError: for a layer index out of range.
            ValueError: for a sequence whose length is not ``num_layers``.

        >>> import torch
        >>> kv = EncodeOnceKV().allocate(num_layers=2)
        >>> kv.stage({"uncond": {1: (torch.zeros(1), torch.zeros(1))}}).missing_layers(
        ...     "uncond", include_staged=True)
        (0,)
        """
        self._require_allocated("stage into")
        updates = self._parse(payload)
        staged = [list(row) for row in self.staged]
        for (b, i), pair in updates.items():
            staged[b][i] = pair
        return self._evolve(self.layers, tuple(tuple(row) for row in staged))

    def commit(self, payload: Mapping[str, Any] | None = None, /) -> EncodeOnceKV:
        """Return an object with the staged pairs committed (``commit(payload)``: stage first).

        Staged pairs replace committed ones layer by layer; afterwards every branch must be
        whole (every layer) or untouched-and-empty.

        Raises:
            NotAllocatedError: if the object is not allocated.
            ValueError: if nothing is staged and no payload is given.
            IncompleteStateError: if a branch would be partially initialised, naming its
                missing layers. ``self`` is unchanged (as after every transition).

        >>> import torch
        >>> kv = EncodeOnceKV().allocate(num_layers=2, branches=("cond",))
        >>> half = kv.stage({"cond": {0: (torch.zeros(1), torch.zeros(1))}})
        >>> try:
        ...     half.commit()
        ... except IncompleteStateError as exc:
        ...     print(str(exc)[:63])
        EncodeOnceKV `kv` would be partially initialised: branch `cond`
        >>> half.commit({"cond": {1: (torch.ones(1), torch.ones(1))}}).is_complete
        True
        """
        obj = self if payload is None else self.stage(payload)
        obj._require_allocated("commit to")
        if not obj.has_staged:
            msg = (
                f"EncodeOnceKV `{obj.name}` has nothing staged to commit; `stage(payload)` "
                "first, or pass the payload: `commit(payload)`."
            )
            raise ValueError(msg)
        layers = tuple(
            tuple(s if s is not None else c for c, s in zip(crow, srow, strict=True))
            for crow, srow in zip(obj.layers, obj.staged, strict=True)
        )
        for branch, row in zip(obj.branches, layers, strict=True):
            obj._check_whole(branch, row, "would be")
        return obj._evolve(layers, _empty(len(obj.branches), obj.num_layers))

    def discard(self) -> EncodeOnceKV:
        """Return an object with the staged pairs dropped and the committed ones kept.

        >>> import torch
        >>> kv = EncodeOnceKV().allocate(num_layers=1).stage({"cond": [(torch.ones(1),) * 2]})
        >>> kv.discard().has_staged, kv.has_staged
        (False, True)
        """
        self._require_allocated("discard from")
        return self._evolve(self.layers, _empty(len(self.branches), self.num_layers))

    def reset(self) -> EncodeOnceKV:
        """Return an empty object with the same configuration (still allocated).

        >>> EncodeOnceKV().allocate(num_layers=2).reset().num_layers
        2
        """
        self._require_allocated("reset")
        empty = _empty(len(self.branches), self.num_layers)
        return self._evolve(empty, empty)

    def evict(self) -> EncodeOnceKV:
        """Return an object whose pairs are released and which is not resident.

        The K/V is a pure function of the conditioning input, so a model that finds it
        evicted re-encodes and allocates again.

        >>> kv = EncodeOnceKV().allocate(num_layers=2).evict()
        >>> kv.is_allocated, kv.nbytes_by_device()
        (False, {})
        """
        return attrs.evolve(self, layers=(), staged=(), allocated=False)

    # -- helpers -------------------------------------------------------------------------------

    def _evolve(self, layers: _Layers, staged: _Layers) -> EncodeOnceKV:
        return attrs.evolve(self, layers=layers, staged=staged)

    def _require_allocated(self, action: str) -> None:
        if not self.allocated:
            msg = (
                f"Cannot {action} EncodeOnceKV `{self.name}`: it is not allocated; "
                "call `.allocate(num_layers=...)` first."
            )
            raise NotAllocatedError(msg)

    def _branch_index(self, branch: object) -> int:
        if branch not in self.branches:
            msg = (
                f"EncodeOnceKV `{self.name}` has no branch {describe(branch)}; its branches "
                f"are {list(self.branches)}."
            )
            raise MissingKeyError(msg)
        return self.branches.index(branch)

    def _check_index(self, index: object) -> int:
        if not is_int(index) or not 0 <= index < self.num_layers:
            msg = (
                f"EncodeOnceKV `{self.name}` has layers 0-{self.num_layers - 1}, got layer "
                f"{describe(index)}."
            )
            raise IndexError(msg)
        return index

    def _row(self, branch: str, include_staged: bool) -> tuple[KVPair | None, ...]:
        b = self._branch_index(branch)
        row = self.layers[b]
        if include_staged:
            row = tuple(s if s is not None else c for c, s in zip(row, self.staged[b], strict=True))
        return row

    def _check_whole(
        self,
        branch: str,
        row: tuple[KVPair | None, ...],
        verb: str,
        *,
        allow_empty: bool = True,
        include_staged: bool = False,
    ) -> None:
        missing = _missing(row)
        if not missing or (allow_empty and len(missing) == len(row)):
            return
        if verb == "has":
            where = "committed or staged" if include_staged else "committed"
            state = "is empty" if len(missing) == len(row) else "is partially initialised"
            msg = (
                f"EncodeOnceKV `{self.name}` {state}: branch `{branch}` has no {where} K/V for "
                f"layer(s) {_format_layers(missing)} of {self.num_layers}. Encode the "
                "conditioning and `commit()` every layer before reading it."
            )
        else:
            msg = (
                f"EncodeOnceKV `{self.name}` {verb} partially initialised: branch `{branch}` is "
                f"missing layer(s) {_format_layers(missing)} of {self.num_layers}. Stage every "
                "layer before `commit()`, or `discard()` the staged pairs."
            )
        raise IncompleteStateError(msg)

    def _parse(self, payload: object) -> dict[tuple[int, int], KVPair]:
        if not isinstance(payload, Mapping):
            msg = (
                f"EncodeOnceKV `{self.name}` stages a mapping of branch to pairs, got "
                f"{type(payload).__name__}; e.g. `{{'cond': {{0: (k, v)}}}}`."
            )
            raise TypeError(msg)
        out: dict[tuple[int, int], KVPair] = {}
        for branch, entries in payload.items():
            b = self._branch_index(branch)
            items: Iterable[tuple[object, object]]
            if isinstance(entries, Mapping):
                items = entries.items()
            elif isinstance(entries, Sequence) and not isinstance(entries, (str, bytes)):
                if len(entries) != self.num_layers:
                    msg = (
                        f"EncodeOnceKV `{self.name}` branch `{branch}` got {len(entries)} pairs "
                        f"in a sequence, which must hold all {self.num_layers} layers; pass a "
                        "mapping `{layer: (k, v)}` to stage some of them."
                    )
                    raise ValueError(msg)
                items = enumerate(entries)
            else:
                msg = (
                    f"EncodeOnceKV `{self.name}` branch `{branch}` takes a sequence of every "
                    f"layer's pair or a mapping of layer to pair, got {type(entries).__name__}."
                )
                raise TypeError(msg)
            for index, pair in items:
                out[(b, self._check_index(index))] = self._as_pair(branch, index, pair)
        return out

    def _as_pair(self, branch: object, index: object, pair: object) -> KVPair:
        if isinstance(pair, KVPair):
            return pair
        if isinstance(pair, tuple) and len(pair) == 2:
            return KVPair(pair[0], pair[1])
        msg = (
            f"EncodeOnceKV `{self.name}` layer {index} of branch `{branch}` must be a KVPair "
            f"or a (key, value) tuple, got {type(pair).__name__}."
        )
        raise TypeError(msg)
