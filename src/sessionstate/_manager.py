"""The manager: the one mutable part, a thin table of the latest record per session."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Literal, TypeVar

import attrs
import torch

from sessionstate._accounting import (
    StorageEntry,
    count_entries,
    storage_entries,
)
from sessionstate._errors import (
    ImmutabilityViolationError,
    ParkingError,
    SessionAdmissionError,
    SessionStateLostError,
    UnsupportedTensorError,
)
from sessionstate._ledger import Ledger, parse_nbytes
from sessionstate._objects import ParkedObject
from sessionstate._park import ParkedBytes, Tier, check_tier
from sessionstate._session import SessionState
from sessionstate._snapshot import load_state, save_state
from sessionstate._tree import tree_flatten_with_keys, tree_leaves

__all__ = ["DEFAULT_MAX_SESSIONS", "SessionStateManager"]

logger = logging.getLogger("sessionstate")

DEFAULT_MAX_SESSIONS = 64
"""The default session cap: mirrors DreamZero's bespoke ``MAX_DREAMZERO_SESSIONS``."""

_St = TypeVar("_St", bound=SessionState)
OnFull = Literal["evict", "refuse"]

# A stored value (an object or attribute of a session) and the storages it reaches.
_Item = tuple[object, list[StorageEntry]]
_Values = dict[tuple[str, str], _Item]
_EXTRA_FIELDS: dict[type, tuple[str, ...]] = {}


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


def _distinct_storages(value: object) -> list[StorageEntry]:
    return list({entry[1]: entry for entry in storage_entries(value)}.values())


def _check_max_bytes(max_bytes: object) -> dict[str, int] | None:
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


def check_session_id(session_id: object) -> Hashable:
    """Return ``session_id`` if it is a valid session id: any hashable value, as a dict key.

    The manager and the models' bespoke paths apply the same rule with the same message.

    Raises:
        TypeError: for an unhashable value, naming it, its type and the rule.

    >>> check_session_id(42), check_session_id(("user", 7))
    (42, ('user', 7))
    """
    try:
        hash(session_id)
    except TypeError:
        msg = (
            f"`session_id` must be hashable (any value a dict accepts as a key: a str, an int, "
            f"a tuple, ...), got {session_id!r} ({type(session_id).__name__}); pass an "
            "immutable id such as a str or a tuple."
        )
        raise TypeError(msg) from None
    return session_id


