"""Admission: the session cap, the per-device byte ledger, and the planner that parks or evicts.

`BudgetedTable` is the manager's session table seen as capacity: the cap on sessions, each
stored value and the storages it reaches, the ledger's totals per device, the parked objects
and the tier handles the table created. A new session at the cap evicts the least recently
used one or is refused (``on_full``). With a byte budget (``max_bytes``), making room parks
the least recently used sessions' parkable objects first, then applies ``on_full``.
"""

from __future__ import annotations

import itertools
import logging
import operator
import tempfile
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Generic, Literal

import attrs
import torch
from typing_extensions import TypeVar

from sessionstate._accounting import (
    EngineBlock,
    StorageEntry,
    _RefusedError,
    _storages,
    count_entries,
    storage_entries,
)
from sessionstate._errors import ParkingError, SessionAdmissionError, UnsupportedTensorError
from sessionstate._ledger import Ledger, parse_nbytes
from sessionstate._objects import ParkedObject
from sessionstate._park import ParkedBytes, SpoolDir, Tier, reclaim_spool
from sessionstate._session import SessionState
from sessionstate._tree import tree_leaves

__all__ = ["BudgetedTable", "OnFull", "SessionT", "check_max_bytes"]

logger = logging.getLogger("sessionstate")

OnFull = Literal["evict", "refuse"]

SessionT = TypeVar("SessionT", bound=SessionState, default=SessionState)
"""The record type a manager holds; `SessionState` when the manager is not parameterised."""


@attrs.define(eq=False)
class _Item:
    """A stored value (an object or attribute of a session) and the storages it reaches.

    ``per_leaf[i]`` are the storage entries of ``leaves[i]``; the ledger holds one reference
    per position. An item made from an earlier version of the value (``base``) that shares a
    run of leaves with it (an append-only buffer that grew, a ring that moved on) records how:
    the base's first ``dropped`` leaves are gone and the rest are this item's first leaves, so
    the ledger moves from the base to this item by the difference alone. Once the ledger has
    moved, ``base`` is cleared, so stored items never keep earlier versions alive.
    """

    value: object
    leaves: list[object]
    per_leaf: list[list[StorageEntry]]
    base: _Item | None = None
    dropped: int = 0

    @property
    def entries(self) -> Iterator[StorageEntry]:
        return itertools.chain.from_iterable(self.per_leaf)


_Values = dict[tuple[str, str], _Item]
_EXTRA_FIELDS: dict[type, tuple[str, ...]] = {}
_MAX_DROPPED = 8  # leading leaves a new version of a value may drop and still share the rest


def _value_items(state: SessionState) -> list[tuple[tuple[str, str], object]]:
    items: list[tuple[tuple[str, str], object]] = [
        (("o", name), obj) for name, obj in state.objects.items()
    ]
    items.extend((("a", name), value) for name, value in state.attrs.items())
    cls = type(state)
    extra = _EXTRA_FIELDS.get(cls)
    if extra is None:  # a subclass with fields of its own
        extra = _EXTRA_FIELDS[cls] = tuple(
            f.name for f in attrs.fields(cls) if f.name not in ("_objects", "_attrs")
        )
    items.extend((("f", name), getattr(state, name)) for name in extra)
    return items


def _shared_run(old: list[object], new: list[object]) -> int | None:
    # The number of leading leaves of `old` that are gone when the rest of `old` starts `new`
    # (leaf for leaf, the same objects); None when no such run exists.
    for dropped in range(min(len(old), _MAX_DROPPED + 1)):
        kept = len(old) - dropped
        if kept <= len(new) and all(map(operator.is_, old[dropped:], new[:kept])):
            return dropped
    return None


