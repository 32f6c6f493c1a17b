"""The snapshot benchmark runs end to end at the tiny preset's shapes, so it cannot rot.

No timing is asserted: the smoke run only has to measure every method and judge the target.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from tests.support import ROOT

BENCHMARK = ROOT / "benchmarks" / "snapshot.py"
METHODS = (
    "snapshot_save",
    "snapshot_load",
    "snapshot_file",
    "torch_save",
    "torch_load",
    "torch_file",
    "snapshot_bytes",
    "torch_bytes",
    "raw_copy",
)


def test_smoke_run_measures_every_method(tmp_path: Path) -> None:
    out = tmp_path / "snapshot.json"
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
    results = json.loads(out.read_text())
    assert results["smoke"] is True
    assert results["bit_identical"] is True
    assert results["record"]["tensors"] == results["record"]["storages"] > 0
    for method in METHODS:
        value = results["ms_per_mib"][method]
        assert math.isfinite(value), method
        assert value > 0, method
    assert isinstance(results["target"]["met"], bool)
    assert "| snapshot_file_over_torch_file |" in out.with_suffix(".md").read_text()
