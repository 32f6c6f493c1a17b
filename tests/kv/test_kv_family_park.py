"""A family's K/V parks per session and comes back shared: unparking takes back live blocks.

Each block a pool hands out has a content id that a parked copy carries. Unparking reuses a
live block of the same content (a sibling's, or the one a sibling unparked into) holding at
least the tokens the parked handles read there, instead of a fresh block: these tests park
the branches of a prefix one by one, in every order, and check the reads (`torch.equal`), the
blocks shared and the pool's free blocks against the family never parked; and that a block
written past its restored tokens is never taken for another sibling's tokens.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from sessionstate import (
    KVCache,
    KVHandle,
    KVPool,
    KVPoolExhaustedError,
    SessionState,
    SessionStateManager,
)
from sessionstate._kv._pool import offload_payload, reload_handles


def _family(pool: KVPool) -> list[KVHandle]:
    """A prefix of 5 tokens and two branches of it: one written in place into the prefix's
    half-full block, one that copied that block on write (7 blocks in all)."""
    g = torch.Generator().manual_seed(0)
    prefix = pool.append(pool.empty(), torch.randn(5, 2, generator=g))
    left = pool.append(prefix, torch.randn(4, 2, generator=g))
    right = pool.append(prefix, torch.randn(2, 2, generator=g))
    return [prefix, left, right]


def _parked(handle: KVHandle) -> dict[str, object]:
    # One session's park: its handle's blocks copied to host memory (as the host tier does).
    payload = offload_payload([("kv", handle)])
    for group in payload["pools"]:
        group["blocks"] = group["blocks"].read()
    return payload


def _held(pool: KVPool) -> int:
    return pool.num_blocks - pool.free_blocks


def test_a_branch_parked_alone_comes_back_on_its_siblings_blocks() -> None:
    pool = KVPool(16, block_tokens=2, token_shape=(2,))
    prefix, left, right = _family(pool)
    want, held = left.read(), _held(pool)
    payload = _parked(left)
    del left
    assert _held(pool) == held - 2  # its own two blocks went back; the shared ones stay
    (back,) = reload_handles(payload)
    assert torch.equal(back.read(), want)
    assert back.blocks[:3] == prefix.blocks  # the prefix's blocks, the half-full one too
    assert back.blocks[:2] == right.blocks[:2]
    assert _held(pool) == held
    assert pool.blocks_reused == 3


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_a_family_parked_one_by_one_comes_back_shared_in_any_order(
    order: tuple[int, ...],
) -> None:
    pool = KVPool(16, block_tokens=2, token_shape=(2,))
    family = _family(pool)
    reads = [h.read() for h in family]
    held = _held(pool)
    layout = [h.blocks for h in family]
    payloads = []
    for i in order:  # parked one by one: each park leaves the others resident
        payloads.append((i, _parked(family[i])))
        family[i] = None  # type: ignore[call-overload]
    assert pool.free_blocks == pool.num_blocks
    back: dict[int, KVHandle] = {}
    for i, payload in reversed(payloads):
        (back[i],) = reload_handles(payload)
    assert [torch.equal(back[i].read(), reads[i]) for i in range(3)] == [True] * 3
    assert _held(pool) == held  # shared again: as many blocks as the family held
    # The same sharing as before, block for block (ids may differ).
    before = {(i, j): b for i, blocks in enumerate(layout) for j, b in enumerate(blocks)}
    after = {(i, j): b for i, h in back.items() for j, b in enumerate(h.blocks)}
    for a, b in itertools.combinations(before, 2):
        assert (before[a] == before[b]) == (after[a] == after[b]), (a, b)
    # Appends still copy on write: every branch reads what it read.
    grown = [pool.append(back[i], torch.full((1, 2), float(i))) for i in range(3)]
    for i in range(3):
        assert torch.equal(back[i].read(), reads[i])
        assert torch.equal(grown[i].read()[:-1], reads[i])


def test_a_block_written_past_its_restored_tokens_is_not_taken_for_more() -> None:
    # prefix reads 1 token of block 2, left 2 (its own token written in place). prefix comes
    # back first (block 2 restored with its 1 token) and appends its own second token in
    # place; left's second token there differs, so left must not take that block.
    pool = KVPool(16, block_tokens=2, token_shape=(2,))
    prefix, left, _ = _family(pool)
    want_prefix, want_left = prefix.read(), left.read()
    parked_prefix, parked_left = _parked(prefix), _parked(left)
    del prefix, left, _
    (prefix,) = reload_handles(parked_prefix)
    grown = pool.append(prefix, torch.full((1, 2), -9.0))  # in place, into block 2
    assert grown.blocks[2] == prefix.blocks[2]
    (left,) = reload_handles(parked_left)
    assert torch.equal(left.read(), want_left)
    assert left.blocks[:2] == prefix.blocks[:2]
    assert left.blocks[2] != prefix.blocks[2]
    assert torch.equal(grown.read()[:-1], want_prefix)


def test_a_reload_short_of_fresh_blocks_takes_nothing_and_names_only_those() -> None:
    pool = KVPool(9, block_tokens=2, token_shape=(2,))
    prefix, left, right = _family(pool)
    want = left.read()
    payload = _parked(left)
    del left
    free = pool.free_blocks
    hog = pool.append(pool.empty(), torch.zeros(2 * (free - 1), 2))  # one block left free
    with pytest.raises(KVPoolExhaustedError) as info:
        reload_handles(payload)  # 2 fresh blocks needed (3 taken back from the prefix)
    assert info.value.needed == 2
    assert pool.free_blocks == 1
    del hog
    assert pool.free_blocks == free
    (back,) = reload_handles(payload)
    assert torch.equal(back.read(), want)
    del prefix, right, back
    assert pool.free_blocks == pool.num_blocks  # no reference left behind


def test_a_managed_family_under_pool_pressure_keeps_its_sharing() -> None:
    # Four branches of one session share its KV prefix; parking all of them and reading
    # them back leaves the pool holding the family's blocks once, each branch bit-identical.
    pool = KVPool(64, block_tokens=4, token_shape=(8,))
    m = SessionStateManager(pools=(pool,))
    g = torch.Generator().manual_seed(1)
    kv = KVCache().allocate().append(pool, torch.randn(30, 8, generator=g))
    m.put("root", SessionState(objects={"kv": kv}))
    del kv
    m.fork("root", "a", "b", "c")
    for sid in "abc":  # each branch grows its own tokens past the shared prefix
        state = m.require(sid)
        grown = state.object("kv", KVCache).append(pool, torch.randn(5, 8, generator=g))
        m.put(sid, state.with_object("kv", grown))
    del state, grown
    reads: dict[Any, Any] = {
        sid: m.require(sid).object("kv", KVCache).read() for sid in m.session_ids()
    }
    held = _held(pool)
    sharing = {sid: sorted(m.session_stats(sid)["shared_with"]) for sid in reads}
    assert sharing["a"] == ["b", "c", "root"]
    assert m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
    for sid, want in reads.items():
        got = m.require(sid).object("kv", KVCache).read()
        assert got is not None
        assert torch.equal(got, want)
    assert _held(pool) == held
    assert {sid: sorted(m.session_stats(sid)["shared_with"]) for sid in reads} == sharing
    assert pool.blocks_reused > 0


def _tokens(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_tokens_written_past_a_restored_blocks_own_are_parked_as_no_content() -> None:
    # A block restored with 2 tokens of a content and written past them in place by its own
    # handle holds a third token that is not that content's: parked again, it must not be
    # taken for another block of the content holding a different third token.
    pool = KVPool(4, block_tokens=4, token_shape=())
    a = pool.append(pool.empty(), _tokens(1, 2))
    b = pool.append(a, _tokens(3))  # in place: [1, 2, 3]
    parked_a, parked_b = _parked(a), _parked(b)
    del a, b
    (r,) = reload_handles(parked_a)  # a fresh block, [1, 2]
    nine = pool.append(r, _tokens(9))  # in place: [1, 2, 9]
    (s,) = reload_handles(parked_b)  # another fresh block of the content, [1, 2, 3]
    parked_nine = _parked(nine)
    del r, nine
    (back,) = reload_handles(parked_nine)
    assert back.read().tolist() == [1, 2, 9]
    assert s.read().tolist() == [1, 2, 3]


def test_tokens_a_rolled_back_step_wrote_are_never_taken_back() -> None:
    # A copy taken inside a step that rolls back holds a token the rollback forgets; a
    # sibling then writes another token there. The copy must come back with its own.
    pool = KVPool(4, block_tokens=4, token_shape=())
    a = pool.append(pool.empty(), _tokens(1, 2))
    kept: dict[str, Any] = {}

    def step() -> None:
        with pool.transaction():
            kept["payload"] = _parked(pool.append(a, _tokens(3)))
            raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        step()
    c = pool.append(a, _tokens(9))  # in place again: [1, 2, 9]
    (back,) = reload_handles(kept["payload"])
    assert back.read().tolist() == [1, 2, 3]
    assert c.read().tolist() == [1, 2, 9]


def test_a_rollback_leaves_a_block_taken_again_since_as_its_new_holders_wrote_it() -> None:
    # A step writes into a block, the block is freed and taken again by a reload (which
    # logs nothing), and the step rolls back: the reloaded handles keep their tokens.
    pool = KVPool(2, block_tokens=4, token_shape=())
    q0 = pool.append(pool.empty(), _tokens(1, 2))
    p0 = pool.append(q0, _tokens(3))
    payload = offload_payload([("p", p0), ("q", q0)])
    payload["pools"][0]["blocks"] = payload["pools"][0]["blocks"].read()
    del p0, q0
    kept: dict[str, Any] = {"x": [pool.append(pool.empty(), _tokens(7, 8))]}

    def step() -> None:
        with pool.transaction():
            pool.append(kept["x"][0], _tokens(9))  # x's block's first fill is logged
            kept["x"].clear()  # the block is free again
            kept["back"] = reload_handles(payload)  # and taken for the reload
            raise RuntimeError("the step failed")

    with pytest.raises(RuntimeError, match="the step failed"):
        step()
    p, q = kept["back"]
    q2 = pool.append(q, _tokens(100))  # past p's end: a copy on write, not in place
    assert p.read().tolist() == [1, 2, 3]
    assert q2.read().tolist() == [1, 2, 100]


def test_a_restored_block_extended_in_place_is_shared_again_by_a_later_family() -> None:
    # "a" parks and comes back on a fresh block, writes its third token in place there, and
    # forks: the family holds that block once, and parked and read back it still does.
    pool = KVPool(16, block_tokens=4, token_shape=(1,))
    m = SessionStateManager(pools=(pool,))
    kv = KVCache().allocate().append(pool, torch.arange(2.0).view(2, 1))
    m.put("a", SessionState(objects={"kv": kv}))
    del kv
    assert m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
    state = m.require("a")
    grown = state.object("kv", KVCache).append(pool, torch.full((1, 1), 7.0))
    assert grown.view().blocks == state.object("kv", KVCache).view().blocks  # in place
    m.put("a", state.with_object("kv", grown))
    del state, grown
    m.fork("a", "b")
    assert _held(pool) == 1
    assert m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
    back = [m.require(sid).object("kv", KVCache) for sid in "ab"]
    assert [b.read().flatten().tolist() for b in back] == [[0.0, 1.0, 7.0]] * 2
    assert _held(pool) == 1
    assert back[0].view().blocks == back[1].view().blocks
    assert pool.blocks_reused == 1


@pytest.mark.parametrize("root_writes", [False, True])
def test_the_third_sibling_reuses_the_block_the_longer_one_came_back_on(
    root_writes: bool,
) -> None:
    # "root" reads 1 token of a block, its branch "a" 2 (its own written in place), and "c",
    # a fork of "a", the same 2. Back in that order: "a" comes back on the longer block (the
    # root's, extended; or a fresh one when the root wrote past its token first), which then
    # holds the content for "c" to take back.
    pool = KVPool(16, block_tokens=4, token_shape=(1,))
    m = SessionStateManager(pools=(pool,))
    kv = KVCache().allocate().append(pool, torch.ones(1, 1))
    m.put("root", SessionState(objects={"kv": kv}))
    del kv
    m.fork("root", "a")
    state = m.require("a")
    m.put(
        "a",
        state.with_object("kv", state.object("kv", KVCache).append(pool, torch.full((1, 1), 2.0))),
    )
    del state
    m.fork("a", "c")
    assert _held(pool) == 1
    assert m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
    root = m.require("root")
    if root_writes:
        grown = root.object("kv", KVCache).append(pool, torch.full((1, 1), 9.0))  # in place
        m.put("root", root.with_object("kv", grown))
        del grown
    del root
    a, c = (m.require(sid).object("kv", KVCache) for sid in "ac")
    assert a.read().flatten().tolist() == c.read().flatten().tolist() == [1.0, 2.0]
    assert a.view().blocks == c.view().blocks
    assert pool.blocks_reused == (1 if root_writes else 2)
    assert _held(pool) == (2 if root_writes else 1)
