"""The command line's front door: ``python -m``, a light and plain ``--help``, missing extras."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sessionstate import DEFAULT_MAX_SESSIONS, ENV_ENABLE
from sessionstate.cli import _ab, build_parser, main
from sessionstate.cli._ab import _print_ab, deploy_on_cpu_warning, episode_command

REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_python_dash_m_sessionstate_prints_plain_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sessionstate", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: sessionstate ")
    for command in ("ab", "sizes", "demo", "inspect", "cluster"):
        assert f"\n    {command} " in done.stdout, command
    assert "``" not in done.stdout  # no raw reST
    assert "_episode" not in done.stdout


@pytest.mark.parametrize("argv", [["--help"], ["ab", "--help"], ["sizes", "--help"]])
def test_help_does_not_import_torch(argv: list[str]) -> None:
    code = (
        "import contextlib, io, json, sys\n"
        "from sessionstate.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    status = main({argv!r})\n"
        "print(json.dumps([status, 'torch' in sys.modules]))\n"
    )
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [0, False]


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ab", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "steps per session (default: 24)" in text
    assert "(default: cpu)" in text
    assert "sessionstate.DEFAULT_MAX_SESSIONS" in text
    assert f"{ENV_ENABLE}=0/1" in text


def test_the_internal_episode_command_is_not_offered(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["nope"]) == 2
    assert capsys.readouterr().err == (
        "sessionstate: error: argument {ab,sizes,demo,inspect,cluster}: invalid choice: 'nope' "
        "(choose from 'ab', 'sizes', 'demo', 'inspect', 'cluster') (see `sessionstate --help`)\n"
    )


def test_ab_without_the_models_extra_is_one_line() -> None:
    # `sys.modules[name] = None` makes `import name` fail as if it were not installed.
    code = (
        "import sys\n"
        "sys.modules['diffusers'] = None\n"
        "from sessionstate.cli import main\n"
        "raise SystemExit(main(['ab', '--json']))\n"
    )
    done = _python(code)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "sessionstate ab: error: `sessionstate ab` needs diffusers, which is not installed; "
        'install the `models` extra: pip install "sessionstate[models]" '
        '(from a clone: pip install -e ".[models]").'
    ]


def test_an_unrelated_missing_module_still_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: argparse.Namespace) -> int:
        raise ModuleNotFoundError("No module named 'nowhere'", name="nowhere")

    monkeypatch.setattr(_ab, "_cmd_ab", broken)
    with pytest.raises(ModuleNotFoundError, match=re.escape("No module named 'nowhere'")):
        main(["ab"])


def test_deploy_on_cpu_warns_before_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spawned: list[argparse.Namespace] = []

    def stop(args: argparse.Namespace, *rest: Any) -> None:
        spawned.append(args)
        raise RuntimeError("stopped before the children")

    monkeypatch.setattr(_ab, "_spawn", stop)
    config = str(REPO / "configs" / "dreamzero-deploy.yaml")
    assert main(["ab", "--config", config, "--json"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "sessionstate ab: warning: the deploy geometry runs minutes per step on CPU; pass "
        "`--device cuda` on a machine with a GPU, or `--preset tiny` for a quick check.",
        "sessionstate ab: error: stopped before the children",
    ]
    assert spawned[0].max_sessions == DEFAULT_MAX_SESSIONS  # the cap when none is given
    assert deploy_on_cpu_warning("deploy", "cuda:0") is None
    assert deploy_on_cpu_warning("tiny", "cpu") is None


def test_device_reaches_both_children(tmp_path: Path) -> None:
    args = build_parser().parse_args(["ab", "--device", "meta"])
    args.max_sessions = DEFAULT_MAX_SESSIONS
    cmd = episode_command(args, tmp_path / "out.pt")
    assert cmd[:4] == [sys.executable, "-m", "sessionstate.cli", "_episode"]
    assert cmd[cmd.index("--device") + 1] == "meta"
    child = _ab.episode_parser().parse_args(cmd[4:])
    assert (child.device, child.max_sessions) == ("meta", DEFAULT_MAX_SESSIONS)
    assert "--device" not in episode_command(build_parser().parse_args(["ab"]), tmp_path)


def test_the_ab_table_says_what_is_counted(capsys: pytest.CaptureFixture[str]) -> None:
    path = {"median_step_ms": 1.0, "nbytes_by_device": {"cpu": 1024}, "sessions_held": 2}
    report = {
        "identical": True,
        "outputs_compared": 16,
        "first_mismatch": None,
        "steps": 2,
        "sessions": 2,
        "seed": 0,
        "preset": "tiny",
        "paths": {"bespoke": path, "managed": path},
    }
    _print_ab(report)
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "outputs compared: per served step actions, video, reset reason; per session at the "
        "end latents, decoded" in text
    )
    assert (
        "median step: wall clock over 4 steps per path, one run each; a short run's median "
        "is noisy" in text
    )


def test_sizes_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sizes", "--preset", "tiny", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "One DreamZero session, preset tiny, after 2 steps (meta)" in out
    assert f"{DEFAULT_MAX_SESSIONS} sessions" in out
