"""What a Prometheus scrape of a manager costs beside a `stats()` call, in one run.

A manager holding ``--sessions`` sessions (each a small feature cache and KV blocks of one
pool, a budget parking a tenth of them) is read both ways in turns: ``stats()``, and one
scrape (`SessionStateCollector.collect` rendered by ``prometheus_client.generate_latest``).
Medians in microseconds and their ratio; nothing here asserts a time. Target: a scrape at
most 2x a ``stats()`` call with 1,000 sessions held.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from prometheus_client import CollectorRegistry, generate_latest

from sessionstate import KVCache, KVPool, SessionState, SessionStateManager, TensorCache
from sessionstate.metrics import SessionStateCollector


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    n = args.sessions
    pool = KVPool(2 * n, block_tokens=2, token_shape=(2,), name="kv", step_tokens=2)
    one = 2 * 16 + 64  # a session: two 16-byte blocks and a 64-byte feature
    manager = SessionStateManager(n + 1, max_bytes={"cpu": one * (n - n // 10)}, pools=(pool,))
    for i in range(n):
        kv = KVCache().allocate().append(pool, torch.full((3, 2), float(i)))
        feat = TensorCache().allocate().commit(torch.full((16,), float(i)))
        manager.put(f"s{i}", SessionState(objects={"kv": kv, "feat": feat}))
    del kv, feat
    registry = CollectorRegistry()
    registry.register(SessionStateCollector(manager))
    stats_us, scrape_us = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        manager.stats()
        stats_us.append((time.perf_counter() - start) * 1e6)
        start = time.perf_counter()
        generate_latest(registry)
        scrape_us.append((time.perf_counter() - start) * 1e6)
    a, b = statistics.median(stats_us), statistics.median(scrape_us)
    held = manager.stats()
    print(
        json.dumps(
            {
                "sessions": held["sessions"],
                "parked_sessions": held["parked_sessions"],
                "stats_us": round(a, 1),
                "scrape_us": round(b, 1),
                "ratio": round(b / a, 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
