"""The manager: the one mutable part, a thin table of the latest record per session."""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Literal, TypeVar

import torch

from sessionstate._accounting import (
    StorageEntry,
    count_entries,
    engine_entries,
    storage_entries,
)
from sessionstate._errors import (
    ImmutabilityViolationError,
    SessionAdmissionError,
    SessionStateLostError,
)
from sessionstate._session import SessionState
from sessionstate._snapshot import load_state, save_state
from sessionstate._tree import tree_flatten_with_keys, tree_leaves

__all__ = ["DEFAULT_MAX_SESSIONS", "SessionStateManager"]

logger = logging.getLogger("sessionstate")

DEFAULT_MAX_SESSIONS = 64
"""The default session cap: mirrors DreamZero's bespoke ``MAX_DREAMZERO_SESSIONS``."""

_St = TypeVar("_St", bound=SessionState)
OnFull = Literal["evict", "refuse"]


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
        self._table: OrderedDict[Hashable, SessionState] = OrderedDict()
        self._check_immutable = check_immutable
        self._versions: dict[Hashable, list[tuple[int, torch.Tensor, int]]] = {}
        self._warned_unversioned = False
        self._warned_eviction = False
        # Storage entries per stored record, computed by `stats()` once per record, and the
        # byte totals of the whole table, valid while `_generation` (bumped by every change
        # to the table) stays the same.
        self._entries: dict[Hashable, tuple[SessionState, list[StorageEntry]]] = {}
        self._generation = 0
        self._totals: tuple[int, dict[str, int], dict[str, int]] | None = None
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
                self._hits += 1
                self._table.move_to_end(session_id)
                return state
            self._misses += 1
            if self._on_full == "refuse":
                self._admit(session_id)  # refuse before paying for the factory
            created = factory()
            _check_state(created, session_id)
            entries = storage_entries(created)  # refuse an uncountable record up front
            # Evict only once the new record exists: a failing factory costs no resident. A
            # factory that stored this session itself (re-entrantly) made room already.
            if session_id not in self._table:
                self._admit(session_id)
            self._store(session_id, created, entries)
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
        # Counted before anything changes, so `stats()` can never fail because of one session.
        entries = storage_entries(state)
        with self._lock:
            if session_id in self._table:
                self._table.move_to_end(session_id)
            else:
                self._admit(session_id)
            self._store(session_id, state, entries)

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
            self._versions.pop(session_id, None)
            self._entries.pop(session_id, None)
            self._generation += 1
            return self._table.pop(session_id, None) is not None

    def clear(self) -> None:
        """Drop every session (statistics are kept).

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.clear(); len(m)
        0
        """
        with self._lock:
            self._table.clear()
            self._versions.clear()
            self._entries.clear()
            self._generation += 1

    def stats(self) -> dict[str, int]:
        """Counters and bytes held, per device, deduplicated across all sessions.

        Keys: ``sessions``, ``max_sessions``, ``hits``, ``misses``, ``evictions``,
        ``total_nbytes``, and ``nbytes:<device>`` for each device holding bytes
        (``nbytes:cpu``, ``nbytes:cuda:0``). Device memory is the contended resource and host
        memory usually is not, so the per-device keys are the ones to watch. Engine-owned
        bytes (blocks of a `KVPool` reached through a `KVHandle`) are part of those totals and
        also reported on their own as ``engine_nbytes:<device>``, each block once.

        >>> SessionStateManager(8).stats()  # doctest: +NORMALIZE_WHITESPACE
        {'sessions': 0, 'max_sessions': 8, 'hits': 0, 'misses': 0, 'evictions': 0,
         'total_nbytes': 0}
        """
        with self._lock:
            items = list(self._table.items())
            memo = {sid: self._entries.get(sid) for sid, _ in items}
            generation = self._generation
            valid = self._totals if self._totals and self._totals[0] == generation else None
            totals, engine = (valid[1], valid[2]) if valid else (None, {})
            out = {
                "sessions": len(items),
                "max_sessions": self._max_sessions,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
            }
        if totals is None:
            # Records are immutable, so counting outside the lock sees a consistent snapshot,
            # and a record's storage entries, once computed, serve every later call.
            entries: list[StorageEntry] = []
            fresh: dict[Hashable, tuple[SessionState, list[StorageEntry]]] = {}
            for sid, state in items:
                cached = memo[sid]
                if cached is None or cached[0] is not state:
                    cached = fresh[sid] = (state, storage_entries(state))
                entries.extend(cached[1])
            totals = count_entries(entries)
            engine = count_entries(engine_entries(entries))
            with self._lock:
                for sid, record in fresh.items():
                    if self._table.get(sid) is record[0]:  # not replaced or dropped meanwhile
                        self._entries[sid] = record
                if self._generation == generation:
                    self._totals = (generation, totals, engine)
        out["total_nbytes"] = sum(totals.values())
        for device in sorted(totals):
            out[f"nbytes:{device}"] = totals[device]
        for device in sorted(engine):
            out[f"engine_nbytes:{device}"] = engine[device]
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
        save_state(state, path, metadata={**(metadata or {}), "session_id": sid})

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
        evicted, _ = self._table.popitem(last=False)
        self._versions.pop(evicted, None)
        self._entries.pop(evicted, None)
        self._generation += 1
        self._evictions += 1
        if not self._warned_eviction:
            self._warned_eviction = True
            logger.warning(
                "Session %r was evicted by the session cap (max_sessions=%d) although nobody "
                "ended it; its state is lost. End finished sessions explicitly with "
                "`drop(session_id)` (`drop_session(session_id)` on a model pipeline), or raise "
                "the cap. Warned once per manager; `stats()['evictions']` counts every eviction.",
                evicted,
                self._max_sessions,
            )

    def _store(
        self, session_id: Hashable, state: SessionState, entries: list[StorageEntry]
    ) -> None:
        # Caller holds the lock. `entries` are the record's storage entries, computed already.
        self._table[session_id] = state
        self._entries[session_id] = (state, entries)
        self._generation += 1
        if self._check_immutable:
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
