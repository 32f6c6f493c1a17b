"""What a manager reports as it works: events, their timings, and profiler ranges.

Parks, unparks, prefetches, evictions and refusals are `SessionEvent`s: each is logged on the
``sessionstate`` logger (at DEBUG; the first eviction of a manager at WARNING, as its
eviction warning always was) and passed to the manager's ``on_event`` callback, if any, so a
server can attach them to its own tracing. Park and unpark times are kept as histograms
(`Timings`) for a metrics collector to read without walking anything. Parks, unparks,
prefetches and a managed step are `torch.profiler.record_function` ranges while a profiler
runs (`span`), and cost one flag read otherwise.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any

import attrs
import torch

__all__ = ["BUCKETS", "EventHook", "Reporter", "SessionEvent", "Timings", "span"]

logger = logging.getLogger("sessionstate")

BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
"""Upper bounds (seconds) of the park and unpark time histograms; a last bucket is unbounded."""


@attrs.frozen
class SessionEvent:
    """One thing a manager did to a session.

    Attributes:
        kind: ``"park"``, ``"unpark"``, ``"prefetch"``, ``"evict"`` or ``"refuse"``.
        session_id: The session.
        nbytes: The bytes moved (parked, unparked, prefetched) or lost (evicted); 0 for a
            refusal.
        seconds: How long it took (parks and unparks; 0 otherwise).
        tier: The park tier (``"host"`` or ``"disk"``), where one was involved.
        reason: Why (an eviction's or refusal's cause), else None.

    >>> SessionEvent("park", "a", nbytes=16, seconds=0.001, tier="host").kind
    'park'
    """

    kind: str
    session_id: Hashable
    nbytes: int = 0
    seconds: float = 0.0
    tier: str | None = None
    reason: str | None = None


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

    def emit(self, event: SessionEvent, *, level: int = logging.DEBUG) -> None:
        self.counts[event.kind] = self.counts.get(event.kind, 0) + 1
        if event.kind in ("park", "unpark") and event.tier is not None:
            self.timings.observe(f"{event.kind}:{event.tier}", event.seconds)
        if logger.isEnabledFor(level):
            logger.log(
                level,
                "%s session %r: %d bytes%s in %.6f s%s",
                event.kind,
                event.session_id,
                event.nbytes,
                f" ({event.tier} tier)" if event.tier else "",
                event.seconds,
                f"; {event.reason}" if event.reason else "",
            )
        if self.hook is not None:
            try:
                self.hook(event)
            except Exception:  # a callback's failure never fails the manager's work
                logger.exception("The manager's `on_event` callback raised on %r", event)


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A `torch.profiler.record_function` range named ``name`` while a profiler runs, else a
    no-op (a record_function costs microseconds even with no profiler)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
