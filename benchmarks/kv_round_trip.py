"""KV park+unpark through the manager, and a step's room check, timed in one process.

For comparing two checkouts in turns (``PYTHONPATH=<checkout>/src``, e.g. with
``farm-bench``): a session of ``--mib`` MiB of KV blocks parked with `park_until` and read
back with `get` (its blocks reloaded into the pool), ``--repeats`` times; the median round
trip in ms and, beside it, the copy floor (copying the same bytes out and back with two
``copy_`` into preallocated buffers). Prints one JSON line; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sessionstate import KVCache, KVPool, SessionState, SessionStateManager


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens, token_shape = 64, (2, 8, 64)  # a block: 64 tokens of 2 x 8 heads x 64 fp32 values
    block_nbytes = tokens * 2 * 8 * 64 * 4
    blocks = args.mib * 2**20 // block_nbytes
    pool = KVPool(blocks, block_tokens=tokens, token_shape=token_shape)
    kv = torch.randn(blocks * tokens - tokens // 2, *token_shape)  # the last block half full
    m = SessionStateManager()
    m.put("a", SessionState(objects={"kv": KVCache().allocate().append(pool, kv)}))
    want = kv.clone()
    del kv
    trips = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
        state = m.get("a")
        trips.append(time.perf_counter() - start)
        assert state is not None
        del state
    check = m.get("a")
    assert check is not None
    assert torch.equal(check.object("kv", KVCache).read(), want)  # type: ignore[arg-type]
    src = pool.storage
    out, back = torch.empty_like(src), torch.empty_like(src)
    out.copy_(src)
    back.copy_(out)  # pre-touched
    floor = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out.copy_(src)
        back.copy_(out)
        floor.append(time.perf_counter() - start)
    trip, copy = statistics.median(trips), statistics.median(floor)
    print(
        json.dumps(
            {
                "mib": args.mib,
                "round_trip_ms": trip * 1e3,
                "copy_floor_ms": copy * 1e3,
                "ratio": trip / copy,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
