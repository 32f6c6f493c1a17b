"""What a manager reports as it works: events, their timings, and profiler ranges.

Parks, unparks, prefetches, forks, evictions, refusals and migrations are `SessionEvent`s:
each is logged on the ``sessionstate`` logger and passed to the manager's ``on_event``
callback, if any, so a server can attach them to its own tracing. Park, unpark and migration
times are kept as histograms (`Timings`) for a metrics collector to read without walking
anything. Parks, unparks, prefetches and a managed step are `torch.profiler.record_function`
ranges while a profiler runs (`span`), and cost one flag read otherwise.

Log levels. Every event is a DEBUG line, except evictions: a session evicted is state lost,
so an eviction is a WARNING line, at most one per manager every `WARN_EVERY` seconds (the
first eviction of a manager is its eviction warning, which says what to do), the evictions in
between at DEBUG and counted in the next WARNING line. A per-eviction WARNING would flood a
log under pressure, when the cap evicts on every new session; once a minute with a count says
the same. Refusals stay at DEBUG: each is raised to its caller (`SessionAdmissionError`, a
budget error), whose handler decides what to log; a second report here would double every
refusal, and a refusing manager never warns (pinned by ``tests/manager/test_upstream_parity``).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import attrs
import torch

__all__ = ["BUCKETS", "WARN_EVERY", "EventHook", "Reporter", "SessionEvent", "Timings", "span"]

logger = logging.getLogger("sessionstate")

BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
"""Upper bounds (seconds) of the park, unpark and migration time histograms; a last bucket is
unbounded."""

WARN_EVERY = 60.0
"""Seconds between two WARNING lines of evictions of one manager (see the module's text)."""

_TIMED = ("park", "unpark", "migrate")
_now = time.monotonic


@attrs.frozen
class SessionEvent:
    """One thing a manager did to a session.

    Attributes:
        kind: ``"park"``, ``"unpark"``, ``"prefetch"``, ``"fork"``, ``"evict"``,
            ``"refuse"`` or ``"migrate"``.
        session_id: The session.
        nbytes: The bytes moved (parked, unparked, prefetched, migrated) or lost (evicted); 0
            for a refusal or a fork.
        seconds: How long it took (parks, unparks and migrations; 0 otherwise).
        tier: The park tier (``"host"`` or ``"disk"``), where one was involved.
        reason: Why (an eviction's or refusal's cause), else None.
        direction: A migration's: ``"out"`` (exported by a worker) or ``"in"`` (imported).

    >>> SessionEvent("park", "a", nbytes=16, seconds=0.001, tier="host").kind
    'park'
    """

    kind: str
    session_id: Hashable
    nbytes: int = 0
    seconds: float = 0.0
    tier: str | None = None
    reason: str | None = None
    direction: str | None = None


EventHook = Callable[[SessionEvent], None]
"""A manager's ``on_event`` callback: called under the manager's lock; it must not call it."""


class Timings:
    """Histograms of seconds by kind (``"park:host"``, ``"unpark:disk"``), read as a whole.

    >>> t = Timings()
    >>> t.observe("park:host", 0.002)
    >>> counts, total, n = t.snapshot()["park:host"]
    >>> counts[2], n  # in the bucket up to 5 ms, one observation
    (1, 1)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, tuple[list[int], list[float]]] = {}

    def observe(self, kind: str, seconds: float) -> None:
        with self._lock:
            counts, total = self._data.setdefault(kind, ([0] * (len(BUCKETS) + 1), [0.0]))
            counts[bisect.bisect_left(BUCKETS, seconds)] += 1
            total[0] += seconds

    def snapshot(self) -> dict[str, tuple[list[int], float, int]]:
        """Per kind: observations per bucket (not cumulative; the last unbounded), the sum of
        seconds and the count."""
        with self._lock:
            return {k: (list(c), t[0], sum(c)) for k, (c, t) in self._data.items()}


class Reporter:
    """Logs events, passes them to a callback, keeps their timings and counts by kind."""

    def __init__(self, hook: EventHook | None = None) -> None:
        if hook is not None and not callable(hook):
            msg = f"`on_event` must be a callable taking a SessionEvent, got {hook!r:.80}."
            raise TypeError(msg)
        self.hook = hook
        self.timings = Timings()
        self.counts: dict[str, int] = {}
        self._warned_at: float | None = None  # the last eviction WARNING
        # What a callback raised beyond `Exception` (KeyboardInterrupt, SystemExit) while
        # `defer` is set: held for the caller to raise once its work is whole (the manager,
        # when it lets go of its lock), never swallowed. The first one is kept.
        self.defer = False
        self.deferred: BaseException | None = None
        self._quiet = 0  # evictions logged at DEBUG since

    def emit(self, event: SessionEvent, *, warned: bool = False) -> None:
        """Count, time, log and pass on ``event``; ``warned``: the caller just warned of it."""
        self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
        timed = event.tier or event.direction
        if event.kind in _TIMED and timed is not None:
            self.timings.observe(f"{event.kind}:{timed}", event.seconds)
        level, more = logging.DEBUG, ""
        if event.kind == "evict":
            level, more = self._eviction_level(warned)
        if logger.isEnabledFor(level):
            where = f" ({event.tier} tier)" if event.tier else ""
            if event.direction:
                where = f" ({event.direction})"
            logger.log(
                level,
                "%s session %r: %d bytes%s in %.6f s%s%s",
                event.kind,
                event.session_id,
                event.nbytes,
                where,
                event.seconds,
                f"; {event.reason}" if event.reason else "",
                more,
            )
        if self.hook is not None:
            try:
                self.hook(event)
            except Exception:  # a callback's failure never fails the manager's work
                logger.exception("The manager's `on_event` callback raised on %r", event)
            except BaseException as exc:
                if not self.defer:
                    raise
                if self.deferred is None:
                    self.deferred = exc

    def _eviction_level(self, warned: bool) -> tuple[int, str]:
        # WARNING at most once every WARN_EVERY seconds, counting the DEBUG ones in between.
        now = _now()
        if warned or (self._warned_at is not None and now - self._warned_at < WARN_EVERY):
            if warned:
                self._warned_at = now
            else:
                self._quiet += 1
            return logging.DEBUG, ""
        self._warned_at, quiet, self._quiet = now, self._quiet, 0
        if not quiet:
            return logging.WARNING, ""
        return logging.WARNING, (
            f" ({quiet} more evicted since the last warning, logged at DEBUG; "
            "`stats()['evictions']` counts them all)"
        )


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A `torch.profiler.record_function` range named ``name`` while a profiler runs, else a
    no-op (a record_function costs microseconds even with no profiler).

    A profiler started with ``profile_all_threads`` (``sessionstate ab --trace``) records
    every thread yet leaves the thread-local flag off, on its own thread too; torch's Python
    flag is set by every profiler, so either one counts."""
    if torch._C._autograd._profiler_enabled() or torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
