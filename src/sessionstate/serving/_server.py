"""The server loop both clocks share, and the metrics it reports in upstream's vocabulary.

**Deadlines.** A session arriving at ``a`` asks for its first chunk at once; it is due at
``a + ttfc_s``. Its first chunk's delivery ``t0`` starts playout: chunk ``k`` is due at
``t0 + k * chunk_period_s``, and its input (the viewer's next action) arrives one period
before, at ``t0 + (k - 1) * chunk_period_s``, when chunk ``k - 1`` starts playing. That is the
chunk's *release*: the server cannot step a chunk before it (nor before the session's previous
chunk is done). A chunk's *latency* is its delivery less its release, so a chunk after the
first meets its deadline exactly when its latency is at most one period. Deadlines never slip:
a late chunk leaves the next one's deadline where it was.

**The loop.** Whenever the compute lane is free, the server admits the sessions that have
arrived (or refuses them: the policy's limit, or admission by deadline), then steps the
released chunks earliest deadline first, one by one or ``batch`` at a time, telling the
backend the order in which the held sessions will be used next (by their next deadline).
When nothing is released it waits for the next arrival or release. A session is dropped after
its last chunk.

**Metrics.** Over every chunk of every admitted session: TTFC (the first chunk's latency),
chunk latency (later chunks), chunk-deadline attainment (all chunks, the first against the
TTFC budget; a session that fails mid-way, its backend unable to make it resident, counts
its chunks left as missed), RTF (media seconds over the seconds taken, per chunk), active sessions
(time-weighted mean and max), refused sessions, and the backend's parks, unparks, prefetch
hits and bytes moved per second of the run. Percentiles are nearest-rank.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import attrs

from sessionstate._errors import SessionAdmissionError
from sessionstate.serving._admission import DeadlineAdmission
from sessionstate.serving._load import Arrival, check_positive

__all__ = ["Backend", "ChunkRecord", "Run", "SessionFailedError", "percentile", "serve_loop"]


class SessionFailedError(SessionAdmissionError):
    """A held session could not be stepped (its backend refused to make it resident).

    Raised by a backend's ``step``; the loop ends that session there, and counts every chunk
    it had left as missed.
    """

    def __init__(self, session_id: str, msg: str) -> None:
        super().__init__(msg)
        self.session_id = session_id


class Backend(Protocol):
    """What the loop drives: a clock's model of the server's memory, copies and steps."""

    def admit(self, session_id: str, now: float, /) -> None:
        """Take a new session at ``now``; raise `SessionAdmissionError` to refuse it."""

    def step(
        self, session_ids: Sequence[str], now: float, schedule: Sequence[str], /
    ) -> tuple[float, float]:
        """Step one chunk of each of ``session_ids`` from ``now``; return (start, end) times.

        ``schedule`` is every held session in the order of its next use after this step.
        Raises `SessionFailedError` (stepping none of them) if one cannot be made resident.
        """

    def finish(self, session_id: str, now: float, /) -> None:
        """The session's last chunk is done at ``now``: drop it."""

    def counters(self) -> dict[str, float]:
        """Parks, unparks, prefetches, prefetch hits and bytes moved so far."""


@attrs.frozen
class ChunkRecord:
    """One delivered chunk: its session, index, release, start, delivery and deadline."""

    session_id: str
    index: int
    release: float
    start: float
    done: float
    due: float

    @property
    def latency(self) -> float:
        """Delivery less release."""
        return self.done - self.release

    @property
    def on_time(self) -> bool:
        """Whether the chunk met its deadline."""
        return self.done <= self.due + 1e-9


@attrs.define
class _Live:
    arrival: Arrival
    k: int = 0
    t0: float | None = None
    last_done: float = 0.0

    def release(self, period: float) -> float:
        if self.k == 0 or self.t0 is None:
            return self.arrival.time
        return max(self.t0 + (self.k - 1) * period, self.last_done)

    def due(self, period: float, ttfc: float) -> float:
        if self.k == 0 or self.t0 is None:
            return self.arrival.time + ttfc
        return self.t0 + self.k * period