def _walk(value: object, previous: _Item | None) -> _Item:
    """``value``'s item, reusing the entries of the leaves ``previous`` (its earlier version) holds.

    Raises:
        UnsupportedTensorError: for a leaf the accounting cannot count (naming its key path
            inside ``value``).
    """
    leaves = tree_leaves(value)
    dropped = None if previous is None else _shared_run(previous.leaves, leaves)
    if previous is None or dropped is None:
        return _Item(value, leaves, _count_leaves(value, leaves))
    kept = len(previous.leaves) - dropped
    per_leaf = previous.per_leaf[dropped:] + _count_leaves(value, leaves[kept:])
    return _Item(value, leaves, per_leaf, previous, dropped)


def _count_leaves(value: object, leaves: list[object]) -> list[list[StorageEntry]]:
    try:
        return [list(_storages(leaf)) for leaf in leaves]
    except _RefusedError:
        storage_entries(value)  # raises, naming the leaf's key path
        raise


def check_max_bytes(max_bytes: object) -> dict[str, int] | None:
    if max_bytes is None:
        return None
    if not isinstance(max_bytes, Mapping):
        msg = (
            f"`max_bytes` must map device strings to byte budgets, got {max_bytes!r} "
            f"({type(max_bytes).__name__}); e.g. `max_bytes={{'cuda:0': 24 * 2**30}}`."
        )
        raise TypeError(msg)
    out: dict[str, int] = {}
    for key, value in max_bytes.items():
        try:
            device = torch.device(key)
        except (RuntimeError, TypeError):
            device = None
        if device is None or (device.type not in ("cpu", "meta") and device.index is None):
            msg = (
                f"`max_bytes` key {key!r} ({type(key).__name__}) is not a device string with "
                "its index; name each budgeted device as tensors report it, e.g. 'cuda:0' or "
                "'cpu'."
            )
            raise ValueError(msg)
        out[str(device)] = parse_nbytes(value, name=f"max_bytes[{key!r}]")
    return out


