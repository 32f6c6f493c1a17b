"""Micro-benchmarks, timed by pyperf: the reader, the library's overhead per step, ring commit,
and ``stats()`` scaling.

A pyperf script: pyperf calibrates the loop counts, runs each benchmark in fresh worker
processes, and writes every value to a JSON file that `summarize` turns into the results'
sections. `run.py` runs it; by hand::

    python benchmarks/micro.py --sizes quick --in-process --debug-single-value -o /tmp/micro.json
    python benchmarks/micro.py -o /tmp/micro.json      # pyperf's defaults: about 20 processes

Benchmarks, by name (``N`` is a session length or a count):

- ``reader/{bespoke,ring}/N``: the observation reader (`DreamZeroNetworks.observation_latents`)
  at the deploy latent geometry over N latent frames, as one whole history or a ring of 2.
- ``overhead/{bespoke,managed,checked}/N``: one `DreamZeroPipeline.forward` of a session that
  holds N video latent chunks, on each path (``checked``: managed with ``check_immutable``),
  with the pipeline's networks replaced by `Replay` (no model compute). The managed path's
  time minus the bespoke path's is what the library adds per step.
- ``ring/...``: `LatentBuffer.commit` of one deploy-size bf16 latent frame into a ring of 2,
  next to floors (a plain copy, an in-place preallocated ring, a list index assignment), and
  commits into accumulating buffers of N chunks.
- ``stats/.../N``: `SessionStateManager.stats` over N DreamZero-shaped sessions, and its parts.
- ``accounting/{nbytes_by_device,floor_walk}``: `nbytes_by_device` of one DreamZero-shaped
  record (438 leaves, an attribute a view of another) next to a hand-written walk that counts
  each storage once; the ratio is issue 23's target (<= 2x).
- ``ledger/{upkeep,floor_walk}/N``: a session stepped (one video chunk committed, a new feature
  cache) and put, then `stats()`, the session holding N video chunks, the records built
  untimed; next to a plain walk of the leaves each step changed (added or dropped). The ratio
  is issue 23's target (<= 1.5x).
- ``guard/{off,on}/N``: the same steps put and read back (`get`) with and without
  ``check_immutable``: the guard's cost, and how it grows with the leaves a record holds.
"""

from __future__ import annotations

import functools
import gc
import itertools
import time
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path
from typing import Any

import pyperf
import torch
from common import FULL, QUICK, Sizes, commit, path_environ, tiny_feat_map, tiny_session

from sessionstate import (
    ENV_CHECK_IMMUTABLE,
    LatentBuffer,
    SessionStateManager,
    nbytes_by_device,
    tree_leaves,
)
from sessionstate._accounting import ByteCounter
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode
from sessionstate.models.dreamzero.networks import build_networks

TimeFunc = Callable[[int], float]
PROMPT_GROUPS = 3
RING_SHAPE = (1, 32, 1, 44, 80)  # one deploy-geometry latent frame of the encoder output


def _collected() -> float:
    """Collect the untimed fixture's garbage, then read the clock: a sample's start.

    A fixture that builds many objects (hundreds of records) leaves them for the collector's
    next full pass, which would otherwise fall inside the timed loop and charge the fixture's
    objects to whatever the loop allocates. The loop still pays every collection its own
    allocations cause.
    """
    gc.collect()
    return time.perf_counter()


def _loop(make: Callable[[], Callable[[], object]]) -> TimeFunc:
    """A pyperf time function: ``loops`` calls of ``make()``, timed together.

    ``make`` builds the function to time (untimed), so a worker process that runs another
    benchmark never builds this one's inputs.
    """

    def time_func(loops: int) -> float:
        fn = make()
        start = _collected()
        for _ in range(loops):
            fn()
        return time.perf_counter() - start

    return time_func


# -- the reader --------------------------------------------------------------------------------


