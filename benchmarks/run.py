"""Benchmarks: managed vs bespoke session state, library overhead, floors (issue 5).

Run from the repository root::

    .venv/bin/python benchmarks/run.py                  # full run (minutes)
    .venv/bin/python benchmarks/run.py --quick          # every measurement, tiny sizes (seconds)
    .venv/bin/python benchmarks/run.py --out some/dir/latest.json

Writes the results as JSON and, next to it, the same results as a markdown report with a
"Targets" table (``latest.json`` -> ``latest.md``). Every timing is a median over repeats
after a warm-up, measured with `time.perf_counter` (and with `time.process_time` beside it, a
cross-check that a busy machine inflates much less); what matters is the ratios within one
run, and nothing here asserts a time. ``docs/performance.md`` explains every number. The five
measurements:

1. ``step_time``: per-step time vs session length, DreamZero tiny preset, one 400-step session
   on each path (the two pipelines are stepped alternately on the same observations, so
   machine load hits both alike); plus ``reader``: the observation reader alone at the deploy
   latent geometry, whole history (bespoke) vs a ring of 2 (managed).
2. ``library_overhead``: one DreamZero step's record transitions and manager get/put with no
   model compute, vs the same bookkeeping done in place on a dict and deques.
3. ``ring_commit``: `LatentBuffer.commit` of one 0.2148 MiB bf16 latent frame into a ring of 2,
   vs a plain copy of the chunk, an in-place preallocated ring, and a list index assignment.
4. ``stats_scaling``: `SessionStateManager.stats()` over 1..256 DreamZero-shaped sessions.
5. ``memory``: bytes held per session vs steps from the library's accounting, and the peak RSS
   of a 400-step run, each path in its own subprocess.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import attrs
import torch

from sessionstate import LatentBuffer, SessionStateManager, nbytes_by_device, tree_leaves
from sessionstate._accounting import ByteCounter
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline, new_session
from sessionstate.models.dreamzero.episode import scripted_episode
from sessionstate.models.dreamzero.networks import build_networks
from sessionstate.models.dreamzero.state import DreamZeroSession

ENV_FLAG = "OMNI_DIFFUSION_SESSION_STATE_MANAGER"
PATHS = {"bespoke": "0", "managed": "1"}
MIB = 1024 * 1024
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "latest.json"
# Target thresholds (issue 5).
TARGET_STEP_GROWTH = 1.2
TARGET_OVERHEAD_US = 30.0
TARGET_RING_VS_FLOOR = 2.0
TARGET_STATS_US_PER_LEAF = 0.3
TARGET_STATS_SESSIONS = 64


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is; ``quick`` shrinks every one to a smoke run."""

    steps: int
    step_repeats: int
    step_window: int
    step_checkpoints: tuple[int, ...]
    step_warmup: int
    reader_frames: tuple[int, ...]
    reader_repeats: int
    overhead_chunks: tuple[int, ...]
    overhead_steps_per_repeat: int
    accumulate_chunks: tuple[int, ...]
    micro_repeats: int
    micro_min_time: float
    stats_sessions: tuple[int, ...]
    stats_video_chunks: int
    memory_steps: int
    memory_samples: tuple[int, ...]
    memory_deploy_steps: int


FULL = Sizes(
    steps=400,
    step_repeats=7,
    step_window=32,
    step_checkpoints=(10, 100, 400),
    step_warmup=8,
    reader_frames=(10, 100, 400),
    reader_repeats=5,
    overhead_chunks=(10, 400),
    overhead_steps_per_repeat=200,
    accumulate_chunks=(10, 400, 4000),
    micro_repeats=15,
    micro_min_time=0.05,
    stats_sessions=(1, 8, 64, 256),
    stats_video_chunks=8,
    memory_steps=400,
    memory_samples=(1, 10, 50, 100, 200, 300, 400),
    memory_deploy_steps=400,
)

QUICK = Sizes(
    steps=12,
    step_repeats=1,
    step_window=4,
    step_checkpoints=(4, 8, 12),
    step_warmup=1,
    reader_frames=(2, 4, 8),
    reader_repeats=2,
    overhead_chunks=(2, 8),
    overhead_steps_per_repeat=10,
    accumulate_chunks=(10, 40),
    micro_repeats=3,
    micro_min_time=0.002,
    stats_sessions=(1, 8, 64, 256),
    stats_video_chunks=8,
    memory_steps=6,
    memory_samples=(1, 3, 6),
    memory_deploy_steps=2,
)


# ---------------------------------------------------------------------------------------------
# Timing helpers
# ---------------------------------------------------------------------------------------------


def _calibrate(fn: Callable[[], object], min_time: float) -> int:
    """The smallest power-of-two loop count whose loop runs at least ``min_time`` seconds."""
    number = 1
    while True:
        start = time.perf_counter()
        for _ in range(number):
            fn()
        if time.perf_counter() - start >= min_time or number >= 1 << 20:
            return number
        number *= 2


