"""Compiled steps: what donation saves in memory, and compiled against eager step time.

Run from the repository root::

    .venv/bin/python benchmarks/compiled.py            # the figures (a few minutes)
    .venv/bin/python benchmarks/compiled.py --smoke    # every measurement, tiny sizes
    .venv/bin/python benchmarks/compiled.py --out benchmarks/results/compiled.json

1. ``donation_memory``: a step over a ring of 4 chunks and a cache, each chunk and the cache
   N MiB, compiled by `sessionstate.compile` with and without ``donate=True`` (``aot_eager``).
   At the end of each step the record given and the record returned are both alive (the
   caller has not let go of the old one yet): the bytes they hold together, each storage once
   (`nbytes_by_device`), are the step's record peak. Without donation it is two records' worth
   of what the step rewrote; with donation one record. Also: how many leaves kept their
   ``data_ptr`` once the ring is full (step 5 on; the cache from step 2).
2. ``step_time``: the README's step and a ring + cache step under `sessionstate.compile`
   (``aot_eager``, and ``inductor`` unless ``--no-inductor``) against eager, median per step
   after the structures have settled, with the structures and compiles each took.
3. ``models``: one tiny DreamZero and one tiny Cosmos3 managed step, eager against
   ``torch.compile(step, backend="aot_eager")``. Their steps do not compile whole yet (the
   graph breaks are reported: seeded host generators, diffusers' scheduler), so this is
   ``torch.compile`` with breaks, not `sessionstate.compile`; inductor on these is left out
   (minutes of compile on 2 CPUs).

Nothing here asserts a time: the figures are ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.utils import counters

import sessionstate as ss

MIB = 1024 * 1024


def _ring_cache_session(nbytes: int) -> ss.SessionState:
    n = nbytes // 4
    ring = ss.LatentBuffer(name="latents", dim=0).allocate(maxlen=4)
    cache = ss.TensorCache(name="feat").allocate().commit(torch.zeros(n))
    return ss.SessionState(objects={"latents": ring, "feat": cache}, attrs={"steps": 0})


def _ring_cache_step(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, Any]:
    state = state.update_object("latents", lambda r: r.commit(x))
    feat = state.object("feat", ss.TensorCache).view()
    state = state.update_object("feat", lambda c: c.commit(feat + 1.0))
    return state.with_attrs(steps=state.attrs["steps"] + 1), x.sum()


class _Session(ss.SessionState):
    steps = ss.SessionAttr(0, coerce=int, doc="Completed steps.")


def _readme_session(nbytes: int) -> _Session:
    ring = ss.LatentBuffer(name="latents", dim=0).allocate(maxlen=2)
    return _Session(objects={"latents": ring})


def _readme_step(state: _Session, x: torch.Tensor) -> tuple[_Session, torch.Tensor]:
    state = state.update_object("latents", lambda ring: ring.commit(x))
    out = state.object("latents").concat().mean(dim=0)
    return state.with_attrs(steps=state.steps + 1), out


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in ss.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def donation_memory(mib: int, steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {"chunk_and_cache_mib": mib, "steps": steps}
    for donate in (False, True):
        fast = ss.compile(_ring_cache_step, backend="aot_eager", donate=donate)
        state = _ring_cache_session(mib * MIB)
        peaks, addresses = [], []
        for i in range(steps):
            x = torch.full((1, mib * MIB // 4), float(i))
            new, _ = fast(state, x)
            peaks.append(sum(ss.nbytes_by_device((state, new)).values()))
            state = new
            del new
            addresses.append([t.data_ptr() for t in _tensor_leaves(state)])
        settled = peaks[-1]
        record = sum(ss.nbytes_by_device(state).values())
        stable = sum(
            all(a[j] == addresses[4][j] for a in addresses[4:]) for j in range(len(addresses[4]))
        )
        out["donated" if donate else "copied"] = {
            "record_bytes": record,
            "step_record_peak_bytes": settled,
            "peak_over_record": round(settled / record, 3),
            "leaves_at_one_address_once_the_ring_is_full": f"{stable}/{len(addresses[-1])}",
            "donated_steps": fast.donated,
            "structures": fast.structures,
            "compiles": fast.compiles,
        }
    return out


def _median_step(
    run: Callable[..., Any], make: Callable[[int], Any], xs: list[torch.Tensor], warm: int
) -> float:
    state = make(MIB)
    for x in xs[:warm]:
        state, _ = run(state, x.clone())
    times = []
    for x in xs[warm:]:
        x = x.clone()
        t0 = time.perf_counter()
        state, _ = run(state, x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_time(steps: int, backends: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases: dict[str, tuple[Callable[..., Any], Callable[[int], Any], tuple[int, ...]]] = {
        "readme": (_readme_step, _readme_session, (1, 4)),
        "ring_cache_1mib": (_ring_cache_step, _ring_cache_session, (1, 1024)),
    }
    for name, (step, make, shape) in cases.items():
        xs = [torch.full(shape, float(i % 5)) for i in range(steps)]
        warm = 6
        eager = _median_step(step, make, xs, warm)
        row: dict[str, Any] = {"eager_us": round(eager * 1e6, 1)}
        for backend in backends:
            for donate in (False, True):
                fast = ss.compile(step, backend=backend, donate=donate)
                t = _median_step(fast, make, xs, warm)
                key = f"{backend}{'_donated' if donate else ''}"
                row[key] = {
                    "us": round(t * 1e6, 1),
                    "eager_over_compiled": round(eager / t, 2),
                    "structures": fast.structures,
                    "compiles": fast.compiles,
                }
        out[name] = row
    return out


def _model_step(name: str) -> tuple[Callable[..., Any], Any, list[Any]]:
    from sessionstate.models._registry import get_model

    spec = get_model(name)
    cfg = spec.config_from_dict({"preset": "tiny"})
    if name == "dreamzero":
        from sessionstate.models.dreamzero import DreamZeroPipeline as Pipe
    else:
        from sessionstate.models.cosmos3 import Cosmos3Pipeline as Pipe  # type: ignore[assignment]
    pipe = Pipe(cfg, environ={ss.ENV_ENABLE: "1"})
    inputs = [x for _, x in spec.episode(cfg, steps=8, sessions=1, seed=0)]
    return pipe.step, pipe.new_session(), inputs


def models(steps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("dreamzero", "cosmos3"):
        step, first, inputs = _model_step(name)
        inputs = (inputs * (steps // len(inputs) + 1))[:steps]
        state = first
        state, _ = step(state, inputs[0])
        explained = torch._dynamo.explain(step)(state, inputs[1])
        compiled = torch.compile(step, backend="aot_eager")
        row: dict[str, Any] = {"graph_breaks": explained.graph_break_count}
        for label, run in (("eager", step), ("aot_eager", compiled)):
            before = counters["stats"]["unique_graphs"]
            state, times = first, []
            for i, x in enumerate(inputs):
                t0 = time.perf_counter()
                state, _ = run(state, x)
                if i >= 3:
                    times.append(time.perf_counter() - t0)
            row[f"{label}_ms"] = round(statistics.median(times) * 1e3, 2)
            row[f"{label}_graphs"] = counters["stats"]["unique_graphs"] - before
        row["eager_over_compiled"] = round(row["eager_ms"] / row["aot_eager_ms"], 2)
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, every measurement")
    parser.add_argument("--no-inductor", action="store_true", help="skip inductor timings")
    parser.add_argument("--out", help="write the figures as JSON to this path")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    smoke = args.smoke
    backends = ["aot_eager"] + ([] if args.no_inductor or smoke else ["inductor"])
    report = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "donation_memory": donation_memory(1 if smoke else 16, 8 if smoke else 100),
        "step_time": step_time(10 if smoke else 60, backends),
        "models": models(5 if smoke else 12),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
