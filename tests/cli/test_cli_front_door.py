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
from tests.support import ROOT


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
    for command in ("ab", "sizes", "plan", "demo", "inspect", "cluster"):
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
        "sessionstate: error: argument {ab,sizes,plan,rollout,demo,inspect,cluster,serve-bench}: "
        "invalid choice: 'nope' (choose from 'ab', 'sizes', 'plan', 'rollout', 'demo', "
        "'inspect', 'cluster', 'serve-bench') (see "
        "`sessionstate --help`)\n"
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
        'install the `models` extra from your clone: pip install -e ".[models]" '
        "(no release is on PyPI yet)."
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
    config = str(ROOT / "configs" / "dreamzero-deploy.yaml")
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
    # A short run's step time is noise: the table shows counters, `--json` has the time.
    assert "median" not in text


def test_the_ab_table_shows_each_paths_counters(capsys: pytest.CaptureFixture[str]) -> None:
    def path(**counts: int) -> dict[str, object]:
        return {"nbytes_by_device": {"cpu": 1024}, "sessions_held": 2, **counts}

    report = {
        "identical": True,
        "outputs_compared": 16,
        "first_mismatch": None,
        "steps": 2,
        "sessions": 2,
        "seed": 0,
        "preset": "tiny",
        "paths": {
            "bespoke": path(evictions=3, parks=0, unparks=0),
            "managed": path(evictions=0, parks=11, unparks=9),
        },
    }
    _print_ab(report)
    rows = [line.split("│") for line in capsys.readouterr().out.splitlines() if "│" in line]
    cells = {row[1].strip(): [c.strip() for c in row[2:-1]] for row in rows}
    assert cells["bespoke"][-3:] == ["3", "0", "0"]
    assert cells["managed"][-3:] == ["0", "11", "9"]


def test_a_device_torch_cannot_use_is_one_line_before_any_child(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch

    assert main(["ab", "--device", "banana"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "sessionstate ab: error: `--device` must name a torch device such as cpu, cuda or "
        "cuda:1, got 'banana'.\n"
    )
    if not torch.cuda.is_available():
        assert main(["ab", "--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "`--device cuda` needs a CUDA GPU" in err
        assert "pass `--device cpu`" in err


def test_version_is_the_installed_distributions(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"sessionstate {version('sessionstate')}\n"


def test_sizes_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sizes", "--preset", "tiny", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "One DreamZero session, preset tiny, after 2 steps (meta)" in out
    assert f"{DEFAULT_MAX_SESSIONS} sessions" in out


def test_ctrl_c_is_one_line_and_exit_130_with_no_child_left() -> None:
    import signal
    import time

    import psutil

    proc = subprocess.Popen(
        [sys.executable, "-m", "sessionstate.cli", "ab", "--steps", "50", "--seed", "7"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    children: list[psutil.Process] = []
    while not children and time.monotonic() < deadline:
        children = [c for c in parent.children(recursive=True) if "_episode" in c.cmdline()]
        time.sleep(0.2)
    assert children, "ab never started its first child"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "sessionstate ab: interrupted"
    assert "Traceback" not in err
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"children left running: {alive}"


def test_a_budget_refusal_on_the_managed_path_only_is_named_as_the_budget() -> None:
    reason = (
        "Cannot store session 'session-0': its record holds 1100000 bytes on cpu, more than "
        "the whole budget of 1000000 bytes there (`max_bytes`)."
    )
    served = {"session": "session-0", "reset": None}
    results: dict[str, Any] = {
        "bespoke": {"records": [served, served]},
        "managed": {
            "records": [served, {"session": "session-0", "refused": True, "reason": reason}]
        },
    }
    assert _ab.budget_refusal(results) == f"step 1 (session-0): {reason}"
    # A cap refusal (no `max_bytes` in it) on one path only stays a mismatch.
    cap = {"session": "session-0", "refused": True, "reason": "the cap of 2 sessions is full"}
    results["managed"]["records"][1] = cap
    assert _ab.budget_refusal(results) is None


def test_demo_saves_a_session_that_inspect_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from sessionstate.models.dreamzero.state import BUCKETS

    path = tmp_path / "session.safetensors"
    argv = ["demo", "--sessions", "2", "--steps", "2", "--json", "--save", str(path)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["saved"] == str(path)
    assert report["stats"]["sessions"] == 2
    # The buckets are the reference table's, the one `sizes` and the Models page use.
    buckets = {name: row["bucket"] for name, row in report["values"].items()}
    assert buckets == {name: BUCKETS[name] for name in buckets}
    assert buckets["kv_cache"] == "engine"
    assert buckets["vae_enc_feat_map"] == "object"
    assert main(["inspect", str(path)]) == 0
    assert report["largest_session"] in capsys.readouterr().out


def test_demo_runs_cosmos3_with_its_own_buckets(capsys: pytest.CaptureFixture[str]) -> None:
    from sessionstate.models.cosmos3.state import BUCKETS

    assert main(["demo", "--model", "cosmos3", "--sessions", "2", "--steps", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "cosmos3"
    assert report["stats"]["sessions"] == 2
    buckets = {name: row["bucket"] for name, row in report["values"].items()}
    assert buckets == {name: BUCKETS[name] for name in BUCKETS}
    assert buckets["text_kv"] == "object"


def test_evictions_the_budget_adds_on_the_managed_path_are_counted() -> None:
    results: dict[str, Any] = {
        "bespoke": {"stats": {"evictions": 1}},
        "managed": {"stats": {"evictions": 4}},
    }
    assert _ab.budget_evictions(results) == 3
    results["managed"]["stats"]["evictions"] = 1
    assert _ab.budget_evictions(results) == 0
