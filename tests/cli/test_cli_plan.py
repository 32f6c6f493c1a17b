"""`sessionstate plan`: its figures recomputed here from the size tables and the KV geometry.

The expected numbers are derived in each test from `size_table` and the DreamZero KV pool's
`handle_blocks` / `block_nbytes`, with a brute-force search for the resident count, never
copied from the command's output.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sessionstate import ENV_ENABLE, nbytes_by_device
from sessionstate.cli import main
from sessionstate.cli._common import fmt_at_least, fmt_bytes
from sessionstate.cli._plan import HOST_VALUES, capacity_plan
from tests.support import ROOT

DOCS = ROOT / "docs"
GIB = 1024**3
sys.path.insert(0, str(DOCS))
import gen_sizes  # noqa: E402  (docs/ is not a package)


def _plan_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    plan: dict[str, Any] = json.loads(capsys.readouterr().out)
    return plan


def _kv(model: str, preset: str) -> tuple[int, int] | None:
    if model != "dreamzero":
        return None
    from sessionstate.models.dreamzero import DreamZeroConfig
    from sessionstate.models.dreamzero.kv import block_nbytes, handle_blocks

    cfg = DreamZeroConfig.preset(preset)
    return block_nbytes(cfg), handle_blocks(cfg)


def _expected(
    table: dict[str, Any],
    host_values: set[str],
    kv: tuple[int, int] | None,
    *,
    device: int,
    host: int,
    bandwidth: float,
    reserved: int = 0,
) -> dict[str, Any]:
    """The plan recomputed: per-bucket sums, and the resident count by trying every one."""
    values = table["values"]
    by = {"engine": 0, "object": 0, "attrs": 0, "unparkable": 0}
    host_kept = 0
    for name, row in values.items():
        assert row["parkable"] == (row["bucket"] != "attrs" and name != "random_key")
        if name in host_values:
            host_kept += row["managed_nbytes"]
        elif row["parkable"] or row["bucket"] == "attrs":
            by[row["bucket"]] += row["managed_nbytes"]
        else:
            by["unparkable"] += row["managed_nbytes"]
    resident_bytes = by["engine"] + by["object"] + by["unparkable"] + by["attrs"]
    assert resident_bytes + host_kept == table["session_nbytes"]["managed"]  # nothing shared
    moved = by["engine"] + by["object"]
    stays = by["unparkable"] + by["attrs"]
    headroom = kv[0] * kv[1] - by["engine"] if kv else 0
    avail = device - reserved - headroom
    alone = min(avail // resident_bytes, host // host_kept if host_kept else avail)

    def parked(r: int) -> int:
        return (host - r * host_kept) // (moved + host_kept)

    best = max(
        (r for r in range(1, alone + 1) if r * resident_bytes + parked(r) * stays <= avail),
        default=1,
    )
    room = (avail - best * resident_bytes) // stays
    return {
        "kv": by["engine"],
        "parkable": by["object"],
        "attrs": by["attrs"],
        "unparkable": by["unparkable"],
        "stays": stays,
        "host_kept": host_kept,
        "resident_bytes": resident_bytes,
        "parked_host": moved + host_kept,
        "headroom": headroom,
        "alone": alone,
        "resident": best,
        "parked": min(parked(best), room),
        "swap_s": moved / bandwidth,
    }


def _check(plan: dict[str, Any], want: dict[str, Any]) -> None:
    s = plan["session"]
    got = {
        "kv": s["kv_nbytes"],
        "parkable": s["parkable_nbytes"],
        "attrs": s["attrs_nbytes"],
        "unparkable": s["unparkable_nbytes"],
        "stays": s["parked_device_nbytes"],
        "host_kept": s["host_kept_nbytes"],
        "resident_bytes": s["device_nbytes"],
        "parked_host": s["parked_host_nbytes"],
        "headroom": plan["step_headroom_nbytes"],
        "alone": plan["sessions_resident_without_parking"],
        "resident": plan["sessions_resident"],
        "parked": plan["sessions_parked"],
        "swap_s": plan["swap_in_s"],
    }
    assert got == pytest.approx(want)
    assert plan["sessions_total"] == want["resident"] + want["parked"]
    assert plan["swap_out_s"] == plan["swap_in_s"]
    assert plan["device_used_nbytes"] <= plan["device_nbytes"]
    assert plan["host_used_nbytes"] <= plan["host_nbytes"]
    assert s["parked_device_nbytes"] == want["attrs"] + want["unparkable"]


@pytest.fixture(scope="module")
def host_values() -> dict[str, set[str]]:
    """Per model, the values a tiny pipeline whose host device is ``meta`` keeps there."""
    from sessionstate.models._registry import get_model

    found = {}
    for model in ("dreamzero", "cosmos3"):
        spec = get_model(model)
        cfg = spec.config_from_dict({"preset": "tiny"})
        pipe = spec.pipeline.load()(
            cfg, device="cpu", host_device="meta", environ={ENV_ENABLE: "1"}
        )
        for sid, inputs in spec.episode(cfg, steps=3, sessions=1, seed=0):
            pipe.forward(inputs, sid)
        values = pipe.session_values("session-0")
        found[model] = {k for k, v in values.items() if "meta" in nbytes_by_device(v)}
    return found


def test_the_host_values_are_those_the_pipelines_keep_on_their_host_device(
    host_values: dict[str, set[str]],
) -> None:
    assert {k: set(v) for k, v in HOST_VALUES.items()} == host_values


@pytest.mark.parametrize(
    ("model", "steps", "device", "host"),
    [
        ("dreamzero", 3, 4 * 2**20, 16 * 2**20),
        ("dreamzero", 3, 8 * 2**20, 64 * 1024),  # the host limits residents
        ("cosmos3", 2, 64 * 1024, 2**20),
    ],
)
def test_tiny_plan_matches_the_size_table(
    model: str,
    steps: int,
    device: int,
    host: int,
    host_values: dict[str, set[str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sessionstate.cli._sizes import size_table

    table = size_table("tiny", steps, model=model)
    argv = ["--model", model, "--preset", "tiny", "--steps", str(steps)]
    argv += ["--device-bytes", str(device), "--host-bytes", str(host), "--bandwidth", "1MB/s"]
    plan = _plan_json(argv, capsys)
    want = _expected(
        table, host_values[model], _kv(model, "tiny"), device=device, host=host, bandwidth=1e6
    )
    _check(plan, want)
    if host < plan["session"]["parked_host_nbytes"]:
        assert plan["sessions_parked"] == 0
        assert plan["sessions_resident"] == host // plan["session"]["host_kept_nbytes"]


def test_deploy_dreamzero_plan_matches_the_size_table(
    host_values: dict[str, set[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    from sessionstate.cli._sizes import size_table

    table = size_table("deploy", 8)  # the 9-frame window is full after 8 steps
    argv = ["--preset", "deploy", "--steps", "8", "--device-bytes", "141GiB"]
    argv += ["--host-bytes", "1TiB", "--bandwidth", "25GiB/s", "--reserved-bytes", "30GB"]
    plan = _plan_json(argv, capsys)
    kv = _kv("dreamzero", "deploy")
    want = _expected(
        table,
        host_values["dreamzero"],
        kv,
        device=141 * GIB,
        host=2**40,
        bandwidth=25 * GIB,
        reserved=30 * 10**9,
    )
    _check(plan, want)
    assert kv is not None
    assert plan["kv_pool"]["blocks_held"] * kv[0] == want["kv"]
    assert plan["sessions_resident"] >= 1
    assert plan["sessions_parked"] > 0


@pytest.mark.parametrize("model", ["dreamzero", "cosmos3"])
@pytest.mark.parametrize("device", gen_sizes.PLAN_DEVICES)
def test_the_committed_docs_plans_are_what_plan_computes(
    model: str, device: str, host_values: dict[str, set[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    committed = json.loads(gen_sizes.plan_path(model, device).read_text(encoding="utf-8"))
    argv = gen_sizes.plan_argv(model, device)
    argv[argv.index("--sizes-json") + 1] = str(ROOT / argv[argv.index("--sizes-json") + 1])
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out) == committed
    table = json.loads(gen_sizes.PLAN_SIZES[model].read_text(encoding="utf-8"))
    want = _expected(
        table,
        host_values[model],
        _kv(model, "deploy"),
        device=int(device.removesuffix("GiB")) * GIB,
        host=2**40,
        bandwidth=50e9,
    )
    _check(committed, want)


def test_the_docs_render_the_committed_plans() -> None:
    page = (DOCS / "budget.md").read_text(encoding="utf-8")
    assert "<!-- plan-table:" in page  # written into the page by docs/gen_tables.py
    plan = gen_sizes.load_plan(gen_sizes.plan_path("dreamzero", "141GiB"))
    assert "| **sessions resident** | **" in page
    assert f"**{plan['sessions_parked']}**" in page


@pytest.mark.parametrize(
    ("d", "a", "h", "moved", "avail", "host"),
    [
        (14, 2, 0, 12, 100, 36),
        (10, 3, 1, 7, 1000, 100),
        (65, 7, 14, 58, 900, 5000),
        (20, 15, 0, 5, 100, 1000),  # parked attributes fill the device: one stays resident
        (10, 0, 0, 10, 95, 1000),
        (10, 10, 0, 0, 95, 1000),  # nothing to park
    ],
)
def test_the_resident_count_is_the_largest_that_fits_beside_the_parked(
    d: int, a: int, h: int, moved: int, avail: int, host: int
) -> None:
    values = {
        "kv": {"bucket": "engine", "managed_nbytes": moved // 2},
        "obj": {"bucket": "object", "managed_nbytes": moved - moved // 2},
        "a": {"bucket": "attrs", "managed_nbytes": a},
        "video_latents": {"bucket": "object", "managed_nbytes": h},
    }
    assert d == moved + a
    table = {"preset": "x", "steps": 1, "values": values, "session_nbytes": {"managed": d + h}}
    plan = capacity_plan(
        table, model="cosmos3", kv=None, device_nbytes=avail, host_nbytes=host, bandwidth=1.0
    )

    def parked(r: int) -> int:
        return (host - r * h) // (moved + h) if moved else 0

    alone = min(avail // d, host // h if h else avail)
    fits = [r for r in range(1, alone + 1) if r * d + parked(r) * a <= avail]
    resident = max(fits, default=1)
    room = (avail - resident * d) // a if a else parked(resident)
    assert (plan["sessions_resident"], plan["sessions_parked"]) == (
        resident,
        min(parked(resident), room),
    )
    assert plan["device_used_nbytes"] <= avail
    assert plan["host_used_nbytes"] <= host


def test_resident_pins_the_resident_count(capsys: pytest.CaptureFixture[str]) -> None:
    sizes = str(gen_sizes.COSMOS3_DATA)
    argv = ["--model", "cosmos3", "--sizes-json", sizes, "--device-bytes", "80GiB"]
    plan = _plan_json([*argv, "--host-bytes", "1TiB", "--resident", "1000"], capsys)
    s = plan["session"]
    room = (plan["available_nbytes"] - 1000 * s["device_nbytes"]) // s["attrs_nbytes"]
    by_host = (2**40 - 1000 * s["host_kept_nbytes"]) // s["parked_host_nbytes"]
    assert (plan["sessions_resident"], plan["sessions_parked"]) == (1000, min(room, by_host))
    assert main(["plan", *argv, "--host-bytes", "1TiB", "--resident", "99999"]) == 2
    err = capsys.readouterr().err
    assert f"more than the {plan['sessions_resident_without_parking']} sessions" in err


def test_the_table_shows_the_plan_and_its_assumption(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--sizes-json", str(gen_sizes.DEFAULT_DATA), "--device-bytes", "141GiB"]
    assert main([*argv, "--host-bytes", "1TiB"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in (
        "Capacity plan: DreamZero, preset deploy",
        "sessions resident",
        "sessions parked",
        "swap one session in / out at 50 GB/s",
        "Assumption: Parking moves a session's KV",
        "--reserved-bytes",
        "blocks",
    ):
        assert text in out, text


def test_a_device_too_small_says_the_bytes_one_session_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    table = json.loads(gen_sizes.DEFAULT_DATA.read_text(encoding="utf-8"))
    kv = _kv("dreamzero", "deploy")
    assert kv is not None
    need = sum(
        r["managed_nbytes"] for k, r in table["values"].items() if k not in HOST_VALUES["dreamzero"]
    )
    need += kv[0] * kv[1] - table["values"]["kv_cache"]["managed_nbytes"]
    argv = ["plan", "--sizes-json", str(gen_sizes.DEFAULT_DATA), "--host-bytes", "1TiB"]
    assert main([*argv, "--device-bytes", "8GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sessionstate plan: error: `--device-bytes 8.00 GiB`")
    assert f"needs {fmt_bytes(need)} on the device" in err
    assert f"pass --device-bytes of at least {fmt_at_least(need)}." in err
    assert main([*argv, "--device-bytes", "141GiB", "--reserved-bytes", "140GiB"]) == 2
    assert f"at least {fmt_at_least(need + 140 * GIB)}." in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--device-bytes", "lots"], "argument --device-bytes: expected a byte count"),
        (["--device-bytes", "0"], "argument --device-bytes: expected a positive byte count"),
        (["--host-bytes=-1GiB"], "argument --host-bytes: a size cannot be negative"),
        (["--bandwidth", "50GB"], "argument --bandwidth: `--bandwidth` must be a positive"),
        (["--bandwidth", "0GB/s"], "per second such as 50GB/s or 25GiB/s, got '0GB/s'"),
        (["--bandwidth", "fast/s"], "got 'fast/s'"),
        (["--host-bytes", "1MiB"], "`--host-bytes 1.00 MiB` is less than the"),
        (["--steps", "3"], "`--steps` and `--sizes-json` exclude each other"),
        (["--model", "cosmos3"], "pass `--model dreamzero --preset deploy`"),
        (["--preset", "tiny"], "pass `--model dreamzero --preset deploy`"),
    ],
)
def test_bad_input_is_one_line_naming_the_value_and_the_fix(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--sizes-json", str(gen_sizes.DEFAULT_DATA)]
    argv += ["--device-bytes", "141GiB", "--host-bytes", "1TiB", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("sessionstate plan: error: "), err
    assert err.count("\n") == 1, err
    assert message in err, err


def test_a_sizes_file_that_is_not_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "x.json"
    for text, message in (("{", "cannot be read as JSON"), ("[]", "is not `sessionstate sizes")):
        bad.write_text(text, encoding="utf-8")
        argv = ["plan", "--sizes-json", str(bad), "--device-bytes", "1GiB", "--host-bytes", "0"]
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_plan_help_does_not_import_torch() -> None:
    code = (
        "import contextlib, io, json, sys\n"
        "from sessionstate.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        "    status = main(['plan', '--help'])\n"
        "print(json.dumps([status, 'torch' in sys.modules, '--device-bytes' in out.getvalue()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [0, False, True]


@pytest.mark.parametrize(("model", "steps"), [("dreamzero", 3), ("cosmos3", 2)])
def test_the_plan_counts_a_budgeted_managers_parked_session_exactly(
    model: str, steps: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A parked session holds on the device what the plan says, and on its tier the rest.

    The plan is arithmetic over the size table; this runs the tiny pipeline for real under a
    budget that holds one session, so the other is parked, and reads the manager's own
    figures. The 16-byte random key is not parkable: it stays with the attributes.
    """
    from sessionstate import ENV_MAX_BYTES
    from sessionstate.models._registry import get_model

    argv = ["--model", model, "--preset", "tiny", "--steps", str(steps)]
    argv += ["--device-bytes", "64MiB", "--host-bytes", "64MiB", "--bandwidth", "1MB/s"]
    s = _plan_json(argv, capsys)["session"]
    one = s["device_nbytes"] + s["host_kept_nbytes"]  # all on cpu here
    spec = get_model(model)
    cfg = spec.config_from_dict({"preset": "tiny"})
    env = {ENV_ENABLE: "1", ENV_MAX_BYTES: f"cpu={one * 3 // 2}"}
    pipe = spec.pipeline.load()(cfg, device="cpu", environ=env)
    episode = spec.episode(cfg, steps=steps, sessions=2, seed=0, prompt_change_every=steps + 1)
    for sid, inputs in episode:
        pipe.forward(inputs, sid)
    parked, resident = (pipe.session_stats(sid) for sid in pipe.session_ids())
    assert not parked["resident"]
    assert resident["resident"]
    assert resident["nbytes"] == {"cpu": one}
    assert parked["nbytes"] == {"cpu": s["parked_device_nbytes"]}
    assert parked["nbytes_parked"] == {"host": s["parked_host_nbytes"]}
    assert s["unparkable_nbytes"] == 16  # the random key
