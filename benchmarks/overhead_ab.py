"""The library's overhead per DreamZero step, the two paths alternating in one process.

`micro.py` times each path in its own pyperf worker processes; on a shared VM whose speed
drifts by tens of percent between processes, the difference of two such medians is noisy.
This script steps the bespoke and the managed pipeline (networks replayed, `micro.Replay`)
in turns, in one process on one torch thread, each round from a fresh session grown to the
same length untimed, and reports per path the fastest and the median step, and their
differences: what the library adds per step. `benchmarks/run.py` runs it (`section`) for the
report's overhead target. With ``--parts`` it also times, for the
managed path, the library calls inside the step (each wrapped, so the parts carry a little
wrapper cost of their own).

    .venv/bin/python benchmarks/overhead_ab.py                 # 10 and 400 chunks held
    .venv/bin/python benchmarks/overhead_ab.py --chunks 10 --rounds 60 --parts
    .venv/bin/python benchmarks/overhead_ab.py --chunks 10 --rounds 300 --bare  # without put, get

Timing only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from micro import OVERHEAD_WINDOW, overhead_pipeline

from sessionstate import KVPool, LatentBuffer, SessionState, SessionStateManager


@functools.cache
def bare_pipeline() -> Any:
    """The managed pipeline, its manager's `put`, `get` and `drop` only a dict's store and read.

    What the managed step costs besides `put` and `get`: the step's own transitions, commits
    and KV pool, and the manager's `step` around them.
    """
    pipe, _ = overhead_pipeline.__wrapped__("managed")
    store: dict[Any, Any] = {}
    manager = pipe._path.manager
    manager.put = store.__setitem__
    manager.get = store.get
    manager.drop = lambda session_id: store.pop(session_id, None) is not None
    return pipe


def _steps(kind: str, chunks: int, observations: Iterator[Any]) -> list[float]:
    pipe = bare_pipeline() if kind == "bare" else overhead_pipeline(kind)[0]
    pipe.drop_session("bench")
    for _ in range(chunks):  # untimed: grow the session to its length
        pipe.forward(next(observations), "bench")
    times = []
    for _ in range(OVERHEAD_WINDOW):
        obs = next(observations)
        start = time.perf_counter()
        pipe.forward(obs, "bench")
        times.append(time.perf_counter() - start)
    return times


def alternate(chunks: int, rounds: int, *, bare: bool = False) -> dict[str, dict[str, float]]:
    """Per path, the fastest and the median step (us) over ``rounds`` alternating rounds.

    With ``bare``, a third path in the turns: the managed one without `put` and `get`
    (`bare_pipeline`).
    """
    _, observations = overhead_pipeline("bespoke")
    obs = itertools.cycle(observations)
    fastest: dict[str, list[float]] = {"bespoke": [], "managed": []}
    if bare:
        fastest["bare"] = []
    for _ in range(rounds):
        for kind in fastest:
            fastest[kind].append(min(_steps(kind, chunks, obs)))
    return {
        kind: {"min_us": min(v) * 1e6, "median_us": statistics.median(v) * 1e6}
        for kind, v in fastest.items()
    }


def section(chunks: tuple[int, ...], rounds: int) -> dict[str, Any]:
    """The results' ``library_overhead_ab`` section: `alternate` at each session length.

    The overhead at a length is the median over rounds of the managed path's fastest step
    less the same median of the bespoke path's.
    """
    points = []
    for n in chunks:
        r = alternate(n, rounds)
        b, m = r["bespoke"], r["managed"]
        points.append(
            {
                "video_chunks": n,
                "bespoke_min_us": b["min_us"],
                "bespoke_median_us": b["median_us"],
                "managed_min_us": m["min_us"],
                "managed_median_us": m["median_us"],
                "overhead_us": m["median_us"] - b["median_us"],
                "overhead_min_us": m["min_us"] - b["min_us"],
            }
        )
    return {
        "rounds": rounds,
        "steps_per_round": OVERHEAD_WINDOW,
        "points": points,
        "worst_overhead_us": max(p["overhead_us"] for p in points),
    }


def _wrap(owner: Any, name: str, into: dict[str, float]) -> Callable[[], None]:
    real = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into[name] += time.perf_counter() - start

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, real)


def parts(chunks: int, rounds: int) -> dict[str, float]:
    """Per managed step (us, mean of the fastest quarter of rounds), the library's calls."""
    import sessionstate.models.dreamzero._managed as managed

    pipe, observations = overhead_pipeline("managed")
    obs = itertools.cycle(observations)
    spent: dict[str, float] = collections.defaultdict(float)
    targets = [
        (SessionStateManager, "get"),
        (SessionStateManager, "put"),
        (SessionState, "with_values"),
        (LatentBuffer, "commit"),
        (KVPool, "append"),
        (KVPool, "read"),
        (SessionStateManager, "_make_step_room"),
        (managed.ManagedPath, "step"),
    ]
    undo = [_wrap(owner, name, spent) for owner, name in targets]
    samples = []
    try:
        for _ in range(rounds):
            pipe.drop_session("bench")
            for _ in range(chunks):
                pipe.forward(next(obs), "bench")
            spent.clear()
            start = time.perf_counter()
            for _ in range(OVERHEAD_WINDOW):
                pipe.forward(next(obs), "bench")
            samples.append((time.perf_counter() - start, dict(spent)))
    finally:
        for restore in undo:
            restore()
    samples.sort(key=lambda s: s[0])
    best = samples[: max(1, len(samples) // 4)]
    out = {"forward": statistics.mean(s[0] for s in best)}
    for name in best[0][1]:
        out[name] = statistics.mean(s[1][name] for s in best)
    return {k: v / OVERHEAD_WINDOW * 1e6 for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, nargs="*", default=[10, 400])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--parts", action="store_true", help="time the managed step's parts")
    parser.add_argument(
        "--bare", action="store_true", help="also time the managed step without put and get"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    for chunks in args.chunks:
        r = alternate(chunks, args.rounds, bare=args.bare)
        b, m = r["bespoke"], r["managed"]
        print(
            f"{chunks} chunks: bespoke min {b['min_us']:.0f} us, median {b['median_us']:.0f}; "
            f"managed min {m['min_us']:.0f} us, median {m['median_us']:.0f}; overhead "
            f"{m['min_us'] - b['min_us']:.0f} us (min), {m['median_us'] - b['median_us']:.0f} "
            f"us (median); managed / bespoke {m['median_us'] / b['median_us']:.2f}x (median), "
            f"{m['min_us'] / b['min_us']:.2f}x (min)"
        )
        if args.bare:
            w = r["bare"]
            print(
                f"    without put and get: min {w['min_us']:.0f} us, median "
                f"{w['median_us']:.0f}; / bespoke {w['median_us'] / b['median_us']:.2f}x "
                f"(median), {w['min_us'] / b['min_us']:.2f}x (min)"
            )
        if args.parts:
            for name, us in parts(chunks, args.rounds).items():
                print(f"    {name:16s} {us:8.1f} us")


if __name__ == "__main__":
    main()
