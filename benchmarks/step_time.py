"""Per-step time vs session length: both paths side by side, stepped alternately.

The A/B harness: two DreamZero pipelines (tiny preset, no window reset) run one long session
each on the same observations, one step of each in turn (the order flips every step), so a
change in machine load hits both alike. Each step's outputs (actions and video latents) are
checked bit-identical between the paths. Every step is timed with `time.perf_counter`, and
with `time.process_time` beside it as a cross-check that a busy machine inflates much less.

`bench_step_growth` measures what the long series cannot separate from drift: how the
managed step's time depends on the session's length. Records are immutable, so the session at
its first and at its last checkpoint is kept and put back in turns: each round steps a
window from the short record, then the same window from the long one (the order flips every
round), and the ratio of the two is taken round by round, so a drift in machine speed over
the run cancels. Each fork's outputs are checked equal round after round.
"""

from __future__ import annotations

import math
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


GROWTH_WINDOW = 8  # steps timed after each fork: two of them encode frames (one in four)


def bench_step_growth(sizes: Sizes, rounds: int) -> dict[str, Any]:
    """The managed step at the last checkpoint over the first, from forks of one session.

    One session grows to ``sizes.steps`` steps; its records after the first and the last
    checkpoint are kept. Each round puts one record back and times ``GROWTH_WINDOW`` steps
    from it, then the other (the order flips every round). A round's ratio is the median step
    of the long fork's window over the short one's; the result is the median of the rounds'
    ratios, with the per-fork medians and fastest steps beside it.
    """
    cfg = DreamZeroConfig.preset("tiny", local_attn_size=-1)
    pipe = DreamZeroPipeline(cfg, environ=path_environ("managed"))
    manager = pipe.manager
    assert manager is not None
    first, last = sizes.step_checkpoints[0], sizes.steps
    window = min(GROWTH_WINDOW, sizes.step_window)
    observations = [
        obs
        for _, obs in scripted_episode(
            cfg, steps=last + window, sessions=1, seed=0, prompt_change_every=10**9
        )
    ]
    forks = {}
    for step, obs in enumerate(observations[:last], start=1):
        pipe.forward(obs, "growth")
        if step in (first, last):
            forks[step] = manager.get("growth")
    medians: dict[int, list[float]] = {first: [], last: []}
    fastest: dict[int, float] = {first: math.inf, last: math.inf}
    outputs: dict[int, list[torch.Tensor]] = {}
    deterministic = True
    for r in range(rounds):
        for at in (first, last) if r % 2 == 0 else (last, first):
            manager.put("growth", forks[at])
            times, actions = [], []
            for obs in observations[at : at + window]:
                start = time.perf_counter()
                out = pipe.forward(obs, "growth")
                times.append(time.perf_counter() - start)
                actions.append(out.actions)
            medians[at].append(statistics.median(times))
            fastest[at] = min(fastest[at], min(times))
            if at in outputs:
                deterministic = deterministic and all(map(torch.equal, outputs[at], actions))
            outputs[at] = actions
    ratios = [b / a for a, b in zip(medians[first], medians[last], strict=True)]
    return {
        "first_step": first,
        "last_step": last,
        "rounds": rounds,
        "window_steps": window,
        "first_median_ms": statistics.median(medians[first]) * 1e3,
        "last_median_ms": statistics.median(medians[last]) * 1e3,
        "first_fastest_ms": fastest[first] * 1e3,
        "last_fastest_ms": fastest[last] * 1e3,
        "last_over_first": statistics.median(ratios),
        "last_over_first_fastest": fastest[last] / fastest[first],
        "forks_deterministic": deterministic,
    }


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
