"""The manager's byte ledger: resident bytes per device, kept up to date incrementally.

`SessionLedger` is the manager's accounting part: per session, the storages each stored value
reaches, and one `Ledger` of them all.

Every stored value (a state object or an attribute of a session) adds one reference to each
storage it reaches; replacing, dropping or parking the value removes them. A storage counts
while it has a reference, once, however many values reach it, so the totals are what
`nbytes_by_device` of all stored records together would say (each storage once; storages over
overlapping memory as the union of their address ranges), at the cost of the values that
changed rather than a walk of every session.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence

import attrs
import torch

from sessionstate._accounting import (
    EngineBlock,
    StorageEntry,
    _RefusedError,
    derivation,
    leaf_entries,
    storage_entries,
    union_size,
)
from sessionstate._errors import UnsupportedTensorError
from sessionstate._objects import TensorCache
from sessionstate._session import SessionState, ValueKey, iter_values
from sessionstate._tree import tree_leaves

__all__ = ["Ledger", "SessionLedger", "Values"]


class _Ranges:
    """A multiset of address ranges on one device and the size of their union."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, int]] = []  # distinct ranges, sorted
        self._counts: dict[tuple[int, int], int] = {}
        self._longest = 0
        self.total = 0

    def add(self, start: int, end: int) -> None:
        span = (start, end)
        count = self._counts.get(span, 0)
        self._counts[span] = count + 1
        if count:
            return
        spans = self._spans
        at = bisect.bisect_left(spans, span)
        self.total += (end - start) - self._covered(start, end, at)
        spans.insert(at, span)
        if end - start > self._longest:
            self._longest = end - start

    def add_all(self, spans: Iterable[tuple[int, int]]) -> None:
        for start, end in spans:
            self.add(start, end)

    def remove_all(self, spans: Iterable[tuple[int, int]]) -> None:
        for start, end in spans:
            self.remove(start, end)

    def remove(self, start: int, end: int) -> None:
        span = (start, end)
        count = self._counts[span] - 1
        if count:
            self._counts[span] = count
            return
        del self._counts[span]
        spans = self._spans
        at = bisect.bisect_left(spans, span)
        del spans[at]
        self.total -= (end - start) - self._covered(start, end, at)

    def _covered(self, start: int, end: int, at: int) -> int:
        """Bytes of ``[start, end)`` that the held ranges cover; ``at`` is where it sorts."""
        spans = self._spans
        # A range overlapping [start, end) starts after `start - longest` and before `end`.
        lo = bisect.bisect_left(spans, (start - self._longest, start - self._longest), 0, at)
        if lo == at and (at == len(spans) or spans[at][0] >= end):
            return 0  # no held range can reach it: distinct allocations, the common case
        hi = bisect.bisect_left(spans, (end, end), at)
        covered, reach = 0, start
        for s, e in sorted(spans[lo:hi]):
            if e <= reach:
                continue
            s = max(s, reach)
            e = min(e, end)
            if e > s:
                covered += e - s
                reach = e
        return covered


