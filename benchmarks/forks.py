"""Forks through the manager against the bespoke way (a deep copy per branch), in one run.

A session shaped like DreamZero's managed record: a history of ``--chunks`` latent chunks (a
`LatentBuffer`, shared by every step), a causal-conv cache replaced wholesale every step (a
`TensorCache`), and a frame ring. ``--branches`` branches are made by `SessionStateManager.fork`
and by `copy.deepcopy` of the record (what a hand-rolled model does), then each branch steps
``--steps`` times (one new chunk, a new cache, a new frame). Reported, per history length:

- ``fork_ms``: the fork, against the deep copies (median of ``--repeats``);
- ``bytes``: what the manager holds after the branches stepped (each storage once) against
  what the deep copies hold (the source and every copy), and their ratio.

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

from sessionstate import LatentBuffer, SessionState, SessionStateManager, TensorCache, tree_equal
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [measure(c, args.branches, args.steps, args.repeats) for c in args.chunks]
    print(json.dumps({"forks": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
