"""The manager's byte ledger: resident bytes per device, kept up to date incrementally.

`SessionLedger` is the manager's accounting part: per session, the storages each stored value
reaches, and one `Ledger` of them all.

Every stored value (a state object or an attribute of a session) adds one reference to each
storage it reaches; replacing, dropping or parking the value removes them. A storage counts
while it has a reference, once, however many values reach it, so the totals are what
`nbytes_by_device` of all stored records together would say (each storage once; storages over
overlapping memory as the union of their address ranges), at the cost of the values that
changed rather than a walk of every session.

The ledger is lazy: it counts the common storage, one that
owns its memory (an allocator made it), by its size alone, and so the blocks of an engine pool
whose storage is not itself held: no two live allocations overlap, nor two blocks. Only a
device that also holds memory some storage does not own (a NumPy array's, a loaded file's) has
its address ranges sorted and their union measured, when a total is read (`_LazyRanges`).
Without a byte budget only `stats()` reads the totals; under one, every put reads them (and
the per-session ledgers' totals of the session it stores), which costs a dict lookup per
device while the device holds owned storages only. The eager reference it is tested against
(every range placed as it comes) is `sessionstate.testing.EagerLedger`.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import cast

import attrs
import torch

from sessionstate._accounting import (
    EngineBlock,
    RefusedError,
    StorageEntry,
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


class _LazyRanges:
    """The shared address ranges of one device, and their union with the owned ones when read.

    For the ledger, which sorts each storage's range into one of two kinds as it comes
    (`Ledger`):

    - *owned*: the whole allocation of a storage that owns its memory (one an allocator made:
      `UntypedStorage.resizable`), or a block of an engine pool whose storage owns its memory
      and is not itself held. No two live allocations overlap, nor two blocks, so while a
      device holds only owned ranges its total is the sum of their lengths, kept by the
      ledger as they come and go, and no range is placed anywhere.
    - *shared*: any other range (memory its storage does not own: `torch.from_numpy`, a
      loaded or memory-mapped file, an entry a leaf reports itself; a pool's storage held
      beside its blocks). These can overlap each other and owned ones; they are held here,
      as a multiset.

    While a shared range is held, a read after changes brings the ranges of both kinds,
    sorted, up to date (placing each range that came or went, or sorting afresh after many)
    and sums their union. The sorted ranges are two lists, starts and ends, so placing a
    range compares integers. The pending changes never outgrow the held ranges (by 8x, plus
    256): past that they are folded in without a read.
    """

    def __init__(self) -> None:
        self._counts: dict[tuple[int, int], int] = {}  # distinct shared ranges: references
        self.shared = 0  # shared ranges held, one per storage
        # Owned and distinct shared ranges as of the last read, sorted by (start, end), as two
        # lists; kept up to date (`sorted`) only while shared ranges are held.
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.sorted = False
        self._pending: list[tuple[int, int, int]] = []  # (+1 | -1, start, end) since then
        self._total = 0
        self._disjoint = True  # whether no two sorted ranges overlap
        self._fold_at = 256  # pending changes that trigger a fold without a read

    def add_shared(self, spans: Sequence[tuple[int, int]]) -> None:
        counts, pending, tracked = self._counts, self._pending, self.sorted
        for span in spans:
            count = counts.get(span, 0)
            counts[span] = count + 1
            if not count and tracked:
                pending.append((1, *span))
        self.shared += len(spans)

    def remove_shared(self, spans: Sequence[tuple[int, int]]) -> None:
        counts, pending, tracked = self._counts, self._pending, self.sorted
        for span in spans:
            count = counts[span] - 1
            if count:
                counts[span] = count
                continue
            del counts[span]
            if tracked:
                pending.append((-1, *span))
        self.shared -= len(spans)
        if not self.shared:  # owned ranges alone again: none to place until a shared one
            self.sorted = False
            pending.clear()

    def place(self, sign: int, start: int, end: int) -> None:
        """Note an owned range that came (``sign`` 1) or went (-1) while ranges are sorted."""
        self._pending.append((sign, start, end))

    def overdue(self) -> bool:
        """Whether the pending changes have outgrown the held ranges (fold them unread)."""
        return len(self._pending) > self._fold_at

    def total(self, owned: Callable[[], Iterable[tuple[int, int]]]) -> int:
        """The union of the shared ranges and the owned ones (``owned()``, read if needed)."""
        if self._pending or not self.sorted:
            self.fold(owned)
        return self._total

    def fold(self, owned: Callable[[], Iterable[tuple[int, int]]]) -> None:
        """Bring the sorted ranges and the union up to date with the pending changes."""
        pending = self._pending
        starts, ends = self._starts, self._ends
        if not self.sorted or 8 * len(pending) > len(starts):  # sorting afresh is cheaper
            spans = sorted(itertools.chain(owned(), self._counts))
            self._starts = starts = [start for start, _ in spans]
            self._ends = ends = [end for _, end in spans]
            self._total, self._disjoint = union_size(starts, ends)
            self.sorted = True
        else:
            # While no two ranges overlap (distinct allocations, the common case) the union is
            # the sum of the lengths, moved by each range that came or went; a range that
            # reaches into a neighbour as it is placed ends that, and the union is measured.
            total, disjoint = self._total, self._disjoint
            for sign, start, end in pending:
                at = bisect.bisect_left(starts, start)
                while at < len(starts) and starts[at] == start and ends[at] < end:
                    at += 1  # ranges sharing a start sort by end
                if sign > 0:
                    if disjoint and (
                        (at and ends[at - 1] > start) or (at < len(starts) and starts[at] < end)
                    ):
                        disjoint = False
                    starts.insert(at, start)
                    ends.insert(at, end)
                    total += end - start
                else:
                    del starts[at], ends[at]
                    total -= end - start
            if disjoint:
                self._total = total
            else:
                self._total, self._disjoint = union_size(starts, ends)
        pending.clear()
        self._fold_at = 8 * len(starts) + 256


class Ledger:
    """Resident bytes per device from per-storage reference counts.

    Lazy: the union of each device's address ranges is measured when a total is read after
    changes, instead of kept up to date on every change (the manager's ledgers are moved on
    every put and read by `stats()`, and, under a budget, by the checks of every put); and a
    storage that owns its memory counts by its size alone, placing no range, unless the device
    holds a range over memory some storage does not own (`_LazyRanges`).

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

    def __init__(self) -> None:
        self._refs: dict[Hashable, int] = {}  # storage identity -> references
        self._engine: dict[str, int] = {}  # bytes of engine-owned blocks, per device
        self._unmapped: dict[str, int] = {}  # bytes of storages without memory (meta)
        # The owned storages held (identity -> entry), their bytes per device, the shared
        # ranges per device, and the devices whose ranges are sorted (owned changes placed).
        self._owned: dict[Hashable, StorageEntry] = {}
        self._pools: dict[int, int] = {}  # pool storage identity -> its blocks counted by size
        self._owned_bytes: dict[str, int] = {}
        self._shared: dict[str, _LazyRanges] = {}
        self._tracked: set[str] = set()

    def add(self, entries: Iterable[StorageEntry], /) -> None:
        """Add one reference to each entry's storage."""
        refs = self._refs
        born = []  # storages that had no reference: counted, in one pass
        # The common storages, those that own their memory and blocks of a pool that owns
        # its memory, are counted as they come.
        owned, owned_bytes, tracked = self._owned, self._owned_bytes, self._tracked
        pools = self._pools
        for entry in entries:
            identity = entry[1]
            count = refs.get(identity, 0)
            refs[identity] = count + 1
            if count or not entry[3]:
                continue
            keepalive = entry[4]
            if (
                type(keepalive) is torch.UntypedStorage
                and keepalive._cdata == identity
                and entry[2]
                and keepalive.resizable()
                and identity not in pools  # not a pool whose blocks are counted by size
            ):
                pass
            elif type(identity) is EngineBlock and _pool_owns(identity, entry, refs):
                pools[identity.pool] = pools.get(identity.pool, 0) + 1
                self._engine[entry[0]] = self._engine.get(entry[0], 0) + entry[3]
            else:
                born.append(entry)
                continue
            owned[identity] = entry
            device = entry[0]
            owned_bytes[device] = owned_bytes.get(device, 0) + entry[3]
            if tracked and device in tracked:
                self._shared[device].place(1, entry[2], entry[2] + entry[3])
        if born:
            self._count(born, add=True)
        self._fold_overdue()

    def remove(self, entries: Iterable[StorageEntry], /) -> None:
        """Remove one reference from each entry's storage (added before)."""
        refs, owned = self._refs, self._owned
        owned_bytes, tracked = self._owned_bytes, self._tracked
        died = []  # storages left with no reference
        for entry in entries:
            identity = entry[1]
            count = refs[identity] - 1
            if count:
                refs[identity] = count
                continue
            del refs[identity]
            if not entry[3]:
                continue
            counted = owned.pop(identity, None) if owned else None
            if counted is not None:  # counted by size (as it came, whatever `entry` says)
                device, nbytes = counted[0], counted[3]
                owned_bytes[device] -= nbytes
                if type(identity) is EngineBlock:
                    self._engine[device] -= nbytes
                    left = self._pools[identity.pool] - 1
                    if left:
                        self._pools[identity.pool] = left
                    else:
                        del self._pools[identity.pool]
                if tracked and device in tracked:
                    self._shared[device].place(-1, counted[2], counted[2] + nbytes)
            else:
                died.append(entry)
        if died:
            self._count(died, add=False)
        self._fold_overdue()

    def _fold_overdue(self) -> None:
        # A lazy ledger nobody reads stays bounded: after each change, fold the pending changes
        # of a sorted device that outgrew its held ranges.
        for device in self._tracked:
            ranges = self._shared[device]
            if ranges.overdue():
                ranges.fold(functools.partial(self._owned_spans, device))

    def _owned_spans(self, device: str) -> Iterator[tuple[int, int]]:
        for entry_device, _, pointer, nbytes, _ in self._owned.values():
            if entry_device == device:
                yield pointer, pointer + nbytes

    def _count(self, entries: list[StorageEntry], *, add: bool) -> None:
        # Count storages that came (or went), each once; callers skip entries of no bytes and
        # the owned storages counted by size.
        spans: dict[str, list[tuple[int, int]]] = {}
        for device, identity, pointer, nbytes, _ in entries:
            signed = nbytes if add else -nbytes
            if isinstance(identity, EngineBlock):
                self._engine[device] = self._engine.get(device, 0) + signed
            if not pointer:
                self._unmapped[device] = self._unmapped.get(device, 0) + signed
                continue
            on_device = spans.get(device)
            if on_device is None:
                on_device = spans[device] = []
            on_device.append((pointer, pointer + nbytes))
        for device, moved in spans.items():
            shared = self._shared.get(device)
            if shared is None:
                shared = self._shared[device] = _LazyRanges()
            if add:
                shared.add_shared(moved)
            else:
                shared.remove_shared(moved)
                if not shared.sorted:
                    self._tracked.discard(device)

    def total(self, device: str, /) -> int:
        """Resident bytes on ``device``."""
        unmapped = self._unmapped.get(device, 0)
        shared = self._shared.get(device)
        if shared is None or not shared.shared:
            return self._owned_bytes.get(device, 0) + unmapped
        total = shared.total(functools.partial(self._owned_spans, device))
        self._tracked.add(device)  # sorted now: owned changes are placed
        return total + unmapped

    def references(self, identity: Hashable, /) -> int:
        """The references held to storage ``identity`` (0 if none)."""
        return self._refs.get(identity, 0)

    def engine_totals(self) -> dict[str, int]:
        """Bytes of engine-owned blocks per device (each block once), for devices holding any."""
        return {d: n for d, n in sorted(self._engine.items()) if n}

    def totals(self) -> dict[str, int]:
        """Resident bytes per device, for devices holding any."""
        devices = {*self._unmapped, *self._owned_bytes, *self._shared}
        out = {d: self.total(d) for d in devices}
        return {d: n for d, n in sorted(out.items()) if n}


