"""Serving under load (issue 53): sessions kept at their chunk deadlines, per policy.

Run from the repository root::

    .venv/bin/python benchmarks/serve.py                    # the headline (a few minutes)
    .venv/bin/python benchmarks/serve.py --smoke            # every step, short loads (seconds)
    .venv/bin/python benchmarks/serve.py --out benchmarks/results/serve.json --plot docs/img

Everything runs on the simulated clock (`sessionstate.serving`): a real `SessionStateManager`
decides over scale models of deploy-sized records, copies run on two lanes at the shape's
bandwidth, steps take the shape's stated time. Nothing here depends on this machine's speed:
the figures are the same on every run of the same commit.

1. ``headline``: DreamZero deploy and the LingBot shape on an H200-shaped device (141 GB,
   50 GB/s). Every policy on the same Poisson arrivals (geometric lengths, mean 40 chunks:
   30 s sessions, assumed) at rates around the planned limit; per policy the highest rate
   *sustained* (at least 99% of chunk deadlines met and at most 1% of sessions refused) and
   the sessions active at it. Policies (c) and (d) also with admission by deadline.
2. ``plan_vs_harness``: per shape, the sessions the plan's arithmetic holds at the deadline
   (`DeadlineAdmission`, no headroom, from the plan's resident count and swap time) against
   the sessions the harness sustains (`sustained_sessions`).
3. ``sana_wm``: RFC #4480's setting: sessions the A100 holds resident, and with parking.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sessionstate.cli._plan import plan_for
from sessionstate.serving import (
    H200_NBYTES,
    LINGBOT,
    POLICIES,
    SANA_WM,
    DeadlineAdmission,
    DeployShape,
    dreamzero_shape,
    sustained_sessions,
    sweep,
)

HERE = Path(__file__).resolve().parent
MEAN_CHUNKS = 40
MULTIPLIERS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.65, 0.85, 1.0, 1.25, 1.6)
LINES = [(p, False) for p in POLICIES] + [("lru", True), ("schedule", True)]


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE, check=False
    )
    return done.stdout.strip() or "unknown"


def dreamzero() -> DeployShape:
    """The DreamZero deploy shape from `sessionstate plan` (its size table, on meta)."""
    plan = plan_for(
        "dreamzero",
        "deploy",
        None,
        device_nbytes=H200_NBYTES,
        host_nbytes=1024 * 2**30,
        bandwidth=50e9,
    )
    return dreamzero_shape(plan)


def headline(shape: DeployShape, *, sessions: int, multipliers: tuple[float, ...]) -> dict:
    """Every line at every rate; the highest rate each sustains."""
    limit = DeadlineAdmission.planned(shape).limit
    base = limit / (MEAN_CHUNKS * shape.chunk_period_s)  # sessions per second at the limit
    rates = [round(base * m, 5) for m in multipliers]
    lines: dict[str, Any] = {}
    for policy, admission in LINES:
        name = policy + ("+admission" if admission else "")
        duration = sessions / rates[len(rates) // 2]
        out = sweep(
            shape,
            rates,
            mean_chunks=MEAN_CHUNKS,
            duration_s=duration,
            policies=[policy],  # type: ignore[list-item]
            admission=admission,
        )
        lines[name] = {
            "label": POLICIES[policy] + (" + admission by deadline" if admission else ""),
            "best": out["best"][policy],
            "runs": [
                {
                    "rate": run["load"]["rate"],
                    "schedule_api": run["schedule_api"],
                    "admission_limit": run["admission_limit"],
                    **run["metrics"],
                }
                for run in out["runs"][policy]
            ],
        }
        print(f"  {shape.name} {name}: best {lines[name]['best']}", flush=True)
    return {
        "shape": shape.name,
        "figures": dict(shape.figures),
        "session_nbytes": shape.session_nbytes,
        "swap_s": shape.swap_s,
        "resident_capacity": shape.resident_capacity,
        "planned_limit": limit,
        "mean_chunks": MEAN_CHUNKS,
        "duration_s": sessions / rates[len(rates) // 2],
        "rates": rates,
        "lines": lines,
    }


def plan_vs_harness(shape: DeployShape, *, most: int) -> dict:
    """Planned against measured sessions at the deadline, per parking policy."""
    out: dict[str, Any] = {"resident_capacity": shape.resident_capacity}
    for policy in ("lru", "schedule"):
        planned = DeadlineAdmission.planned(
            shape, prefetch=policy == "schedule", headroom=1.0
        ).limit
        measured = sustained_sessions(shape, policy, chunks=30, most=most)  # type: ignore[arg-type]
        out[policy] = {
            "planned": planned,
            "measured": measured,
            "within_10_percent": abs(planned - measured) <= 0.1 * max(measured, 1),
        }
    return out


def draw(shape_result: dict, out: Path) -> None:
    """Attainment and p99 chunk latency against arrival rate, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, line) in enumerate(shape_result["lines"].items()):
        rates = [r["rate"] for r in line["runs"]]
        style = "--" if "admission" in name else "-"
        ax1.plot(rates, [r["attainment"] for r in line["runs"]], style, marker="o", ms=3,
                 color=f"C{i}", label=line["label"])  # fmt: skip
        p99 = [r["chunk_latency_p99_s"] or float("nan") for r in line["runs"]]
        ax2.plot(rates, p99, style, marker="o", ms=3, color=f"C{i}", label=line["label"])
    period = shape_result["figures"].get("chunk_period_s", "")
    ax1.axhline(0.99, color="0.6", ls=":", lw=1)
    ax1.set(xlabel="session arrivals per second", ylabel="chunk-deadline attainment",
            title=f"{shape_result['shape']}: attainment", ylim=(0, 1.02))  # fmt: skip
    ax2.set(xlabel="session arrivals per second", ylabel="p99 chunk latency (s)",
            title=f"{shape_result['shape']}: p99 chunk latency", yscale="log")  # fmt: skip
    ax2.axhline(0.75, color="0.6", ls=":", lw=1)
    ax1.legend(fontsize=7, loc="lower left")
    fig.suptitle(f"simulated clock; chunk period: {period}", fontsize=8)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write JSON and the plots."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="short loads, few rates")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    parser.add_argument("--plot", type=Path, default=None, help="folder for the PNG plots")
    args = parser.parse_args(argv)
    sessions, multipliers = (40, (0.2, 1.0)) if args.smoke else (400, MULTIPLIERS)
    started = time.perf_counter()
    shapes = [dreamzero(), LINGBOT]
    results: dict[str, Any] = {
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "clock": "simulated",
        "sustained": "attainment >= 0.99 and refused_fraction <= 0.01",
        "headline": {},
        "plan_vs_harness": {},
    }
    for shape in shapes:
        print(f"{shape.name}: planned limit {DeadlineAdmission.planned(shape).limit}", flush=True)
        results["headline"][shape.name] = headline(
            shape, sessions=sessions, multipliers=multipliers
        )
    for shape in [*shapes, SANA_WM]:
        results["plan_vs_harness"][shape.name] = plan_vs_harness(
            shape, most=8 if args.smoke else 64
        )
        print(f"plan vs harness {shape.name}: {results['plan_vs_harness'][shape.name]}")
    results["sana_wm"] = {
        "figures": dict(SANA_WM.figures),
        "resident_without_parking": SANA_WM.resident_capacity,
        "sustained_with_parking": results["plan_vs_harness"][SANA_WM.name]["schedule"]["measured"],
        "rfc_4480": 42,
    }
    results["wall_s"] = round(time.perf_counter() - started, 1)
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    if args.plot:
        for name, shape_result in results["headline"].items():
            draw(shape_result, args.plot / f"serve_{name}.png")
    for name, shape_result in results["headline"].items():
        print(f"\n{name} (resident {shape_result['resident_capacity']}, planned limit "
              f"{shape_result['planned_limit']}):")  # fmt: skip
        for line in shape_result["lines"].values():
            best = line["best"]
            print(f"  {line['label']:<55} "
                  + ("none sustained" if best is None else
                     f"rate {best['rate']:.4f}/s, active mean {best['active_mean']:.2f}, "
                     f"max {best['active_max']}"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