@functools.cache
def reader_inputs(frames: int) -> tuple[Any, torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(networks, whole history, ring of the newest 2)`` over ``frames`` latent frames."""
    cfg = DreamZeroConfig.preset("tiny", view_height=176, view_width=320)
    nets = build_networks(cfg)
    n, channels = cfg.num_frame_per_block, 2 * cfg.vae_z_dim
    g = torch.Generator().manual_seed(0)
    shape = (1, channels, frames, cfg.latent_height, cfg.latent_width)
    whole = torch.randn(shape, generator=g, dtype=nets.dtype)
    ring = tuple(whole[:, :, t : t + 1].contiguous() for t in range(max(0, frames - n), frames))
    return nets, whole, ring


def reader_benchmarks(sizes: Sizes) -> Iterator[tuple[str, TimeFunc]]:
    for k in sizes.reader_frames:

        def read(kind: str, k: int = k) -> Callable[[], object]:
            nets, whole, ring = reader_inputs(k)
            held = [whole] if kind == "bespoke" else ring
            return functools.partial(nets.observation_latents, held, len(ring))

        yield f"reader/bespoke/{k}", _loop(functools.partial(read, "bespoke"))
        yield f"reader/ring/{k}", _loop(functools.partial(read, "ring"))


# -- the library's overhead per step ---------------------------------------------------------


def _signature(value: object) -> Hashable:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, tuple | list):
        return tuple(_signature(v) for v in value)
    return value if isinstance(value, Hashable) else type(value).__name__


class Replay:
    """A pipeline's networks that compute each answer once and then replay it.

    Each method answers every later call with the same argument shapes with its first result,
    so a step through `DreamZeroPipeline.forward` runs the pipeline's own session-state code
    (both paths, unchanged) and no model compute.
    """

    def __init__(self, nets: Any) -> None:
        self._nets = nets
        self._memo: dict[Hashable, object] = {}

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._nets, name)
        if not callable(attr):
            return attr

        def replay(*args: object) -> object:
            key = (name, _signature(args))
            if key not in self._memo:
                self._memo[key] = attr(*args)
            return self._memo[key]

        return replay


OVERHEAD_KINDS = {"bespoke": {}, "managed": {}, "checked": {ENV_CHECK_IMMUTABLE: "1"}}


@functools.cache
def overhead_pipeline(kind: str) -> tuple[DreamZeroPipeline, tuple[Any, ...]]:
    """A tiny pipeline on ``kind``'s path with replayed networks, and observations to step."""
    cfg = DreamZeroConfig.preset("tiny", local_attn_size=-1)
    path = "bespoke" if kind == "bespoke" else "managed"
    pipe = DreamZeroPipeline(cfg, environ=path_environ(path, **OVERHEAD_KINDS[kind]))
    pipe.nets = Replay(pipe.nets)  # type: ignore[assignment]
    episode = scripted_episode(cfg, steps=16, sessions=1, seed=0, prompt_change_every=10**9)
    observations = tuple(obs for _, obs in episode)
    for obs in observations:  # every answer a steady-state step needs, computed once here
        pipe.forward(obs, "warmup")
    pipe.drop_session("warmup")
    return pipe, observations


# Steps timed per sample. A step adds a video chunk, so timing all of pyperf's loops (hundreds)
# would measure a session from `chunks` to `chunks + loops` long; a window of 8 holds it fixed.
OVERHEAD_WINDOW = 8


def overhead_time_func(kind: str, chunks: int) -> TimeFunc:
    """Steps of a session that holds ``chunks`` to ``chunks + OVERHEAD_WINDOW`` video chunks.

    Each sample grows a fresh session to ``chunks`` (untimed) and times at most
    `OVERHEAD_WINDOW` steps of it; the time is scaled to ``loops`` steps, so pyperf's loop
    count sets the scale of the value, never the session's length.
    """

    def time_func(loops: int) -> float:
        pipe, observations = overhead_pipeline(kind)
        pipe.drop_session("bench")
        obs = itertools.cycle(observations)
        for _ in range(chunks):  # untimed: grow the session to its length
            pipe.forward(next(obs), "bench")
        steps = min(loops, OVERHEAD_WINDOW)
        start = _collected()
        for _ in range(steps):
            pipe.forward(next(obs), "bench")
        return (time.perf_counter() - start) * loops / steps

    return time_func


def overhead_benchmarks(sizes: Sizes) -> Iterator[tuple[str, TimeFunc]]:
    for chunks in sizes.overhead_chunks:
        for kind in OVERHEAD_KINDS:
            yield f"overhead/{kind}/{chunks}", overhead_time_func(kind, chunks)


# -- ring commit -------------------------------------------------------------------------------


def ring_benchmarks(sizes: Sizes) -> Iterator[tuple[str, TimeFunc]]:
    g = torch.Generator().manual_seed(0)
    chunk = torch.randn(RING_SHAPE, generator=g).to(torch.bfloat16)
    ring = LatentBuffer(name="vae_encoder_out", dim=2).allocate(maxlen=2)
    ring = ring.commit(chunk.clone()).commit(chunk.clone())
    dst = torch.empty_like(chunk)
    prealloc = torch.empty((1, 32, 2, 44, 80), dtype=torch.bfloat16)
    refs: list[torch.Tensor] = [chunk, chunk]
    counter = itertools.count()

    def inplace_copy_ring() -> None:
        prealloc[:, :, next(counter) % 2].copy_(chunk[:, :, 0])

    def inplace_ref_ring() -> None:
        refs[next(counter) % 2] = chunk

    yield "ring/commit", _loop(lambda: functools.partial(ring.commit, chunk))
    yield "ring/memcpy", _loop(lambda: functools.partial(dst.copy_, chunk))
    yield "ring/inplace_copy_ring", _loop(lambda: inplace_copy_ring)
    yield "ring/inplace_ref_ring", _loop(lambda: inplace_ref_ring)
    tiny = torch.zeros(1, 2, 1, 2, 2)
    for length in sizes.accumulate_chunks:
        held = LatentBuffer(name="video_latents_across_time", dim=2).allocate()
        held = held.extend([tiny] * length)
        make = functools.partial(functools.partial, held.commit, tiny)
        yield f"ring/accumulate/{length}", _loop(make)


# -- stats() scaling ---------------------------------------------------------------------------


@functools.cache
def stats_fixture(count: int, sizes: Sizes) -> dict[str, Any]:
    """A manager holding ``count`` tiny DreamZero sessions, their records and leaves."""
    cfg = DreamZeroConfig.preset("tiny")
    # Sessions with the same prompt share its token ids and embeddings (one storage each).
    shared = [
        (torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, 2)) for _ in range(PROMPT_GROUPS)
    ]
    manager = SessionStateManager(max_sessions=max(sizes.stats_sessions))
    for i in range(count):
        record = tiny_session(
            cfg, video_chunks=sizes.stats_video_chunks, shared=shared[i % PROMPT_GROUPS]
        )
        manager.put(f"session-{i}", record)
    records = [manager.get(sid) for sid in manager.session_ids()]
    # Every session stepped once (a new video chunk and a new feature cache), as in a serving
    # loop: a cache keyed on record identity cannot hide the walk after a step.
    stepped = [
        record.update_object(
            "video_latents_across_time", commit(torch.zeros(1, 2, 2, 2, 2))
        ).update_object("vae_enc_feat_map", lambda c: c.commit(tiny_feat_map()))
        for record in records
        if record is not None
    ]
    leaves = [leaf for record in records for leaf in tree_leaves(record)]
    return {"manager": manager, "records": records, "stepped": stepped, "leaves": leaves}


