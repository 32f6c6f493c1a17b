"""What a Prometheus scrape of a manager costs beside a `stats()` call, in one run.

A manager holding ``--sessions`` sessions (each a small feature cache and KV blocks of one
pool, a budget parking a tenth of them) is read four ways in turns: ``stats()``; the
collector's snapshot (`SessionStateManager.metrics_snapshot`); the collector's metric
families (`SessionStateCollector.collect`, what the library builds); and a whole scrape, the
families rendered by ``prometheus_client.generate_latest`` (whose text rendering is
``prometheus_client``'s own cost). Medians in microseconds and their ratios to ``stats()``;
nothing here asserts a time. Target: a scrape at most 2x a ``stats()`` call with 1,000
sessions held.
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
    collector = SessionStateCollector(manager)
    registry = CollectorRegistry()
    registry.register(collector)
    ways = {
        "stats": manager.stats,
        "snapshot": manager.metrics_snapshot,
        "families": lambda: list(collector.collect()),
        "scrape": lambda: generate_latest(registry),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, read in ways.items():
            start = time.perf_counter()
            read()
            times[name].append((time.perf_counter() - start) * 1e6)
    median = {name: statistics.median(us) for name, us in times.items()}
    held = manager.stats()
    out: dict[str, float] = {
        "sessions": held["sessions"],
        "parked_sessions": held["parked_sessions"],
    }
    for name, us in median.items():
        out[f"{name}_us"] = round(us, 1)
    for name in ("snapshot", "families", "scrape"):
        out[f"{name}_ratio"] = round(median[name] / median["stats"], 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