def _pool_owns(block: EngineBlock, entry: StorageEntry, refs: Mapping[Hashable, int]) -> bool:
    # Whether an engine block's entry can be counted by size: its pool's storage (the entry's
    # keepalive, a tensor) owns its memory and is not itself held, so only the pool's blocks
    # reach that memory, and blocks do not overlap.
    pool, keepalive = block.pool, entry[4]
    if not entry[2] or pool in refs or not isinstance(keepalive, torch.Tensor):
        return False
    storage = keepalive.untyped_storage()
    return bool(storage._cdata == pool and storage.resizable())


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
    grew: int = -1
    """Where this item's walk extended ``backing`` in place (its length before), until the item
    is stored: a put refused after the walk cuts the extension off again (`undo_growth`), so
    a refused record's new leaves are not kept alive by the stored item's backing."""

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


class _Walked(dict[ValueKey, _Item]):
    """`Values` as `SessionLedger.values_for` builds them, with what the next walk compares.

    ``names`` (the record's object and attribute names, None for a record class with fields
    of its own), ``order`` and ``raw`` (its keys and values in order) let the walk of a
    successor with the same names find the values that changed by identity, in one pass, and
    walk those alone;
    ``parent`` (the values it was walked against, until stored) and ``changed`` (the keys
    walked) let the ledger move by those keys alone.
    """

    __slots__ = ("changed", "names", "order", "parent", "raw")  # (no instance dict to make)

    names: tuple[tuple[str, ...], tuple[str, ...]] | None
    order: tuple[ValueKey, ...]
    raw: tuple[object, ...]
    parent: Values | None
    changed: tuple[ValueKey, ...]


