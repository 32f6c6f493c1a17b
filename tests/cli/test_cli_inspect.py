"""`sessionstate inspect`: a family file per session, one way of counting tensors, piped whole."""

from __future__ import annotations

import json
import re

import pytest

from sessionstate._storage import inspect_snapshot
from sessionstate.cli import main
from tests.support import DATA, run_cli

GOLDEN = DATA / "snapshots" / "0.1.0.dev0"


def test_a_family_file_is_shown_per_session_with_one_tensor_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = GOLDEN / "family_v4.safetensors"
    report = inspect_snapshot(path)
    ids = json.loads(report["metadata"]["session_ids"])
    rows = report["values"]
    assert [r["name"] for r in rows] == ids
    assert {r["bucket"] for r in rows} == {"session"}
    # One count, everywhere: references, K/V leaves' tensors included.
    assert sum(r["tensors"] for r in rows) == report["tensors"]
    assert report["root"] == f"list of {len(ids)} ({report['tensors']} tensors)"
    for r in rows:
        assert r["structure"].endswith(f"({r['tensors']} tensors)")
    assert report["views"] <= report["tensors"]
    # Each storage once, for the first session: the rows add up to the file's bytes.
    total: dict[str, int] = {}
    for r in rows:
        for device, n in r["nbytes"].items():
            total[device] = total.get(device, 0) + n
    assert total == report["nbytes"]
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert report["root"] in out
    assert f"{report['tensors']} references to {report['views']} views" in out
    for sid in ids:
        assert re.search(rf"│ {sid} +│ session", out), sid


def test_piped_tables_print_every_header_and_cell_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not a terminal: rich's default 80 columns cut headers and cells ("LatentBuffer(nam…").
    monkeypatch.delenv("COLUMNS", raising=False)
    path = GOLDEN / "dreamzero_keyed_v4.safetensors"
    run = run_cli("inspect", str(path))
    assert run.returncode == 0, run.stderr
    assert "…" not in run.stdout
    for header in ("value", "bucket", "structure", "tensors", "bytes"):
        assert re.search(rf"┃ {header} +┃", run.stdout), header
    for row in inspect_snapshot(path)["values"]:
        assert row["structure"] in run.stdout