class BudgetedTable(Generic[SessionT]):
    """The session table's bytes: the ledger, the budget and parking (a base of the manager).

    The subclass owns the table's public behaviour and calls these methods under its lock; it
    provides `_forget` (drop a session entirely) and `_record_versions`; `_put_locked` is the
    one way a record is admitted and stored.
    """

    _table: OrderedDict[Hashable, SessionT]
    _max_sessions: int
    _on_full: OnFull
    _evictions: int
    _warned_eviction: bool

    def _init_budget(
        self, max_bytes: dict[str, int] | None, park_tier: Tier, spool_root: str | None
    ) -> None:
        self._max_bytes = max_bytes
        self._park_tier: Tier = park_tier
        self._spool_root = spool_root
        self._spool_dir: SpoolDir | None = None
        # The byte ledger, and per session the storages each stored value reaches (so a put
        # walks only the values that changed).
        self._ledger = Ledger()
        self._values: dict[Hashable, _Values] = {}
        self._parked: dict[Hashable, dict[str, ParkedObject]] = {}
        self._handles: dict[int, ParkedBytes] = {}  # the tier handles this manager created
        self._parks = 0
        self._unparks = 0
        if park_tier == "disk":  # what dead processes left on this spool root goes now
            reclaim_spool(spool_root if spool_root is not None else tempfile.gettempdir())

    def _forget(self, session_id: Hashable) -> bool:
        raise NotImplementedError

    def _record_versions(self, session_id: Hashable, state: SessionState) -> None:
        raise NotImplementedError

    def _put_locked(self, session_id: Hashable, state: SessionT, *, touch: bool) -> None:
        # Caller holds the lock. Nothing changes unless the whole put succeeds, except that
        # other sessions may have been parked (losslessly) or evicted to make room.
        values = self._values_for(session_id, state)
        if self._max_bytes is not None:
            self._check_fits(session_id, values)
        if session_id in self._table:
            if touch:
                self._table.move_to_end(session_id)
        else:
            self._admit(session_id)
        previous = self._set_values(session_id, values)
        if self._max_bytes is not None:
            try:
                self._make_room(session_id, {})
            except BaseException:
                self._set_values(session_id, previous)
                raise
        self._store(session_id, state)

    def _store(self, session_id: Hashable, state: SessionT) -> None:
        # Caller holds the lock and has accounted the record's values (`_set_values`).
        self._table[session_id] = state
        self._track_parked(session_id, state)
        self._record_versions(session_id, state)

    def _admit(self, session_id: Hashable) -> None:
        # Caller holds the lock and has checked that `session_id` is new.
        if len(self._table) < self._max_sessions:
            return
        if self._on_full == "refuse":
            msg = (
                f"Cannot admit session {session_id!r}: the manager holds "
                f"{self._max_sessions} sessions (its cap) and `on_full='refuse'`. Drop a "
                "finished session first, or raise `max_sessions`."
            )
            raise SessionAdmissionError(msg)
        evicted = next(iter(self._table))
        self._forget(evicted)
        self._evictions += 1
        self._warn_evicted(evicted, f"the session cap (max_sessions={self._max_sessions})")

    def _warn_evicted(self, evicted: Hashable, by: str) -> None:
        # Caller holds the lock. One warning per manager; `stats()` counts every eviction.
        if self._warned_eviction:
            return
        self._warned_eviction = True
        logger.warning(
            "Session %r was evicted by %s although nobody ended it; its state is lost. End "
            "finished sessions explicitly with `drop(session_id)` (`drop_session(session_id)` "
            "on a model pipeline), or raise the cap. Warned once per manager; "
            "`stats()['evictions']` counts every eviction.",
            evicted,
            by,
        )

    def _byte_stats(self, out: dict[str, int]) -> dict[str, int]:
        # Caller holds the lock. Adds the ledger's and the budget's keys to `stats()`.
        totals = self._ledger.totals()
        out["total_nbytes"] = sum(totals.values())
        for device, nbytes in totals.items():
            out[f"nbytes:{device}"] = nbytes
        for device, nbytes in self._ledger.engine_totals().items():
            out[f"engine_nbytes:{device}"] = nbytes
        if self._max_bytes is None:
            return out
        for device in sorted(self._max_bytes):
            out[f"max_bytes:{device}"] = self._max_bytes[device]
        parked = {"host": 0, "disk": 0}
        for objects in self._parked.values():
            for handle in _handles_of(objects.values()):
                parked[handle.tier] += handle.nbytes
        out["parked_sessions"] = len(self._parked)
        out["parks"] = self._parks
        out["unparks"] = self._unparks
        out["nbytes_parked:host"] = parked["host"]
        out["nbytes_parked:disk"] = parked["disk"]
        return out

    def _track_parked(self, session_id: Hashable, state: SessionState) -> None:
        # Caller holds the lock: `state` is now stored for `session_id`.
        parked = {n: o for n, o in state.objects.items() if isinstance(o, ParkedObject)}
        kept = {id(handle) for handle in _handles_of(parked.values())}
        for handle in _handles_of(self._parked.pop(session_id, {}).values()):
            if id(handle) not in kept:
                self._release(handle)
        if parked:
            self._parked[session_id] = parked

    def _untrack(self, session_id: Hashable) -> None:
        # Caller holds the lock: `session_id` is gone from the table.
        self._set_values(session_id, {})
        for handle in _handles_of(self._parked.pop(session_id, {}).values()):
            self._release(handle)

    # -- the ledger ------------------------------------------------------------------------------

    def _values_for(self, session_id: Hashable, state: SessionState) -> _Values:
        # Values the stored record shares with `state` keep their storages: only the values
        # that changed are walked.
        held = self._values.get(session_id, {})
        out: _Values = {}
        try:
            for key, value in _value_items(state):
                item = held.get(key)
                out[key] = item if item is not None and item.value is value else _walk(value, item)
        except UnsupportedTensorError:
            # Walked value by value, the error lacks the key path inside the session: walk the
            # whole record once more so the error names it.
            storage_entries(state)
            raise
        return out

    def _set_values(self, session_id: Hashable, values: _Values) -> _Values:
        # Caller holds the lock. Adds before it removes, so a storage both records reach never
        # drops out of the ledger in between.
        # The ledger holds one reference per leaf position of each value. A value derived
        # from the one stored (its base) moves by the difference: the leaves it added, the
        # leaves its base dropped.
        previous = self._values.get(session_id, {})
        for key, item in values.items():
            old = previous.get(key)
            if old is item:
                continue
            kept = len(old.leaves) - item.dropped if old is not None and item.base is old else 0
            for entries in item.per_leaf[kept:]:
                self._ledger.add(entries)
        for key, old in previous.items():
            new = values.get(key)
            if new is old:
                continue
            gone = new.dropped if new is not None and new.base is old else len(old.per_leaf)
            for entries in old.per_leaf[:gone]:
                self._ledger.remove(entries)
        for item in values.values():
            item.base = None
        if values:
            self._values[session_id] = values
        else:
            self._values.pop(session_id, None)
        return previous

    # -- the budget ------------------------------------------------------------------------------

    def _check_fits(self, session_id: Hashable, values: _Values) -> None:
        assert self._max_bytes is not None
        alone = count_entries(entry for item in values.values() for entry in item.entries)
        for device, budget in self._max_bytes.items():
            if alone.get(device, 0) > budget:
                msg = (
                    f"Cannot store session {session_id!r}: its record holds "
                    f"{alone[device]} bytes on {device}, more than the whole budget of "
                    f"{budget} bytes there (`max_bytes`). Raise the budget for {device}, or "
                    "keep less of the session on that device."
                )
                raise SessionAdmissionError(msg)

    def _over(self, extra: Mapping[str, int]) -> list[str]:
        assert self._max_bytes is not None
        return [
            device
            for device, budget in self._max_bytes.items()
            if self._ledger.total(device) + extra.get(device, 0) > budget
        ]

    def _make_room(self, session_id: Hashable, extra: Mapping[str, int]) -> None:
        # Caller holds the lock. Park the least recently used sessions' parkable objects,
        # oldest first and never `session_id`'s; then apply `on_full`.
        if self._max_bytes is None:
            return
        over = self._over(extra)
        if not over:
            return
        for other in list(self._table):
            if other == session_id:
                continue
            names = self._parkable(other, over)
            if names:
                self._park_session(other, names)
                over = self._over(extra)
                if not over:
                    return
        if self._on_full == "evict":
            for other in list(self._table):
                if other == session_id or not self._holds_on(other, over):
                    continue
                self._forget(other)
                self._evictions += 1
                self._warn_evicted(other, "the byte budget (`max_bytes`)")
                over = self._over(extra)
                if not over:
                    return
        device = over[0]
        wanted = self._ledger.total(device) + extra.get(device, 0)
        after = "parking and evicting" if self._on_full == "evict" else "parking"
        msg = (
            f"Cannot make room for session {session_id!r}: {device} would hold {wanted} bytes, "
            f"over its budget of {self._max_bytes[device]} bytes, even after {after} the "
            "other sessions' parkable objects (`on_full="
            f"{self._on_full!r}`). Drop finished sessions, raise `max_bytes` for {device}, or "
            "keep large values in parkable state objects rather than attributes."
        )
        raise SessionAdmissionError(msg)

    def _parkable(self, session_id: Hashable, devices: list[str]) -> list[str]:
        # The parkable objects holding bytes on `devices`, except any sharing a storage with
        # a value that stays resident (an attribute): parking it would free nothing, and
        # unparking would split the alias into two copies. Engine blocks stay where they are
        # when their object is parked, so they free nothing either.
        values = self._values.get(session_id, {})
        objects = self._table[session_id].objects
        candidates = {
            name
            for name, obj in objects.items()
            if obj.parkable
            and any(
                entry[0] in devices and entry[3] and not isinstance(entry[1], EngineBlock)
                for entry in values[("o", name)].entries
            )
        }
        staying = {
            entry[1]
            for key, item in values.items()
            if not (key[0] == "o" and key[1] in candidates)
            for entry in item.entries
        }
        return [
            name
            for name in objects
            if name in candidates
            and not any(entry[1] in staying for entry in values[("o", name)].entries)
        ]

    def _holds_on(self, session_id: Hashable, devices: list[str]) -> bool:
        return any(
            entry[0] in devices and entry[3]
            for item in self._values.get(session_id, {}).values()
            for entry in item.entries
        )

    def _spool(self) -> SpoolDir | None:
        # The manager's own locked subdirectory of the spool root, removed with the manager;
        # what a process that died (`kill -9`) left there is reclaimed by the next one.
        if self._park_tier != "disk":
            return None
        if self._spool_dir is None:
            self._spool_dir = SpoolDir(
                self._spool_root if self._spool_root is not None else tempfile.gettempdir()
            )
        return self._spool_dir

    def _park_session(self, session_id: Hashable, names: list[str]) -> None:
        # Caller holds the lock. The objects are parked (a pure transition) before anything is
        # stored, so a failure half-way leaves the session resident and intact.
        state = self._table[session_id]
        try:
            new = state.park(self._park_tier, names=names, spool_dir=self._spool())
        except Exception as exc:
            msg = (
                f"Cannot park session {session_id!r} (objects {names}) on the "
                f"{self._park_tier} tier: {exc}. The session is left resident and intact; "
                "free room on the tier (or pick the other one), or raise `max_bytes`."
            )
            raise ParkingError(msg) from exc
        parked = {n: o for n, o in new.objects.items() if isinstance(o, ParkedObject)}
        self._table[session_id] = new
        self._set_values(session_id, self._values_for(session_id, new))
        for handle in _handles_of(parked.values()):
            self._handles[id(handle)] = handle
        self._parked[session_id] = parked
        self._parks += 1
        self._record_versions(session_id, new)

    def _resident(self, session_id: Hashable, state: SessionT) -> SessionT:
        # Caller holds the lock. Unpark the session's parked objects, then make room for them:
        # an unpark that fails (a damaged spool file) costs no other session anything. Either
        # failure leaves the session parked (and a retry can succeed).
        parked = self._parked.get(session_id)
        if not parked:
            return state
        try:
            new = state.unpark()
        except Exception as exc:
            tiers = sorted({obj.handle.tier for obj in parked.values()})
            msg = (
                f"Cannot unpark session {session_id!r} (objects {sorted(parked)}) from the "
                f"{' and '.join(tiers)} tier: {exc}. The session stays parked and intact; "
                "retry once the cause is fixed, or `drop` it."
            )
            raise ParkingError(msg) from exc
        need: dict[str, int] = {}
        for handle in _handles_of(parked.values()):
            for device, nbytes in handle.nbytes_by_device.items():
                need[device] = need.get(device, 0) + nbytes
        self._make_room(session_id, need)
        self._table[session_id] = new
        self._set_values(session_id, self._values_for(session_id, new))
        del self._parked[session_id]
        for handle in _handles_of(parked.values()):
            self._release(handle)
        self._unparks += 1
        self._record_versions(session_id, new)
        return new

    def _release(self, handle: ParkedBytes) -> None:
        # Only the handles this manager created: a record put with objects parked elsewhere
        # keeps its bytes for whoever parked them.
        if self._handles.pop(id(handle), None) is handle:
            handle.release()


def _handles_of(objects: Iterable[ParkedObject]) -> list[ParkedBytes]:
    # Objects parked together share one handle: each handle once.
    return list({id(obj.handle): obj.handle for obj in objects}.values())
