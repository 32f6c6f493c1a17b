"""The manager's decisions, each against an obvious model, without a manager.

`sessionstate._manager._decide` holds the decisions the rooms apply: whether the cap holds a
batch or a fork's branches, which device a batch alone is over, whether a pool holds a batch
of steps, what a session shares and holds. Each is drawn over plain data here and checked
against a model that does the naive thing: admits sessions one by one into an `OrderedDict`,
takes blocks one step at a time, counts references with a `Counter`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Hashable

from hypothesis import given
from hypothesis import strategies as st

from sessionstate._accounting import EngineBlock
from sessionstate._manager._decide import (
    batch_fits,
    footprint,
    fork_refusal,
    over_whole_budget,
    shares,
    step_room_ready,
)
from sessionstate._protocols import StorageEntry

ON_FULL = st.sampled_from(["evict", "refuse"])


def _admit_one_by_one(
    table: OrderedDict[str, None], new: list[str], keep: set[str], cap: int, on_full: str
) -> bool:
    # The model: each new id admitted in turn; at the cap, evict the least recently used id
    # outside `keep`, or refuse.
    for sid in new:
        if len(table) >= cap:
            if on_full == "refuse":
                return False
            victims = [other for other in table if other not in keep]
            if not victims:
                return False
            del table[victims[0]]
        table[sid] = None
    return True


@given(
    cap=st.integers(1, 8),
    held=st.integers(0, 8),
    size=st.integers(1, 10),
    fresh=st.integers(0, 10),
    on_full=ON_FULL,
)
def test_a_batch_fits_the_cap_exactly_when_admitting_it_one_by_one_succeeds(
    cap: int, held: int, size: int, fresh: int, on_full: str
) -> None:
    held = min(held, cap)
    fresh = min(fresh, size)
    fresh = max(fresh, size - held)  # the batch's held members are among the held
    table: OrderedDict[str, None] = OrderedDict((f"h{i}", None) for i in range(held))
    batch = [f"h{i}" for i in range(size - fresh)] + [f"n{i}" for i in range(fresh)]
    for sid in batch[: size - fresh]:
        table.move_to_end(sid)
    new = [sid for sid in batch if sid not in table]
    model = _admit_one_by_one(table, new, set(batch), cap, on_full)
    assert batch_fits(size, fresh, held, cap, on_full) == model


@given(
    cap=st.integers(1, 8),
    held=st.integers(1, 8),
    branches=st.integers(1, 10),
    on_full=ON_FULL,
)
def test_a_fork_is_refused_exactly_when_the_branches_cannot_be_admitted_beside_the_source(
    cap: int, held: int, branches: int, on_full: str
) -> None:
    held = min(held, cap)
    table: OrderedDict[str, None] = OrderedDict((f"h{i}", None) for i in range(held))
    source = f"h{held - 1}"
    new = [f"b{i}" for i in range(branches)]
    model = _admit_one_by_one(table, new, {source, *new}, cap, on_full)
    why = fork_refusal(branches, held, cap, on_full)
    assert (why is None) == model
    if why is not None and branches > cap - 1:
        assert why == f"the cap (max_sessions={cap}) leaves {cap - 1}"
    elif why is not None:
        assert why == f"`on_full='refuse'` and the cap leaves {cap - held} free"


DEVICES = ["cpu", "cuda:0", "cuda:1"]


@given(
    totals=st.dictionaries(st.sampled_from(DEVICES), st.integers(0, 100)),
    budget=st.dictionaries(st.sampled_from(DEVICES), st.integers(0, 100), min_size=1),
)
def test_a_batch_is_over_the_first_budgeted_device_it_alone_exceeds(
    totals: dict[str, int], budget: dict[str, int]
) -> None:
    over = [device for device in budget if totals.get(device, 0) > budget[device]]
    assert over_whole_budget(totals, budget) == (over[0] if over else None)


@given(
    free=st.integers(0, 64),
    per_step=st.integers(0, 8),
    sessions=st.integers(1, 8),
    prefetching=st.integers(0, 4),
    session_blocks=st.none() | st.integers(0, 8),
)
def test_a_pool_holds_the_steps_exactly_when_taking_their_blocks_one_by_one_never_runs_out(
    free: int, per_step: int, sessions: int, prefetching: int, session_blocks: int | None
) -> None:
    left, ran_out = free, False
    takes = [per_step] * sessions + [session_blocks or 0] * prefetching
    for blocks in takes:
        for _ in range(blocks):
            if left == 0:
                ran_out = True
            left -= 1
    assert step_room_ready(free, per_step, sessions, prefetching, session_blocks) == (not ran_out)


# Storages drawn from a small shared pool, so sessions and values alias them often: plain
# storages on two devices and engine blocks.
STORAGES: list[StorageEntry] = [
    *(("cpu" if i % 2 else "cuda:0", f"s{i}", 0, 4 * (i + 1), None) for i in range(5)),
    *(("cuda:0", EngineBlock(pool=1, block=i), 0, 16, None) for i in range(3)),
]
VALUE = st.tuples(
    st.sampled_from(["objects", "attrs"]), st.lists(st.sampled_from(STORAGES), max_size=4)
)
SESSIONS = st.lists(st.lists(VALUE, max_size=4), min_size=1, max_size=4)


def _references(sessions: list[list[tuple[str, list[StorageEntry]]]]) -> Counter[Hashable]:
    return Counter(entry[1] for values in sessions for _, entries in values for entry in entries)


@given(sessions=SESSIONS)
def test_a_session_shares_exactly_when_another_session_reaches_one_of_its_storages(
    sessions: list[list[tuple[str, list[StorageEntry]]]],
) -> None:
    first = sessions[0]
    own = Counter(entry[1] for _, entries in first for entry in entries)
    others = {entry[1] for values in sessions[1:] for _, entries in values for entry in entries}
    assert shares(own, _references(sessions)) == any(identity in others for identity in own)


@given(sessions=SESSIONS)
def test_a_footprint_counts_each_storage_once_by_its_first_kind_and_shares_what_others_reach(
    sessions: list[list[tuple[str, list[StorageEntry]]]],
) -> None:
    first = sessions[0]
    reached: dict[Hashable, StorageEntry] = {}
    kinds: dict[Hashable, str] = {}
    for kind, entries in first:
        for entry in entries:
            reached[entry[1]] = entry
            kinds.setdefault(entry[1], kind)
    others = {entry[1] for values in sessions[1:] for _, entries in values for entry in entries}

    def total(identities: object) -> dict[str, int]:
        out: dict[str, int] = {}
        for identity in identities:  # type: ignore[attr-defined]
            device, _, _, size, _ = reached[identity]
            out[device] = out.get(device, 0) + size
        return out

    def kind_of(identity: Hashable) -> str:
        return "engine" if isinstance(identity, EngineBlock) else kinds[identity]

    got = footprint(first, _references(sessions))
    assert {d: n for d, n in got.nbytes.items() if n} == {
        d: n for d, n in total(reached).items() if n
    }
    assert got.shared_ids == {identity for identity in reached if identity in others}
    assert got.shared == total(got.shared_ids)
    assert got.engine == total(i for i in reached if isinstance(i, EngineBlock))
    for kind in ("engine", "objects", "attrs"):
        assert got.by_kind[kind] == total(i for i in reached if kind_of(i) == kind)
