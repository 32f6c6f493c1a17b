"""``sessionstate ab --on-full refuse``: refusals counted per path, served sessions identical.

The two children of ``ab`` run in this process (`subprocess.Popen` replaced by a stand-in
that calls `main` under the child's environment), so the command line, the environment each
child gets and the comparison are all exercised without paying for two interpreter starts;
``tests/cli/test_cli.py`` runs the real processes once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest

from sessionstate import ENV_CHECK_IMMUTABLE, ENV_ENABLE, ENV_MAX_SESSIONS, ENV_ON_FULL
from sessionstate.cli import _print_ab, build_parser, main
from sessionstate.models.dreamzero import DreamZeroConfig
from sessionstate.models.dreamzero.episode import scripted_episode
from tests.support import torch_threads

STEPS, SESSIONS, CAP, SEED = 2, 3, 2, 4


class _InProcessChild:
    """Runs ``python -m sessionstate.cli ...`` as a call of `main`, under ``env``."""

    def __init__(self, cmd: Sequence[str], *, env: Mapping[str, str], **_: Any) -> None:
        assert list(cmd[:3]) == [sys.executable, "-m", "sessionstate.cli"]
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(env)
        try:
            self.returncode = main(list(cmd[3:]))
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.stderr: Iterator[str] = iter(())

    def wait(self) -> int:
        return self.returncode


def test_ab_with_refuse_reports_refusals_and_identical_served_sessions(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in (ENV_ENABLE, ENV_MAX_SESSIONS, ENV_CHECK_IMMUTABLE, ENV_ON_FULL):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(subprocess, "Popen", _InProcessChild)
    args = [
        "ab", "--preset", "tiny", "--steps", str(STEPS), "--sessions", str(SESSIONS),
        "--seed", str(SEED), "--max-sessions", str(CAP), "--on-full", "refuse", "--json",
    ]  # fmt: skip
    with torch_threads(1):
        status = main(args)
    captured = capsys.readouterr()
    assert status == 0, captured.err
    report = json.loads(captured.out)

    # The model: the first CAP distinct sessions are admitted and every step of the others is
    # refused, since nothing ends a session during the episode.
    order = [sid for sid, _ in scripted_episode(DreamZeroConfig.preset("tiny"), steps=STEPS,
                                               sessions=SESSIONS, seed=SEED)]  # fmt: skip
    admitted = list(dict.fromkeys(order))[:CAP]
    refused = sum(sid not in admitted for sid in order)
    served = len(order) - refused
    assert refused > 0

    assert report["identical"] is True
    assert report["first_mismatch"] is None
    assert report["on_full"] == "refuse"
    assert report["outputs_compared"] == 3 * served + 2 * CAP
    for name in ("bespoke", "managed"):
        path = report["paths"][name]
        assert path["refusals"] == refused, name
        assert path["sessions_held"] == CAP, name


def test_on_full_is_unset_unless_given() -> None:
    assert build_parser().parse_args(["ab"]).on_full is None
    assert build_parser().parse_args(["ab", "--on-full", "refuse"]).on_full == "refuse"


def test_the_table_shows_refused_steps(capsys: pytest.CaptureFixture[str]) -> None:
    path = {"median_step_ms": 1.0, "nbytes_by_device": {"cpu": 1024}, "sessions_held": 2}
    report = {
        "identical": True,
        "outputs_compared": 16,
        "first_mismatch": None,
        "steps": STEPS,
        "sessions": SESSIONS,
        "seed": SEED,
        "preset": "tiny",
        "on_full": "refuse",
        "paths": {"bespoke": {**path, "refusals": 7}, "managed": {**path, "refusals": 7}},
    }
    _print_ab(report)
    out = capsys.readouterr().out
    assert "refused steps" in out
    assert "preset tiny, on_full refuse)" in out
    assert out.count(" 7 ") == 2
