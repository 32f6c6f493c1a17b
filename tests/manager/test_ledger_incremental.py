"""The manager's ledger moves by the difference when a value grows or a ring moves on.

A put of a record whose buffer shares a run of chunks with the stored one walks only the new
chunks; these tests drive such puts (accumulating buffers, rings, `extend`, resets, chunks
shared across sessions and with attributes, rollbacks of a refused put) and compare
`stats()` after every call with an independent recount of every stored record.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sessionstate._manager._ledger as ledger_module
from sessionstate import LatentBuffer, SessionAdmissionError, SessionState, SessionStateManager
from tests.support import assert_stats_equal_a_recount

POOL = torch.zeros(64)  # chunks are views of it too, so storages are shared across records

OPS = st.lists(
    st.tuples(
        st.sampled_from(["commit", "extend", "view", "reset", "alias", "drop", "big"]),
        st.integers(0, 2),  # the session
        st.integers(1, 5),  # how many chunks
    ),
    max_size=40,
)


@given(ops=OPS, maxlen=st.sampled_from([None, 1, 3]))
def test_stats_equal_a_recount_after_every_incremental_put(
    ops: list[tuple[str, int, int]], maxlen: int | None
) -> None:
    manager = SessionStateManager(max_bytes={"cpu": 2048}, on_full="refuse")
    for op, session, n in ops:
        sid = f"s{session}"
        state = manager.peek(sid)
        if state is None:
            state = SessionState(objects={"v": LatentBuffer(dim=0).allocate(maxlen=maxlen)})
        if op == "commit":
            state = state.update_object("v", lambda b: b.commit(torch.zeros(1, 4)))
        elif op == "extend":
            chunks = [torch.full((1, 4), float(i)) for i in range(n)]
            state = state.update_object("v", lambda b, c=chunks: b.extend(c))
        elif op == "view":  # a chunk that is a view of a storage other records share
            state = state.update_object("v", lambda b, k=n: b.commit(POOL[k : k + 4].view(1, 4)))
        elif op == "reset":
            state = state.update_object("v", lambda b: b.reset())
        elif op == "alias":  # an attribute aliasing the newest chunk
            chunks = state.objects["v"].view()
            state = state.with_attrs(newest=chunks[-1] if chunks else POOL)
        elif op == "drop":
            manager.drop(sid)
            assert_stats_equal_a_recount(manager)
            continue
        elif op == "big":  # larger than the whole budget: refused, nothing changes
            state = state.with_attrs(big=torch.zeros(1024))
        with contextlib.suppress(SessionAdmissionError):
            manager.put(sid, state)
        assert_stats_equal_a_recount(manager)


BRANCH_OPS = st.lists(
    st.tuples(
        st.sampled_from(["commit", "extend", "put", "refuse"]),
        st.integers(0, 30),  # which earlier version to build on, or to put again
        st.integers(1, 4),  # how many chunks
    ),
    max_size=40,
)


@given(ops=BRANCH_OPS, maxlen=st.sampled_from([None, 2]))
def test_puts_of_earlier_versions_and_their_successors_keep_the_ledger_exact(
    ops: list[tuple[str, int, int]], maxlen: int | None
) -> None:
    # Successors of one version put one after another (branches), earlier versions put
    # again, and refused puts: each stored version reads only its own run of entries.
    manager = SessionStateManager(max_bytes={"cpu": 4096}, on_full="refuse")
    versions = [SessionState(objects={"v": LatentBuffer(dim=0).allocate(maxlen=maxlen)})]
    manager.put("s", versions[0])
    for op, which, n in ops:
        base = versions[which % len(versions)]
        if op == "commit":
            state = base.update_object("v", lambda b, k=n: b.commit(POOL[k : k + 4].view(1, 4)))
        elif op == "extend":
            chunks = [torch.full((1, 4), float(i)) for i in range(n)]
            state = base.update_object("v", lambda b, c=chunks: b.extend(c))
        elif op == "put":
            state = base
        else:  # over the whole budget: refused, nothing changes
            state = base.update_object("v", lambda b: b.commit(torch.zeros(1024, 4)))
        with contextlib.suppress(SessionAdmissionError):
            manager.put("s", state)
        versions.append(state)
        assert_stats_equal_a_recount(manager)


def test_a_put_after_one_commit_counts_the_new_chunk_only(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = SessionStateManager()
    buf = LatentBuffer(dim=0).allocate().extend([torch.zeros(1, 4) for _ in range(500)])
    state = SessionState(objects={"v": buf}, attrs={"n": 1})
    manager.put("s", state)
    counted: list[object] = []
    real = ledger_module.leaf_entries

    def counting(leaf: object) -> object:
        counted.append(leaf)
        return real(leaf)

    monkeypatch.setattr(ledger_module, "leaf_entries", counting)
    chunk = torch.ones(1, 4)
    state = state.update_object("v", lambda b: b.commit(chunk))
    manager.put("s", state)
    assert len(counted) == 1
    assert counted[0] is chunk
    assert_stats_equal_a_recount(manager)


def test_a_ring_that_moves_on_for_hundreds_of_commits_stays_exact() -> None:
    manager = SessionStateManager()
    state = SessionState(objects={"v": LatentBuffer(dim=0).allocate(maxlen=2)})
    for i in range(300):
        chunk = POOL[i % 60 : i % 60 + 4].view(1, 4) if i % 3 else torch.full((1, 4), float(i))
        state = state.update_object("v", lambda b, c=chunk: b.commit(c))
        manager.put("s", state)
        assert_stats_equal_a_recount(manager)
    manager.drop("s")
    assert manager.stats()["total_nbytes"] == 0
