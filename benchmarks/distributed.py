"""Benchmarks: migrating sessions between Ray workers, vs moving the same bytes with put+get.

Run from the repository root::

    .venv/bin/python benchmarks/distributed.py                 # full sizes (a minute or two)
    .venv/bin/python benchmarks/distributed.py --smoke         # every measurement, tiny sizes
    .venv/bin/python benchmarks/distributed.py --out benchmarks/results/distributed.json

Three measurements on a local Ray cluster (two worker actors, one torch thread each):

1. ``tiny_session``: `Router.migrate` of one DreamZero tiny-preset session after a few steps,
   there and back, median seconds.
2. ``large_session``: migration of a stand-in session holding one large tensor (hundreds of
   MiB at full size), per MiB of snapshot, side by side with ``ray.put`` + ``ray.get`` of a
   byte string of the same size from the driver (the floor: one copy into the object store
   and one out of it).
3. ``cluster_rss``: resident memory of every process the local cluster started (the raylet,
   the GCS, the workers), summed from ``/proc``.

Medians after a warm-up; nothing asserts a time. Targets: migration within 1.3x of put+get
per MiB (issue 26), and a tiny session migrating in under 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

from sessionstate import SessionState, SessionStateManager
from sessionstate.distributed import DreamZeroFactory, Router, init_local_ray
from sessionstate.models.dreamzero import DreamZeroConfig
from sessionstate.models.dreamzero.episode import scripted_episode

MIB = 1024 * 1024

# Workers receive `BlobPipeline` by value: this file is not an importable module there.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class BlobPipeline:
    """A stand-in model whose session holds one uint8 tensor of the requested MiB."""

    def __init__(self) -> None:
        self.manager = SessionStateManager()

    def forward(self, mib: int, session_id: str) -> int:
        state = self.manager.get(session_id)
        if state is None:
            blob = torch.randint(0, 256, (mib * MIB,), dtype=torch.uint8)
            state = SessionState(attrs={"blob": blob, "steps": 0})
        self.manager.put(session_id, state.with_attrs(steps=state.attrs["steps"] + 1))
        return mib


def _migrations(router: Router, session_id: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats + 1):  # the first one warms up both workers
        other = next(w for w in router.workers if w != router.owner(session_id))
        times.append(router.migrate(session_id, other).seconds)
    return times[1:]


def tiny_session(repeats: int, steps: int) -> dict[str, Any]:
    cfg = DreamZeroConfig.preset("tiny")
    router = Router(DreamZeroFactory(preset="tiny"), workers=2)
    try:
        for sid, obs in scripted_episode(cfg, steps=steps, sessions=1, seed=0):
            router.step(sid, obs)
        times = _migrations(router, "session-0", repeats)
        nbytes = router.migrations[-1].nbytes
    finally:
        router.shutdown()
    return {"steps": steps, "snapshot_mib": nbytes / MIB, "median_s": statistics.median(times)}


def large_session(mib: int, repeats: int) -> dict[str, Any]:
    router = Router(BlobPipeline, workers=2)
    try:
        router.step("large", mib)
        times = _migrations(router, "large", repeats)
        nbytes = router.migrations[-1].nbytes
    finally:
        router.shutdown()
    payload = os.urandom(nbytes)
    put_get = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        ref = ray.put(payload)
        ray.get(ref, timeout=300)
        put_get.append(time.perf_counter() - start)
        del ref
    migrate_ms = 1000 * statistics.median(times) / (nbytes / MIB)
    put_get_ms = 1000 * statistics.median(put_get[1:]) / (nbytes / MIB)
    return {
        "snapshot_mib": nbytes / MIB,
        "migrate_ms_per_mib": migrate_ms,
        "put_get_ms_per_mib": put_get_ms,
        "ratio": migrate_ms / put_get_ms,
    }


def cluster_rss() -> dict[str, Any]:
    """RSS of every descendant of this process (the local cluster's processes)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        pid = int(entry.name)
        children.setdefault(int(fields["PPid"]), []).append(pid)
        rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
    stack, total, count = list(children.get(os.getpid(), [])), 0, 0
    while stack:
        pid = stack.pop()
        total += rss.get(pid, 0)
        count += 1
        stack.extend(children.get(pid, []))
    return {"processes": count, "rss_mib": total / MIB}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    parser.add_argument("--large-mib", type=int, default=256, help="stand-in session size")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    large_mib = 4 if args.smoke else args.large_mib
    repeats = 1 if args.smoke else 5
    # Room for a migration in flight: the exported bytes and a put+get copy of them.
    init_local_ray(object_store_mib=max(200, 3 * large_mib + 64))
    try:
        results = {
            "smoke": args.smoke,
            "tiny_session": tiny_session(repeats, steps=2 if args.smoke else 8),
            "large_session": large_session(large_mib, repeats),
        }
        results["cluster_rss"] = cluster_rss()
    finally:
        ray.shutdown()
    results["targets"] = {
        "migration_within_1.3x_put_get": results["large_session"]["ratio"] <= 1.3,
        "tiny_session_under_1s": results["tiny_session"]["median_s"] < 1.0,
    }
    text = json.dumps(results, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