class _LazyRanges:
    """A multiset of address ranges whose union is measured when read, not on every change.

    For a ledger nobody reads between puts (no byte budget): a change costs a dict update,
    and a read after changes brings a sorted list of the distinct ranges up to date (placing
    each range that came or went, or sorting afresh after many) and sums their union. The
    pending changes never outgrow the held ranges (by 8x, plus 256): past that they are
    folded in without a read.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], int] = {}
        self._spans: list[tuple[int, int]] = []  # distinct ranges, sorted, as of the last read
        self._pending: list[tuple[int, tuple[int, int]]] = []  # (+1 | -1, range) since then
        self._total = 0
        self._disjoint = True  # whether no two of `_spans` overlap
        self._fold_at = 256  # pending changes that trigger a fold without a read

    def add_all(self, spans: Iterable[tuple[int, int]]) -> None:
        counts, pending = self._counts, self._pending
        for span in spans:
            count = counts.get(span, 0)
            counts[span] = count + 1
            if not count:
                pending.append((1, span))
        if len(pending) > self._fold_at:
            self._fold()

    def remove_all(self, spans: Iterable[tuple[int, int]]) -> None:
        counts, pending = self._counts, self._pending
        for span in spans:
            count = counts[span] - 1
            if count:
                counts[span] = count
                continue
            del counts[span]
            pending.append((-1, span))
        if len(pending) > self._fold_at:
            self._fold()

    @property
    def total(self) -> int:
        if self._pending:
            self._fold()
        return self._total

    def _fold(self) -> None:
        # Bring `_spans` and `_total` up to date with the pending changes. Also run when the
        # pending list outgrows the held ranges, so a ledger nobody reads stays bounded.
        pending = self._pending
        spans = self._spans
        if 8 * len(pending) > len(spans):  # many changes: sorting afresh is cheaper
            self._spans = spans = sorted(self._counts)
            self._total, self._disjoint = _union_size(spans)
        else:
            # While no two ranges overlap (distinct allocations, the common case) the union is
            # the sum of the lengths, moved by each range that came or went; a range that
            # reaches into a neighbour as it is placed ends that, and the union is measured.
            total, disjoint = self._total, self._disjoint
            for sign, (start, end) in pending:
                at = bisect.bisect_left(spans, (start, end))
                if sign > 0:
                    if disjoint and (
                        (at and spans[at - 1][1] > start)
                        or (at < len(spans) and spans[at][0] < end)
                    ):
                        disjoint = False
                    spans.insert(at, (start, end))
                    total += end - start
                else:
                    del spans[at]
                    total -= end - start
            if disjoint:
                self._total = total
            else:
                self._total, self._disjoint = _union_size(spans)
        pending.clear()
        self._fold_at = 8 * len(spans) + 256


def _union_size(spans: Sequence[tuple[int, int]]) -> tuple[int, bool]:
    # `union_size` of sorted, distinct `(start, end)` ranges.
    if not spans:
        return 0, True
    starts, ends = zip(*spans, strict=True)
    return union_size(starts, ends)


class Ledger:
    """Resident bytes per device from per-storage reference counts.

    With ``lazy=True`` the union of each device's address ranges is measured when a total is
    read after changes, instead of kept up to date on every change: for a ledger read rarely
    (`stats()`) and moved on every put.

    >>> import torch
    >>> from sessionstate._accounting import storage_entries
    >>> x = torch.zeros(8)
    >>> ledger = Ledger()
    >>> ledger.add(storage_entries(x)); ledger.add(storage_entries(x[2:]))
    >>> ledger.totals()
    {'cpu': 32}
    >>> ledger.remove(storage_entries(x)); ledger.totals()
    {'cpu': 32}
    >>> ledger.remove(storage_entries(x[2:])); ledger.totals()
    {}
    """

    def __init__(self, *, lazy: bool = False) -> None:
        self._refs: dict[Hashable, int] = {}  # storage identity -> references
        self._engine: dict[str, int] = {}  # bytes of engine-owned blocks, per device
        self._ranges: dict[str, _Ranges | _LazyRanges] = {}
        self._range_kind: type[_Ranges | _LazyRanges] = _LazyRanges if lazy else _Ranges
        self._unmapped: dict[str, int] = {}  # bytes of storages without memory (meta)

    def add(self, entries: Iterable[StorageEntry], /) -> None:
        """Add one reference to each entry's storage."""
        refs = self._refs
        born = []  # storages that had no reference: counted, in one pass
        for entry in entries:
            identity = entry[1]
            count = refs.get(identity, 0)
            refs[identity] = count + 1
            if not count and entry[3]:
                born.append(entry)
        if born:
            self._count(born, add=True)

    def remove(self, entries: Iterable[StorageEntry], /) -> None:
        """Remove one reference from each entry's storage (added before)."""
        refs = self._refs
        died = []  # storages left with no reference
        for entry in entries:
            identity = entry[1]
            count = refs[identity] - 1
            if count:
                refs[identity] = count
                continue
            del refs[identity]
            if entry[3]:
                died.append(entry)
        if died:
            self._count(died, add=False)

    def _count(self, entries: list[StorageEntry], *, add: bool) -> None:
        # Count storages that came (or went), each once; callers skip entries of no bytes.
        spans: dict[str, list[tuple[int, int]]] = {}
        for device, identity, pointer, nbytes, _ in entries:
            if isinstance(identity, EngineBlock):
                self._engine[device] = self._engine.get(device, 0) + (nbytes if add else -nbytes)
            if not pointer:
                unmapped = self._unmapped.get(device, 0)
                self._unmapped[device] = unmapped + (nbytes if add else -nbytes)
                continue
            on_device = spans.get(device)
            if on_device is None:
                on_device = spans[device] = []
            on_device.append((pointer, pointer + nbytes))
        for device, moved in spans.items():
            ranges = self._ranges.get(device)
            if ranges is None:
                ranges = self._ranges[device] = self._range_kind()
            if add:
                ranges.add_all(moved)
            else:
                ranges.remove_all(moved)

    def total(self, device: str, /) -> int:
        """Resident bytes on ``device``."""
        ranges = self._ranges.get(device)
        return (ranges.total if ranges is not None else 0) + self._unmapped.get(device, 0)

    def engine_totals(self) -> dict[str, int]:
        """Bytes of engine-owned blocks per device (each block once), for devices holding any."""
        return {d: n for d, n in sorted(self._engine.items()) if n}

    def totals(self) -> dict[str, int]:
        """Resident bytes per device, for devices holding any."""
        devices = {*self._ranges, *self._unmapped}
        out = {d: self.total(d) for d in devices}
        return {d: n for d, n in sorted(out.items()) if n}


