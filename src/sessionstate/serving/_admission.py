"""Admission by deadline: admit a session only while every held session still meets its chunks.

A server that admits every session until memory runs out lets all of them miss their
deadlines together once the work of one chunk period no longer fits in the period. Admission
by deadline refuses the one new session instead, at once, with an error naming the limit and
the rate, judged from step and swap times (planned from a deploy shape, or measured).

The arithmetic, per chunk period ``T`` with ``n`` sessions held, ``R`` of them resident at
most (what the device holds), one step ``t``, one swap ``s`` each way, batches of ``b``:

- compute: the steps of ``n`` sessions (``ceil(n / b)`` batches) take ``C(n)`` seconds;
- swaps: with the schedule known (the server tells the manager what runs next and it parks
  the session used furthest ahead: Belady), a round robin of ``n`` sessions through ``R``
  slots finds its session parked at a fraction ``(n - R) / (n - 1)`` of its steps, so
  ``S(n) = n * (n - R) / (n - 1) * s`` per period on each copy lane; least recently used
  first, at every step, ``S(n) = n * s``;
- a swap does not overlap a step in a round robin: the session parked for the next one is the
  one just stepped (its record is in use until its step ends), and the next one's restore
  waits for that room. So ``C(n) + 2 * S(n) <= h * T``.

``h`` (``headroom``, 0.9 by default) leaves room for the jitter of Poisson arrivals: a new
session's first chunk lands in a period already full of held ones.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import attrs

from sessionstate._errors import SessionAdmissionError
from sessionstate.serving._load import DeployShape, check_positive

__all__ = ["DeadlineAdmission", "DeadlineAdmissionError"]


class DeadlineAdmissionError(SessionAdmissionError):
    """A new session was refused because the server would then miss held sessions' deadlines."""


@attrs.frozen
class DeadlineAdmission:
    """Admits a session only if the server still meets every held session's chunk deadlines.

    Args:
        chunk_period_s: Seconds one chunk plays (the deadline between two chunks).
        step_s: Seconds of one step of a batch of 1, 2, ... sessions (planned or measured).
        swap_s: Seconds to copy one session one way (0 when nothing is parked).
        resident: Sessions the device holds resident at once.
        prefetch: Whether the server tells the manager what runs next (Belady parking).
        headroom: The fraction of each period the work may fill (0 < headroom <= 1).

    >>> adm = DeadlineAdmission(chunk_period_s=0.75, step_s=(0.15,), swap_s=0.1, resident=4)
    >>> adm.limit
    4
    >>> adm.admit("s9", held=4)
    Traceback (most recent call last):
    ...
    sessionstate.serving._admission.DeadlineAdmissionError: Cannot admit session 's9': 5 \
sessions would need 0.750 s of steps and 0.125 s of copies each way per 0.750 s chunk period, \
over the 0.675 s (90%) this server fills, so held sessions would miss their deadlines. Its \
limit at this deadline is 4 sessions, 5.33 chunks per second (0.150 s per step, 0.100 s per \
swap each way, 4 sessions resident). Retry later, or offer sessions at a lower rate.
    """

    chunk_period_s: float
    step_s: tuple[float, ...]
    swap_s: float
    resident: int
    prefetch: bool = True
    headroom: float = 0.9

    def __attrs_post_init__(self) -> None:
        check_positive(self.chunk_period_s, "chunk_period_s", fix="give the seconds a chunk plays")
        if not self.step_s:
            msg = "`step_s` is empty; give the seconds of one step of one session, such as (0.15,)."
            raise ValueError(msg)
        for b, s in enumerate(self.step_s, 1):
            check_positive(s, f"step_s[{b - 1}]", fix=f"give the seconds of a step of {b}")
        if not (isinstance(self.swap_s, (int, float)) and math.isfinite(self.swap_s)) or (
            self.swap_s < 0
        ):
            msg = f"`swap_s` must be a finite number of seconds, 0 or more, got {self.swap_s!r}."
            raise ValueError(msg)
        if not isinstance(self.resident, int) or self.resident < 1:
            msg = f"`resident` must be a positive int, got {self.resident!r}."
            raise ValueError(msg)
        check_positive(self.headroom, "headroom", fix="give a fraction such as 0.9")
        if self.headroom > 1:
            msg = f"`headroom` must be at most 1 (the whole period), got {self.headroom!r}."
            raise ValueError(msg)

    @classmethod
    def planned(
        cls, shape: DeployShape, *, prefetch: bool = True, headroom: float = 0.9
    ) -> DeadlineAdmission:
        """The admission a deploy shape plans: its step times, its swap at its bandwidth.

        >>> from sessionstate.serving import LINGBOT
        >>> DeadlineAdmission.planned(LINGBOT).limit
        4
        """
        return cls(
            chunk_period_s=shape.chunk_period_s,
            step_s=shape.step_s,
            swap_s=shape.swap_s,
            resident=shape.resident_capacity,
            prefetch=prefetch,
            headroom=headroom,
        )

    def compute_s(self, n: int) -> float:
        """Seconds of the steps of ``n`` sessions in one period, in the largest batches known."""
        b = len(self.step_s)
        full, rest = divmod(n, b)
        return full * self.step_s[-1] + (self.step_s[rest - 1] if rest else 0.0)

    def copy_s(self, n: int) -> float:
        """Seconds of copies on each lane in one period with ``n`` sessions held."""
        if n <= self.resident:
            return 0.0
        if self.prefetch:
            return n * (n - self.resident) / (n - 1) * self.swap_s
        return n * self.swap_s

    def fits(self, n: int) -> bool:
        """Whether ``n`` sessions meet their deadlines (see the module's arithmetic)."""
        budget = self.headroom * self.chunk_period_s
        return self.compute_s(n) + 2 * self.copy_s(n) <= budget + 1e-12

    @property
    def limit(self) -> int:
        """The most sessions held at once that meet their deadlines (0 if not even one)."""
        n = 0
        while self.fits(n + 1):
            n += 1
        return n

    def admit(self, session_id: Hashable, /, *, held: int) -> None:
        """Return if a session may join ``held`` sessions; else raise, naming limit and rate.

        Raises:
            DeadlineAdmissionError: if ``held + 1`` sessions would miss their deadlines.
        """
        n = held + 1
        if self.fits(n):
            return
        limit = self.limit
        msg = (
            f"Cannot admit session {session_id!r}: {n} sessions would need "
            f"{self.compute_s(n):.3f} s of steps and {self.copy_s(n):.3f} s of copies each way "
            f"per {self.chunk_period_s:.3f} s chunk period, over the "
            f"{self.headroom * self.chunk_period_s:.3f} s ({self.headroom:.0%}) this server "
            f"fills, so held sessions would miss their deadlines. Its limit at this deadline "
            f"is {limit} sessions, {limit / self.chunk_period_s:.2f} chunks per second "
            f"({self.step_s[0]:.3f} s per step, {self.swap_s:.3f} s per swap each way, "
            f"{self.resident} sessions resident). Retry later, or offer sessions at a lower "
            "rate."
        )
        raise DeadlineAdmissionError(msg)
