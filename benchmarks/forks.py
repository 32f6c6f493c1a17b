"""Forks through the manager against the bespoke way (a deep copy per branch), in one run.

A session shaped like DreamZero's managed record: a history of ``--chunks`` latent chunks (a
`LatentBuffer`, shared by every step), a causal-conv cache replaced wholesale every step (a
`TensorCache`), and a frame ring. ``--branches`` branches are made by `SessionStateManager.fork`
and by `copy.deepcopy` of the record (what a hand-rolled model does), then each branch steps
``--steps`` times (one new chunk, a new cache, a new frame). Reported, per history length:

- ``fork_ms``: the fork, against the deep copies (median of ``--repeats``);
- ``bytes``: what the manager holds after the branches stepped (each storage once) against
  what the deep copies hold (the source and every copy), and their ratio.

Then a family holding K/V (``kv_family``): a session whose `KVCache` holds a prefix of
``--kv-prefix`` tokens in a `KVPool` given to the manager, forked into ``--branches`` branches
that each append ``--kv-own`` tokens; every session is parked (`park_until`) and read back.
Reported: the pool blocks the family holds before and after, what per-session copies of every
branch's blocks would hold (each branch's blocks counted for it alone), and the blocks the
unparks took back from a sibling (`KVPool.blocks_reused`); every read is checked with
`torch.equal`.

Prints one JSON object; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch

from sessionstate import (
    KVCache,
    KVPool,
    LatentBuffer,
    SessionState,
    SessionStateManager,
    TensorCache,
    tree_equal,
)
from sessionstate import nbytes_by_device as nbytes

CHUNK = (1, 16, 2, 11, 20)  # a latent chunk at a quarter of the deploy latent grid
CACHE = [(1, 96, 2, 44, 80)] * 4  # four causal-conv slots of a reduced Wan cache
FRAME = (88, 160, 3)


def session(chunks: int) -> SessionState:
    g = torch.Generator().manual_seed(0)
    history = LatentBuffer(name="history", dim=2).allocate()
    for _ in range(chunks):
        history = history.commit(torch.randn(CHUNK, generator=g))
    cache = TensorCache(name="cache").allocate().commit(tuple(torch.randn(s) for s in CACHE))
    ring = LatentBuffer(name="ring", dim=0).allocate(maxlen=4)
    for _ in range(4):
        ring = ring.commit(torch.zeros(FRAME, dtype=torch.uint8))
    return SessionState(objects={"history": history, "cache": cache, "ring": ring})


def step(state: SessionState, seed: int) -> SessionState:
    g = torch.Generator().manual_seed(seed)
    return state.with_values(
        {
            "history": state.object("history", LatentBuffer).commit(
                torch.randn(CHUNK, generator=g)
            ),
            "cache": state.object("cache", TensorCache).commit(
                tuple(torch.randn(s, generator=g) for s in CACHE)
            ),
            "ring": state.object("ring", LatentBuffer).commit(
                torch.full(FRAME, seed % 256, dtype=torch.uint8)
            ),
        }
    )


def measure(chunks: int, branches: int, steps: int, repeats: int) -> dict[str, Any]:
    source = session(chunks)
    ids = [f"b{i}" for i in range(branches)]
    fork_s, copy_s = [], []
    for _ in range(repeats):
        m: SessionStateManager[SessionState] = SessionStateManager()
        m.put("src", source)
        start = time.perf_counter()
        m.fork("src", *ids)
        fork_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        copies = [copy.deepcopy(source) for _ in ids]
        copy_s.append(time.perf_counter() - start)
    for i, branch in enumerate(ids):
        state = m.require(branch)
        for k in range(steps):
            state = step(state, 1000 * i + k)
        m.put(branch, state)
        copies[i] = _stepped_copy(copies[i], i, steps)
        assert tree_equal(m.peek(branch), copies[i])  # the same branch, both ways
    managed = m.stats()["total_nbytes"]
    deep = sum(nbytes([source, *copies]).values())
    return {
        "chunks": chunks,
        "branches": branches,
        "steps": steps,
        "fork_ms": round(1000 * statistics.median(fork_s), 3),
        "deepcopy_ms": round(1000 * statistics.median(copy_s), 3),
        "fork_vs_deepcopy": round(statistics.median(fork_s) / statistics.median(copy_s), 4),
        "managed_bytes": managed,
        "deepcopy_bytes": deep,
        "bytes_ratio": round(managed / deep, 4),
    }


def measure_kv_family(prefix: int, branches: int, own: int) -> dict[str, Any]:
    """Pool blocks a forked K/V family holds before and after parking every session."""
    block_tokens, token_shape = 16, (2, 4, 32)  # a block: 16 tokens of 2 x 4 heads x 32
    per = -(-(prefix + own) // block_tokens) + 1
    pool = KVPool(per * (branches + 1), block_tokens=block_tokens, token_shape=token_shape)
    m: SessionStateManager[SessionState] = SessionStateManager(pools=(pool,))
    g = torch.Generator().manual_seed(0)
    kv = KVCache(name="kv").allocate().append(pool, torch.randn(prefix, *token_shape, generator=g))
    m.put("src", SessionState(objects={"kv": kv}))
    del kv
    ids = [f"b{i}" for i in range(branches)]
    m.fork("src", *ids)
    for sid in ids:
        state = m.require(sid)
        grown = state.object("kv", KVCache).append(
            pool, torch.randn(own, *token_shape, generator=g)
        )
        m.put(sid, state.with_object("kv", grown))
    del state, grown
    reads = {sid: m.require(sid).object("kv", KVCache).read() for sid in m.session_ids()}
    copies = sum(len(m.require(sid).object("kv", KVCache).view().blocks) for sid in reads)
    before = pool.num_blocks - pool.free_blocks
    parked = m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
    assert parked, "every session's K/V parks"
    for sid, want in reads.items():
        assert torch.equal(m.require(sid).object("kv", KVCache).read(), want)
    after = pool.num_blocks - pool.free_blocks
    return {
        "prefix_tokens": prefix,
        "branches": branches,
        "own_tokens": own,
        "blocks_before": before,
        "blocks_after": after,
        "blocks_as_per_session_copies": copies,
        "after_over_before": round(after / before, 4),
        "blocks_reused": getattr(pool, "blocks_reused", 0),
    }


def _stepped_copy(state: SessionState, i: int, steps: int) -> SessionState:
    for k in range(steps):
        state = step(state, 1000 * i + k)
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[10, 400])
    parser.add_argument("--branches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-prefix", type=int, default=1000)
    parser.add_argument("--kv-own", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(c, args.branches, args.steps, args.repeats) for c in args.chunks]
    family = measure_kv_family(args.kv_prefix, args.branches, args.kv_own)
    print(json.dumps({"forks": rows, "kv_family": family}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