def time_per_call(
    fn: Callable[[], object],
    *,
    repeats: int,
    min_time: float,
    setup: Callable[[], object] | None = None,
    number: int | None = None,
) -> dict[str, float]:
    """Median and min seconds per call of ``fn`` over ``repeats`` loops, after a warm-up.

    Like `timeit`, the garbage collector is off inside a timed loop. ``setup`` runs (untimed)
    before each loop.
    """
    if setup is not None:
        setup()
    if number is None:
        number = _calibrate(fn, min_time)  # doubles as the warm-up
    else:
        for _ in range(max(1, number // 10)):
            fn()
    samples, cpu_samples = [], []
    for _ in range(repeats):
        if setup is not None:
            setup()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            cpu_start, start = time.process_time(), time.perf_counter()
            for _ in range(number):
                fn()
            elapsed = time.perf_counter() - start
            cpu_elapsed = time.process_time() - cpu_start
        finally:
            if gc_was_enabled:
                gc.enable()
        samples.append(elapsed / number)
        cpu_samples.append(cpu_elapsed / number)
    return {
        "median_s": statistics.median(samples),
        "min_s": min(samples),
        "max_s": max(samples),
        "cpu_median_s": statistics.median(cpu_samples),
        "number": number,
        "repeats": repeats,
    }


def _us(timing: dict[str, float]) -> float:
    return timing["median_s"] * 1e6


def _cpu_us(timing: dict[str, float]) -> float:
    return timing["cpu_median_s"] * 1e6


def _spread(timing: dict[str, float]) -> float:
    """(max - min) / median of the repeats: how noisy a timing was."""
    return (timing["max_s"] - timing["min_s"]) / timing["median_s"] if timing["median_s"] else 0.0


# ---------------------------------------------------------------------------------------------
# Machine
# ---------------------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """The machine and runtime a run was measured on."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": list(os.getloadavg()),
    }


# ---------------------------------------------------------------------------------------------
# 1. Per-step time vs session length, and the reader alone
# ---------------------------------------------------------------------------------------------


def _window(center: int, width: int, steps: int) -> tuple[int, int]:
    """Steps [lo, hi] (1-based, inclusive) of a ``width``-step window around ``center``.

    Step 1 (window start: the conditioning encode) is never in a window; a window near the end
    of the run is shifted to end at the last step.
    """
    lo = max(2, min(center - width // 2, steps - width + 1))
    return lo, min(steps, lo + width - 1)


def bench_step_time(sizes: Sizes) -> dict[str, Any]:
    """Both paths over one long session, stepped alternately on the same observations."""
    cfg = DreamZeroConfig.preset("tiny", local_attn_size=-1)
    pipes = {name: DreamZeroPipeline(cfg, environ={ENV_FLAG: flag}) for name, flag in PATHS.items()}
    assert not pipes["bespoke"].managed
    assert pipes["managed"].managed

    # Warm-up: a short session on each path (first-call allocator and oneDNN set-up).
    for sid, obs in scripted_episode(
        cfg, steps=sizes.step_warmup, sessions=1, seed=1, prompt_change_every=10**9
    ):
        for pipe in pipes.values():
            pipe.forward(obs, f"warmup-{sid}")
    for pipe in pipes.values():
        pipe.drop_session("warmup-session-0")

    # clock -> path -> repeat -> per-step seconds. Wall time (perf_counter) is the measure;
    # CPU time (process_time) is a cross-check that a busy machine inflates much less.
    times: dict[str, dict[str, list[list[float]]]] = {
        clock: {name: [] for name in PATHS} for clock in ("wall", "cpu")
    }
    identical = {"actions": True, "video_latents": True}
    for repeat in range(sizes.step_repeats):
        wall: dict[str, list[float]] = {name: [] for name in PATHS}
        cpu: dict[str, list[float]] = {name: [] for name in PATHS}
        episode = scripted_episode(
            cfg, steps=sizes.steps, sessions=1, seed=0, prompt_change_every=10**9
        )
        for step, (_, obs) in enumerate(episode):
            order = list(PATHS) if step % 2 == 0 else list(reversed(PATHS))
            outs = {}
            for name in order:
                cpu_start, start = time.process_time(), time.perf_counter()
                outs[name] = pipes[name].forward(obs, f"bench-{repeat}")
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - cpu_start)
            for field in identical:
                same = torch.equal(getattr(outs["bespoke"], field), getattr(outs["managed"], field))
                identical[field] = identical[field] and same
        for name, pipe in pipes.items():
            pipe.drop_session(f"bench-{repeat}")
            times["wall"][name].append(wall[name])
            times["cpu"][name].append(cpu[name])

    def window_ms(clock: str, name: str, lo: int, hi: int, *, mean: bool = False) -> float:
        runs = times[clock][name]
        if mean:  # every step of every repeat: VAE encode steps included
            return statistics.fmean(t for run in runs for t in run[lo - 1 : hi]) * 1e3
        # Each step's median over the repeats, then the median over the window.
        per_step = [statistics.median(run[i] for run in runs) for i in range(lo - 1, hi)]
        return statistics.median(per_step) * 1e3

    checkpoints = []
    for center in sizes.step_checkpoints:
        lo, hi = _window(center, sizes.step_window, sizes.steps)
        row: dict[str, Any] = {"step": center, "window": [lo, hi]}
        for name in PATHS:
            row[f"{name}_median_ms"] = window_ms("wall", name, lo, hi)
            row[f"{name}_mean_ms"] = window_ms("wall", name, lo, hi, mean=True)
            row[f"{name}_cpu_median_ms"] = window_ms("cpu", name, lo, hi)
        row["bespoke_over_managed"] = row["bespoke_median_ms"] / row["managed_median_ms"]
        row["bespoke_over_managed_mean"] = row["bespoke_mean_ms"] / row["managed_mean_ms"]
        row["bespoke_over_managed_cpu"] = (
            row["bespoke_cpu_median_ms"] / row["managed_cpu_median_ms"]
        )
        checkpoints.append(row)
    series = []
    for center in range(sizes.step_window, sizes.steps + 1, sizes.step_window):
        lo, hi = _window(center, sizes.step_window, sizes.steps)
        series.append(
            {
                "steps": [lo, hi],
                **{f"{name}_median_ms": window_ms("wall", name, lo, hi) for name in PATHS},
                **{f"{name}_cpu_median_ms": window_ms("cpu", name, lo, hi) for name in PATHS},
            }
        )
    first, last = checkpoints[0], checkpoints[-1]
    return {
        "preset": "tiny",
        "local_attn_size": -1,
        "steps": sizes.steps,
        "repeats": sizes.step_repeats,
        "window_steps": sizes.step_window,
        "bit_identical_actions": identical["actions"],
        "bit_identical_video_latents": identical["video_latents"],
        "checkpoints": checkpoints,
        "managed_last_over_first": last["managed_median_ms"] / first["managed_median_ms"],
        "bespoke_last_over_first": last["bespoke_median_ms"] / first["bespoke_median_ms"],
        "managed_last_over_first_mean": last["managed_mean_ms"] / first["managed_mean_ms"],
        "bespoke_last_over_first_mean": last["bespoke_mean_ms"] / first["bespoke_mean_ms"],
        "managed_last_over_first_cpu": last["managed_cpu_median_ms"]
        / first["managed_cpu_median_ms"],
        "bespoke_last_over_first_cpu": last["bespoke_cpu_median_ms"]
        / first["bespoke_cpu_median_ms"],
        "total_s": {name: sum(sum(run) for run in times["wall"][name]) for name in PATHS},
        "series": series,
    }


def bench_reader(sizes: Sizes) -> dict[str, Any]:
    """The observation reader at the deploy latent geometry: whole history vs a ring of 2."""
    cfg = DreamZeroConfig.preset("tiny", view_height=176, view_width=320)
    nets = build_networks(cfg)
    n = cfg.num_frame_per_block
    channels = 2 * cfg.vae_z_dim
    shape = (1, channels, 1, cfg.latent_height, cfg.latent_width)
    g = torch.Generator().manual_seed(0)
    frames = max(sizes.reader_frames)
    # The bespoke history is one contiguous tensor grown by concatenation; build it once at
    # full length and take each length's prefix as its own contiguous tensor.
    history = torch.randn((1, channels, frames, *shape[3:]), generator=g, dtype=nets.dtype)
    points = []
    for k in sizes.reader_frames:
        whole = history[:, :, :k].contiguous()
        ring = tuple(history[:, :, t : t + 1].contiguous() for t in range(max(0, k - n), k))
        bespoke = time_per_call(
            lambda whole=whole: nets.observation_latents([whole], n),
            repeats=sizes.reader_repeats,
            min_time=0.0,
            number=1,
        )
        managed = time_per_call(
            lambda ring=ring: nets.observation_latents(ring, n),
            repeats=sizes.reader_repeats,
            min_time=sizes.micro_min_time,
        )
        same = torch.equal(nets.observation_latents([whole], n), nets.observation_latents(ring, n))
        points.append(
            {
                "frames": k,
                "bespoke_ms": _us(bespoke) / 1e3,
                "ring_ms": _us(managed) / 1e3,
                "bespoke_over_ring": bespoke["median_s"] / managed["median_s"],
                "bit_identical": same,
            }
        )
    return {
        "frame_shape": list(shape),
        "dtype": str(nets.dtype).removeprefix("torch."),
        "frame_mib": torch.empty(shape, dtype=nets.dtype).nbytes / MIB,
        "ring_frames": n,
        "points": points,
    }


# ---------------------------------------------------------------------------------------------
# DreamZero-shaped records with tiny tensors (for 2 and 4)
# ---------------------------------------------------------------------------------------------

FEAT_MAP_SLOTS = 26
FEAT_MAP_TENSORS = 24


@dataclass
class TinyStep:
    """One step's worth of tiny tensors, as the pipeline would hand them to the record."""

    tokens: torch.Tensor
    stitched: torch.Tensor
    encoder_out: torch.Tensor
    feat_map: tuple[torch.Tensor | None, ...]
    video: torch.Tensor


def tiny_feat_map() -> tuple[torch.Tensor | None, ...]:
    tensors = tuple(torch.zeros(1, 2, 2, 2, 2) for _ in range(FEAT_MAP_TENSORS))
    return tensors + (None,) * (FEAT_MAP_SLOTS - FEAT_MAP_TENSORS)


def tiny_step() -> TinyStep:
    return TinyStep(
        tokens=torch.zeros(1, 4, dtype=torch.int64),
        stitched=torch.zeros(4, 4, 3, dtype=torch.uint8),
        encoder_out=torch.zeros(1, 4, 1, 2, 2),
        feat_map=tiny_feat_map(),
        video=torch.zeros(1, 2, 2, 2, 2),
    )


def tiny_session(
    cfg: DreamZeroConfig,
    *,
    video_chunks: int,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DreamZeroSession:
    """A mid-window DreamZero session record: every value set, tiny tensors.

    ``shared`` is ``(language, prompt_embeds)`` to alias with other sessions of one prompt.
    """
    state = new_session(cfg)
    for _ in range(4):
        state = state.update_object(
            "stitched_buffer", _commit(torch.zeros(4, 4, 3, dtype=torch.uint8))
        )
    for _ in range(cfg.num_frame_per_block):
        state = state.update_object("vae_encoder_out", _commit(torch.zeros(1, 4, 1, 2, 2)))
    for _ in range(video_chunks):
        state = state.update_object(
            "video_latents_across_time", _commit(torch.zeros(1, 2, 2, 2, 2))
        )
    language, prompt_embeds = shared or (torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, 2))
    out = state.with_attrs(
        call_count=5,
        current_start_frame=9,
        clip_feas=torch.zeros(1, 5, 2),
        ys=torch.zeros(1, 8, 3, 2, 2),
        language=language,
        prompt_embeds=prompt_embeds,
        vae_stream_initialized=True,
        vae_enc_feat_map=tiny_feat_map(),
        vae_pending_body_frames=torch.zeros(1, 3, 2, 4, 4),
    )
    assert isinstance(out, DreamZeroSession)
    return out


def _commit(chunk: torch.Tensor) -> Callable[[LatentBuffer], LatentBuffer]:
    return lambda buffer: buffer.commit(chunk)


# ---------------------------------------------------------------------------------------------
# 2. Library overhead per DreamZero step
# ---------------------------------------------------------------------------------------------


def managed_bookkeeping(
    manager: SessionStateManager,
    session_id: str,
    factory: Callable[[], DreamZeroSession],
    step: TinyStep,
    n: int,
) -> None:
    """One DreamZero step's record transitions (`DreamZeroPipeline.step`), no model compute.

    The worst-case step: a body chunk is encoded, so all three buffers are committed.
    """
    state = manager.get_or_create(session_id, factory)
    assert isinstance(state, DreamZeroSession)
    _ = state.language, state.current_start_frame  # the reset check reads both
    state = state.with_attrs(language=step.tokens)
    call_count = state.call_count + 1
    state = state.update_object("stitched_buffer", _commit(step.stitched))
    state = state.with_attrs(call_count=call_count)
    _ = list(state.stitched_buffer.view())
    if state.prompt_embeds is None:
        state = state.with_attrs(prompt_embeds=step.video)
    csf = state.current_start_frame
    _ = state.vae_pending_body_frames, state.vae_enc_feat_map
    state = state.update_object("vae_encoder_out", _commit(step.encoder_out))
    state = state.with_attrs(vae_enc_feat_map=step.feat_map, vae_pending_body_frames=None)
    _ = state.vae_encoder_out.view(last=n)
    _ = state.ys, state.clip_feas, state.prompt_embeds
    state = state.with_attrs(current_start_frame=csf + n)
    state = state.update_object("video_latents_across_time", _commit(step.video))
    manager.put(session_id, state)


def floor_bookkeeping(
    table: collections.OrderedDict[str, dict[str, Any]],
    session_id: str,
    step: TinyStep,
    n: int,
) -> None:
    """The same bookkeeping in place on a dict, two deques and a list (the bespoke way)."""
    state = table[session_id]
    table.move_to_end(session_id)
    _ = state["language"], state["current_start_frame"]
    state["language"] = step.tokens
    state["call_count"] += 1
    state["stitched_buffer"].append(step.stitched)
    _ = list(state["stitched_buffer"])
    if state["prompt_embeds"] is None:
        state["prompt_embeds"] = step.video
    csf = state["current_start_frame"]
    _ = state["vae_pending_body_frames"], state["vae_enc_feat_map"]
    state["vae_encoder_out"].append(step.encoder_out)
    state["vae_enc_feat_map"] = step.feat_map
    state["vae_pending_body_frames"] = None
    _ = tuple(state["vae_encoder_out"])[-n:]
    _ = state["ys"], state["clip_feas"], state["prompt_embeds"]
    state["current_start_frame"] = csf + n
    state["video_latents_across_time"].append(step.video)
    table[session_id] = state


def _floor_state(record: DreamZeroSession) -> dict[str, Any]:
    values = record.values()
    state: dict[str, Any] = {
        name: value for name, value in values.items() if not isinstance(value, LatentBuffer)
    }
    state["stitched_buffer"] = collections.deque(record.stitched_buffer.view(), maxlen=4)
    state["vae_encoder_out"] = collections.deque(
        record.vae_encoder_out.view(), maxlen=record.vae_encoder_out.maxlen
    )
    state["video_latents_across_time"] = list(record.video_latents_across_time.view())
    return state


def bench_library_overhead(sizes: Sizes) -> dict[str, Any]:
    """Microseconds per step: record transitions + manager vs in-place dict/deque floor."""
    cfg = DreamZeroConfig.preset("tiny")
    n = cfg.num_frame_per_block
    step = tiny_step()
    steps = sizes.overhead_steps_per_repeat
    sid = "session-0"
    points = []
    for chunks in sizes.overhead_chunks:
        base = tiny_session(cfg, video_chunks=chunks)
        manager = SessionStateManager()
        floor_base = _floor_state(base)
        table: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()

        def reset_managed(manager: SessionStateManager = manager, base: DreamZeroSession = base):
            # Each timed loop starts from a session holding `chunks` video latents.
            manager.put(sid, base)

        def reset_floor(table=table, floor_base=floor_base) -> None:
            state = dict(floor_base)
            state["stitched_buffer"] = collections.deque(floor_base["stitched_buffer"], maxlen=4)
            state["vae_encoder_out"] = collections.deque(floor_base["vae_encoder_out"], maxlen=n)
            state["video_latents_across_time"] = list(floor_base["video_latents_across_time"])
            table[sid] = state

        managed = time_per_call(
            lambda manager=manager, base=base: managed_bookkeeping(
                manager, sid, lambda: base, step, n
            ),
            repeats=sizes.micro_repeats,
            min_time=0.0,
            setup=reset_managed,
            number=steps,
        )
        checked_manager = SessionStateManager(check_immutable=True)

        def reset_checked(
            manager: SessionStateManager = checked_manager, base: DreamZeroSession = base
        ) -> None:
            manager.put(sid, base)

        checked = time_per_call(
            lambda manager=checked_manager, base=base: managed_bookkeeping(
                manager, sid, lambda: base, step, n
            ),
            repeats=sizes.micro_repeats,
            min_time=0.0,
            setup=reset_checked,
            number=steps,
        )
        floor = time_per_call(
            lambda table=table: floor_bookkeeping(table, sid, step, n),
            repeats=sizes.micro_repeats,
            min_time=0.0,
            setup=reset_floor,
            number=steps,
        )
        points.append(
            {
                "video_chunks": chunks,
                "managed_us": _us(managed),
                "checked_us": _us(checked),
                "floor_us": _us(floor),
                "overhead_us": _us(managed) - _us(floor),
                "managed_cpu_us": _cpu_us(managed),
                "floor_cpu_us": _cpu_us(floor),
                "overhead_cpu_us": _cpu_us(managed) - _cpu_us(floor),
                "managed_spread": _spread(managed),
                "floor_spread": _spread(floor),
            }
        )
    leaves = len(tree_leaves(tiny_session(cfg, video_chunks=0)))
    return {
        "steps_per_repeat": steps,
        "transitions_per_step": {
            "with_attrs": 4,
            "latent_buffer_commits": 3,
            "update_object": 3,
            "manager": ["get_or_create", "put"],
        },
        "record_leaves_without_video": leaves,
        "points": points,
        "worst_overhead_us": max(p["overhead_us"] for p in points),
        "worst_overhead_cpu_us": max(p["overhead_cpu_us"] for p in points),
    }


# ---------------------------------------------------------------------------------------------
# 3. Ring commit vs floors
# ---------------------------------------------------------------------------------------------


def bench_ring_commit(sizes: Sizes) -> dict[str, Any]:
    """Commit one deploy-size bf16 latent frame into a ring of 2, vs copies and a list."""
    shape = (1, 32, 1, 44, 80)
    chunk = torch.randn(shape).to(torch.bfloat16)
    ring = LatentBuffer(name="vae_encoder_out", dim=2).allocate(maxlen=2)
    ring = ring.commit(torch.randn(shape).to(torch.bfloat16)).commit(
        torch.randn(shape).to(torch.bfloat16)
    )
    dst = torch.empty_like(chunk)
    prealloc = torch.empty((1, 32, 2, 44, 80), dtype=torch.bfloat16)
    refs: list[torch.Tensor] = [chunk, chunk]
    counter = [0]

    def inplace_copy_ring() -> None:
        i = counter[0] = counter[0] + 1
        prealloc[:, :, i % 2].copy_(chunk[:, :, 0])

    def inplace_ref_ring() -> None:
        i = counter[0] = counter[0] + 1
        refs[i % 2] = chunk

    kw = {"repeats": sizes.micro_repeats, "min_time": sizes.micro_min_time}
    # An accumulating buffer (`video_latents_across_time`) rebuilds its chunk tuple per commit.
    tiny = torch.zeros(1, 2, 1, 2, 2)
    accumulate = []
    for length in sizes.accumulate_chunks:
        held = LatentBuffer(name="video_latents_across_time", dim=2).allocate()
        held = attrs.evolve(held, chunks=(tiny,) * length)
        timing = time_per_call(lambda held=held: held.commit(tiny), **kw)
        accumulate.append({"chunks_held": length, "commit_us": _us(timing)})
    commit = time_per_call(lambda: ring.commit(chunk), **kw)
    memcpy = time_per_call(lambda: dst.copy_(chunk), **kw)
    copy_ring = time_per_call(inplace_copy_ring, **kw)
    ref_ring = time_per_call(inplace_ref_ring, **kw)
    return {
        "chunk_shape": list(shape),
        "dtype": "bfloat16",
        "chunk_mib": chunk.nbytes / MIB,
        "ring_maxlen": 2,
        "commit_us": _us(commit),
        "memcpy_us": _us(memcpy),
        "inplace_copy_ring_us": _us(copy_ring),
        "inplace_ref_ring_us": _us(ref_ring),
        "commit_over_inplace_copy_ring": commit["median_s"] / copy_ring["median_s"],
        "commit_over_inplace_copy_ring_cpu": commit["cpu_median_s"] / copy_ring["cpu_median_s"],
        "commit_over_memcpy": commit["median_s"] / memcpy["median_s"],
        "commit_over_inplace_ref_ring": commit["median_s"] / ref_ring["median_s"],
        "memcpy_gib_per_s": chunk.nbytes / memcpy["median_s"] / 2**30,
        "accumulate_commit": accumulate,
    }


# ---------------------------------------------------------------------------------------------
# 4. stats() scaling
# ---------------------------------------------------------------------------------------------

PROMPT_GROUPS = 3


def bench_stats_scaling(sizes: Sizes) -> dict[str, Any]:
    """Time per `stats()` call and per tensor leaf, over growing numbers of sessions."""
    cfg = DreamZeroConfig.preset("tiny")
    # Sessions with the same prompt share its token ids and embeddings (one storage each).
    shared = [
        (torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 4, 2)) for _ in range(PROMPT_GROUPS)
    ]
    points = []
    for count in sizes.stats_sessions:
        manager = SessionStateManager(max_sessions=max(sizes.stats_sessions))
        for i in range(count):
            manager.put(
                f"session-{i}",
                tiny_session(
                    cfg, video_chunks=sizes.stats_video_chunks, shared=shared[i % PROMPT_GROUPS]
                ),
            )
        records = [manager.get(sid) for sid in manager.session_ids()]
        leaves = [leaf for record in records for leaf in tree_leaves(record)]
        tensor_leaves = sum(isinstance(leaf, torch.Tensor) for leaf in leaves)

        def count_only(leaves: list[Any] = leaves) -> None:
            counter = ByteCounter()
            for leaf in leaves:
                counter.add(leaf)

        def flatten_only(records: list[Any] = records) -> None:
            for record in records:
                tree_leaves(record)

        def floor_walk(leaves: list[Any] = leaves) -> None:
            # The least any per-call walk can do: one storage lookup per tensor, deduplicated.
            seen: dict[int, int] = {}
            for leaf in leaves:
                if isinstance(leaf, torch.Tensor):
                    storage = leaf.untyped_storage()
                    key = storage.data_ptr()
                    if key not in seen:
                        seen[key] = storage.nbytes()

        # Every session stepped once between two calls (a new video chunk and a new feature
        # cache), as in a serving loop: a future cache keyed on record identity cannot hide
        # the walk here.
        stepped = [
            record.update_object(
                "video_latents_across_time", _commit(torch.zeros(1, 2, 2, 2, 2))
            ).with_attrs(vae_enc_feat_map=tiny_feat_map())
            for record in records
        ]

        def step_every_session(
            manager: SessionStateManager = manager,
            records: list[Any] = records,
            stepped: list[Any] = stepped,
            flip: list[bool] = [False],  # noqa: B006 - mutable on purpose: the toggle's state
        ) -> None:
            flip[0] = not flip[0]
            for i, record in enumerate(stepped if flip[0] else records):
                manager.put(f"session-{i}", record)

        kw = {"repeats": sizes.micro_repeats, "min_time": sizes.micro_min_time}
        call = time_per_call(manager.stats, **kw)
        after_step = time_per_call(
            manager.stats,
            repeats=sizes.micro_repeats,
            min_time=0.0,
            setup=step_every_session,
            number=1,
        )
        flatten = time_per_call(flatten_only, **kw)
        counting = time_per_call(count_only, **kw)
        floor = time_per_call(floor_walk, **kw)
        stats = manager.stats()
        points.append(
            {
                "sessions": count,
                "leaves": len(leaves),
                "tensor_leaves": tensor_leaves,
                "distinct_storages_bytes": stats["total_nbytes"],
                "call_us": _us(call),
                "per_tensor_leaf_us": _us(call) / tensor_leaves,
                "per_tensor_leaf_cpu_us": _cpu_us(call) / tensor_leaves,
                "call_after_step_us": _us(after_step),
                "per_tensor_leaf_after_step_us": _us(after_step) / tensor_leaves,
                "call_spread": _spread(call),
                "flatten_us": _us(flatten),
                "byte_counter_us": _us(counting),
                "floor_walk_us": _us(floor),
                "floor_walk_per_tensor_leaf_us": _us(floor) / tensor_leaves,
            }
        )
    return {
        "video_chunks_per_session": sizes.stats_video_chunks,
        "prompt_groups_sharing_storages": PROMPT_GROUPS,
        "points": points,
    }


# ---------------------------------------------------------------------------------------------
# 5. Memory (each path in its own subprocess)
# ---------------------------------------------------------------------------------------------


def _maxrss_kib() -> int:
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss // 1024 if sys.platform == "darwin" else rss


def _vm_hwm_kib() -> int | None:
    """The peak RSS of this process's own address space (Linux), a cross-check of ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


# On Linux a process's ru_maxrss starts at its parent's RSS at fork time (the high-water mark
# of the address space it replaced at exec), so a worker forked from this large process would
# report our peak, not its own. A small launcher process in between has a small address space
# of its own, and the worker it starts measures from there.
_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def _value_bytes(values: dict[str, object]) -> dict[str, int]:
    return {name: sum(nbytes_by_device(value).values()) for name, value in values.items()}


def memory_worker(path: str, steps: int, samples: Sequence[int], deploy_steps: int) -> dict:
    """Run one path for ``steps`` steps; bytes held at ``samples`` and the peak RSS.

    Then, on the ``meta`` device (nothing allocated), the same accounting at the deploy
    geometry for ``deploy_steps`` steps.
    """
    cfg = DreamZeroConfig.preset("tiny", local_attn_size=-1)
    environ = {ENV_FLAG: PATHS[path]}
    pipe = DreamZeroPipeline(cfg, environ=environ)
    rss_baseline_kib = _maxrss_kib()
    hwm_baseline_kib = _vm_hwm_kib()
    tiny = []
    episode = scripted_episode(cfg, steps=steps, sessions=1, seed=0, prompt_change_every=10**9)
    for i, (sid, obs) in enumerate(episode, start=1):
        pipe.forward(obs, sid)
        if i in samples:
            per_value = _value_bytes(pipe.session_values(sid))
            tiny.append({"step": i, "total": sum(per_value.values()), "per_value": per_value})
    rss_peak_kib = _maxrss_kib()
    hwm_peak_kib = _vm_hwm_kib()

    deploy_cfg = DreamZeroConfig.preset("deploy", local_attn_size=-1)
    meta = DreamZeroPipeline(deploy_cfg, device="meta", host_device="meta", environ=environ)
    deploy = []
    deploy_samples = set(_scaled_samples(samples, deploy_steps))
    episode = scripted_episode(
        deploy_cfg, steps=deploy_steps, sessions=1, seed=0, prompt_change_every=10**9
    )
    for i, (sid, obs) in enumerate(episode, start=1):
        meta.forward(obs, sid)
        if i in deploy_samples:
            per_value = _value_bytes(meta.session_values(sid))
            deploy.append({"step": i, "total": sum(per_value.values()), "per_value": per_value})
    return {
        "path": path,
        "steps": steps,
        "rss_baseline_kib": rss_baseline_kib,
        "rss_peak_kib": rss_peak_kib,
        "rss_growth_kib": rss_peak_kib - rss_baseline_kib,
        "vm_hwm_baseline_kib": hwm_baseline_kib,
        "vm_hwm_peak_kib": hwm_peak_kib,
        "tiny_bytes_by_step": tiny,
        "deploy_meta_bytes_by_step": deploy,
        "torch_threads": torch.get_num_threads(),
    }


def _scaled_samples(samples: Sequence[int], target: int) -> list[int]:
    return sorted({s for s in samples if s <= target} | {target})


def bench_memory(sizes: Sizes, threads: int) -> dict[str, Any]:
    """Both paths in their own subprocesses (run side by side: RSS is per process)."""
    procs = {}
    for path in PATHS:
        cmd = [
            sys.executable,
            "-c",
            _LAUNCHER,
            sys.executable,
            str(Path(__file__).resolve()),
            "--memory-worker",
            path,
            "--threads",
            str(threads),
            "--steps",
            str(sizes.memory_steps),
            "--samples",
            ",".join(map(str, sizes.memory_samples)),
            "--deploy-steps",
            str(sizes.memory_deploy_steps),
        ]
        procs[path] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results = {}
    for path, proc in procs.items():
        out, err = proc.communicate()
        if proc.returncode != 0:
            msg = f"memory worker `{path}` failed (exit {proc.returncode}):\n{err.decode()}"
            raise RuntimeError(msg)
        results[path] = json.loads(out.decode().strip().splitlines()[-1])
    summary = {}
    for path, result in results.items():
        tiny = result["tiny_bytes_by_step"]
        deploy = result["deploy_meta_bytes_by_step"]
        summary[path] = {
            "rss_peak_mib": result["rss_peak_kib"] / 1024,
            "rss_growth_mib": result["rss_growth_kib"] / 1024,
            "tiny_last_total_bytes": tiny[-1]["total"],
            "deploy_last_total_mib": deploy[-1]["total"] / MIB,
            "deploy_last_vae_encoder_out_mib": deploy[-1]["per_value"]["vae_encoder_out"] / MIB,
        }
    return {"paths": results, "summary": summary}


# ---------------------------------------------------------------------------------------------
# Targets and report
# ---------------------------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    step = results["step_time"]
    first, last = step["checkpoints"][0]["step"], step["checkpoints"][-1]["step"]
    overhead = results["library_overhead"]
    ring = results["ring_commit"]
    stats_points = results["stats_scaling"]["points"]
    at = next((p for p in stats_points if p["sessions"] == TARGET_STATS_SESSIONS), stats_points[-1])
    rows = [
        {
            "target": f"managed step time at step {last} / at step {first}",
            "value": step["managed_last_over_first"],
            "cpu_value": step["managed_last_over_first_cpu"],
            "threshold": TARGET_STEP_GROWTH,
            "unit": "x",
        },
        {
            "target": "library overhead per DreamZero step (worst session length)",
            "value": overhead["worst_overhead_us"],
            "cpu_value": overhead["worst_overhead_cpu_us"],
            "threshold": TARGET_OVERHEAD_US,
            "unit": "us",
        },
        {
            "target": "ring commit / in-place preallocated ring (copy) floor",
            "value": ring["commit_over_inplace_copy_ring"],
            "cpu_value": ring["commit_over_inplace_copy_ring_cpu"],
            "threshold": TARGET_RING_VS_FLOOR,
            "unit": "x",
        },
        {
            "target": f"stats() per tensor leaf at {at['sessions']} sessions",
            "value": at["per_tensor_leaf_us"],
            "cpu_value": at["per_tensor_leaf_cpu_us"],
            "threshold": TARGET_STATS_US_PER_LEAF,
            "unit": "us",
        },
    ]
    for row in rows:
        row["met"] = bool(row["value"] <= row["threshold"])
    rows.append(
        {
            "target": f"bespoke / managed step time at step {last} (reported, no threshold)",
            "value": step["checkpoints"][-1]["bespoke_over_managed"],
            "cpu_value": step["checkpoints"][-1]["bespoke_over_managed_cpu"],
            "threshold": None,
            "unit": "x",
            "met": None,
        }
    )
    return rows


def _fmt(value: float, digits: int = 2) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}" if abs(value) >= 0.01 else f"{value:.2g}"


def _kib_to_mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f}"


def render_markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    quick = "Quick (smoke) run: sizes too small to mean anything. " if results["quick"] else ""
    lines = [
        "# Benchmark results",
        "",
        f"{quick}Generated by `benchmarks/run.py` in {results['duration_s']:.0f} s on "
        f"{m['cpu']}, {m['usable_cores']} usable cores, torch {m['torch']} "
        f"({m['torch_threads']} intra-op threads), Python {m['python']}. "
        f"One-minute load average {m['loadavg_start'][0]:.1f} at start, "
        f"{m['loadavg_end'][0]:.1f} at the end of the timings.",
        "",
    ]
    if results["noisy"]:
        lines += [
            "> **Noisy machine:** the load average exceeded the number of usable cores during "
            "the run (other processes were competing for the CPU). Absolute times are "
            "inflated and jittery; compare the ratios, which are measured side by side.",
            "",
        ]
    lines += [
        "## Targets",
        "",
        "| target | measured | threshold | met | CPU-time cross-check |",
        "|---|---|---|---|---|",
    ]
    for row in results["targets"]:
        unit = row["unit"]
        threshold = "-" if row["threshold"] is None else f"<= {row['threshold']} {unit}"
        met = "-" if row["met"] is None else ("met" if row["met"] else "**not met**")
        lines.append(
            f"| {row['target']} | {_fmt(row['value'])} {unit} | {threshold} | {met} "
            f"| {_fmt(row['cpu_value'])} {unit} |"
        )
    lines += [
        "",
        "Measured: wall clock (`time.perf_counter`), medians over repeats after a warm-up; "
        "met or not is judged on it. The cross-check is the same statistic in CPU time "
        "(`time.process_time`), which time spent waiting for a busy CPU does not inflate.",
    ]

    st = results["step_time"]
    lines += [
        "",
        f"## 1. Per-step time vs session length (DreamZero tiny, {st['steps']} steps, "
        f"{st['repeats']} repeat(s), {st['window_steps']}-step windows)",
        "",
        "| step (window) | bespoke median ms | managed median ms | bespoke / managed "
        "| bespoke mean ms | managed mean ms | bespoke CPU ms | managed CPU ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in st["checkpoints"]:
        lo, hi = row["window"]
        lines.append(
            f"| {row['step']} ({lo}-{hi}) | {_fmt(row['bespoke_median_ms'])} "
            f"| {_fmt(row['managed_median_ms'])} | {_fmt(row['bespoke_over_managed'])} "
            f"| {_fmt(row['bespoke_mean_ms'])} | {_fmt(row['managed_mean_ms'])} "
            f"| {_fmt(row['bespoke_cpu_median_ms'])} | {_fmt(row['managed_cpu_median_ms'])} |"
        )
    lines += [
        "",
        f"Growth, last window / first (median): managed {_fmt(st['managed_last_over_first'])}x, "
        f"bespoke {_fmt(st['bespoke_last_over_first'])}x; "
        f"(mean, VAE encode steps included): managed "
        f"{_fmt(st['managed_last_over_first_mean'])}x, bespoke "
        f"{_fmt(st['bespoke_last_over_first_mean'])}x; (CPU time, median): managed "
        f"{_fmt(st['managed_last_over_first_cpu'])}x, bespoke "
        f"{_fmt(st['bespoke_last_over_first_cpu'])}x. "
        f"Actions bit-identical on every step: {st['bit_identical_actions']}; video latents: "
        f"{st['bit_identical_video_latents']}.",
        "",
        "Median step time along the session (ms):",
        "",
        "| steps | bespoke | managed | bespoke / managed |",
        "|---|---|---|---|",
    ]
    series = st["series"]
    stride = max(1, len(series) // 8)
    for row in series[stride - 1 :: stride]:
        lo, hi = row["steps"]
        lines.append(
            f"| {lo}-{hi} | {_fmt(row['bespoke_median_ms'])} | {_fmt(row['managed_median_ms'])} "
            f"| {_fmt(row['bespoke_median_ms'] / row['managed_median_ms'])} |"
        )

    rd = results["reader"]
    lines += [
        "",
        f"### Reader alone at the deploy latent geometry ({rd['dtype']} frames "
        f"{tuple(rd['frame_shape'])}, {_fmt(rd['frame_mib'], 4)} MiB each)",
        "",
        "| latent frames held | bespoke whole history ms | ring of 2 ms | bespoke / ring "
        "| bit-identical |",
        "|---|---|---|---|---|",
    ]
    for p in rd["points"]:
        lines.append(
            f"| {p['frames']} | {_fmt(p['bespoke_ms'])} | {_fmt(p['ring_ms'])} "
            f"| {_fmt(p['bespoke_over_ring'])} | {p['bit_identical']} |"
        )

    lo = results["library_overhead"]
    lines += [
        "",
        "## 2. Library overhead per DreamZero step (no model compute)",
        "",
        "| video latent chunks held | records + manager us | in-place dict/deque floor us "
        "| overhead us | overhead, CPU time us | with `check_immutable=True` us |",
        "|---|---|---|---|---|---|",
    ]
    for p in lo["points"]:
        lines.append(
            f"| {p['video_chunks']} | {_fmt(p['managed_us'])} | {_fmt(p['floor_us'])} "
            f"| {_fmt(p['overhead_us'])} | {_fmt(p['overhead_cpu_us'])} "
            f"| {_fmt(p['checked_us'])} |"
        )

    rc = results["ring_commit"]
    lines += [
        "",
        f"## 3. Ring commit of one {_fmt(rc['chunk_mib'], 4)} MiB bf16 latent frame "
        f"{tuple(rc['chunk_shape'])} (ring of 2)",
        "",
        "| operation | us | LatentBuffer.commit / this |",
        "|---|---|---|",
        f"| `LatentBuffer.commit` (by reference) | {_fmt(rc['commit_us'])} | 1 |",
        f"| in-place preallocated ring, `buf[:, :, i % 2].copy_(chunk)` "
        f"| {_fmt(rc['inplace_copy_ring_us'])} | {_fmt(rc['commit_over_inplace_copy_ring'])} |",
        f"| plain copy, `dst.copy_(chunk)` (memcpy floor, "
        f"{_fmt(rc['memcpy_gib_per_s'])} GiB/s) "
        f"| {_fmt(rc['memcpy_us'])} | {_fmt(rc['commit_over_memcpy'])} |",
        f"| list index assignment, `ring[i % 2] = chunk` (by reference) "
        f"| {_fmt(rc['inplace_ref_ring_us'])} | {_fmt(rc['commit_over_inplace_ref_ring'])} |",
        "",
        "Commit into an accumulating buffer (`maxlen=None`, as `video_latents_across_time`) "
        "vs the chunks it already holds:",
        "",
        "| chunks held | commit us |",
        "|---|---|",
        *(f"| {p['chunks_held']} | {_fmt(p['commit_us'])} |" for p in rc["accumulate_commit"]),
    ]

    ss = results["stats_scaling"]
    lines += [
        "",
        f"## 4. stats() scaling ({ss['video_chunks_per_session']} video chunks per session, "
        f"{ss['prompt_groups_sharing_storages']} prompt groups sharing storages)",
        "",
        "| sessions | tensor leaves | stats() us | us per tensor leaf "
        "| after a step of every session, us per leaf | of which tree_leaves us "
        "| ByteCounter us | floor walk us per leaf |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in ss["points"]:
        lines.append(
            f"| {p['sessions']} | {p['tensor_leaves']} | {_fmt(p['call_us'])} "
            f"| {_fmt(p['per_tensor_leaf_us'], 3)} | {_fmt(p['per_tensor_leaf_after_step_us'], 3)} "
            f"| {_fmt(p['flatten_us'])} | {_fmt(p['byte_counter_us'])} "
            f"| {_fmt(p['floor_walk_per_tensor_leaf_us'], 3)} |"
        )

    mem = results["memory"]
    bespoke, managed = mem["paths"]["bespoke"], mem["paths"]["managed"]
    lines += [
        "",
        "## 5. Memory per session",
        "",
        "Bytes held by one session (library accounting of `pipe.session_values`), tiny preset:",
        "",
        "| step | bespoke bytes | managed bytes | bespoke vae_encoder_out "
        "| managed vae_encoder_out |",
        "|---|---|---|---|---|",
    ]
    for b, mg in zip(bespoke["tiny_bytes_by_step"], managed["tiny_bytes_by_step"], strict=True):
        lines.append(
            f"| {b['step']} | {b['total']:,} | {mg['total']:,} "
            f"| {b['per_value']['vae_encoder_out']:,} | {mg['per_value']['vae_encoder_out']:,} |"
        )
    lines += [
        "",
        "Same accounting at the deploy geometry (352x640 bf16, real Wan encoder width), "
        "run on the `meta` device (nothing allocated), MiB:",
        "",
        "| step | bespoke total | managed total | bespoke vae_encoder_out "
        "| managed vae_encoder_out | video_latents_across_time (both) |",
        "|---|---|---|---|---|---|",
    ]
    for b, mg in zip(
        bespoke["deploy_meta_bytes_by_step"], managed["deploy_meta_bytes_by_step"], strict=True
    ):
        lines.append(
            f"| {b['step']} | {b['total'] / MIB:.2f} | {mg['total'] / MIB:.2f} "
            f"| {b['per_value']['vae_encoder_out'] / MIB:.4f} "
            f"| {mg['per_value']['vae_encoder_out'] / MIB:.4f} "
            f"| {mg['per_value']['video_latents_across_time'] / MIB:.2f} |"
        )
    lines += [
        "",
        f"Peak RSS of a {bespoke['steps']}-step tiny run, each path in its own process: "
        f"bespoke {bespoke['rss_peak_kib'] / 1024:.1f} MiB "
        f"(+{bespoke['rss_growth_kib'] / 1024:.1f} MiB over the built pipeline), "
        f"managed {managed['rss_peak_kib'] / 1024:.1f} MiB "
        f"(+{managed['rss_growth_kib'] / 1024:.1f} MiB). Cross-check, the worker's own "
        f"address-space peak (VmHWM): bespoke {_kib_to_mib(bespoke['vm_hwm_peak_kib'])} MiB, "
        f"managed {_kib_to_mib(managed['vm_hwm_peak_kib'])} MiB.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def run(sizes: Sizes, *, quick: bool, threads: int, log: Callable[[str], None]) -> dict:
    """Every measurement; returns the results dictionary (also holding the targets)."""
    start = time.perf_counter()
    results: dict[str, Any] = {"quick": quick, "sizes": asdict(sizes)}
    results["machine"] = machine_info()
    m = results["machine"]
    log(
        f"machine: {m['cpu']}; {m['usable_cores']}/{m['cores']} cores; torch {m['torch']}; "
        f"{m['torch_threads']} torch threads; load {m['loadavg_start'][0]:.1f}"
    )
    steps: Iterable[tuple[str, Callable[[], dict[str, Any]]]] = (
        ("step_time", lambda: bench_step_time(sizes)),
        ("reader", lambda: bench_reader(sizes)),
        ("library_overhead", lambda: bench_library_overhead(sizes)),
        ("ring_commit", lambda: bench_ring_commit(sizes)),
        ("stats_scaling", lambda: bench_stats_scaling(sizes)),
        ("memory", lambda: bench_memory(sizes, threads)),
    )
    for name, fn in steps:
        if name == "memory":
            # The timings are done; the memory workers (no timing) load the machine themselves.
            m["loadavg_end"] = list(os.getloadavg())
        t0 = time.perf_counter()
        results[name] = fn()
        log(f"{name}: {time.perf_counter() - t0:.1f} s")
    # One-minute load above the usable cores: other processes competed with the timings.
    results["noisy"] = max(m["loadavg_start"][0], m["loadavg_end"][0]) > m["usable_cores"]
    results["targets"] = targets(results)
    results["duration_s"] = time.perf_counter() - start
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="JSON output; the .md goes beside it"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: the tiny-tensor steps gain nothing from "
        "more, and one thread keeps timings stable on a shared machine)",
    )
    parser.add_argument("--memory-worker", choices=sorted(PATHS), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--samples", help=argparse.SUPPRESS)
    parser.add_argument("--deploy-steps", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.memory_worker:
        samples = [int(s) for s in args.samples.split(",")]
        result = memory_worker(args.memory_worker, args.steps, samples, args.deploy_steps)
        print(json.dumps(result))
        return 0

    sizes = QUICK if args.quick else FULL
    results = run(sizes, quick=args.quick, threads=args.threads, log=print)
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    markdown = render_markdown(results)
    out.with_suffix(".md").write_text(markdown)
    print()
    print(markdown)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