def stats_benchmarks(sizes: Sizes) -> Iterator[tuple[str, TimeFunc]]:
    for count in sizes.stats_sessions:
        fixture = functools.partial(stats_fixture, count, sizes)

        def call(fixture: Callable[[], dict[str, Any]] = fixture) -> Callable[[], object]:
            return fixture()["manager"].stats

        # `stats()` after every session stepped: puts and `stats()` timed together, less the
        # puts alone. Timing only the `stats()` call would leave the puts outside the timer,
        # and pyperf's calibration, which sizes the loop count by the timed part, runs away.
        def put_all(f: dict[str, Any], i: int) -> None:
            for k, record in enumerate(f["stepped"] if i % 2 == 0 else f["records"]):
                f["manager"].put(f"session-{k}", record)

        def puts(loops: int, fixture: Callable[[], dict[str, Any]] = fixture) -> float:
            f = fixture()
            start = _collected()
            for i in range(loops):
                put_all(f, i)
            return time.perf_counter() - start

        def puts_and_stats(loops: int, fixture: Callable[[], dict[str, Any]] = fixture) -> float:
            f = fixture()
            start = _collected()
            for i in range(loops):
                put_all(f, i)
                f["manager"].stats()
            return time.perf_counter() - start

        def flatten(records: list[Any]) -> None:
            for record in records:
                tree_leaves(record)

        def count_bytes(leaves: list[Any]) -> None:
            counter = ByteCounter()
            for leaf in leaves:
                counter.add(leaf)

        def floor_walk(leaves: list[Any]) -> None:
            # The least any per-call walk can do: one storage lookup per tensor, deduplicated.
            seen: dict[int, int] = {}
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    storage = leaf.untyped_storage()
                    seen.setdefault(storage.data_ptr(), storage.nbytes())

        def over(fn: Callable[[list[Any]], None], key: str, fixture: Any = fixture) -> Any:
            return _loop(lambda: functools.partial(fn, fixture()[key]))

        yield f"stats/call/{count}", _loop(call)
        yield f"stats/puts/{count}", puts
        yield f"stats/puts_and_stats/{count}", puts_and_stats
        yield f"stats/flatten/{count}", over(flatten, "records")
        yield f"stats/byte_counter/{count}", over(count_bytes, "leaves")
        yield f"stats/floor_walk/{count}", over(floor_walk, "leaves")


