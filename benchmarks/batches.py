"""Batched steps against one by one, through the public API, in one run (real tiny networks).

For each reference model and batch size N, three pipelines hold the same N sessions (every
one at the same place in its stream: one shape bucket) and step them, in turns within each
repeat (the order rotating), one round at a time:

- ``one_by_one``: ``forward(x, sid)`` for each session;
- ``batched``: ``forward_many(inputs)``, the networks run once on the batch;
- ``batched_invariant``: ``forward_many(inputs, batch_invariant=True)``, the networks run per
  session inside the batched step (every output bit for bit the one-by-one one).

Reported per model and N: milliseconds per session-step over the ``--repeats`` measured rounds
(their total over rounds times N: DreamZero's VAE encodes a body of frames every fourth step
and its window start once a window, so a median round would leave them out) and each batched
figure over the one-by-one one. Then the library's share, on DreamZero-shaped
records without networks: ``get_many`` + ``put_many`` of N sessions against N ``get`` + ``put``,
per session-step. Prints one JSON object; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from benchmarks.common import code_version, machine_info, tiny_session

import sessionstate as ss
from sessionstate.models._registry import get_model
from sessionstate.models.dreamzero import DreamZeroConfig

VARIANTS = ("one_by_one", "batched", "batched_invariant")


def _rounds(spec: Any, cfg: Any, n: int, steps: int) -> list[dict[Any, Any]]:
    # Round k holds each session's k-th input: every session at the same place in its stream.
    per: dict[Any, list[Any]] = {}
    for sid, x in spec.episode(cfg, steps=steps, sessions=n, seed=0, prompt_change_every=10**6):
        per.setdefault(sid, []).append(x)
    return [{sid: xs[k] for sid, xs in per.items()} for k in range(steps)]


def _runner(variant: str, pipe: Any) -> Callable[[dict[Any, Any]], None]:
    if variant == "one_by_one":
        return lambda inputs: [pipe.forward(x, sid) for sid, x in inputs.items()] and None
    invariant = variant == "batched_invariant"
    return lambda inputs: pipe.forward_many(inputs, batch_invariant=invariant) and None


def measure_model(model: str, n: int, warmup: int, repeats: int) -> dict[str, Any]:
    spec = get_model(model)
    cfg = spec.config_from_dict({"preset": "tiny"})
    rounds = _rounds(spec, cfg, n, warmup + repeats)
    pipes = {v: spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"}) for v in VARIANTS}
    runs = {v: _runner(v, pipes[v]) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for k, inputs in enumerate(rounds):
        order = VARIANTS[k % 3 :] + VARIANTS[: k % 3]
        for variant in order:
            start = time.perf_counter()
            runs[variant](inputs)
            if k >= warmup:
                times[variant].append((time.perf_counter() - start) / n)
    ms = {v: 1000 * statistics.fmean(t) for v, t in times.items()}
    return {
        "model": model,
        "n": n,
        **{f"{v}_ms": round(ms[v], 3) for v in VARIANTS},
        "batched_over_one_by_one": round(ms["batched"] / ms["one_by_one"], 3),
        "invariant_over_one_by_one": round(ms["batched_invariant"] / ms["one_by_one"], 3),
    }


def measure_library(n: int, repeats: int) -> dict[str, Any]:
    # The manager's part of a step alone: read N records and store N new ones.
    cfg = DreamZeroConfig.preset("tiny")
    records = {f"s{i}": tiny_session(cfg, video_chunks=10) for i in range(n)}
    nexts = {sid: r.with_attrs(call_count=r.call_count + 1) for sid, r in records.items()}
    single: ss.SessionStateManager[Any] = ss.SessionStateManager()
    many: ss.SessionStateManager[Any] = ss.SessionStateManager()
    single.put_many(records)
    many.put_many(records)
    ids = list(records)
    one_s, many_s = [], []
    for k in range(repeats):
        swap = nexts if k % 2 == 0 else records
        start = time.perf_counter()
        for sid in ids:
            single.get(sid)
            single.put(sid, swap[sid])
        one_s.append((time.perf_counter() - start) / n)
        start = time.perf_counter()
        many.get_many(ids)
        many.put_many(swap)
        many_s.append((time.perf_counter() - start) / n)
    one, batch = statistics.median(one_s), statistics.median(many_s)
    return {
        "n": n,
        "get_put_us": round(1e6 * one, 2),
        "get_many_put_many_us": round(1e6 * batch, 2),
        "many_over_single": round(batch / one, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--models", nargs="+", default=["dreamzero", "cosmos3"])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--library-repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [
        measure_model(model, n, args.warmup, args.repeats)
        for model in args.models
        for n in args.sizes
    ]
    library = [measure_library(n, args.library_repeats) for n in args.sizes]
    result = {
        "batches": rows,
        "library": library,
        "threads": args.threads,
        "code": code_version(),
        "machine": machine_info(),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
