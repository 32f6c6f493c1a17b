"""A LatentBuffer's chunks in shared blocks: the same buffer as a tuple, at a block's cost.

A buffer keeps its chunks in blocks of 64 shared between versions (`_objects._Chunks`), and
builds the `chunks` tuple only when it is read. These tests hold it to a plain list model
across block boundaries (rings larger and smaller than a block, unbounded buffers, extends
that seal several blocks), check that a commit shares every block but the newest, that a
dropped chunk is not kept alive by a block, and that the manager's ledger stays equal to a
recount while rings drop chunks across blocks.
"""

from __future__ import annotations

import collections
import copy
import gc
import pickle
import weakref

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sessionstate import LatentBuffer, SessionState, SessionStateManager
from sessionstate._objects import _BLOCK
from tests.support import assert_stats_equal_a_recount

MAXLENS = (None, 1, 2, _BLOCK - 1, _BLOCK, _BLOCK + 1, 2 * _BLOCK + 3)


def _chunk(i: int) -> torch.Tensor:
    return torch.full((1, 2), float(i))


def _same(a: object, b: list[torch.Tensor]) -> bool:
    return all(x is y for x, y in zip(a, b, strict=True))  # type: ignore[call-overload]


def _check_against(buf: LatentBuffer, model: list[torch.Tensor]) -> None:
    assert len(buf) == len(model)
    seq = buf._seq
    assert _same(seq, model)
    for i in {0, 1, _BLOCK - 1, _BLOCK, _BLOCK + 1, len(model) // 2, len(model) - 1}:
        if 0 <= i < len(model):
            assert seq[i] is model[i]
            assert seq[i - len(model)] is model[i]
    for last in {0, 1, 2, _BLOCK - 1, _BLOCK, _BLOCK + 1, len(model)}:
        if buf.maxlen is None or last <= buf.maxlen:
            want = model[len(model) - min(last, len(model)) :]
            assert _same(buf.view(last=last), want)
    with pytest.raises(IndexError):
        seq[len(model)]
    with pytest.raises(IndexError):
        seq[-len(model) - 1]


@pytest.mark.parametrize("maxlen", MAXLENS)
def test_commits_match_a_list_at_every_length(maxlen: int | None) -> None:
    buf = LatentBuffer(name="latents", dim=0).allocate(maxlen=maxlen)
    model: collections.deque[torch.Tensor] = collections.deque(maxlen=maxlen)
    for i in range(3 * _BLOCK + 5):
        chunk = _chunk(i)
        buf = buf.commit(chunk)
        model.append(chunk)
        _check_against(buf, list(model))
    # Read once, the tuple is built from the blocks and kept.
    assert isinstance(buf.chunks, tuple)
    assert buf.chunks is buf.chunks
    assert _same(buf.chunks, list(model))
    assert torch.equal(buf.concat(), torch.cat(list(model)))


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("commit"), st.just(1)),
        st.tuples(st.just("extend"), st.integers(0, 3 * _BLOCK)),
        st.tuples(st.just("reset"), st.just(0)),
        st.tuples(st.just("read"), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(maxlen=st.sampled_from(MAXLENS), ops=_OPS)
def test_commits_extends_and_resets_match_a_list(
    maxlen: int | None, ops: list[tuple[str, int]]
) -> None:
    buf = LatentBuffer(name="latents", dim=0).allocate(maxlen=maxlen)
    model: collections.deque[torch.Tensor] = collections.deque(maxlen=maxlen)
    made = 0
    for op, count in ops:
        if op == "commit":
            chunk = _chunk(made)
            made += 1
            buf = buf.commit(chunk)
            model.append(chunk)
        elif op == "extend":
            new = [_chunk(made + k) for k in range(count)]
            made += count
            buf = buf.extend(new)
            model.extend(new)
        elif op == "reset":
            buf = buf.reset()
            model.clear()
        else:  # build the tuple mid-run: later commits start from a buffer that holds it
            assert _same(buf.chunks, list(model))
        _check_against(buf, list(model))


def test_a_commit_shares_every_block_but_the_newest() -> None:
    buf = LatentBuffer(name="latents", dim=0).allocate()
    buf = buf.extend([_chunk(i) for i in range(4000)])
    for i in range(3 * _BLOCK):
        new = buf.commit(_chunk(i))
        old_blocks, new_blocks = buf._seq._blocks, new._seq._blocks
        # Every block the old buffer holds is the new one's, by identity; a commit builds
        # at most one tail and one tuple of block references.
        assert all(a is b for a, b in zip(old_blocks, new_blocks, strict=False))
        assert len(new_blocks) - len(old_blocks) in (0, 1)
        assert len(new._seq._tail) <= _BLOCK
        assert all(len(block) == _BLOCK for block in new_blocks)
        buf = new
    assert "chunks" not in vars(buf)  # nothing read the tuple, so nothing built it


def test_a_short_buffer_is_one_tuple_and_a_long_one_blocks() -> None:
    # Up to a block's worth of chunks (every small ring) is one tuple, as cheap as a commit
    # gets; the commit past it moves the chunks into blocks, once.
    buf = LatentBuffer(name="latents", dim=0).allocate()
    for i in range(_BLOCK):
        buf = buf.commit(_chunk(i))
        assert buf._seq is buf.chunks
    buf = buf.commit(_chunk(_BLOCK))
    assert len(buf._seq._blocks) == 1
    assert len(buf._seq._tail) == 1
    ring = LatentBuffer(name="ring", dim=0).allocate(maxlen=_BLOCK)
    for i in range(3 * _BLOCK):
        ring = ring.commit(_chunk(i))
        assert type(ring._seq) is tuple


def test_a_ring_rebuilds_only_its_first_block() -> None:
    ring = LatentBuffer(name="latents", dim=0).allocate(maxlen=3 * _BLOCK)
    ring = ring.extend([_chunk(i) for i in range(3 * _BLOCK)])
    moved = ring.commit(_chunk(-1))
    assert len(moved._seq._blocks[0]) == _BLOCK - 1
    assert all(a is b for a, b in zip(ring._seq._blocks[1:], moved._seq._blocks[1:], strict=True))


@pytest.mark.parametrize("maxlen", [_BLOCK + 1, 2 * _BLOCK + 3])
def test_a_dropped_chunk_is_not_kept_by_a_block(maxlen: int) -> None:
    ring = LatentBuffer(name="latents", dim=0).allocate(maxlen=maxlen)
    first = _chunk(0)
    gone = weakref.ref(first)
    ring = ring.commit(first)
    del first
    for i in range(1, maxlen + 2 * _BLOCK):
        ring = ring.commit(_chunk(i))
    gc.collect()
    # Only the current version is held: the chunk it dropped is freed, though later ones of
    # its first block are still held.
    assert gone() is None
    assert len(ring) == maxlen


def test_a_reset_buffer_holds_none_of_the_old_chunks() -> None:
    buf = LatentBuffer(name="latents", dim=0).allocate()
    buf = buf.extend([_chunk(i) for i in range(3 * _BLOCK)])
    refs = [weakref.ref(c) for c in buf._seq]
    buf = buf.reset().commit(_chunk(-1))
    gc.collect()
    assert all(r() is None for r in refs)


@pytest.mark.parametrize("read", [False, True], ids=["unread", "read"])
def test_a_buffer_of_blocks_pickles_and_copies(read: bool) -> None:
    buf = LatentBuffer(name="latents", dim=0).allocate()
    for i in range(2 * _BLOCK + 7):
        buf = buf.commit(_chunk(i))
    if read:
        assert len(buf.chunks) == 2 * _BLOCK + 7
    for other in (pickle.loads(pickle.dumps(buf)), copy.deepcopy(buf)):
        assert len(other) == len(buf)
        assert torch.equal(other.concat(), buf.concat())
        assert torch.equal(other.commit(_chunk(-1)).concat()[-1], _chunk(-1)[0])
    shallow = copy.copy(buf)
    assert all(a is b for a, b in zip(shallow.chunks, buf.chunks, strict=True))


@pytest.mark.parametrize("budget", [None, {"cpu": 10**9}], ids=["no-budget", "budget"])
@pytest.mark.parametrize("maxlen", [None, _BLOCK + 1, 2 * _BLOCK + 3])
def test_the_ledger_equals_a_recount_across_blocks(
    budget: dict[str, int] | None, maxlen: int | None
) -> None:
    manager = SessionStateManager(max_bytes=budget)
    ring = LatentBuffer(name="latents", dim=0).allocate(maxlen=maxlen)
    state = SessionState(objects={"latents": ring})
    manager.put("s", state)
    for i in range(3 * _BLOCK + 9):
        state = state.update_object("latents", lambda b, i=i: b.commit(_chunk(i)))
        manager.put("s", state)
        if i % 17 == 0 or i > 3 * _BLOCK:
            assert_stats_equal_a_recount(manager)
    # A record put back after later ones (an older version of the session) is counted too.
    manager.put("s", state.update_object("latents", lambda b: b.reset()))
    assert_stats_equal_a_recount(manager)
    manager.put("s", state)
    assert_stats_equal_a_recount(manager)