# -- accounting, ledger upkeep and the guard, each next to its floor --------------------------

ACCOUNTING_CHUNKS = 400  # video chunks of the counted record: 438 leaves, as in issue 23
UPKEEP_CHUNKS = (10, 400)  # video chunks the stepped session holds
TARGET_NBYTES_OVER_FLOOR = 2.0
TARGET_UPKEEP_OVER_FLOOR = 1.5


@functools.cache
def accounting_record() -> Any:
    """A DreamZero-shaped record of 438 leaves whose ``clip_feas`` is a view of ``ys``."""
    record = tiny_session(DreamZeroConfig.preset("tiny"), video_chunks=ACCOUNTING_CHUNKS)
    ys = record.attrs["ys"]
    return record.with_attrs(clip_feas=ys.view(-1)[:10].view(1, 5, 2))


def floor_walk(tree: Any) -> dict[Any, int]:
    """The least a walk that counts each storage once can do: one lookup per tensor leaf."""
    seen: dict[int, tuple[Any, int]] = {}
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            storage = leaf.untyped_storage()
            if storage._cdata not in seen:
                seen[storage._cdata] = (storage.device, storage.nbytes())
    totals: dict[Any, int] = {}
    for device, nbytes in seen.values():
        totals[device] = totals.get(device, 0) + nbytes
    return totals


def _steps(chunks: int, count: int) -> tuple[list[Any], list[list[Any]]]:
    # `count` successive records of one session holding `chunks` video chunks (a ring of that
    # length, so the length stays fixed), and per step the leaves it added or dropped.
    cfg = DreamZeroConfig.preset("tiny")
    record = tiny_session(cfg, video_chunks=0)
    record = record.update_object(
        "video_latents_across_time", lambda b: b.reset().allocate(maxlen=chunks)
    )
    for _ in range(chunks):
        record = record.update_object(
            "video_latents_across_time", commit(torch.zeros(1, 2, 2, 2, 2))
        )
    records, changed = [record], []
    for _ in range(count):
        new = record.update_object(
            "video_latents_across_time", commit(torch.zeros(1, 2, 2, 2, 2))
        ).update_object("vae_enc_feat_map", lambda c: c.commit(tiny_feat_map()))
        before, after = {id(x): x for x in tree_leaves(record)}, tree_leaves(new)
        now = {id(x) for x in after}
        changed.append(
            [x for x in after if id(x) not in before]
            + [x for k, x in before.items() if k not in now]
        )
        records.append(new)
        record = new
    return records, changed


