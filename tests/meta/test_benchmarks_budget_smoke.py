"""The budget benchmark runs end to end at its smoke size, so it cannot rot (no timing asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT


def test_budget_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "budget.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "budget.py"), "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert results["smoke"] is True
    (trip,) = results["round_trip"]
    for key in (
        "host_over_floor",
        "host_pool_over_floor",
        "host_pool_cpu_restores_over_floor",
        "disk_over_torch_save_load",
        "copy_floor_ms_per_mib",
    ):
        assert trip[key] > 0
    assert trip["spool_files_left"] == 0  # every disk round trip released its handle
    (check,) = results["put_check"]
    assert check["leaves"] > 0
    assert check["check_over_walk"] >= 0
    robin = results["round_robin"]
    assert robin["kv_parks"] > 0  # the budget of two parked KV with the sessions
    assert robin["evictions"] == 0
    assert robin["prefetches"] > 0
    assert robin["prefetch_over_unbudgeted"] > 0
    (kv,) = results["kv_park"]
    assert kv["kv_over_floor"] > 0