_NONE = _Walked()  # no values held
_NONE.names, _NONE.order, _NONE.raw, _NONE.parent, _NONE.changed = None, (), (), None, ()

# Per record class, whether it holds objects and attributes alone (no fields of its own).
_PLAIN: dict[type, bool] = {}

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
    # A ring's backing leads with the entries of the chunks it dropped, and an entry keeps
    # its storage alive: copy the kept run once they outnumber the live ones, so the ledger
    # keeps at most one ring's worth of dropped chunks alive (amortised O(1) per commit).
    grew = -1
    if previous.stop == len(backing) and start <= len(leaves):
        grew = len(backing)
        backing.extend(added)
    else:
        backing, start = previous.per_leaf(dropped) + added, 0
    return _Item(value, leaves, backing, start, previous, dropped, grew)


def _count_leaves(value: object, leaves: Sequence[object]) -> list[list[StorageEntry]]:
    try:
        return [leaf_entries(leaf) for leaf in leaves]
    except RefusedError:
        storage_entries(value)  # raises, naming the leaf's key path
        raise


def entries_of(values: Mapping[ValueKey, _Item]) -> Iterator[StorageEntry]:
    """Every storage entry of ``values``, value by value."""
    for item in values.values():
        yield from item.entries


def _moves(previous: Values, values: Values) -> tuple[list[StorageEntry], list[StorageEntry]]:
    # The references a session's ledger entries gain and lose going from `previous` to
    # `values`: nothing for a value they share (most values of a step); for a value derived
    # from the one it replaces, the leaves it added and those its base dropped. Clears the
    # bases of `values` (stored items keep no earlier versions alive).
    added: list[StorageEntry] = []
    removed: list[StorageEntry] = []
    matched = 0  # keys of `previous` that `values` holds too
    pairs: Iterable[tuple[ValueKey, _Item]] = values.items()
    if getattr(values, "parent", None) is previous:  # walked against `previous`: same keys
        pairs = [(key, values[key]) for key in values.changed]  # type: ignore[attr-defined]
        matched = len(previous) - len(pairs)
    for key, item in pairs:
        old = previous.get(key)
        if old is item:
            matched += 1
            continue
        base, item.base, item.grew = item.base, None, -1  # stored: its extension stays
        kept = 0
        if old is not None:
            matched += 1
            derived = base is old
            kept = len(old.leaves) - item.dropped if derived else 0
            for entries in old.per_leaf(0, item.dropped if derived else len(old.leaves)):
                removed += entries
        for entries in item.per_leaf(kept):
            added += entries
    if matched < len(previous):  # values gone from the record
        for key, old in previous.items():
            if key not in values:
                for entries in old.per_leaf():
                    removed += entries
    return added, removed


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
        # Owned storages are counted by size; shared ranges are placed when a total is
        # read (by `stats()`, and under a budget by the checks of every put).
        self._ledger = Ledger()
        self._values: dict[Hashable, Values] = {}
        self._alone: dict[Hashable, Ledger] | None = {} if per_session else None

    def values_for(self, session_id: Hashable, state: SessionState, /) -> Values:
        """``state``'s values, reusing the stored ones it shares (only changed values walked).

        Raises:
            UnsupportedTensorError: for a leaf the accounting cannot count, naming its key
                path inside the session.
        """
        held = self._values.get(session_id, _NONE)
        objects, attributes = state._objects, state._attrs
        plain = _PLAIN.get(type(state))
        if plain is None:
            plain = _PLAIN[type(state)] = len(attrs.fields(type(state))) == 2
        names = (tuple(objects), tuple(attributes)) if plain else None
        raw = (*objects.values(), *attributes.values()) if plain else ()
        try:
            if names is not None and getattr(held, "names", None) == names:
                # The names the stored values were walked from: compare by identity, in key
                # order, and walk what changed alone.
                last = cast(_Walked, held)
                out = _Walked(last)
                changed = []
                moved = map(operator.is_not, last.raw, raw)
                for key, value in itertools.compress(zip(last.order, raw, strict=True), moved):
                    out[key] = _walk(value, last[key])
                    changed.append(key)
                out.parent, out.changed, out.order = last, tuple(changed), last.order
            else:
                out = _Walked()
                for key, value in iter_values(state):
                    item = held.get(key)
                    out[key] = (
                        item if item is not None and item.value is value else _walk(value, item)
                    )
                out.order, out.parent, out.changed = tuple(out), None, ()
            out.names, out.raw = names, raw
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
        return self.set_many(((session_id, values),))[0]

    def set_many(self, items: Iterable[tuple[Hashable, Values]], /) -> list[Values]:
        """`set` for each of ``items`` (distinct sessions), the ledger of them all moved once:
        every reference a batch adds, then every one it removes. Returns the values replaced,
        in order."""
        replaced: list[Values] = []
        added: list[StorageEntry] = []
        removed: list[StorageEntry] = []
        alone_ledgers = self._alone
        for session_id, values in items:
            previous = self._values.get(session_id, _NONE)
            came, went = _moves(previous, values)
            if type(values) is _Walked:
                values.parent = None  # stored values keep no earlier versions alive
            if alone_ledgers is not None:
                alone = alone_ledgers.get(session_id)
                if alone is None:
                    alone = alone_ledgers[session_id] = Ledger()
                if came:
                    alone.add(came)
                if went:
                    alone.remove(went)
            added += came
            removed += went
            if values:
                self._values[session_id] = values
            else:
                self._values.pop(session_id, None)
                if alone_ledgers is not None:
                    del alone_ledgers[session_id]
            replaced.append(previous)
        if added:
            self._ledger.add(added)
        if removed:
            self._ledger.remove(removed)
        return replaced

    @staticmethod
    def growth(walked: Iterable[Values], /) -> list[tuple[_Item, int]]:
        """The items of ``walked`` (values not stored yet) whose walk extended a stored item's
        backing in place, with where: what `undo_growth` cuts off if they are not stored."""
        out = []
        for values in walked:
            items: Iterable[_Item] = values.values()
            if getattr(values, "parent", None) is not None:  # walked against the stored ones
                items = [values[key] for key in values.changed]  # type: ignore[attr-defined]
            out += [(item, item.grew) for item in items if item.grew >= 0]
        return out

    @staticmethod
    def undo_growth(grown: Sequence[tuple[_Item, int]], /) -> None:
        """Cut off the extensions ``grown`` made (values refused after their walk), last first,
        where nothing extended the backing since: the entries there keep storages alive."""
        for item, at in reversed(grown):
            if len(item.backing) == item.stop:
                del item.backing[at:]
            item.grew = -1

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

    def references(self, identity: Hashable, /) -> int:
        """How many stored leaf positions, across every session, reach storage ``identity``."""
        return self._ledger.references(identity)