@attrs.frozen
class Run:
    """What one load did: every chunk, every refusal, the active-session curve, the counters."""

    chunks: tuple[ChunkRecord, ...]
    refused: tuple[tuple[str, float, str], ...]
    failed: tuple[tuple[str, float, int, str], ...]
    offered: int
    active: tuple[tuple[float, int], ...]
    counters: dict[str, float]
    chunk_period_s: float
    end: float

    def metrics(self) -> dict[str, Any]:
        """The run's figures (see the module's text); JSON-ready.

        >>> r = Run((ChunkRecord("a", 0, 0.0, 0.0, 0.5, 1.0),), (), (), 1, ((0.0, 1), (0.5, 0)),
        ...         {}, 0.75, 0.5)
        >>> m = r.metrics(); m["ttfc_p50_s"], m["attainment"], m["active_mean"]
        (0.5, 1.0, 1.0)
        """
        first = [c.latency for c in self.chunks if c.index == 0]
        later = [c.latency for c in self.chunks if c.index > 0]
        on_time = sum(c.on_time for c in self.chunks)
        lost = sum(f[2] for f in self.failed)
        due = len(self.chunks) + lost
        rtf = [self.chunk_period_s / max(c.latency, 1e-12) for c in self.chunks if c.index > 0]
        area, peak = 0.0, 0
        for (t, n), (t_next, _) in zip(self.active, self.active[1:], strict=False):
            area += n * (t_next - t)
            peak = max(peak, n)
        span = max(self.end, 1e-12)
        per_s = {f"{k}_per_s": v / span for k, v in sorted(self.counters.items())}
        return {
            "offered_sessions": self.offered,
            "refused_sessions": len(self.refused),
            "refused_fraction": len(self.refused) / self.offered if self.offered else 0.0,
            "failed_sessions": len(self.failed),
            "chunks": len(self.chunks),
            "chunks_lost": lost,
            "attainment": on_time / due if due else 1.0,
            "ttfc_p50_s": percentile(first, 50),
            "ttfc_p99_s": percentile(first, 99),
            "chunk_latency_p50_s": percentile(later, 50),
            "chunk_latency_p99_s": percentile(later, 99),
            "rtf_p50": percentile(rtf, 50),
            "rtf_p1": percentile(rtf, 1),
            "active_mean": area / span,
            "active_max": peak,
            "duration_s": self.end,
            **{k: v for k, v in sorted(self.counters.items())},
            **per_s,
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-th percentile of ``values`` (None for none).

    >>> percentile([4.0, 1.0, 3.0, 2.0], 50), percentile([4.0, 1.0, 3.0, 2.0], 99)
    (2.0, 4.0)
    """
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def serve_loop(
    backend: Backend,
    sessions: Sequence[Arrival],
    *,
    chunk_period_s: float,
    ttfc_s: float,
    batch: int = 1,
    limit: int | None = None,
    admission: DeadlineAdmission | None = None,
) -> Run:
    """Serve ``sessions`` on ``backend`` (see the module's text); return what happened.

    Args:
        backend: The clock's server (`SimulatedServer`, or a real one).
        sessions: The arrivals, in time order.
        chunk_period_s: Seconds one chunk plays.
        ttfc_s: The first chunk's deadline after arrival.
        batch: The most sessions stepped at once.
        limit: Refuse a session beyond this many held (a fixed capacity), None for none.
        admission: Admission by deadline, or None.

    >>> from sessionstate.serving import Arrival
    >>> class Fixed:  # every step takes 0.2 s, no memory
    ...     def admit(self, sid, now): pass
    ...     def step(self, ids, now, schedule): return now, now + 0.2
    ...     def finish(self, sid, now): pass
    ...     def counters(self): return {}
    >>> run = serve_loop(Fixed(), [Arrival("a", 0.0, 2)], chunk_period_s=0.5, ttfc_s=1.0)
    >>> [(c.index, c.release, c.done, c.due) for c in run.chunks]
    [(0, 0.0, 0.2, 1.0), (1, 0.2, 0.4, 0.7)]
    """
    period = check_positive(chunk_period_s, "chunk_period_s", fix="give the seconds a chunk plays")
    ttfc = check_positive(ttfc_s, "ttfc_s", fix="give the seconds the first chunk may take")
    if not isinstance(batch, int) or batch < 1:
        msg = f"`batch` must be a positive int, got {batch!r}."
        raise ValueError(msg)
    pending = deque(sorted(sessions, key=lambda a: a.time))
    live: dict[str, _Live] = {}
    chunks: list[ChunkRecord] = []
    refused: list[tuple[str, float, str]] = []
    failed: list[tuple[str, float, int, str]] = []
    active: list[tuple[float, int]] = [(0.0, 0)]
    now = 0.0
    while pending or live:
        while pending and pending[0].time <= now:
            arrival = pending.popleft()
            sid = arrival.session_id
            try:
                if limit is not None and len(live) >= limit:
                    msg = (
                        f"Cannot admit session {sid!r}: the server holds {len(live)} "
                        f"sessions, its fixed capacity."
                    )
                    raise SessionAdmissionError(msg)
                if admission is not None:
                    admission.admit(sid, held=len(live))
                backend.admit(sid, now)
            except SessionAdmissionError as exc:
                refused.append((sid, arrival.time, str(exc)))
                continue
            live[sid] = _Live(arrival)
            active.append((max(now, arrival.time), len(live)))
        ready = [s for s in live.values() if s.release(period) <= now + 1e-12]
        if not ready:
            upcoming = [s.release(period) for s in live.values()]
            if pending:
                upcoming.append(pending[0].time)
            now = max(now, min(upcoming))
            continue
        ready.sort(key=lambda s: (s.due(period, ttfc), s.arrival.time))
        group = ready[:batch]
        ids = [s.arrival.session_id for s in group]
        schedule = _next_uses(live, group, now, period, ttfc)
        try:
            start, end = backend.step(ids, now, schedule)
        except SessionFailedError as exc:
            s = live.pop(exc.session_id)
            failed.append((exc.session_id, now, s.arrival.chunks - s.k, str(exc)))
            backend.finish(exc.session_id, now)
            active.append((now, len(live)))
            continue
        for s in group:
            chunks.append(
                ChunkRecord(
                    s.arrival.session_id,
                    s.k,
                    s.release(period),
                    start,
                    end,
                    s.due(period, ttfc),
                )
            )
            if s.k == 0:
                s.t0 = end
            s.k += 1
            s.last_done = end
            if s.k >= s.arrival.chunks:
                sid = s.arrival.session_id
                backend.finish(sid, end)
                del live[sid]
                active.append((end, len(live)))
        now = end
    active.append((now, 0))
    return Run(
        chunks=tuple(chunks),
        refused=tuple(refused),
        failed=tuple(failed),
        offered=len(sessions),
        active=tuple(active),
        counters=backend.counters(),
        chunk_period_s=period,
        end=now,
    )


def _next_uses(
    live: dict[str, _Live], group: list[_Live], now: float, period: float, ttfc: float
) -> list[str]:
    # Every held session by its next use after this step: the group's by their following
    # chunk (a first chunk's session plays from about now), the others by their next deadline.
    stepping = {id(s) for s in group}
    keyed: list[tuple[float, float, Hashable]] = []
    for s in live.values():
        if id(s) in stepping:
            if s.k + 1 >= s.arrival.chunks:
                continue  # its last chunk: never used again
            t0 = now if s.t0 is None else s.t0
            due = t0 + (s.k + 1) * period
        else:
            due = s.due(period, ttfc)
        keyed.append((due, s.arrival.time, s.arrival.session_id))
    keyed.sort()
    return [str(sid) for _, _, sid in keyed]