def _stepped(chunks: int, run: Callable[[SessionStateManager, Any], object], **kw: Any) -> TimeFunc:
    def time_func(loops: int) -> float:
        records, _ = _steps(chunks, loops)
        manager = SessionStateManager(**kw)
        manager.put("s", records[0])
        start = _collected()
        for record in records[1:]:
            run(manager, record)
        return time.perf_counter() - start

    return time_func


def _put_stats(manager: SessionStateManager, record: Any) -> None:
    manager.put("s", record)
    manager.stats()


def _put_get(manager: SessionStateManager, record: Any) -> None:
    manager.put("s", record)
    manager.get("s")


def _changed_floor(chunks: int) -> TimeFunc:
    def time_func(loops: int) -> float:
        _, changed = _steps(chunks, loops)
        start = _collected()
        for leaves in changed:
            floor_walk(leaves)
        return time.perf_counter() - start

    return time_func


def accounting_benchmarks() -> Iterator[tuple[str, TimeFunc]]:
    yield (
        "accounting/nbytes_by_device",
        _loop(lambda: functools.partial(nbytes_by_device, accounting_record())),
    )
    yield "accounting/floor_walk", _loop(lambda: functools.partial(floor_walk, accounting_record()))
    for chunks in UPKEEP_CHUNKS:
        yield f"ledger/upkeep/{chunks}", _stepped(chunks, _put_stats)
        yield f"ledger/floor_walk/{chunks}", _changed_floor(chunks)
        yield f"guard/off/{chunks}", _stepped(chunks, _put_get)
        yield f"guard/on/{chunks}", _stepped(chunks, _put_get, check_immutable=True)


PUT_RESTART = 16  # timed puts before the session is put back at its length (fixed)
TARGET_PUT_GROWTH = 1.2


@functools.cache
def put_fixture(chunks: int) -> Any:
    """A tiny DreamZero session whose accumulating video buffer holds ``chunks`` chunks."""
    return tiny_session(DreamZeroConfig.preset("tiny"), video_chunks=chunks)


def _put_after_commit(chunks: int, *, with_commit: bool) -> TimeFunc:
    # A put of a record one video chunk longer than the stored one, which the manager holds
    # alone, so the put also releases it, as in a managed step (``with_commit``: the commit
    # that built the record is timed too). Every `PUT_RESTART` puts the session is put back
    # at its length, untimed, and stepped twice untimed: putting back a record no commit
    # built walks it whole, and the next two puts release what that walk built (a serving
    # session is put back so only after a park or a snapshot load).
    tiny = torch.zeros(1, 2, 2, 2, 2)

    def grow(record: Any) -> Any:
        return record.update_object("video_latents_across_time", commit(tiny))

    def time_func(loops: int) -> float:
        base = put_fixture(chunks)
        manager = SessionStateManager()
        total = 0.0
        for i in range(loops):
            if i % PUT_RESTART == 0:
                record = base
                for _ in range(3):
                    record = grow(record)
                    manager.put("s", record)
                gc.collect()  # the restart's garbage, collected untimed (see `_collected`)
            start = time.perf_counter()
            record = grow(record)
            if not with_commit:
                start = time.perf_counter()
            manager.put("s", record)
            total += time.perf_counter() - start
        return total

    return time_func


def put_benchmarks(sizes: Sizes) -> Iterator[tuple[str, TimeFunc]]:
    for chunks in sizes.accumulate_chunks:
        yield f"put/after_commit/{chunks}", _put_after_commit(chunks, with_commit=False)
        yield f"put/commit_and_put/{chunks}", _put_after_commit(chunks, with_commit=True)


