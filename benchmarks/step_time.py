"""Per-step time vs session length: both paths side by side, stepped alternately.

The A/B harness: two DreamZero pipelines (tiny preset, no window reset) run one long session
each on the same observations, one step of each in turn (the order flips every step), so a
change in machine load hits both alike. Each step's outputs (actions and video latents) are
checked bit-identical between the paths. Every step is timed with `time.perf_counter`, and
with `time.process_time` beside it as a cross-check that a busy machine inflates much less.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from common import PATHS, Sizes, path_environ

from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode


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
    pipes = {name: DreamZeroPipeline(cfg, environ=path_environ(name)) for name in PATHS}
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
    identical = True
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
            bespoke, managed = outs["bespoke"], outs["managed"]
            identical = (
                identical
                and torch.equal(bespoke.actions, managed.actions)
                and torch.equal(bespoke.video_latents, managed.video_latents)
            )
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
        "bit_identical_outputs": identical,
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
