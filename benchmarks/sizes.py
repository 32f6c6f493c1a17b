"""Benchmark: `sessionstate sizes` with the networks' calls replayed against every call run.

Run from the repository root::

    .venv/bin/python benchmarks/sizes.py               # deploy: 12 steps both ways, 400 replayed
    .venv/bin/python benchmarks/sizes.py --smoke       # tiny preset, a few steps (seconds)

Both ways compute DreamZero's size table on the meta device: ``full`` runs every network
call of the scripted episode (the table as it was computed before the replay), ``replayed``
runs each distinct call once (see `sessionstate.models._sizes`). The two tables must be
equal, and the report says so. Then the replayed table alone at ``--long-steps`` (the
command's default of 400), compared with the committed ``docs/data`` table of that length
where there is one. Times are wall and process CPU seconds of one run each, with the ratio
``full / replayed``; the machine, its load, the commit and the date are recorded beside them.
Writes JSON (``benchmarks/results/sizes.json`` by default). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import machine_info

from sessionstate.cli import size_table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_OUT = HERE / "results" / "sizes.json"
COMMITTED = {("deploy", 400): ROOT / "docs" / "data" / "sizes-deploy-400.json"}


def _timed(preset: str, steps: int, *, full: bool) -> tuple[dict[str, Any], dict[str, float]]:
    wall, cpu = time.perf_counter(), time.process_time()
    table = size_table(preset, steps, full=full)
    return table, {
        "wall_s": round(time.perf_counter() - wall, 2),
        "cpu_s": round(time.process_time() - cpu, 2),
    }


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def bench(preset: str, steps: int, long_steps: int | None) -> dict[str, Any]:
    """Both ways at ``steps``, then the replayed way at ``long_steps``; the results."""
    full, full_time = _timed(preset, steps, full=True)
    fast, fast_time = _timed(preset, steps, full=False)
    results: dict[str, Any] = {
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "preset": preset,
        "steps": steps,
        "full": full_time,
        "replayed": fast_time,
        "full_over_replayed_cpu": round(full_time["cpu_s"] / max(fast_time["cpu_s"], 0.01), 1),
        "tables_equal": full == fast,
    }
    if long_steps is not None:
        table, long_time = _timed(preset, long_steps, full=False)
        committed = COMMITTED.get((preset, long_steps))
        results["long"] = {
            "steps": long_steps,
            "replayed": long_time,
            "equal_to_committed": (
                None
                if committed is None
                else json.loads(committed.read_text(encoding="utf-8")) == table
            ),
        }
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny preset, 4 steps, no long run")
    parser.add_argument("--preset", default="deploy", choices=["tiny", "deploy"])
    parser.add_argument("--steps", type=int, default=12, help="steps run both ways")
    parser.add_argument("--long-steps", type=int, default=400, help="steps run replayed only")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.smoke:
        results = bench("tiny", 4, None)
    else:
        results = bench(args.preset, args.steps, args.long_steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=2))
    return 0 if results["tables_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