def summarize_put(us: dict[str, float], sizes: Sizes) -> dict[str, Any]:
    """The results' ``put_after_commit`` section: each length's put over the shortest's."""
    lengths = sizes.accumulate_chunks
    first = lengths[0]
    points = [
        {
            "video_chunks": n,
            "put_us": us[f"put/after_commit/{n}"],
            "commit_and_put_us": us[f"put/commit_and_put/{n}"],
            "put_over_shortest": us[f"put/after_commit/{n}"] / us[f"put/after_commit/{first}"],
            "commit_and_put_over_shortest": us[f"put/commit_and_put/{n}"]
            / us[f"put/commit_and_put/{first}"],
        }
        for n in lengths
    ]
    return {"threshold": TARGET_PUT_GROWTH, "points": points}


def summarize_accounting(us: dict[str, float]) -> dict[str, Any]:
    """The results' ``accounting`` section: each measurement over its floor, from one run."""
    record = accounting_record()
    nbytes, floor = us["accounting/nbytes_by_device"], us["accounting/floor_walk"]
    upkeep = []
    guard = []
    for chunks in UPKEEP_CHUNKS:
        records, changed = _steps(chunks, 4)
        step_us, floor_us = us[f"ledger/upkeep/{chunks}"], us[f"ledger/floor_walk/{chunks}"]
        upkeep.append(
            {
                "video_chunks": chunks,
                "changed_leaves_per_step": len(changed[-1]),
                "upkeep_us": step_us,
                "floor_walk_us": floor_us,
                "upkeep_over_floor": step_us / floor_us,
                "met": step_us / floor_us <= TARGET_UPKEEP_OVER_FLOOR,
            }
        )
        off, on = us[f"guard/off/{chunks}"], us[f"guard/on/{chunks}"]
        tensor_leaves = sum(isinstance(x, torch.Tensor) for x in tree_leaves(records[-1]))
        guard.append(
            {
                "video_chunks": chunks,
                "tensor_leaves": tensor_leaves,
                "put_get_us": off,
                "put_get_checked_us": on,
                "guard_us": on - off,
                "guard_us_per_tensor_leaf": (on - off) / tensor_leaves,
            }
        )
    return {
        "nbytes_by_device": {
            "leaves": len(tree_leaves(record)),
            "nbytes_by_device_us": nbytes,
            "floor_walk_us": floor,
            "over_floor": nbytes / floor,
            "threshold": TARGET_NBYTES_OVER_FLOOR,
            "met": nbytes / floor <= TARGET_NBYTES_OVER_FLOOR,
        },
        "ledger_upkeep": {"threshold": TARGET_UPKEEP_OVER_FLOOR, "points": upkeep},
        "check_immutable": {"points": guard},
    }


def benchmarks(sizes: Sizes) -> Iterator[tuple[str, TimeFunc]]:
    """Every micro-benchmark of this module, by name, in run order."""
    yield from reader_benchmarks(sizes)
    yield from overhead_benchmarks(sizes)
    yield from ring_benchmarks(sizes)
    yield from stats_benchmarks(sizes)
    yield from accounting_benchmarks()
    yield from put_benchmarks(sizes)


def _add_cmdline_args(cmd: list[str], args: Any) -> None:
    cmd.extend(["--sizes", args.sizes])  # pyperf's workers measure the same sizes


def main() -> None:
    runner = pyperf.Runner(add_cmdline_args=_add_cmdline_args)
    runner.argparser.add_argument("--sizes", choices=("full", "quick"), default="full")
    args = runner.parse_args()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and steady under load
    for name, time_func in benchmarks(QUICK if args.sizes == "quick" else FULL):
        runner.bench_time_func(name, time_func)


