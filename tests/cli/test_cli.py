"""The ``sessionstate`` command line: ``ab`` end to end (once), argument errors, size tables.

``ab`` spawns two child processes that each import torch and diffusers, so it is run once,
in a module fixture. The children get ``OMP_NUM_THREADS=1`` (both paths alike): the tiny
preset is thousands of small ops, which two contending threads only slow down.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sessionstate.cli import main, size_table
from sessionstate.models.dreamzero import BUCKETS, FRAMES_PER_CHUNK, DreamZeroConfig
from tests.support import run_cli

MIB = 1024 * 1024
AB_ARGS = ["ab", "--preset", "tiny", "--steps", "6", "--sessions", "2", "--seed", "5", "--json"]


@pytest.fixture(scope="module")
def ab_run() -> subprocess.CompletedProcess[str]:
    return run_cli(*AB_ARGS, timeout=600)


def test_ab_reports_identical_paths(ab_run: subprocess.CompletedProcess[str]) -> None:
    assert ab_run.returncode == 0, ab_run.stderr
    assert "Traceback" not in ab_run.stderr
    report = json.loads(ab_run.stdout)
    assert report["identical"] is True
    assert report["first_mismatch"] is None
    steps, sessions = 6, 2
    assert (report["steps"], report["sessions"], report["seed"]) == (steps, sessions, 5)
    assert report["preset"] == "tiny"
    # Per step: actions, video latents, reset reason; per session: latents and decoded video.
    assert report["outputs_compared"] == 3 * steps * sessions + 2 * sessions
    paths = report["paths"]
    assert set(paths) == {"bespoke", "managed"}
    for name, path in paths.items():
        assert isinstance(path["median_step_ms"], float), name
        assert path["median_step_ms"] > 0, name
        held = path["nbytes_by_device"]
        assert set(held) == {"cpu"}, name
        assert isinstance(held["cpu"], int)
        assert held["cpu"] > 0
        assert path["sessions_held"] == sessions
    # The managed ring never holds more than the bespoke history.
    assert (
        paths["managed"]["nbytes_by_device"]["cpu"] <= paths["bespoke"]["nbytes_by_device"]["cpu"]
    )


_BAD = {
    "steps-0": (
        ["ab", "--steps", "0"],
        "sessionstate ab: error: argument --steps: expected a positive int, got 0 "
        "(see `sessionstate ab --help`)",
    ),
    "preset-huge": (
        ["ab", "--preset", "huge"],
        "sessionstate ab: error: argument --preset: invalid choice: 'huge' (choose from "
        "'tiny', 'deploy') (see `sessionstate ab --help`)",
    ),
}


@pytest.mark.parametrize("case", list(_BAD))
def test_bad_arguments_give_one_line_and_exit_2(
    case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, line = _BAD[case]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == line + "\n"


def test_bad_arguments_from_the_shell() -> None:
    done = run_cli("ab", "--steps", "0", timeout=120)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [_BAD["steps-0"][1]]


def test_missing_config_is_one_line_before_any_child_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing.yaml"
    assert main(["ab", "--config", str(missing), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"sessionstate ab: error: [Errno 2] No such file or directory: '{missing}'\n"
    )


# ---------------------------------------------------------------------------------------------
# size_table
# ---------------------------------------------------------------------------------------------


def _frame_bytes(cfg: DreamZeroConfig) -> int:
    # One pre-quant encoder output frame: 2 * z_dim channels at the latent geometry.
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.dtype]
    return 2 * cfg.vae_z_dim * cfg.latent_height * cfg.latent_width * itemsize


def _check_table(
    table: dict[str, Any], cfg: DreamZeroConfig, steps: int, stitched_frames: int
) -> None:
    values = table["values"]
    assert list(values) == list(BUCKETS)
    assert {k: v["bucket"] for k, v in values.items()} == BUCKETS
    assert table["vae_enc_feat_map_tensors"] == 24
    latent_frames = 1 + (steps - 1) // 4  # the seed frame + one per 4-frame body chunk
    frame = _frame_bytes(cfg)
    enc = values["vae_encoder_out"]
    assert enc["bespoke_nbytes"] == latent_frames * frame
    assert enc["managed_nbytes"] == min(latent_frames, cfg.num_frame_per_block) * frame
    for name, row in values.items():
        if name != "vae_encoder_out":
            assert row["managed_nbytes"] == row["bespoke_nbytes"], name
    totals = table["session_nbytes"]
    assert totals["bespoke"] - totals["managed"] == enc["bespoke_nbytes"] - enc["managed_nbytes"]
    assert table["sessions_64_nbytes"] == {k: 64 * v for k, v in totals.items()}
    stitched = stitched_frames * cfg.canvas_height * cfg.canvas_width * 3  # uint8
    assert values["stitched_buffer"]["managed_nbytes"] == stitched


def test_size_table_tiny() -> None:
    cfg = DreamZeroConfig.preset("tiny")
    table = size_table("tiny", 9)
    assert (table["preset"], table["steps"]) == ("tiny", 9)
    # Windows of 4 steps (local_attn_size 9): step 9 starts a window with one stitched frame.
    _check_table(table, cfg, 9, stitched_frames=1)
    assert _frame_bytes(cfg) == 32 * 4 * 8 * 4


def test_size_table_deploy_on_meta() -> None:
    cfg = DreamZeroConfig.preset("deploy")
    table = size_table("deploy", 9)
    _check_table(table, cfg, 9, stitched_frames=FRAMES_PER_CHUNK)  # no window rollover
    frame = 32 * 44 * 80 * 2  # channels x latent h x latent w x bf16 bytes
    assert frame == _frame_bytes(cfg) == 225280
    values = table["values"]
    feat = values["vae_enc_feat_map"]["managed_nbytes"]
    assert feat == values["vae_enc_feat_map"]["bespoke_nbytes"] == 632586240
    assert feat / MIB == 603.28125
    assert values["vae_encoder_out"]["managed_nbytes"] == 2 * frame  # the ring: 0.43 MiB
    assert values["vae_encoder_out"]["bespoke_nbytes"] == 3 * frame  # 1 seed + 2 body chunks
    managed = table["session_nbytes"]["managed"]
    assert table["sessions_64_nbytes"]["managed"] == 64 * managed
    # The documented 37.7 GiB for 64 sessions is the feature cache alone.
    assert round(64 * feat / 1024**3, 1) == 37.7


def test_ab_trace_writes_both_paths_with_the_librarys_ranges(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    run = run_cli(
        "ab", "--preset", "tiny", "--steps", "2", "--sessions", "3", "--max-bytes", "1300000",
        "--park-tier", "host", "--prefetch", "--trace", str(trace), "--json",
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["identical"] is True
    events = json.loads(trace.read_text())["traceEvents"]
    processes = {
        e["args"]["name"]: e["pid"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name" and "path" in e["args"]["name"]
    }
    assert set(processes) == {"bespoke path", "managed path"}

    def ranges(path: str) -> set[str]:
        pid = processes[path]
        return {e["name"].split(" ")[0] for e in events if e.get("pid") == pid and "name" in e}

    assert "step" in ranges("bespoke path")  # every step of both paths, per session
    assert not {n for n in ranges("bespoke path") if n.startswith("sessionstate::")}
    library = {"sessionstate::step", "sessionstate::park", "sessionstate::unpark"}
    assert library | {"step", "sessionstate::prefetch"} <= ranges("managed path")
    # The prefetch worker's background restores sit on a track of their own, named for it.
    pid = processes["managed path"]
    named = {
        e["tid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") == pid
    }
    workers = {tid for tid, name in named.items() if name == "sessionstate-prefetch"}
    assert len(workers) == 1
    by_tid: dict[Any, set[str]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") == pid:
            by_tid.setdefault(e["tid"], set()).add(e["name"])
    (worker,) = workers
    steps = {tid for tid, names in by_tid.items() if "sessionstate::step" in names}
    assert worker not in steps
    assert {"aten::copy_", "aten::empty_strided"} & by_tid[worker]  # the restore's copies
