"""The size-table benchmark runs end to end at the tiny preset, so it cannot rot.

No timing is asserted: the smoke run only has to time both ways and find their tables equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

BENCHMARK = ROOT / "benchmarks" / "sizes.py"


def test_smoke_run_times_both_ways_and_finds_the_tables_equal(tmp_path: Path) -> None:
    out = tmp_path / "sizes.json"
    # A hang guard only (the smoke run takes seconds); nothing here measures time.
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text(encoding="utf-8"))
    assert results["tables_equal"] is True
    assert (results["preset"], results["steps"]) == ("tiny", 4)
    for way in ("full", "replayed"):
        assert set(results[way]) == {"wall_s", "cpu_s"}
    assert len(results["commit"]) == 40 or results["commit"] == "unknown"
    assert "loadavg_start" in results["machine"]
    assert "loadavg_end" in results["machine"]
