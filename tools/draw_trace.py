"""Draw a `sessionstate ab --trace` file as a timeline picture (for the Observability page).

One row per path and kind of range: each step (coloured by session) and the library's ranges
(parks, unparks, prefetches) on the managed path, time in milliseconds. Each session's first
step (its conditioning encode, ten times a later step) is left out: the picture starts at the
first step of the second round. Usage::

    sessionstate ab --steps 3 --sessions 3 --max-bytes 1300000 --park-tier host \\
        --prefetch --trace trace.json
    python tools/draw_trace.py trace.json docs/img/ab-trace.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROWS = ["step", "sessionstate::park", "sessionstate::unpark", "sessionstate::prefetch"]


def main(source: str, target: str) -> int:
    events = json.loads(Path(source).read_text())["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "path" in e["args"]["name"]
    }
    spans = [e for e in events if e.get("ph") == "X" and e.get("pid") in names]
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.4 + 0.9 * len(names)), sharex=False)
    colours: dict[str, str] = {}
    palette = plt.get_cmap("tab10").colors
    for ax, (pid, name) in zip(axes, sorted(names.items()), strict=True):
        mine = [e for e in spans if e["pid"] == pid]
        steps = sorted((e for e in mine if e["name"].startswith("step ")), key=lambda e: e["ts"])
        sessions = {e["name"] for e in steps}
        start = steps[len(sessions)]["ts"]  # the second round's first step
        mine = [e for e in mine if e["ts"] >= start]
        for row, kind in enumerate(ROWS):
            for e in mine:
                label = e["name"].split(" ")[0] if e["name"].startswith("step ") else e["name"]
                if label != kind:
                    continue
                session = e["name"][5:] if kind == "step" else ""
                colour = colours.setdefault(session, palette[len(colours) % len(palette)])
                ax.broken_barh(
                    [((e["ts"] - start) / 1e3, max(e["dur"] / 1e3, 0.05))],
                    (row - 0.4, 0.8),
                    color=colour if kind == "step" else "0.35",
                )
        ax.set_yticks(range(len(ROWS)), [r.removeprefix("sessionstate::") for r in ROWS])
        ax.invert_yaxis()
        ax.set_title(name, loc="left", fontsize=10)
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(target, dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