@attrs.define(eq=False)
class _Item:
    """A stored value (an object or attribute of a session) and the storages it reaches.

    ``backing[start + i]`` are the storage entries of ``leaves[i]``; the ledger holds one
    reference per position. An item made from an earlier version of the value (``base``) that
    shares a run of leaves with it (an append-only buffer that grew, a ring that moved on)
    records how: the base's first ``dropped`` leaves are gone and the rest are this item's
    first leaves, so the ledger moves from the base to this item by the difference alone. Once
    the ledger has moved, ``base`` is cleared, so stored items never keep earlier versions
    alive.

    Versions of a value share one ``backing`` list: a successor that only appends extends
    it in place when no other item has extended it past its base's window (each item reads
    only its own window), so a commit to a long buffer costs the chunks it added.
    """

    value: object
    leaves: Sequence[object]
    backing: list[list[StorageEntry]]
    start: int = 0
    base: _Item | None = None
    dropped: int = 0

    @property
    def stop(self) -> int:
        return self.start + len(self.leaves)

    def per_leaf(self, begin: int = 0, end: int | None = None) -> list[list[StorageEntry]]:
        """The entries of ``leaves[begin:end]``."""
        stop = self.stop if end is None else self.start + end
        return self.backing[self.start + begin : stop]

    @property
    def entries(self) -> Iterator[StorageEntry]:
        return itertools.chain.from_iterable(self.per_leaf())


Values = dict[ValueKey, _Item]
"""A session's values as the ledger holds them, by `ValueKey`."""

_MAX_DROPPED = 8  # leading leaves a new version of a value may drop and still share the rest


def _shared_run(old: Sequence[object], new: Sequence[object]) -> int | None:
    # The number of leading leaves of `old` that are gone when the rest of `old` starts `new`
    # (leaf for leaf, the same objects); None when no such run exists.
    first = new[0] if new else None
    for dropped in range(min(len(old), _MAX_DROPPED + 1)):
        kept = len(old) - dropped
        if kept > len(new) or old[dropped] is not first:  # (a cheap test before the slices)
            continue
        if all(map(operator.is_, old[dropped:], new[:kept])):
            return dropped
    return None


