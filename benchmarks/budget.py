"""Benchmarks of the byte budget: what parking costs, and what the budget check costs per put.

Run from the repository root::

    .venv/bin/python benchmarks/budget.py            # full sizes (a minute or so)
    .venv/bin/python benchmarks/budget.py --smoke    # every measurement, tiny sizes (seconds)
    .venv/bin/python benchmarks/budget.py --out some/dir/budget.json

Two measurements, each a median over repeats after a warm-up (`time.perf_counter`); what
matters is the ratios within one run, and nothing here asserts a time:

1. ``round_trip``: ``park`` then ``unpark`` of a `TensorCache` holding one tensor (and a view
   of it), per MiB, on the host tier and the disk tier; beside it the copy floor (two
   ``dst.copy_(src)`` into pre-touched memory: out and back) and, for disk, ``torch.save`` +
   ``torch.load`` of the same tensor. The host tier three ways: a new host tensor per park
   (``host``, no pool), through a `HostBufferPool` (``host_pool``: the parked copy lands in
   pre-touched memory, the restore is a fresh allocation), and through a pool that also serves
   CPU restores (``host_pool_cpu_restores``: both copies land in pre-touched memory, as the
   CUDA caching allocator gives a device restore). Every handle is released after its round
   trip (a disk handle's spool file goes with it). Targets: the pooled host round trip
   within 1.2x of the copy floor at 16 and 64 MiB; disk beside torch.save + torch.load.
2. ``put_check``: `SessionStateManager.put` of a DreamZero-shaped record (one value changed
   per put, as a model step does) with a byte budget that never parks, vs the same put without
   a budget, vs a plain walk of the record's leaves (`tree_leaves`). The budget check is the
   difference between the first two. Target: within 2x of the walk.
3. ``round_robin``: six DreamZero tiny sessions stepped in turn through the managed
   pipeline's ``forward``, median step time: unbudgeted, under a budget fitting two sessions
   (the least recently used are parked, KV included, and unparked on their turn), and the
   same with ``prefetch(next, make_room=True)`` before each step (the next session copied
   back on the worker thread while the current one steps). Target: with prefetch within 1.3x
   of unbudgeted on CPU.
4. ``kv_park``: a `KVCache` whose handle holds N MiB of a `KVPool`'s blocks, parked and
   unparked (`park_tree` on the host tier, then `restore`), per MiB, beside the copy floor.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import machine_info

from sessionstate import (
    DEFAULT_MAX_SESSIONS,
    KVCache,
    KVPool,
    LatentBuffer,
    SessionState,
    SessionStateManager,
    TensorCache,
    tree_leaves,
)
from sessionstate._storage import HostBufferPool, park_tree

_MIB = 1024 * 1024


def _median_s(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def round_trip(mib: int, repeats: int) -> dict[str, Any]:
    """Park+unpark per MiB on both tiers, beside the copy floor and torch.save+torch.load."""
    n = mib * _MIB // 4
    x = torch.randn(n)
    cache = TensorCache(name="bench").allocate().commit((x, x[1:]))
    spool = tempfile.mkdtemp(prefix="sessionstate-bench-")
    # Room for one parked copy and one restored copy (`cpu_restores`), with a page to spare.
    pool = HostBufferPool(2 * mib * _MIB + 4096, pin_memory=False)
    restoring_pool = HostBufferPool(2 * mib * _MIB + 4096, pin_memory=False, cpu_restores=True)

    def park_unpark(tier: str) -> Callable[[], object]:
        def once() -> object:
            parked = cache.park(tier, spool_dir=spool)  # type: ignore[arg-type]
            back = parked.unpark()
            parked.handle.release()  # the disk tier's spool file goes now
            return back

        return once

    def pooled(host_pool: HostBufferPool) -> Callable[[], object]:
        def once() -> object:
            handle = park_tree(cache, "host", pool=host_pool)
            back = handle.restore()
            handle.release()
            return back

        return once

    dst, back = torch.empty_like(x), torch.empty_like(x)
    dst.fill_(0)
    back.fill_(0)

    def floor() -> None:
        dst.copy_(x)
        back.copy_(dst)

    path = os.path.join(spool, "torch.pt")

    def save_load() -> object:
        torch.save(x, path)
        return torch.load(path)

    try:
        out = {
            "mib": mib,
            "host_ms_per_mib": _median_s(park_unpark("host"), repeats) * 1e3 / mib,
            "host_pool_ms_per_mib": _median_s(pooled(pool), repeats) * 1e3 / mib,
            "host_pool_cpu_restores_ms_per_mib": (
                _median_s(pooled(restoring_pool), repeats) * 1e3 / mib
            ),
            "disk_ms_per_mib": _median_s(park_unpark("disk"), repeats) * 1e3 / mib,
            "copy_floor_ms_per_mib": _median_s(floor, repeats) * 1e3 / mib,
            "torch_save_load_ms_per_mib": _median_s(save_load, repeats) * 1e3 / mib,
            "spool_files_left": len(os.listdir(spool)) - 1,  # torch.pt is the baseline's
        }
    finally:
        shutil.rmtree(spool, ignore_errors=True)
    if pool.stats()["allocations"] or restoring_pool.stats()["allocations"]:
        msg = "a pooled round trip left ranges held in its pool"
        raise RuntimeError(msg)
    floor_ms = out["copy_floor_ms_per_mib"]
    out["host_over_floor"] = out["host_ms_per_mib"] / floor_ms
    out["host_pool_over_floor"] = out["host_pool_ms_per_mib"] / floor_ms
    out["host_pool_cpu_restores_over_floor"] = out["host_pool_cpu_restores_ms_per_mib"] / floor_ms
    out["disk_over_torch_save_load"] = out["disk_ms_per_mib"] / out["torch_save_load_ms_per_mib"]
    return out


def _dreamzero_shaped(step: int) -> SessionState:
    # 24 feature-cache tensors, three buffers and a handful of attributes, as one DreamZero
    # session holds; small tensors, since the check's cost is per leaf, not per byte.
    feat = tuple(torch.zeros(8) for _ in range(24))
    objects = {
        "vae_enc_feat_map": TensorCache(name="vae_enc_feat_map").allocate().commit(feat),
        "stitched_buffer": LatentBuffer(name="s", dim=0).allocate(maxlen=4),
        "video_latents_across_time": LatentBuffer(name="v", dim=2).allocate(),
        "vae_encoder_out": LatentBuffer(name="e", dim=2).allocate(maxlen=2),
    }
    for _ in range(4):
        objects["stitched_buffer"] = objects["stitched_buffer"].commit(torch.zeros(1, 8))
    attributes = {f"a{i}": torch.zeros(4) for i in range(6)}
    attributes["step"] = step
    return SessionState(objects=objects, attrs=attributes)


def put_check(sessions: int, repeats: int) -> dict[str, Any]:
    """Cost of the budget check per put, beside the same put unbudgeted and a leaf walk."""
    base = _dreamzero_shaped(0)
    records = [
        base.update_object("vae_encoder_out", lambda b, i=i: b.commit(torch.full((1, 1, 1), i)))
        for i in range(repeats + 2)
    ]

    def puts(manager: SessionStateManager) -> Callable[[], object]:
        for s in range(sessions):
            manager.put(f"s{s}", base)
        it = iter(range(10**9))

        def one() -> None:
            manager.put("s0", records[next(it) % len(records)])

        return one

    budgeted = SessionStateManager(max_bytes={"cpu": 2**40})
    plain = SessionStateManager()
    put_budget = _median_s(puts(budgeted), repeats * 20)
    put_plain = _median_s(puts(plain), repeats * 20)
    walk = _median_s(lambda: tree_leaves(base), repeats * 20)
    check = max(put_budget - put_plain, 0.0)
    return {
        "sessions": sessions,
        "leaves": len(tree_leaves(base)),
        "put_with_budget_us": put_budget * 1e6,
        "put_without_budget_us": put_plain * 1e6,
        "budget_check_us": check * 1e6,
        "leaf_walk_us": walk * 1e6,
        "check_over_walk": check / walk,
    }


def round_robin(sessions: int, rounds: int) -> dict[str, Any]:
    """Median step time of a round robin of DreamZero tiny sessions: unbudgeted, under a
    budget of two sessions, and the same with the next session prefetched before each step."""
    from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    from sessionstate.models.dreamzero.episode import scripted_episode

    cfg = DreamZeroConfig.preset("tiny")
    episode = list(scripted_episode(cfg, steps=rounds + 1, sessions=sessions, seed=0))
    ids = [sid for sid, _ in episode[:sessions]]

    def run(max_bytes: int | None, prefetch: bool) -> tuple[float, dict[str, int]]:
        env = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
        if max_bytes is not None:
            env["OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES"] = str(max_bytes)
            env["OMNI_DIFFUSION_SESSION_STATE_MANAGER_PARK_TIER"] = "host"
        pipe = DreamZeroPipeline(cfg, environ=env)
        times = []
        for i, (sid, obs) in enumerate(episode):
            start = time.perf_counter()
            if prefetch and i + 1 < len(episode):
                pipe.prefetch(episode[i + 1][0], make_room=True)
            pipe.forward(obs, sid)
            if i >= sessions:  # the first round starts the sessions: not timed
                times.append(time.perf_counter() - start)
        stats = pipe.stats()
        for sid in ids:
            pipe.drop_session(sid)
        return statistics.median(times), stats

    plain_s, plain = run(None, prefetch=False)
    one = plain["nbytes:cpu"] // sessions
    budget = 2 * one + one // 4
    parked_s, parked = run(budget, prefetch=False)
    fetched_s, fetched = run(budget, prefetch=True)
    return {
        "sessions": sessions,
        "rounds": rounds,
        "session_nbytes": one,
        "max_bytes": budget,
        "unbudgeted_step_ms": plain_s * 1e3,
        "budgeted_step_ms": parked_s * 1e3,
        "budgeted_prefetch_step_ms": fetched_s * 1e3,
        "budgeted_over_unbudgeted": parked_s / plain_s,
        "prefetch_over_unbudgeted": fetched_s / plain_s,
        "kv_parks": parked.get("kv_parks", 0),
        "evictions": parked.get("evictions", 0) + fetched.get("evictions", 0),
        "prefetches": fetched.get("prefetches", 0),
        "prefetch_hits": fetched.get("prefetch_hits", 0),
        "prefetches_dropped": fetched.get("prefetches_dropped", 0),
    }


def kv_park(mib: int, repeats: int) -> dict[str, Any]:
    """Park+unpark per MiB of a `KVCache` whose handle holds ``mib`` MiB of pool blocks."""
    block_tokens, width = 256, 256  # one block: 256 tokens of 256 floats = 256 KiB
    blocks = mib * _MIB // (block_tokens * width * 4)
    pool = KVPool(blocks + 1, block_tokens=block_tokens, token_shape=(width,))
    handle = pool.append(pool.empty(), torch.randn(blocks * block_tokens, width))
    held = [KVCache().allocate().commit(handle)]  # the one live cache: its blocks move
    del handle
    free = pool.free_blocks
    x = held[0].read()

    def once() -> None:
        parked = park_tree(held.pop(), "host")  # the blocks go back to the pool
        held.append(parked.restore())  # and are taken again
        parked.release()

    dst, again = torch.zeros_like(x), torch.zeros_like(x)

    def floor() -> None:
        dst.copy_(x)
        again.copy_(dst)

    out = {
        "mib": mib,
        "kv_park_unpark_ms_per_mib": _median_s(once, repeats) * 1e3 / mib,
        "copy_floor_ms_per_mib": _median_s(floor, repeats) * 1e3 / mib,
    }
    if pool.free_blocks != free:
        msg = "a KV round trip left blocks held in its pool"
        raise RuntimeError(msg)
    out["kv_over_floor"] = out["kv_park_unpark_ms_per_mib"] / out["copy_floor_ms_per_mib"]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; print and write the results as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args(argv)
    sizes, repeats = ([1], 3) if args.smoke else ([1, 16, 64], 7)
    results = {
        "smoke": args.smoke,
        "machine": machine_info(),  # the commit, date, machine and load at the start
        "torch": torch.__version__,
        "round_trip": [round_trip(mib, repeats) for mib in sizes],
        "put_check": [
            put_check(n, repeats) for n in ([4] if args.smoke else [4, DEFAULT_MAX_SESSIONS])
        ],
        "round_robin": round_robin(6, 1 if args.smoke else 4),
        "kv_park": [kv_park(mib, repeats) for mib in sizes],
    }
    results["loadavg_end"] = list(os.getloadavg())
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
