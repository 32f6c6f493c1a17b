"""Benchmarks: managed vs bespoke session state, the library's overhead, and floors.

Run from the repository root::

    .venv/bin/python benchmarks/run.py                  # full run (minutes)
    .venv/bin/python benchmarks/run.py --quick          # every measurement, tiny sizes (seconds)
    .venv/bin/python benchmarks/run.py --out some/dir/latest.json

Writes the results as JSON and, next to it, the same results as a markdown report with a
"Targets" table (``latest.json`` -> ``latest.md``). What matters is the ratios within one run;
nothing here asserts a time. ``docs/performance.md`` explains every number. Each measurement
lives in its own module beside this one:

- `step_time`: per-step time vs session length, both paths side by side (the A/B harness);
- `overhead_ab`: the library's overhead per step, both paths alternating in one process (the
  report's overhead target);
- `micro` (pyperf): the reader alone, the library's overhead per step, ring commit, and
  ``stats()`` scaling;
- `memory`: bytes held per session vs steps, and the peak RSS, each path in its own process;
- `report`: the Targets table and the markdown report; `chart`: the performance page's chart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import micro
import overhead_ab
import torch
from common import FULL, QUICK, Sizes, machine_info
from memory import bench_memory
from report import render_markdown, targets
from step_time import bench_step_growth, bench_step_time

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "latest.json"


def run_micro(sizes: Sizes, *, quick: bool, threads: int) -> dict[str, Any]:
    """Run `micro` under pyperf in its own process; its sections of the results."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "micro.json"
        cmd = [
            sys.executable,
            str(HERE / "micro.py"),
            "--sizes",
            "quick" if quick else "full",
            *sizes.pyperf_args,
            "--quiet",
            "--output",
            str(out),
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        subprocess.run(cmd, check=True, env=env)
        return micro.summarize(micro.load(out), sizes)


def run(sizes: Sizes, *, quick: bool, threads: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Every measurement; returns the results dictionary (also holding the targets)."""
    start = time.perf_counter()
    results: dict[str, Any] = {"quick": quick, "sizes": asdict(sizes)}
    results["machine"] = m = machine_info()
    log(
        f"machine: {m['cpu']}; {m['usable_cores']}/{m['cores']} cores; torch {m['torch']}; "
        f"{m['torch_threads']} torch threads; load {m['loadavg_start'][0]:.1f}"
    )
    t0 = time.perf_counter()
    results["step_time"] = bench_step_time(sizes)
    log(f"step_time: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    results["step_growth"] = bench_step_growth(sizes, 2 if quick else 40)
    log(f"step growth, forked: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    results["library_overhead_ab"] = overhead_ab.section(sizes.overhead_chunks, 3 if quick else 40)
    log(f"library overhead, alternating: {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    results.update(run_micro(sizes, quick=quick, threads=threads))
    log(f"micro-benchmarks (pyperf): {time.perf_counter() - t0:.1f} s")
    # The timings are done; the memory workers (no timing) load the machine themselves.
    m["loadavg_end"] = list(os.getloadavg())
    t0 = time.perf_counter()
    results["memory"] = bench_memory(sizes, threads)
    log(f"memory: {time.perf_counter() - t0:.1f} s")
    # One-minute load above the usable cores: other processes competed with the timings.
    results["noisy"] = max(m["loadavg_start"][0], m["loadavg_end"][0]) > m["usable_cores"]
    results["targets"] = targets(results)
    results["duration_s"] = time.perf_counter() - start
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
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
