"""``sessionstate serve-bench``: JSON per policy and rate; bad input refused before a run."""

from __future__ import annotations

import json

import pytest

from sessionstate.cli import main


def test_serve_bench_prints_every_policy_at_every_rate(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve-bench", "--rate", "0.05", "--rate", "0.1", "--duration", "60", "--json"]
    assert main([*argv, "--policy", "cap", "--policy", "schedule"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["clock"] == "simulated"
    assert out["shape"] == "lingbot"
    assert [(r["policy"], r["load"]["rate"]) for r in out["runs"]] == [
        ("cap", 0.05),
        ("cap", 0.1),
        ("schedule", 0.05),
        ("schedule", 0.1),
    ]
    assert all(0 <= r["metrics"]["attainment"] <= 1 for r in out["runs"])


@pytest.mark.parametrize("rate", ["0", "-1", "nan", "inf", "fast"])
def test_a_bad_rate_is_refused_before_anything_runs(
    rate: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve-bench", "--rate", rate]) == 2
    err = capsys.readouterr().err
    assert f"argument --rate: expected a positive finite number such as 0.5, got {rate!r}" in err


def test_an_impossible_step_is_refused_with_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-bench", "--rate", "0.1", "--step", "2.4"]) != 0
    err = capsys.readouterr().err
    assert "one session's step takes 2.4 s, longer than `chunk_period_s` 0.75 s" in err


def test_a_bad_bandwidth_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-bench", "--rate", "0.1", "--bandwidth", "0GB/s"]) == 2
    assert "`--bandwidth` must be a positive byte count per second" in capsys.readouterr().err


def test_the_policies_offered_are_the_librarys() -> None:
    from sessionstate.cli._serve import POLICY_HELP
    from sessionstate.serving import POLICIES

    assert POLICY_HELP == POLICIES


def test_a_piped_table_prints_every_header_whole(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve-bench", "--rate", "0.05", "--duration", "60", "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    for header in ("attainment", "chunk p99 s", "active mean", "prefetch hits /s"):
        assert header in out
    assert "…" not in out
