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
    reads = {sid: m.require(sid).object("kv", KVCache).read() for sid in m.session_ids()}
    held = _held(pool)
    sharing = {sid: sorted(m.session_stats(sid)["shared_with"]) for sid in reads}
    assert sharing["a"] == ["b", "c", "root"]
    assert m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
    for sid in reads:
        assert torch.equal(m.require(sid).object("kv", KVCache).read(), reads[sid])
    assert _held(pool) == held
    assert {sid: sorted(m.session_stats(sid)["shared_with"]) for sid in reads} == sharing
    assert pool.blocks_reused > 0
