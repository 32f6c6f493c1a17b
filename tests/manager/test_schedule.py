"""The schedule's decisions as pure functions, against naive models: no manager here.

`park_order` is checked by its invariants and by what it is for: a cache run with it as the
eviction rule misses no more than the best of every possible eviction choice (Belady is
optimal for one cache with a known future), and no more than least-recently-used. `prefetch_plan`
is checked against a model that reads the schedule position by position.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from sessionstate._manager._schedule import next_uses, park_order, prefetch_plan

IDS = st.sampled_from("abcdef")


@given(lru=st.lists(IDS, unique=True), schedule=st.lists(IDS | st.integers(0, 2)))
def test_park_order_is_belady_after_the_unscheduled(lru: list[str], schedule: list[object]) -> None:
    order = park_order(lru, schedule)
    assert sorted(order) == sorted(lru)  # a permutation of the table, unknown ids ignored
    first = {sid: schedule.index(sid) for sid in lru if sid in schedule}
    unscheduled = [sid for sid in order if sid not in first]
    scheduled = [sid for sid in order if sid in first]
    assert order == unscheduled + scheduled
    assert unscheduled == [sid for sid in lru if sid not in first]  # LRU among themselves
    # Latest next use first: a session used sooner is never tried before one used later.
    uses = [first[sid] for sid in scheduled]
    assert uses == sorted(uses, reverse=True)
    assert next_uses(schedule) == {sid: schedule.index(sid) for sid in set(schedule)}


@given(lru=st.lists(IDS, unique=True))
def test_no_schedule_is_least_recently_used_first(lru: list[str]) -> None:
    assert park_order(lru, []) == lru


def _misses(requests: Sequence[str], capacity: int, rule: str) -> int:
    # A cache of `capacity` sessions; the table's order is least recently used first. On a
    # miss with the cache full, the first session the rule names (not the one requested) goes.
    cache: list[str] = []
    misses = 0
    for i, sid in enumerate(requests):
        if sid in cache:
            cache.remove(sid)
        else:
            misses += 1
            if len(cache) == capacity:
                future = requests[i:] if rule == "belady" else []
                cache.remove(park_order(cache, future)[0])
        cache.append(sid)
    return misses


def _fewest_misses(requests: Sequence[str], capacity: int) -> int:
    # The naive model: every eviction choice tried.
    @functools.cache
    def best(i: int, cache: frozenset[str]) -> int:
        if i == len(requests):
            return 0
        sid = requests[i]
        if sid in cache:
            return best(i + 1, cache)
        if len(cache) < capacity:
            return 1 + best(i + 1, cache | {sid})
        return 1 + min(best(i + 1, (cache - {out}) | {sid}) for out in cache)

    return best(0, frozenset())


@given(requests=st.lists(st.sampled_from("abcde"), max_size=14), capacity=st.integers(1, 3))
def test_parking_in_park_order_misses_the_fewest(requests: list[str], capacity: int) -> None:
    belady = _misses(requests, capacity, "belady")
    assert belady == _fewest_misses(requests, capacity)
    assert belady <= _misses(requests, capacity, "lru")


def test_a_round_robin_larger_than_the_cache() -> None:
    # LRU misses every access; Belady keeps one session for five accesses and hits it once
    # every five (accesses 6, 11, 16, 21 and 26).
    requests = list("abcdef") * 5
    assert _misses(requests, 2, "lru") == 30
    assert _misses(requests, 2, "belady") == 25


@given(schedule=st.lists(IDS), parked=st.sets(IDS), new=st.sets(IDS, max_size=2))
def test_prefetch_plan_against_a_reading_of_the_schedule(
    schedule: list[str], parked: set[str], new: set[str]
) -> None:
    held = set("abcdef") - new
    parked &= held
    expected = []
    for i, sid in enumerate(schedule):
        if sid not in held:
            break  # a new session needs room before the ones after it
        if sid in parked and sid not in schedule[:i]:
            expected.append((sid, frozenset(schedule[: i + 1])))
    plan = prefetch_plan(schedule, parked, held)
    assert plan == expected
    for sid, keep in plan:
        # The session itself and everything used no later stay; everything used later or
        # not scheduled may be parked for it.
        first = schedule.index(sid)
        assert sid in keep
        assert keep == set(schedule[: first + 1])
        assert not keep & (set(schedule[first + 1 :]) - set(schedule[: first + 1]))
