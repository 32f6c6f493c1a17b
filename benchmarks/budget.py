"""Benchmarks of the byte budget: what parking costs through the manager, and the put check.

Run from the repository root::

    .venv/bin/python benchmarks/budget.py            # full sizes (a few minutes)
    .venv/bin/python benchmarks/budget.py --smoke    # every measurement, tiny sizes (seconds)
    .venv/bin/python benchmarks/budget.py --out benchmarks/results/budget.json

Every parking figure is taken through `SessionStateManager` with the settings a user has (a
byte budget, the host or disk tier, a host pool by its bytes), and in turns with its floor:
each repeat times every variant once, in an order that rotates, so a change in machine load
hits them all; the figure is the median. What matters is the ratios within one run, and
nothing here asserts a time. The target ratios come with the same ratio in CPU time
(`time.process_time`, the keys ending ``_cpu``): on a busy machine a wall-clock ratio moves
with the time spent waiting for a core, the CPU-time one much less.

1. ``round_trip``: two sessions of one `TensorCache` (a tensor of N MiB and a view of it)
   under a budget that holds one: each `get` of the other parks one and unparks the other,
   one park+unpark of N MiB. Beside it two floors: ``fresh_floor`` (copy out into
   preallocated memory, copy back into a fresh allocation: what any CPU restore must do,
   as glibc maps a large allocation afresh and it page-faults) and ``copy_floor`` (two
   ``copy_`` into preallocated memory). The host tier without and with a host pool, and the
   disk tier beside ``torch.save`` + ``torch.load``. Target: the host tier with a pool within
   1.2x of the fresh floor at 16 and 64 MiB. These managers copy every park
   (``keep_parked_copies=False``): the records never change, so with copies kept every park
   after the first takes its copy back, which ``host_pool_kept`` measures beside them.
2. ``kv_park``: a session whose `KVCache` holds N MiB of a `KVPool`'s blocks, parked with
   `park_until` (its blocks go back to the pool) and read back with `get` (reloaded into
   fresh blocks), beside copying the same bytes out and back (two ``copy_``), with a host
   pool and without one (then beside the fresh floor too: each park's host slot is fresh
   memory, which page-faults). Target: with a host pool, 1.5x two ``copy_``.
3. ``tiny_session``: one DreamZero tiny session (its storages and its KV) parked with
   `park_until` and read back with `get`, beside one consolidated copy of its bytes (one
   tensor out and back). Target: 10x, every park copying (the session does not change
   between trips; ``session_kept`` is the same trip with copies kept: the parks take them
   back, K/V aside). Beside them the host tier alone (``park_tree`` of the same objects and
   ``restore``): what the manager's bookkeeping adds is the difference.
4. ``put_check``: `SessionStateManager.put` of a DreamZero-shaped record (one value changed
   per put, as a model step does) with a byte budget that never parks, vs the same put without
   a budget, vs a plain walk of the record's leaves (`tree_leaves`). Target: within 2x.
5. ``round_robin``: six DreamZero tiny sessions stepped in turn through the managed
   pipeline's ``forward``, four pipelines stepped in turns: unbudgeted, under a budget that
   holds two sessions at their largest (the others parked, KV included, and unparked on their
   turn), the same copying every park (``keep_parked_copies=False``), and the same with
   ``prefetch(next, make_room=True)`` before each step. Then the schedule known (issue 53,
   3d): the manager told the next six steps' sessions with ``expect`` before each step,
   without prefetch (Belady's parking alone, whose parks are counted against LRU's) and
   with it (the next sessions restored in the background while the step runs). Each timed
   step includes its ``expect`` or ``prefetch`` call. The budget never evicts: the run fails
   if it does (evicted sessions would start over and the paths would stop doing the same
   work). Target: the schedule known, with prefetch, within 1.15x of unbudgeted.
6. ``many_sessions``: N small sessions (a cache of four 256-byte tensors and a ring buffer)
   under a budget that holds two and a half, stepped in turn with `get` and `put` (a commit
   to the ring): each `get` parks the least recently used resident session and unparks its
   own. Beside it the same round robin of `step` on sessions holding K/V in a `KVPool` given
   to the manager, with blocks for about three: each step parks the least recently used
   session's K/V. Few sessions and many, in turns: a swap should cost the same however many
   sessions are parked (the figures are the ratios; no target of the issue's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping
from itertools import count
from pathlib import Path
from typing import Any

import torch
from common import machine_info

from sessionstate import (
    DEFAULT_MAX_SESSIONS,
    KVCache,
    KVPool,
    LatentBuffer,
    OmniDiffusionConfig,
    SessionState,
    SessionStateManager,
    TensorCache,
    nbytes_by_device,
    tree_leaves,
)
from sessionstate._storage import park_tree

_MIB = 1024 * 1024


def _in_turns(
    variants: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 2,
    *,
    cpu: dict[str, float] | None = None,
) -> dict[str, float]:
    """The median seconds of each variant, timed in turns (the order rotates each repeat).

    ``cpu``, when given, receives the median CPU seconds of each (`time.process_time`): the
    cross-check that time spent waiting for a busy machine's cores did not make a ratio.
    """
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            start, start_cpu = time.perf_counter(), time.process_time()
            variants[name]()
            took, took_cpu = time.perf_counter() - start, time.process_time() - start_cpu
            if r >= warmup:
                times[name].append(took)
                cpu_times[name].append(took_cpu)
    if cpu is not None:
        cpu.update({name: statistics.median(t) for name, t in cpu_times.items()})
    return {name: statistics.median(t) for name, t in times.items()}


def _budgeted(**kwargs: Any) -> SessionStateManager[SessionState]:
    with warnings.catch_warnings():  # a host tier under a cpu budget warns that it frees nothing
        warnings.simplefilter("ignore")
        return SessionStateManager(**kwargs)


def _alternate(m: SessionStateManager[SessionState]) -> Callable[[], object]:
    # Each call reads the session that is parked: the other one parks, this one comes back.
    turn = iter(range(10**9))

    def once() -> object:
        return m.get("ab"[next(turn) % 2])

    return once


def round_trip(mib: int, repeats: int) -> dict[str, Any]:
    """Park+unpark of N MiB through the manager, in turns with the floors."""
    n = mib * _MIB // 4
    spool = tempfile.mkdtemp(prefix="sessionstate-bench-")
    one = n * 4
    budget = {"cpu": one + one // 2}  # one session resident, never two
    pool_bytes = 2 * one + 4096
    # Every park copies (`keep_parked_copies=False`): the records never change, so kept copies
    # would make every park after the first free. ``host_pool_kept`` shows that: the same
    # alternation with the copies kept, each park taking its copy back.
    copy = {"max_bytes": budget, "keep_parked_copies": False}
    managers = {
        "host": _budgeted(**copy, park_tier="host"),
        "host_pool": _budgeted(**copy, park_tier="host", host_pool_bytes=pool_bytes),
        "disk": _budgeted(**copy, park_tier="disk", spool_dir=spool),
        "host_pool_kept": _budgeted(max_bytes=budget, park_tier="host", host_pool_bytes=pool_bytes),
    }
    for m in managers.values():
        for sid in "ab":
            x = torch.randn(n)
            cache = TensorCache(name="c").allocate().commit((x, x[1:]))
            m.put(sid, SessionState(objects={"c": cache}))
            del x, cache
    x = torch.randn(n)
    dst, back = torch.empty_like(x), torch.empty_like(x)
    dst.fill_(0)
    back.fill_(0)

    def copy_floor() -> None:
        dst.copy_(x)
        back.copy_(dst)

    def fresh_floor() -> object:
        dst.copy_(x)
        return torch.empty_like(dst).copy_(dst)

    path = os.path.join(spool, "torch.pt")

    def save_load() -> object:
        torch.save(x, path)
        return torch.load(path)

    try:
        cpu: dict[str, float] = {}
        medians = _in_turns(
            {
                **{name: _alternate(m) for name, m in managers.items()},
                "fresh_floor": fresh_floor,
                "copy_floor": copy_floor,
                "torch_save_load": save_load,
            },
            repeats,
            cpu=cpu,
        )
        stats = {name: m.stats() for name, m in managers.items()}
    finally:
        managers.clear()
        shutil.rmtree(spool, ignore_errors=True)
    for name, s in stats.items():
        if s["evictions"] or s["parks"] < repeats:
            msg = f"the {name} round trip did not park every turn: {s}"
            raise RuntimeError(msg)
    kept = stats["host_pool_kept"]
    if kept["reparks"] < repeats or stats["host_pool"]["reparks"]:
        msg = f"the kept round trip did not take its copies back every turn: {kept}"
        raise RuntimeError(msg)
    out: dict[str, Any] = {"mib": mib}
    out.update({f"{k}_ms": v * 1e3 for k, v in medians.items()})
    for name in ("host", "host_pool", "host_pool_kept"):
        out[f"{name}_over_fresh_floor"] = medians[name] / medians["fresh_floor"]
        out[f"{name}_over_copy_floor"] = medians[name] / medians["copy_floor"]
        out[f"{name}_over_fresh_floor_cpu"] = cpu[name] / cpu["fresh_floor"]
    out["host_pool_kept_over_host_pool"] = medians["host_pool_kept"] / medians["host_pool"]
    out["disk_over_torch_save_load"] = medians["disk"] / medians["torch_save_load"]
    out["host_pool_spills"] = stats["host_pool"]["host_pool_spills"]
    return out


def kv_park(mib: int, repeats: int) -> dict[str, Any]:
    """KV park+unpark of N MiB of pool blocks through the manager, in turns with the floors.

    Two managers, each with its own pool: one with a host pool (the target's measure: the
    parked bytes land in memory the pool reuses) and one without (each park takes a fresh
    host slot, which page-faults on CPU, so it is read against the fresh floor).
    """
    tokens, token_shape = 64, (2, 8, 64)  # a block: 64 tokens of 2 x 8 heads x 64 fp32 values
    block_nbytes = tokens * 2 * 8 * 64 * 4
    blocks = mib * _MIB // block_nbytes
    kv = torch.randn(blocks * tokens - tokens // 2, *token_shape)  # the last block half full
    trips: dict[str, Callable[[], None]] = {}
    managers: dict[str, SessionStateManager[SessionState]] = {}
    for name, extra in (("kv", {}), ("kv_host_pool", {"host_pool_bytes": mib * _MIB + 4096})):
        pool = KVPool(blocks, block_tokens=tokens, token_shape=token_shape)
        m = _budgeted(**extra)
        m.put("a", SessionState(objects={"kv": KVCache().allocate().append(pool, kv)}))
        managers[name] = m

        def trip(m: SessionStateManager[SessionState] = m, pool: KVPool = pool) -> None:
            m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
            if m.get("a") is None:
                msg = "the KV session was lost"
                raise RuntimeError(msg)

        trips[name] = trip

    src = pool.storage
    out_, back = torch.empty_like(src), torch.empty_like(src)
    out_.copy_(src)
    back.copy_(out_)

    def floor() -> None:
        out_.copy_(src)
        back.copy_(out_)

    def fresh_floor() -> None:
        back.copy_(torch.empty_like(src).copy_(src))

    cpu: dict[str, float] = {}
    medians = _in_turns(
        {**trips, "copy_floor": floor, "fresh_floor": fresh_floor}, repeats, cpu=cpu
    )
    for name, m in managers.items():
        state = m.get("a")
        assert state is not None
        if not torch.equal(state.object("kv", KVCache).read(), kv):  # type: ignore[arg-type]
            msg = f"the {name} round trip changed the bytes"
            raise RuntimeError(msg)
        kv_parks = m.stats()["kv_parks"]
        if kv_parks < repeats:
            msg = f"the {name} round trip parked {kv_parks} times in {repeats} repeats"
            raise RuntimeError(msg)
    return {
        "mib": mib,
        "kv_park_unpark_ms": medians["kv"] * 1e3,
        "kv_host_pool_park_unpark_ms": medians["kv_host_pool"] * 1e3,
        "copy_floor_ms": medians["copy_floor"] * 1e3,
        "fresh_floor_ms": medians["fresh_floor"] * 1e3,
        "kv_host_pool_over_copy_floor": medians["kv_host_pool"] / medians["copy_floor"],
        "kv_host_pool_over_copy_floor_cpu": cpu["kv_host_pool"] / cpu["copy_floor"],
        "kv_over_copy_floor": medians["kv"] / medians["copy_floor"],
        "kv_over_fresh_floor": medians["kv"] / medians["fresh_floor"],
    }


def tiny_session(repeats: int) -> dict[str, Any]:
    """Park+unpark of one DreamZero tiny session through the manager, beside one copy."""
    from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    from sessionstate.models.dreamzero.episode import scripted_episode

    cfg = DreamZeroConfig.preset("tiny")

    def manager(keep: bool) -> SessionStateManager[Any]:
        # One session three steps in; ``keep``: whether unparks keep their copies.
        config = OmniDiffusionConfig(
            enable_session_state_manager=True,
            model={"preset": "tiny"},
            session_state_keep_parked_copies=keep,
        )
        pipe = DreamZeroPipeline(config, environ={})
        for sid, obs in scripted_episode(cfg, steps=3, sessions=1, seed=0):
            pipe.forward(obs, sid)
        return pipe._managed.manager  # type: ignore[union-attr]

    # The session is never changed between trips: with its copies kept, every park but the
    # first takes them back (K/V aside), so the target's figure is taken with none kept.
    m, kept = manager(False), manager(True)
    sid: Hashable = m.session_ids()[0]
    state = m.peek(sid)
    assert state is not None
    storages = {
        id(t.untyped_storage()): t.untyped_storage()
        for t in tree_leaves(state)
        if isinstance(t, torch.Tensor)
    }
    nbytes = sum(nbytes_by_device(state).values())
    # The tier's share: the same objects parked and restored by the host tier alone. A copy
    # of them (its own storages, its own blocks of the session's pool), so the manager's
    # session is the only holder of its own.
    objects = park_tree(
        {name: state.object(name) for name, obj in state.objects.items() if obj.parkable}, "host"
    ).restore()
    del state

    def trip(m: SessionStateManager[Any] = m) -> None:
        m.park_until(lambda: False, frees=lambda entry: True)
        if m.get(sid) is None:
            msg = "the tiny session was lost"
            raise RuntimeError(msg)

    def tier() -> None:
        park_tree(objects, "host").restore()

    flat = torch.randn(nbytes // 4)
    dst, back = torch.zeros_like(flat), torch.zeros_like(flat)

    def floor() -> None:
        dst.copy_(flat)
        back.copy_(dst)

    cpu: dict[str, float] = {}
    medians = _in_turns(
        {
            "session": trip,
            "session_kept": lambda: trip(kept),
            "tier": tier,
            "one_copy": floor,
        },
        repeats * 10,
        cpu=cpu,
    )
    return {
        "storages": len(storages),
        "parked_storages": len(
            {id(t.untyped_storage()) for t in tree_leaves(objects) if isinstance(t, torch.Tensor)}
        ),
        "nbytes": nbytes,
        "park_unpark_us": medians["session"] * 1e6,
        "tier_park_restore_us": medians["tier"] * 1e6,
        "one_copy_us": medians["one_copy"] * 1e6,
        "over_one_copy": medians["session"] / medians["one_copy"],
        "tier_over_one_copy": medians["tier"] / medians["one_copy"],
        "over_one_copy_cpu": cpu["session"] / cpu["one_copy"],
        "parks": m.stats()["parks"],
        "kept_park_unpark_us": medians["session_kept"] * 1e6,
        "kept_over_one_copy": medians["session_kept"] / medians["one_copy"],
        "kept_over_copied": medians["session_kept"] / medians["session"],
        "kept_reparks": kept.stats()["reparks"],
    }


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

    def puts(manager: SessionStateManager[SessionState]) -> Callable[[], object]:
        for s in range(sessions):
            manager.put(f"s{s}", base)
        it = iter(range(10**9))

        def one() -> None:
            manager.put("s0", records[next(it) % len(records)])

        return one

    medians = _in_turns(
        {
            "budget": puts(SessionStateManager(max_bytes={"cpu": 2**40})),
            "plain": puts(SessionStateManager()),
            "walk": lambda: tree_leaves(base),
        },
        repeats * 20,
    )
    check = max(medians["budget"] - medians["plain"], 0.0)
    return {
        "sessions": sessions,
        "leaves": len(tree_leaves(base)),
        "put_with_budget_us": medians["budget"] * 1e6,
        "put_without_budget_us": medians["plain"] * 1e6,
        "budget_check_us": check * 1e6,
        "leaf_walk_us": medians["walk"] * 1e6,
        "check_over_walk": check / medians["walk"],
    }


def round_robin(sessions: int, rounds: int) -> dict[str, Any]:
    """Median step time of a round robin of DreamZero tiny sessions, pipelines in turns:
    unbudgeted, under a budget of two sessions, the same with the next one prefetched, and
    with the schedule given to the manager (`expect`), without and with prefetch."""
    from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    from sessionstate.models.dreamzero.episode import scripted_episode

    cfg = DreamZeroConfig.preset("tiny")
    episode = list(scripted_episode(cfg, steps=rounds + 1, sessions=sessions, seed=0))

    def pipeline(max_bytes: int | None, *, keep: bool = True) -> DreamZeroPipeline:
        config = OmniDiffusionConfig(
            enable_session_state_manager=True,
            model={"preset": "tiny"},
            session_state_max_bytes=max_bytes,
            session_state_park_tier="host",
            session_state_keep_parked_copies=keep,
        )
        with warnings.catch_warnings():  # a host tier under a cpu budget warns
            warnings.simplefilter("ignore")
            return DreamZeroPipeline(config, environ={})

    # The budget: two sessions at their largest (the end of an unbudgeted run), a quarter
    # of one to spare, so the round robin parks and never has to evict.
    sizing = pipeline(None)
    for sid, obs in episode:
        sizing.forward(obs, sid)
    manager = sizing._managed.manager  # type: ignore[union-attr]
    largest = max(
        manager.session_stats(sid)["nbytes"].get("cpu", 0) for sid, _ in episode[:sessions]
    )
    budget = 2 * largest + largest // 4
    del sizing, manager
    pipes = {
        "unbudgeted": pipeline(None),
        "budgeted": pipeline(budget),
        "budgeted_copying": pipeline(budget, keep=False),
        "budgeted_prefetch": pipeline(budget),
        "schedule_parking": pipeline(budget),
        "schedule_prefetch": pipeline(budget),
    }
    order = [sid for sid, _ in episode]
    names = list(pipes)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu_times: dict[str, list[float]] = {name: [] for name in names}
    told: dict[str, list[float]] = {"schedule_parking": [], "schedule_prefetch": []}
    for i, (sid, obs) in enumerate(episode):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            pipe = pipes[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            if name == "budgeted_prefetch" and i + 1 < len(episode):
                pipe.prefetch(episode[i + 1][0], make_room=True)
            elif name.startswith("schedule_"):  # this step's session first, then the next five
                manager = pipe._managed.manager  # type: ignore[union-attr]
                manager.expect(order[i : i + sessions], prefetch=name == "schedule_prefetch")
                if i >= sessions:
                    told[name].append(time.perf_counter() - start)
            pipe.forward(obs, sid)
            if i >= sessions:  # the first round starts the sessions: not timed
                times[name].append(time.perf_counter() - start)
                cpu_times[name].append(time.process_time() - start_cpu)
    stats = {name: pipe.stats() for name, pipe in pipes.items()}
    evictions = sum(s.get("evictions", 0) for s in stats.values())
    if evictions:
        msg = (
            f"the round robin evicted {evictions} sessions under a budget of {budget} bytes "
            f"({largest} bytes per session at most): the paths stopped doing the same work"
        )
        raise RuntimeError(msg)
    medians = {name: statistics.median(t) for name, t in times.items()}
    cpu = {name: statistics.median(t) for name, t in cpu_times.items()}
    # Belady's gain is in the steps that do not swap (one in five): a median step swaps, the
    # mean shows them.
    means = {name: statistics.fmean(t) for name, t in times.items()}
    fetched = stats["budgeted_prefetch"]
    scheduled = stats["schedule_prefetch"]
    return {
        "sessions": sessions,
        "rounds": rounds,
        "session_nbytes": largest,
        "max_bytes": budget,
        "unbudgeted_step_ms": medians["unbudgeted"] * 1e3,
        "budgeted_step_ms": medians["budgeted"] * 1e3,
        "budgeted_prefetch_step_ms": medians["budgeted_prefetch"] * 1e3,
        "budgeted_over_unbudgeted": medians["budgeted"] / medians["unbudgeted"],
        "prefetch_over_unbudgeted": medians["budgeted_prefetch"] / medians["unbudgeted"],
        "budgeted_over_unbudgeted_cpu": cpu["budgeted"] / cpu["unbudgeted"],
        "budgeted_copying_step_ms": medians["budgeted_copying"] * 1e3,
        "copying_over_unbudgeted": medians["budgeted_copying"] / medians["unbudgeted"],
        "parks": stats["budgeted"].get("parks", 0),
        "reparks": stats["budgeted"].get("reparks", 0),
        "nbytes_reparked": stats["budgeted"].get("nbytes_reparked", 0),
        "kv_parks": stats["budgeted"].get("kv_parks", 0),
        "evictions": evictions,
        "prefetches": fetched.get("prefetches", 0),
        "prefetch_hits": fetched.get("prefetch_hits", 0),
        "prefetches_dropped": fetched.get("prefetches_dropped", 0),
        "schedule_parking_step_ms": medians["schedule_parking"] * 1e3,
        "schedule_prefetch_step_ms": medians["schedule_prefetch"] * 1e3,
        "schedule_parking_over_unbudgeted": medians["schedule_parking"] / medians["unbudgeted"],
        "schedule_prefetch_over_unbudgeted": medians["schedule_prefetch"] / medians["unbudgeted"],
        "schedule_prefetch_over_unbudgeted_cpu": cpu["schedule_prefetch"] / cpu["unbudgeted"],
        "mean_over_unbudgeted": {
            name: means[name] / means["unbudgeted"] for name in names if name != "unbudgeted"
        },
        "expect_ms": {name: statistics.median(t) * 1e3 for name, t in told.items()},
        "schedule_parking_parks": stats["schedule_parking"].get("parks", 0),
        "schedule_prefetch_parks": scheduled.get("parks", 0),
        "scheduled_prefetches": scheduled.get("scheduled_prefetches", 0),
        "schedule_prefetch_hits": scheduled.get("prefetch_hits", 0),
        "schedule_prefetches_dropped": scheduled.get("prefetches_dropped", 0),
    }


def many_sessions(counts: tuple[int, int], rounds: int) -> dict[str, Any]:
    """Median step of a round robin of few and of many small sessions, in turns: under a byte
    budget of two and a half sessions (`get`, a commit, `put`), and with a `KVPool` given to
    the manager that holds the K/V of about three (`step`, an append)."""

    def record(v: float) -> SessionState:
        cache = (
            TensorCache(name="c").allocate().commit(tuple(torch.full((64,), v) for _ in range(4)))
        )
        ring = LatentBuffer(name="r", dim=0).allocate(maxlen=2).commit(torch.full((1, 4), v))
        return SessionState(objects={"cache": cache, "ring": ring}, attrs={"step": 0})

    one: SessionStateManager[SessionState] = SessionStateManager()
    one.put("x", record(0.0))
    budget = {"cpu": one.stats()["nbytes:cpu"] * 5 // 2}
    few, many = counts
    steps: dict[str, Callable[[], object]] = {}
    managers: dict[str, SessionStateManager[SessionState]] = {}
    for n in counts:
        m = _budgeted(max_sessions=many, max_bytes=budget, park_tier="host")
        for i in range(n):
            m.put(i, record(float(i)))
        managers[f"budget_{n}"] = m

        turns = count()

        def budgeted(
            m: SessionStateManager[SessionState] = m, n: int = n, turn: Iterator[int] = turns
        ) -> None:
            k = next(turn)
            state = m.get(k % n)
            assert state is not None
            ring = state.object("ring", LatentBuffer).commit(torch.full((1, 4), float(k)))
            m.put(k % n, state.with_object("ring", ring))

        steps[f"budget_{n}"] = budgeted
        pool = KVPool(8, block_tokens=2, token_shape=(16,), step_tokens=2, window_tokens=4)
        p: SessionStateManager[SessionState] = SessionStateManager(max_sessions=many, pools=(pool,))
        managers[f"pool_{n}"] = p

        def appended(
            state: SessionState, x: float, pool: KVPool = pool
        ) -> tuple[SessionState, None]:
            kv = state.object("kv", KVCache).append(pool, torch.full((2, 16), x), window=4)
            return state.with_object("kv", kv), None

        stepped_turns = count()

        def stepped(
            p: SessionStateManager[SessionState] = p,
            n: int = n,
            appended: Callable[[SessionState, float], tuple[SessionState, None]] = appended,
            turn: Iterator[int] = stepped_turns,
        ) -> None:
            k = next(turn)
            p.step(
                k % n,
                lambda state: appended(state, float(k)),
                new=lambda: SessionState(objects={"kv": KVCache().allocate()}),
            )

        steps[f"pool_{n}"] = stepped
        for _ in range(n):
            stepped()
    medians = _in_turns(steps, rounds, warmup=few)
    stats = {name: m.stats() for name, m in managers.items()}
    if any(s["evictions"] for s in stats.values()):
        msg = "the sessions' round robin evicted: the paths stopped doing the same work"
        raise RuntimeError(msg)
    return {
        "sessions": list(counts),
        "step_us": {name: t * 1e6 for name, t in medians.items()},
        "many_over_few": medians[f"budget_{many}"] / medians[f"budget_{few}"],
        "pool_many_over_few": medians[f"pool_{many}"] / medians[f"pool_{few}"],
        "parks": {name: s["parks"] for name, s in stats.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; print and write the results as JSON."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes, repeats = ([1], 3) if args.smoke else ([1, 16, 64], 9)
    results = {
        "smoke": args.smoke,
        "machine": machine_info(),  # the commit, date, machine and load at the start
        "torch": torch.__version__,
        "round_trip": [round_trip(mib, repeats) for mib in sizes],
        "kv_park": [kv_park(mib, repeats) for mib in sizes],
        "tiny_session": tiny_session(repeats),
        "put_check": [
            put_check(n, repeats) for n in ([4] if args.smoke else [4, DEFAULT_MAX_SESSIONS])
        ],
        "round_robin": round_robin(6, 1 if args.smoke else 4),
        "many_sessions": many_sessions(
            (6, 60) if args.smoke else (6, 1000), 20 if args.smoke else 400
        ),
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