class SessionStateManager:
    """Maps session id to the latest `SessionState`, capped by least-recently-used eviction.

    The manager stores records, never mutates them: models thread a state through
    ``step(state, inputs) -> (state, out)`` and `put` the result. Evicting a session drops it
    from the table only; a caller still holding its record keeps working on it.

    `get`, `get_or_create`, `require` and `put` mark a session most recently used; ``in`` and
    ``len`` do not. All methods are safe to call from several threads.

    The first eviction logs a warning on the ``sessionstate`` logger naming the evicted session
    and how to end sessions explicitly; later ones are only counted (``stats()["evictions"]``).

    Args:
        max_sessions: The cap on retained sessions (default 64).
        on_full: What a new session does at the cap: ``"evict"`` (default) drops the least
            recently used session, as the bespoke caches do; ``"refuse"`` raises
            `SessionAdmissionError` and keeps serving the residents.
        check_immutable: Record every stored tensor's version counter and verify it on the
            session's next access, raising `ImmutabilityViolationError` that names the session
            and the leaf's key path if an in-place op wrote into it (through the tensor or any
            view of it). Writes that bypass the counter (``tensor.numpy()``, ``tensor.data``,
            ``tensor.untyped_storage().fill_()``)
            and inference-mode tensors (which have no counter; a warning says so once) are
            not seen. Off by default, and then free; `resolve_session_state_config` reads it
            from ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_CHECK_IMMUTABLE``.

    >>> import torch
    >>> from sessionstate import SessionState
    >>> manager = SessionStateManager(max_sessions=2)
    >>> for sid in ["a", "b", "c"]:
    ...     manager.put(sid, SessionState(attrs={"x": torch.zeros(4)}))
    >>> manager.session_ids(), "a" in manager
    (['b', 'c'], False)
    >>> manager.stats()["evictions"], manager.stats()["nbytes:cpu"]
    (1, 32)
    """

    def __init__(
        self,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        *,
        on_full: OnFull = "evict",
        check_immutable: bool = False,
        max_bytes: Mapping[str, int | str] | None = None,
        park_tier: Tier = "host",
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(check_immutable, bool):
            msg = (
                f"`check_immutable` must be a bool (True or False), got {check_immutable!r} "
                f"({type(check_immutable).__name__})."
            )
            raise TypeError(msg)
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions <= 0:
            msg = (
                f"`max_sessions` must be a positive int, got {max_sessions!r} "
                f"({type(max_sessions).__name__}); the default is {DEFAULT_MAX_SESSIONS}."
            )
            raise ValueError(msg)
        if on_full not in ("evict", "refuse"):
            msg = (
                f"`on_full` must be 'evict' or 'refuse', got {on_full!r} "
                f"({type(on_full).__name__})."
            )
            raise ValueError(msg)
        self._max_sessions = max_sessions
        self._on_full: OnFull = on_full
        self._max_bytes = _check_max_bytes(max_bytes)
        self._park_tier: Tier = check_tier(park_tier)
        self._spool_root = None if spool_dir is None else os.fspath(spool_dir)
        self._spool_dir: str | None = None
        self._table: OrderedDict[Hashable, SessionState] = OrderedDict()
        self._check_immutable = check_immutable
        self._versions: dict[Hashable, list[tuple[int, torch.Tensor, int]]] = {}
        self._warned_unversioned = False
        self._warned_eviction = False
        # The byte ledger, and per session the storages each stored value reaches (so a put
        # walks only the values that changed).
        self._ledger = Ledger()
        self._values: dict[Hashable, _Values] = {}
        self._parked: dict[Hashable, dict[str, ParkedObject]] = {}
        self._handles: dict[int, ParkedBytes] = {}  # the tier handles this manager created
        self._parks = 0
        self._unparks = 0
        self._lock = threading.RLock()
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    @property
    def max_sessions(self) -> int:
        """The cap on retained sessions.

        >>> SessionStateManager(3).max_sessions
        3
        """
        return self._max_sessions

    def raise_max_sessions(self, n: int, /) -> bool:
        """Raise the cap to ``n`` at runtime; returns whether the cap went up.

        A serving runner publishes its capacity once it knows its device. The cap never goes
        down at runtime: an ``n`` not above the current cap changes nothing and returns False.

        Raises:
            TypeError: if ``n`` is not an int.
            ValueError: if ``n`` is not positive.

        >>> m = SessionStateManager(2)
        >>> m.raise_max_sessions(8), m.raise_max_sessions(4), m.max_sessions
        (True, False, 8)
        """
        if isinstance(n, bool) or not isinstance(n, int):
            msg = (
                f"`max_sessions` must be a positive int, got {n!r} ({type(n).__name__}); "
                "pass the new cap as an int."
            )
            raise TypeError(msg)
        if n <= 0:
            msg = (
                f"`max_sessions` must be a positive int, got {n!r} ({type(n).__name__}); "
                "pass a cap above the current one (the cap never goes down at runtime)."
            )
            raise ValueError(msg)
        with self._lock:
            if n <= self._max_sessions:
                return False
            self._max_sessions = n
            return True

    @property
    def check_immutable(self) -> bool:
        """Whether stored tensors are checked for in-place writes on each access.

        >>> SessionStateManager(check_immutable=True).check_immutable
        True
        """
        return self._check_immutable

    @property
    def max_bytes(self) -> dict[str, int] | None:
        """The byte budget per device, or None when only the session cap applies.

        >>> SessionStateManager(max_bytes={"cpu": "1KiB"}).max_bytes
        {'cpu': 1024}
        """
        return None if self._max_bytes is None else dict(self._max_bytes)

    @property
    def park_tier(self) -> Tier:
        """Where the budget parks objects: ``"host"`` or ``"disk"``.

        >>> SessionStateManager().park_tier
        'host'
        """
        return self._park_tier

    @property
    def on_full(self) -> OnFull:
        """What a new session does at the cap: ``"evict"`` or ``"refuse"``.

        >>> SessionStateManager().on_full
        'evict'
        """
        return self._on_full

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._table

    def __len__(self) -> int:
        with self._lock:
            return len(self._table)

    def __repr__(self) -> str:
        return (
            f"SessionStateManager(sessions={len(self)}, max_sessions={self._max_sessions}, "
            f"on_full={self._on_full!r})"
        )

    def session_ids(self) -> list[Hashable]:
        """Ids of the retained sessions, least recently used first.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.put("b", SessionState()); _ = m.get("a")
        >>> m.session_ids()
        ['b', 'a']
        """
        with self._lock:
            return list(self._table)

    def get(self, session_id: Hashable, /) -> SessionState | None:
        """The latest record of ``session_id``, or None (counted as a miss).

        >>> SessionStateManager().get("nobody") is None
        True
        """
        check_session_id(session_id)
        with self._lock:
            state = self._table.get(session_id)
            if state is None:
                self._misses += 1
                return None
            self._verify(session_id)
            state = self._resident(session_id, state)
            self._hits += 1
            self._table.move_to_end(session_id)
            return state

    def peek(self, session_id: Hashable, /) -> SessionState | None:
        """The latest record of ``session_id``, or None, for inspection only.

        Unlike `get`, it leaves the LRU order and the hit/miss counters alone, so looking at
        a session (for a size table, a dashboard) does not keep it resident. With
        ``check_immutable``, it raises for a corrupted record, as `get` does.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.put("b", SessionState())
        >>> m.peek("a") is not None, m.session_ids(), m.stats()["hits"]
        (True, ['a', 'b'], 0)
        """
        check_session_id(session_id)
        with self._lock:
            state = self._table.get(session_id)
            if state is not None:
                self._verify(session_id)
            return state

    def require(self, session_id: Hashable, /) -> SessionState:
        """The latest record of ``session_id``; never creates one.

        Use it for a continuation: a session that was evicted or never began raises instead
        of silently starting from scratch.

        Raises:
            SessionStateLostError: if the manager does not hold ``session_id``.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState())
        >>> m.require("a").attrs
        mappingproxy({})
        """
        state = self.get(session_id)
        if state is None:
            msg = (
                f"Session {session_id!r} is not held by this manager (never created, dropped, "
                "or evicted by the LRU cap); its state is lost. Start it again with "
                "`get_or_create`, or raise the cap."
            )
            raise SessionStateLostError(msg)
        return state

    def get_or_create(self, session_id: Hashable, factory: Callable[[], _St], /) -> SessionState:
        """The latest record of ``session_id``, or ``factory()`` stored as a new session.

        The factory runs under the manager's lock, so concurrent callers create a session
        once. It must not block on other threads that use this manager.

        Raises:
            TypeError: if ``factory`` is not callable (checked first: nothing is counted), or
                returns something that is not a `SessionState`.
            SessionAdmissionError: if the session is new, the manager is full and
                ``on_full="refuse"``.
            UnsupportedTensorError: if the new record holds a tensor whose bytes cannot be
                counted; nothing is stored.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> first = m.get_or_create("a", SessionState)
        >>> m.get_or_create("a", SessionState) is first
        True
        """
        check_session_id(session_id)
        if not callable(factory):
            msg = (
                f"Session {session_id!r}: `factory` must be a callable that returns a new "
                f"SessionState, got {factory!r} ({type(factory).__name__}); pass the class "
                "itself (e.g. `SessionState`) or a function."
            )
            raise TypeError(msg)
        with self._lock:
            state = self._table.get(session_id)
            if state is not None:
                self._verify(session_id)
                state = self._resident(session_id, state)
                self._hits += 1
                self._table.move_to_end(session_id)
                return state
            self._misses += 1
            if self._on_full == "refuse":
                self._admit(session_id)  # refuse before paying for the factory
            created = factory()
            _check_state(created, session_id)
            # Evict only once the new record exists: a failing factory costs no resident. A
            # factory that stored this session itself (re-entrantly) made room already.
            self._put_locked(session_id, created, touch=False)
            return created

    def put(self, session_id: Hashable, state: SessionState, /) -> None:
        """Store ``state`` as the latest record of ``session_id`` (replacing any earlier one).

        Replacing a record is how a session recovers from an immutability violation: ``put``
        does not check the record it replaces.

        Raises:
            TypeError: if ``state`` is not a `SessionState`.
            SessionAdmissionError: as `get_or_create`.
            UnsupportedTensorError: if ``state`` holds a tensor whose bytes cannot be counted
                (nothing stored changes).

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"step": 1}))
        >>> m.get("a").attrs["step"]
        1
        """
        check_session_id(session_id)
        _check_state(state, session_id)
        with self._lock:
            self._put_locked(session_id, state, touch=True)

    def drop(self, session_id: Hashable, /) -> bool:
        """End ``session_id``: forget its record. Returns whether it was held.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState())
        >>> m.drop("a"), m.drop("a")
        (True, False)
        """
        check_session_id(session_id)
        with self._lock:
            return self._forget(session_id)

    def clear(self) -> None:
        """Drop every session (statistics are kept).

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.clear(); len(m)
        0
        """
        with self._lock:
            for session_id in list(self._table):
                self._forget(session_id)

    def stats(self) -> dict[str, int]:
        """Counters and bytes held, per device, deduplicated across all sessions.

        Keys: ``sessions``, ``max_sessions``, ``hits``, ``misses``, ``evictions``,
        ``total_nbytes``, and ``nbytes:<device>`` for each device holding bytes
        (``nbytes:cpu``, ``nbytes:cuda:0``). Device memory is the contended resource and host
        memory usually is not, so the per-device keys are the ones to watch. The byte keys count
        resident bytes only (a parked object's bytes are held by its tier).

        With a byte budget (``max_bytes``), also: ``max_bytes:<device>`` per budgeted device,
        ``parked_sessions`` (sessions with a parked object), ``parks`` and ``unparks`` (times
        a session's objects were parked, and brought back), and ``nbytes_parked:host`` and
        ``nbytes_parked:disk`` (bytes the tiers hold).
        Engine-owned bytes (blocks of a `KVPool` reached through a `KVHandle`) are part of the
        per-device totals and also reported on their own as ``engine_nbytes:<device>``, each
        block once; they are never parked.

        >>> SessionStateManager(8).stats()  # doctest: +NORMALIZE_WHITESPACE
        {'sessions': 0, 'max_sessions': 8, 'hits': 0, 'misses': 0, 'evictions': 0,
         'total_nbytes': 0}
        """
        with self._lock:
            out = {
                "sessions": len(self._table),
                "max_sessions": self._max_sessions,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
            }
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

    def nbytes_by_session(self) -> dict[Hashable, dict[str, int]]:
        """Bytes per session and device; each session counted on its own (no cross-dedup).

        >>> import torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.zeros(2)}))
        >>> m.nbytes_by_session()
        {'a': {'cpu': 8}}
        """
        with self._lock:
            items = list(self._table.items())
        return {sid: state.nbytes_by_device() for sid, state in items}

    def snapshot(
        self,
        session_id: Hashable,
        path: str | os.PathLike[str],
        /,
        *,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Write the latest record of ``session_id`` to ``path`` (see `save_state`).

        Like `peek`, it leaves the LRU order and the hit/miss counters alone: saving a session
        does not keep it resident. The session id is stored in the file's metadata as
        ``session_id``.

        Raises:
            SessionStateLostError: if the manager does not hold ``session_id``.

        >>> import os, tempfile, torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.ones(2)})); m.put("b", SessionState())
        >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        >>> m.snapshot("a", path)
        >>> m.session_ids(), m.stats()["hits"]
        (['a', 'b'], 0)
        """
        state = self.peek(session_id)
        if state is None:
            msg = (
                f"Cannot snapshot session {session_id!r}: this manager does not hold it (never "
                "created, dropped, or evicted by the LRU cap). Snapshot a held session; "
                "`session_ids()` lists them."
            )
            raise SessionStateLostError(msg)
        # Metadata values are strings: a non-str id is stored as its repr.
        sid = session_id if isinstance(session_id, str) else repr(session_id)
        save_state(state.unpark(), path, metadata={**(metadata or {}), "session_id": sid})

    def restore(
        self,
        session_id: Hashable,
        path: str | os.PathLike[str],
        /,
        *,
        device: torch.device | str | None = None,
    ) -> SessionState:
        """Load a snapshot (see `load_state`) and store it as ``session_id``, like `put`.

        The record is admitted like a `put` (a new session may evict the least recently used,
        or be refused with ``on_full="refuse"``); a file that fails to load changes nothing.

        Returns:
            The restored record.

        Raises:
            SnapshotError: if the file cannot be loaded or does not hold a `SessionState`.
            SessionAdmissionError: as `put`.

        >>> import os, tempfile, torch
        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"x": torch.ones(2)}))
        >>> path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        >>> m.snapshot("a", path)
        >>> other = SessionStateManager()
        >>> other.restore("a", path).attrs["x"]
        tensor([1., 1.])
        """
        check_session_id(session_id)
        state = load_state(path, device=device, expect=SessionState)
        self.put(session_id, state)
        return state

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

    def _put_locked(self, session_id: Hashable, state: SessionState, *, touch: bool) -> None:
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

    def _store(self, session_id: Hashable, state: SessionState) -> None:
        # Caller holds the lock and has accounted the record's values (`_set_values`).
        self._table[session_id] = state
        parked = {n: o for n, o in state.objects.items() if isinstance(o, ParkedObject)}
        kept = {id(handle) for handle in _handles_of(parked.values())}
        for handle in _handles_of(self._parked.pop(session_id, {}).values()):
            if id(handle) not in kept:
                self._release(handle)
        if parked:
            self._parked[session_id] = parked
        self._record_versions(session_id, state)

    def _forget(self, session_id: Hashable) -> bool:
        # Caller holds the lock.
        state = self._table.pop(session_id, None)
        self._versions.pop(session_id, None)
        self._set_values(session_id, {})
        for handle in _handles_of(self._parked.pop(session_id, {}).values()):
            self._release(handle)
        return state is not None

    # -- the ledger ------------------------------------------------------------------------------

    def _values_for(self, session_id: Hashable, state: SessionState) -> _Values:
        # Values the stored record shares with `state` keep their storages: only the values
        # that changed are walked.
        held = self._values.get(session_id, {})
        out: _Values = {}
        try:
            for key, value in _value_items(state):
                item = held.get(key)
                out[key] = (
                    item
                    if item is not None and item[0] is value
                    else (value, _distinct_storages(value))
                )
        except UnsupportedTensorError:
            # Walked value by value, the error lacks the key path inside the session: walk the
            # whole record once more so the error names it.
            storage_entries(state)
            raise
        return out

    def _set_values(self, session_id: Hashable, values: _Values) -> _Values:
        # Caller holds the lock. Adds before it removes, so a storage both records reach never
        # drops out of the ledger in between.
        previous = self._values.get(session_id, {})
        for key, item in values.items():
            if previous.get(key) is not item:
                self._ledger.add(item[1])
        for key, item in previous.items():
            if values.get(key) is not item:
                self._ledger.remove(item[1])
        if values:
            self._values[session_id] = values
        else:
            self._values.pop(session_id, None)
        return previous

    # -- the budget ------------------------------------------------------------------------------

    def _check_fits(self, session_id: Hashable, values: _Values) -> None:
        assert self._max_bytes is not None
        alone = count_entries(entry for _, entries in values.values() for entry in entries)
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
        # unparking would split the alias into two copies.
        values = self._values.get(session_id, {})
        objects = self._table[session_id].objects
        candidates = {
            name
            for name, obj in objects.items()
            if obj.parkable
            and any(entry[0] in devices and entry[3] for entry in values[("o", name)][1])
        }
        staying = {
            entry[1]
            for key, (_, entries) in values.items()
            if not (key[0] == "o" and key[1] in candidates)
            for entry in entries
        }
        return [
            name
            for name in objects
            if name in candidates
            and not any(entry[1] in staying for entry in values[("o", name)][1])
        ]

    def _holds_on(self, session_id: Hashable, devices: list[str]) -> bool:
        return any(
            entry[0] in devices and entry[3]
            for _, entries in self._values.get(session_id, {}).values()
            for entry in entries
        )

    def _spool(self) -> str | None:
        if self._park_tier != "disk":
            return None
        if self._spool_dir is None:
            if self._spool_root is not None:
                os.makedirs(self._spool_root, exist_ok=True)
            self._spool_dir = tempfile.mkdtemp(prefix="sessionstate-spool-", dir=self._spool_root)
            weakref.finalize(self, shutil.rmtree, self._spool_dir, ignore_errors=True)
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

    def _resident(self, session_id: Hashable, state: SessionState) -> SessionState:
        # Caller holds the lock. Unpark the session's parked objects, making room first; a
        # failure leaves the session parked (and a retry can succeed).
        parked = self._parked.get(session_id)
        if not parked:
            return state
        need: dict[str, int] = {}
        for handle in _handles_of(parked.values()):
            for device, nbytes in handle.nbytes_by_device.items():
                need[device] = need.get(device, 0) + nbytes
        self._make_room(session_id, need)
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

    def _record_versions(self, session_id: Hashable, state: SessionState) -> None:
        if not self._check_immutable:
            return
        # Key paths are costly to render; keep leaf positions and render one on violation.
        versions = []
        for index, leaf in enumerate(tree_leaves(state)):
            version = _version_of(leaf)
            if version is not None:
                versions.append((index, leaf, version))
            elif isinstance(leaf, torch.Tensor) and not self._warned_unversioned:
                self._warned_unversioned = True
                logger.warning(
                    "Session %r: the tensor at `%s` was made under torch.inference_mode() "
                    "and keeps no version counter, so check_immutable cannot watch it "
                    "(warned once per manager). Create session tensors under "
                    "torch.no_grad() to have them checked.",
                    session_id,
                    _key_of(state, index),
                )
        self._versions[session_id] = versions

    def _verify(self, session_id: Hashable) -> None:
        # Caller holds the lock. Views share their base's version counter, so an in-place op
        # through any view of a stored tensor is seen here. Writes that bypass autograd's
        # counter (through `tensor.numpy()` or `tensor.data`) are not.
        for index, leaf, version in self._versions.get(session_id, ()):
            now = _version_of(leaf)
            if now is not None and now != version:
                key = _key_of(self._table[session_id], index)
                msg = (
                    f"Session {session_id!r}: the tensor at `{key}` was modified in place after "
                    f"the record was stored (version {version} -> {now}). Records are immutable: "
                    "build new tensors (`t = t + x`, not `t += x` or `t.copy_(...)`), then "
                    f"`drop({session_id!r})` this corrupted session."
                )
                raise ImmutabilityViolationError(msg)


def _handles_of(objects: Iterable[ParkedObject]) -> list[ParkedBytes]:
    # Objects parked together share one handle: each handle once.
    return list({id(obj.handle): obj.handle for obj in objects}.values())


def _key_of(state: SessionState, index: int) -> str:
    keys, _, _ = tree_flatten_with_keys(state)
    return keys[index]


def _version_of(leaf: object) -> int | None:
    if not isinstance(leaf, torch.Tensor):
        return None
    try:
        return int(leaf._version)
    except RuntimeError:  # inference-mode tensors keep no version counter
        return None


def _check_state(state: object, session_id: Hashable) -> None:
    if not isinstance(state, SessionState):
        msg = (
            f"Session {session_id!r}: the manager stores SessionState records, got "
            f"{type(state).__name__}; build one with `SessionState(objects=..., attrs=...)`."
        )
        raise TypeError(msg)