def _walk(value: object, previous: _Item | None) -> _Item:
    """``value``'s item, reusing the entries of the leaves ``previous`` (its earlier version) holds.

    Raises:
        UnsupportedTensorError: for a leaf the accounting cannot count (naming its key path
            inside ``value``).
    """
    kind = type(value)
    if kind in _SCALAR_LEAVES:  # a leaf holding no storage: nothing to count or share
        return _Item(value, (value,), [[]])
    if value is None:
        return _Item(value, (), [])
    if kind is torch.Tensor:  # a leaf itself, as `tree_leaves` would say
        leaves: Sequence[object] = (value,)
    else:
        if previous is not None:
            derived = derivation(value)
            if derived is not None and derived.base() is previous.value:
                # The transition that built `value` said how (a buffer's commit): count only
                # the leaves it added, whatever the value's history.
                dropped = min(derived.dropped, len(previous.leaves))
                kept = len(previous.leaves) - dropped
                added = _count_leaves(value, derived.leaves[kept:])
                return _successor(value, derived.leaves, previous, dropped, added)
        flat = _flat_cache_leaves(value)
        leaves = tree_leaves(value) if flat is None else flat
    shared = None if previous is None else _shared_run(previous.leaves, leaves)
    if previous is None or shared is None:
        return _Item(value, leaves, _count_leaves(value, leaves))
    kept = len(previous.leaves) - shared
    return _successor(value, leaves, previous, shared, _count_leaves(value, leaves[kept:]))


def _flat_cache_leaves(value: object) -> list[torch.Tensor] | None:
    # The leaves of a `TensorCache` whose contents are a flat tuple of plain tensors and None
    # (a streaming encoder's feature cache), as `tree_leaves` lists them but without the
    # flatten; None for any other value.
    if type(value) is TensorCache:
        contents = value.contents
        if type(contents) is tuple and _TENSOR_OR_NONE.issuperset(map(type, contents)):
            return [leaf for leaf in contents if leaf is not None]
    return None


_TENSOR_OR_NONE = frozenset({torch.Tensor, type(None)})

# Attribute values that are leaves themselves, walked without a tree flatten.
_SCALAR_LEAVES = frozenset({int, float, bool, str, bytes})

_COMPACT_AT = 64  # positions a ring's backing may lead with (dropped) before it is copied


def _successor(
    value: object,
    leaves: Sequence[object],
    previous: _Item,
    dropped: int,
    added: list[list[StorageEntry]],
) -> _Item:
    # `previous`'s leaves less its first `dropped`, then `added`: extend the shared backing
    # in place while `previous` ends it (nobody appended past it), else copy the kept run.
    backing, start = previous.backing, previous.start + dropped
    if previous.stop == len(backing) and start <= _COMPACT_AT + len(leaves):
        backing.extend(added)
    else:
        backing, start = previous.per_leaf(dropped) + added, 0
    return _Item(value, leaves, backing, start, previous, dropped)


def _count_leaves(value: object, leaves: Sequence[object]) -> list[list[StorageEntry]]:
    try:
        return [leaf_entries(leaf) for leaf in leaves]
    except _RefusedError:
        storage_entries(value)  # raises, naming the leaf's key path
        raise


def entries_of(values: Mapping[ValueKey, _Item]) -> Iterator[StorageEntry]:
    """Every storage entry of ``values``, value by value."""
    for item in values.values():
        yield from item.entries


