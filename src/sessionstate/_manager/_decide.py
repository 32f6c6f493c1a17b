"""The manager's decisions as pure functions of plain data; the rooms apply what they decide.

Each function takes counts, mappings and storage entries (never a manager, a record or a
pool) and returns plain data: whether the cap holds a batch or a fork, which device a batch
alone is over, whether a pool has the blocks a batch of steps needs, and what a session
holds alone and shares. They change nothing, so they are tested with hypothesis against
obvious models without building a manager (``tests/manager/test_decide.py``); the rooms call
them under the table's lock and act on the answer.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import NamedTuple

from sessionstate._accounting import EngineBlock
from sessionstate._protocols import StorageEntry

__all__ = [
    "Footprint",
    "batch_fits",
    "footprint",
    "fork_refusal",
    "over_whole_budget",
    "shares",
    "step_room_ready",
]


def batch_fits(size: int, fresh: int, held: int, cap: int, on_full: str) -> bool:
    """Whether the cap holds a batch of ``size`` sessions, ``fresh`` of them new.

    No larger than the cap, and with ``on_full="refuse"`` no more new sessions than the
    ``cap - held`` free places (with ``"evict"`` the least recently used others make way).

    >>> batch_fits(2, 2, 3, 4, "refuse"), batch_fits(2, 2, 3, 4, "evict")
    (False, True)
    """
    return size <= cap and (on_full != "refuse" or fresh <= cap - held)


def fork_refusal(branches: int, held: int, cap: int, on_full: str) -> str | None:
    """Why the cap cannot hold ``branches`` new sessions beside their source, or None.

    The source stays, so at most ``cap - 1`` branches fit; with ``on_full="refuse"`` at most
    the ``cap - held`` free places.

    >>> fork_refusal(1, 1, 2, "refuse") is None, fork_refusal(2, 1, 2, "evict")
    (True, 'the cap (max_sessions=2) leaves 1')
    """
    free = cap - held
    if branches <= cap - 1 and (on_full != "refuse" or branches <= free):
        return None
    if branches > cap - 1:
        return f"the cap (max_sessions={cap}) leaves {cap - 1}"
    return f"`on_full='refuse'` and the cap leaves {free} free"


def over_whole_budget(totals: Mapping[str, int], budget: Mapping[str, int]) -> str | None:
    """The first budgeted device whose whole budget ``totals`` exceed on its own, or None.

    For a batch: its records together (each storage once) over a device's whole budget
    would evict or park every other session and still not fit.

    >>> over_whole_budget({"cpu": 10}, {"cuda:0": 4, "cpu": 8})
    'cpu'
    """
    for device, nbytes in budget.items():
        if totals.get(device, 0) > nbytes:
            return device
    return None


def step_room_ready(
    free: int, per_step: int, sessions: int, prefetching: int, session_blocks: int | None
) -> bool:
    """Whether a pool's ``free`` blocks hold ``sessions`` steps without making room.

    Each step can take ``per_step`` blocks; each of ``prefetching`` running background
    restores may take a whole session's ``session_blocks`` (none when the pool does not say)
    while the steps run.

    >>> step_room_ready(6, 2, 2, 1, 2), step_room_ready(5, 2, 2, 1, 2)
    (True, False)
    """
    return free >= per_step * sessions + prefetching * (session_blocks or 0)


def shares(own: Mapping[Hashable, int], references: Mapping[Hashable, int]) -> bool:
    """Whether a session shares a storage: one that more leaves reach than its own ``own``.

    ``own``: the session's references per storage identity; ``references``: everyone's. A
    storage a session reaches twice on its own is not shared.

    >>> shares({"s": 2}, {"s": 2}), shares({"s": 1}, {"s": 2})
    (False, True)
    """
    return any(references.get(identity, 0) > n for identity, n in own.items())


class Footprint(NamedTuple):
    """What one session holds resident, by device (see `footprint`)."""

    nbytes: dict[str, int]
    engine: dict[str, int]
    shared: dict[str, int]
    by_kind: dict[str, dict[str, int]]
    shared_ids: set[Hashable]


def footprint(
    values: Iterable[tuple[str, Iterable[StorageEntry]]], references: Mapping[Hashable, int]
) -> Footprint:
    """What a session's values hold resident: bytes by device, by kind, and what it shares.

    ``values``: per stored value, its kind (``"objects"`` or ``"attrs"``) and the storage
    entries it reaches; ``references``: every session's references per storage identity.
    Each storage counts once, as the kind of the first value reaching it (an engine block as
    ``"engine"``); it is shared when more references reach it than the session's own.

    >>> a, b = ("cpu", "a", 0, 8, None), ("cpu", "b", 0, 4, None)
    >>> f = footprint([("objects", [a]), ("attrs", [a, b])], {"a": 3, "b": 1})
    >>> f.nbytes, f.shared, f.by_kind["objects"], f.by_kind["attrs"]
    ({'cpu': 12}, {'cpu': 8}, {'cpu': 8}, {'cpu': 4})
    """
    own: dict[Hashable, int] = {}  # references from this session's own leaves
    kinds: dict[Hashable, str] = {}  # the kind of value that reaches it first
    seen: dict[Hashable, StorageEntry] = {}  # each storage once, by identity
    for kind, entries in values:
        for entry in entries:
            own[entry[1]] = own.get(entry[1], 0) + 1
            kinds.setdefault(entry[1], kind)
            seen[entry[1]] = entry
    nbytes: dict[str, int] = {}
    engine: dict[str, int] = {}
    shared: dict[str, int] = {}
    by_kind: dict[str, dict[str, int]] = {"engine": {}, "objects": {}, "attrs": {}}
    shared_ids: set[Hashable] = set()
    for device, identity, _, size, _ in seen.values():
        nbytes[device] = nbytes.get(device, 0) + size
        kind = kinds[identity]
        if isinstance(identity, EngineBlock):
            engine[device] = engine.get(device, 0) + size
            kind = "engine"
        part = by_kind[kind]
        part[device] = part.get(device, 0) + size
        if references.get(identity, 0) > own[identity]:  # another session's too
            shared[device] = shared.get(device, 0) + size
            shared_ids.add(identity)
    return Footprint(nbytes, engine, shared, by_kind, shared_ids)
