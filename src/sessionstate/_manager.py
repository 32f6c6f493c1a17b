"""The manager: the one mutable part, a thin table of the latest record per session."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
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
from sessionstate._tree import tree_flatten_with_keys, tree_leaves

__all__ = ["DEFAULT_MAX_SESSIONS", "SessionStateManager"]

logger = logging.getLogger("sessionstate")

DEFAULT_MAX_SESSIONS = 64
"""The default session cap: mirrors DreamZero's bespoke ``MAX_DREAMZERO_SESSIONS``."""

_St = TypeVar("_St", bound=SessionState)
OnFull = Literal["evict", "refuse"]


def _check_session_id(session_id: object) -> str:
    if not isinstance(session_id, str) or not session_id:
        msg = (
            f"`session_id` must be a non-empty str, got {session_id!r} "
            f"({type(session_id).__name__}); pass the session's id as a string."
        )
        raise (TypeError if not isinstance(session_id, str) else ValueError)(msg)
    return session_id


class SessionStateManager:
    """Maps session id to the latest `SessionState`, capped by least-recently-used eviction.

    The manager stores records, never mutates them: models thread a state through
    ``step(state, inputs) -> (state, out)`` and `put` the result. Evicting a session drops it
    from the table only; a caller still holding its record keeps working on it.

    `get`, `get_or_create`, `require` and `put` mark a session most recently used; ``in`` and
    ``len`` do not. All methods are safe to call from several threads.

    Args:
        max_sessions: The cap on retained sessions (default 64).
        on_full: What a new session does at the cap: ``"evict"`` (default) drops the least
            recently used session, as the bespoke caches do; ``"refuse"`` raises
            `SessionAdmissionError` and keeps serving the residents.
        check_immutable: Record every stored tensor's version counter and verify it on the
            session's next access, raising `ImmutabilityViolationError` that names the session
            and the leaf's key path if an in-place op wrote into it (through the tensor or any
            view of it). Writes that bypass the counter (``tensor.numpy()``, ``tensor.data``)
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
        self._table: OrderedDict[str, SessionState] = OrderedDict()
        self._check_immutable = bool(check_immutable)
        self._versions: dict[str, list[tuple[int, torch.Tensor, int]]] = {}
        self._warned_unversioned = False
        # Storage entries per stored record, computed by `stats()` once per record, and the
        # byte totals of the whole table, valid while `_generation` (bumped by every change
        # to the table) stays the same.
        self._entries: dict[str, tuple[SessionState, list[StorageEntry]]] = {}
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

    def session_ids(self) -> list[str]:
        """Ids of the retained sessions, least recently used first.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.put("b", SessionState()); _ = m.get("a")
        >>> m.session_ids()
        ['b', 'a']
        """
        with self._lock:
            return list(self._table)

    def get(self, session_id: str, /) -> SessionState | None:
        """The latest record of ``session_id``, or None (counted as a miss).

        >>> SessionStateManager().get("nobody") is None
        True
        """
        _check_session_id(session_id)
        with self._lock:
            state = self._table.get(session_id)
            if state is None:
                self._misses += 1
                return None
            self._verify(session_id)
            self._hits += 1
            self._table.move_to_end(session_id)
            return state

    def peek(self, session_id: str, /) -> SessionState | None:
        """The latest record of ``session_id``, or None, for inspection only.

        Unlike `get`, it leaves the LRU order and the hit/miss counters alone, so looking at
        a session (for a size table, a dashboard) does not keep it resident.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState()); m.put("b", SessionState())
        >>> m.peek("a") is not None, m.session_ids(), m.stats()["hits"]
        (True, ['a', 'b'], 0)
        """
        _check_session_id(session_id)
        with self._lock:
            return self._table.get(session_id)

    def require(self, session_id: str, /) -> SessionState:
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

    def get_or_create(self, session_id: str, factory: Callable[[], _St], /) -> SessionState:
        """The latest record of ``session_id``, or ``factory()`` stored as a new session.

        The factory runs under the manager's lock, so concurrent callers create a session
        once. It must not block on other threads that use this manager.

        Raises:
            SessionAdmissionError: if the session is new, the manager is full and
                ``on_full="refuse"``.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> first = m.get_or_create("a", SessionState)
        >>> m.get_or_create("a", SessionState) is first
        True
        """
        _check_session_id(session_id)
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
            # Evict only once the new record exists: a failing factory costs no resident. A
            # factory that stored this session itself (re-entrantly) made room already.
            if session_id not in self._table:
                self._admit(session_id)
            self._store(session_id, created)
            return created

    def put(self, session_id: str, state: SessionState, /) -> None:
        """Store ``state`` as the latest record of ``session_id`` (replacing any earlier one).

        Raises:
            TypeError: if ``state`` is not a `SessionState`.
            SessionAdmissionError: as `get_or_create`.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState(attrs={"step": 1}))
        >>> m.get("a").attrs["step"]
        1
        """
        _check_session_id(session_id)
        _check_state(state, session_id)
        with self._lock:
            if session_id in self._table:
                self._verify(session_id)
                self._table.move_to_end(session_id)
            else:
                self._admit(session_id)
            self._store(session_id, state)

    def drop(self, session_id: str, /) -> bool:
        """End ``session_id``: forget its record. Returns whether it was held.

        >>> from sessionstate import SessionState
        >>> m = SessionStateManager()
        >>> m.put("a", SessionState())
        >>> m.drop("a"), m.drop("a")
        (True, False)
        """
        _check_session_id(session_id)
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
            fresh: dict[str, tuple[SessionState, list[StorageEntry]]] = {}
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

    def nbytes_by_session(self) -> dict[str, dict[str, int]]:
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

    def _admit(self, session_id: str) -> None:
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

    def _store(self, session_id: str, state: SessionState) -> None:
        # Caller holds the lock.
        self._table[session_id] = state
        self._entries.pop(session_id, None)
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

    def _verify(self, session_id: str) -> None:
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


def _check_state(state: object, session_id: str) -> None:
    if not isinstance(state, SessionState):
        msg = (
            f"Session {session_id!r}: the manager stores SessionState records, got "
            f"{type(state).__name__}; build one with `SessionState(objects=..., attrs=...)`."
        )
        raise TypeError(msg)