def summarize(medians: dict[str, float], sizes: Sizes) -> dict[str, Any]:
    """The results' ``reader``, ``library_overhead``, ``ring_commit`` and ``stats_scaling``.

    ``medians`` maps each benchmark's name to its median seconds per call (`load`).
    """
    us = {name: seconds * 1e6 for name, seconds in medians.items()}
    reader = []
    for k in sizes.reader_frames:
        nets, whole, ring = reader_inputs(k)
        same = torch.equal(
            nets.observation_latents([whole], len(ring)), nets.observation_latents(ring, len(ring))
        )
        bespoke_us, ring_us = us[f"reader/bespoke/{k}"], us[f"reader/ring/{k}"]
        reader.append(
            {
                "frames": k,
                "bespoke_ms": bespoke_us / 1e3,
                "ring_ms": ring_us / 1e3,
                "bespoke_over_ring": bespoke_us / ring_us,
                "bit_identical": same,
            }
        )
    frame = reader_inputs(sizes.reader_frames[0])[1][:, :, :1]
    overhead = []
    for chunks in sizes.overhead_chunks:
        b, m, c = (us[f"overhead/{kind}/{chunks}"] for kind in OVERHEAD_KINDS)
        overhead.append(
            {
                "video_chunks": chunks,
                "managed_us": m,
                "checked_us": c,
                "bespoke_us": b,
                "overhead_us": m - b,
            }
        )
    commit_us, copy_ring_us = us["ring/commit"], us["ring/inplace_copy_ring"]
    chunk_bytes = torch.empty(RING_SHAPE, dtype=torch.bfloat16).nbytes
    stats = []
    for count in sizes.stats_sessions:
        fixture = stats_fixture(count, sizes)
        tensor_leaves = sum(isinstance(leaf, torch.Tensor) for leaf in fixture["leaves"])
        call_us = us[f"stats/call/{count}"]
        after_us = us[f"stats/puts_and_stats/{count}"] - us[f"stats/puts/{count}"]
        stats.append(
            {
                "sessions": count,
                "leaves": len(fixture["leaves"]),
                "tensor_leaves": tensor_leaves,
                "distinct_storages_bytes": fixture["manager"].stats()["total_nbytes"],
                "call_us": call_us,
                "per_tensor_leaf_us": call_us / tensor_leaves,
                "call_after_step_us": after_us,
                "per_tensor_leaf_after_step_us": after_us / tensor_leaves,
                "flatten_us": us[f"stats/flatten/{count}"],
                "byte_counter_us": us[f"stats/byte_counter/{count}"],
                "floor_walk_per_tensor_leaf_us": us[f"stats/floor_walk/{count}"] / tensor_leaves,
            }
        )
    return {
        "reader": {
            "frame_shape": list(frame.shape),
            "dtype": str(frame.dtype).removeprefix("torch."),
            "frame_mib": frame.nbytes / 2**20,
            "ring_frames": len(reader_inputs(sizes.reader_frames[0])[2]),
            "points": reader,
        },
        "library_overhead": {
            "networks": "replayed (no model compute)",
            "points": overhead,
            "worst_overhead_us": max(p["overhead_us"] for p in overhead),
        },
        "ring_commit": {
            "chunk_shape": list(RING_SHAPE),
            "dtype": "bfloat16",
            "chunk_mib": chunk_bytes / 2**20,
            "ring_maxlen": 2,
            "commit_us": commit_us,
            "memcpy_us": us["ring/memcpy"],
            "inplace_copy_ring_us": copy_ring_us,
            "inplace_ref_ring_us": us["ring/inplace_ref_ring"],
            "commit_over_inplace_copy_ring": commit_us / copy_ring_us,
            "commit_over_memcpy": commit_us / us["ring/memcpy"],
            "commit_over_inplace_ref_ring": commit_us / us["ring/inplace_ref_ring"],
            "memcpy_gib_per_s": chunk_bytes / medians["ring/memcpy"] / 2**30,
            "accumulate_commit": [
                {"chunks_held": n, "commit_us": us[f"ring/accumulate/{n}"]}
                for n in sizes.accumulate_chunks
            ],
        },
        "stats_scaling": {
            "video_chunks_per_session": sizes.stats_video_chunks,
            "prompt_groups_sharing_storages": PROMPT_GROUPS,
            "points": stats,
        },
        "accounting": summarize_accounting(us),
        "put_after_commit": summarize_put(us, sizes),
    }


def load(path: Path) -> dict[str, float]:
    """Median seconds per call of every benchmark in pyperf's JSON file ``path``."""
    suite = pyperf.BenchmarkSuite.load(str(path))
    return {bench.get_name(): bench.median() for bench in suite.get_benchmarks()}


if __name__ == "__main__":
    main()
