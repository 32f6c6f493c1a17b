"""Draw the performance page's chart from a results file: step time vs session length.

    .venv/bin/python benchmarks/chart.py                      # results/latest.json -> docs/img
    .venv/bin/python benchmarks/chart.py --results r.json --out chart.png

One line per path: the median step time of each window of the session (the ``series`` of
``step_time``), with the windows the Targets table compares marked.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).resolve().parent
DEFAULT_RESULTS = HERE / "results" / "latest.json"
DEFAULT_OUT = HERE.parent / "docs" / "img" / "step_time.png"
STYLE = {"bespoke": ("C3", "bespoke: whole history"), "managed": ("C0", "managed: ring of 2")}


def draw(results: dict[str, Any], out: Path) -> None:
    """Write the chart of ``results``' step times to ``out`` (a PNG, 700 pixels wide)."""
    st = results["step_time"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    centres = [(row["steps"][0] + row["steps"][1]) / 2 for row in st["series"]]
    for path, (color, label) in STYLE.items():
        ys = [row[f"{path}_median_ms"] for row in st["series"]]
        ax.plot(centres, ys, "o-", color=color, lw=2, ms=4, label=label)
    for row in st["checkpoints"]:
        ax.axvline(row["step"], color="0.8", ls=":", lw=1)
    ax.set(
        xlabel="session length (steps)",
        ylabel="median step time (ms)",
        title=f"DreamZero tiny, one session of {st['steps']} steps, both paths side by side",
    )
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    draw(json.loads(args.results.read_text(encoding="utf-8")), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
