"""Room-making with a known future: whom to park first, and whom to prefetch, under a schedule.

A server that schedules its next ticks knows the order in which sessions will be used next
(`SessionStateManager.expect`). Belady's rule is optimal for one cache when that order is
known: make room by parking the session whose next use is furthest away. Under a round robin
larger than the budget, least-recently-used parks exactly the session that runs next.

These are pure functions of plain data (ids in the table's order, the schedule, the parked
ids); the manager's room-making loop acts on what they return.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import TypeVar

from sessionstate._checks import check_session_id, describe

__all__ = ["check_schedule", "next_uses", "park_order", "prefetch_plan"]

H = TypeVar("H", bound=Hashable)


def next_uses(schedule: Sequence[H], /) -> dict[H, int]:
    """Each id of ``schedule`` with the position of its first use (0: next).

    An id scheduled twice is next used at its first position.

    >>> next_uses(["b", "a", "b"])
    {'b': 0, 'a': 1}
    """
    uses: dict[H, int] = {}
    for position, session_id in enumerate(schedule):
        uses.setdefault(session_id, position)
    return uses


def park_order(lru_ids: Sequence[H], schedule: Sequence[H], /) -> list[H]:
    """The order in which room-making tries ``lru_ids`` (least recently used first) under
    ``schedule`` (the order of next use, first = next).

    First the sessions not in the schedule, least recently used first (as without one); then
    the scheduled ones, latest next use first (Belady). A session used sooner than another is
    never tried before it. Ids of the schedule that are not in ``lru_ids`` are ignored; an
    empty schedule leaves the order as it is.

    >>> park_order(["a", "b", "c", "d"], ["b", "d", "a"])
    ['c', 'a', 'd', 'b']
    """
    uses = next_uses(schedule)
    if not uses:
        return list(lru_ids)
    unscheduled = [session_id for session_id in lru_ids if session_id not in uses]
    scheduled = sorted(
        (session_id for session_id in lru_ids if session_id in uses),
        key=lambda session_id: uses[session_id],
        reverse=True,
    )
    return unscheduled + scheduled


def prefetch_plan(
    schedule: Sequence[H], parked: Collection[H], held: Collection[H], /
) -> list[tuple[H, frozenset[H]]]:
    """The parked sessions to prefetch under ``schedule``, in order of next use, each with the
    sessions that must not be parked to make its room.

    Each parked session of the schedule (once, at its first use) comes with every session the
    schedule uses no later than it: room for a prefetch is made only by parking sessions whose
    next use is later (or unknown). The plan ends at the first scheduled id not ``held``: a
    new session needs room, of a size not known yet, before the sessions after it. The caller
    starts them in order and stops at the first that does not fit, so a prefetch never takes
    the room of one needed sooner.

    >>> prefetch_plan(["a", "b", "c", "b", "new", "d"], {"b", "c", "d"}, {"a", "b", "c", "d"}) == [
    ...     ("b", frozenset({"a", "b"})), ("c", frozenset({"a", "b", "c"}))]
    True
    """
    plan: list[tuple[H, frozenset[H]]] = []
    sooner: set[H] = set()
    for session_id in schedule:
        if session_id not in held:
            break
        if session_id in sooner:
            continue
        sooner.add(session_id)
        if session_id in parked:
            plan.append((session_id, frozenset(sooner)))
    return plan


def check_schedule(session_ids: object, /) -> list[Hashable]:
    """``session_ids`` as a list, if it is a sequence of valid session ids (first = next).

    Raises:
        TypeError: for a str or bytes (one id, not a sequence of them), an unordered or
            one-shot collection (a set, a generator), or an id that is not a valid session id.
        ValueError: for an id that is or holds NaN (as `check_session_id`).

    >>> check_schedule(("b", "a"))
    ['b', 'a']
    """
    if not isinstance(session_ids, Sequence) or isinstance(session_ids, (str, bytes)):
        msg = (
            f"`session_ids` must be a sequence of session ids in the order they run next, "
            f"got {describe(session_ids)}; pass a list, e.g. `expect(['a', 'b'])` (and "
            "`expect([])` to clear the schedule)."
        )
        raise TypeError(msg)
    ids = list(session_ids)
    for session_id in ids:
        check_session_id(session_id)
    return ids