class SessionLedger:
    """Per session, the storages each stored value reaches; and the `Ledger` of them all.

    A put walks only the values that changed (`values_for`, which changes nothing), then moves
    the ledger by the difference (`set`). The caller serialises access.

    With ``per_session=True`` it also keeps one `Ledger` per session, moved by the same
    difference, so what a session holds alone (`session_total`, each storage once) costs what
    changed too; a byte budget needs it to refuse a record that alone exceeds a device's budget.

    >>> import torch
    >>> from sessionstate import SessionState
    >>> ledger = SessionLedger()
    >>> state = SessionState(attrs={"x": torch.zeros(4)})
    >>> _ = ledger.set("a", ledger.values_for("a", state))
    >>> ledger.totals()
    {'cpu': 16}
    >>> budgeted = SessionLedger(per_session=True)
    >>> _ = budgeted.set("a", budgeted.values_for("a", state))
    >>> _ = budgeted.set("b", budgeted.values_for("b", state))
    >>> budgeted.totals(), budgeted.session_total("b", "cpu")
    ({'cpu': 16}, 16)
    """

    def __init__(self, *, per_session: bool = False) -> None:
        # Without per-session totals (no byte budget) nobody reads the totals between puts.
        self._ledger = Ledger(lazy=not per_session)
        self._values: dict[Hashable, Values] = {}
        self._alone: dict[Hashable, Ledger] | None = {} if per_session else None

    def values_for(self, session_id: Hashable, state: SessionState, /) -> Values:
        """``state``'s values, reusing the stored ones it shares (only changed values walked).

        Raises:
            UnsupportedTensorError: for a leaf the accounting cannot count, naming its key
                path inside the session.
        """
        held = self._values.get(session_id, {})
        out: Values = {}
        try:
            for key, value in iter_values(state):
                item = held.get(key)
                out[key] = item if item is not None and item.value is value else _walk(value, item)
        except UnsupportedTensorError:
            # Walked value by value, the error lacks the key path inside the session: walk the
            # whole record once more so the error names it.
            storage_entries(state)
            raise
        return out

    def held(self, session_id: Hashable, /) -> Values:
        """The values stored for ``session_id`` (empty if none)."""
        return self._values.get(session_id, {})

    def set(self, session_id: Hashable, values: Values, /) -> Values:
        """Store ``values`` for ``session_id`` (empty: forget it); return the values replaced.

        Adds before it removes, so a storage both versions reach never drops out of the ledger
        in between. The ledger holds one reference per leaf position of each value; a value
        derived from the one stored (its base) moves by the difference: the leaves it added,
        the leaves its base dropped.
        """
        ledgers = [self._ledger]
        if self._alone is not None:
            alone = self._alone.get(session_id)
            if alone is None:
                alone = self._alone[session_id] = Ledger()
            ledgers.append(alone)
        previous = self._values.get(session_id, {})
        added: list[StorageEntry] = []
        for key, item in values.items():
            old = previous.get(key)
            if old is item:
                continue
            kept = len(old.leaves) - item.dropped if old is not None and item.base is old else 0
            for entries in item.per_leaf(kept):
                added += entries
        removed: list[StorageEntry] = []
        for key, old in previous.items():
            new = values.get(key)
            if new is old:
                continue
            gone = new.dropped if new is not None and new.base is old else len(old.leaves)
            for entries in old.per_leaf(0, gone):
                removed += entries
        for ledger in ledgers:
            ledger.add(added)
        for ledger in ledgers:
            ledger.remove(removed)
        for item in values.values():
            item.base = None
        if values:
            self._values[session_id] = values
        else:
            self._values.pop(session_id, None)
            if self._alone is not None:
                del self._alone[session_id]
        return previous

    def total(self, device: str, /) -> int:
        """Resident bytes on ``device``, each storage once across every session."""
        return self._ledger.total(device)

    def totals(self) -> dict[str, int]:
        """Resident bytes per device, for devices holding any."""
        return self._ledger.totals()

    def session_total(self, session_id: Hashable, device: str, /) -> int:
        """Bytes ``session_id``'s stored values alone hold on ``device``, each storage once.

        Raises:
            RuntimeError: if the ledger was built without ``per_session=True``.
        """
        if self._alone is None:
            msg = "`session_total` needs a ledger built with `SessionLedger(per_session=True)`."
            raise RuntimeError(msg)
        alone = self._alone.get(session_id)
        return 0 if alone is None else alone.total(device)

    def engine_totals(self) -> dict[str, int]:
        """Bytes of engine-owned blocks per device, for devices holding any."""
        return self._ledger.engine_totals()
