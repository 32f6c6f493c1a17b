"""What the command says about its arguments before it runs: one line, the help to read, a fix."""

from __future__ import annotations

import pytest

from sessionstate.cli import _sizes as sizes_module
from sessionstate.cli import build_parser, main

_PLAN = ["plan", "--host-bytes", "1TiB"]


@pytest.fixture
def no_sizing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan that sizes a session fails the test: these answers need no sizing."""

    def sized(*args: object, **kwargs: object) -> None:
        raise AssertionError("the plan sized a session before checking its arguments")

    monkeypatch.setattr(sizes_module, "_sized", sized)


@pytest.mark.usefixtures("no_sizing")
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--device-bytes", "1KB"],
            "`--device-bytes 1000 B` less `--reserved-bytes 0 B` leaves 1000 B, but one "
            "DreamZero session at preset deploy needs at least 8.06 GiB on the device for its "
            "KV alone (12 blocks of 687.50 MiB: its window and one step's new blocks); pass "
            "--device-bytes of at least 8.06GiB.",
        ),
        (
            ["--device-bytes", "80GiB", "--reserved-bytes", "90GiB"],
            "`--reserved-bytes 90.00 GiB` leaves nothing of `--device-bytes 80.00 GiB` for "
            "sessions; pass --reserved-bytes below 80.00 GiB, or the device's memory as "
            "--device-bytes.",
        ),
        (
            ["--model", "cosmos3", "--device-bytes", "80GiB", "--reserved-bytes", "80GiB"],
            "`--reserved-bytes 80.00 GiB` leaves nothing of `--device-bytes 80.00 GiB`",
        ),
    ],
)
def test_plan_refuses_what_no_session_fits_before_sizing_one(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*_PLAN, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sessionstate plan: error: {message}"), err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [*_PLAN, "--device-bytes", "-5GiB"],
            "sessionstate plan: error: argument --device-bytes: a size cannot be negative, got "
            "'-5GiB'; pass one such as 141GiB (see `sessionstate plan --help`)\n",
        ),
        (
            ["ab", "--max-bytes", "-1GiB"],
            "sessionstate ab: error: argument --max-bytes: a size cannot be negative, got "
            "'-1GiB'; pass one such as 24GiB (see `sessionstate ab --help`)\n",
        ),
        (
            [*_PLAN, "--device-bytes", "80GiB", "--bandwith", "60GB/s"],
            "sessionstate plan: error: unrecognized arguments: --bandwith 60GB/s; did you mean "
            "`--bandwidth`? (see `sessionstate plan --help`)\n",
        ),
        (
            ["sizes", "--preset=tiny", "--stepss=2"],
            "sessionstate sizes: error: unrecognized arguments: --stepss=2; did you mean "
            "`--steps`? (see `sessionstate sizes --help`)\n",
        ),
        (
            ["demo", "--zzz"],
            "sessionstate demo: error: unrecognized arguments: --zzz (see "
            "`sessionstate demo --help`)\n",
        ),
    ],
)
def test_an_argument_error_names_the_subcommands_help_and_the_fix(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err == message


def test_a_negative_number_is_still_a_value() -> None:
    args = build_parser().parse_args(["ab", "--seed", "-3", "--steps", "2"])
    assert (args.seed, args.steps) == (-3, 2)


def test_the_help_of_ab_and_sizes_names_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    from sessionstate.models._registry import MODELS

    assert main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for command, following in (("ab", "sizes"), ("sizes", "plan")):
        entry = text.split(f" {command} ", 1)[1].split(f" {following} ", 1)[0]
        for spec in MODELS.values():
            assert spec.title in entry, (command, entry)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("2MiB", 2 * 2**20),
        ("cpu=2MiB", {"cpu": 2 * 2**20}),
        ("cuda:0=1GiB, cpu=2MiB", {"cuda:0": 2**30, "cpu": 2 * 2**20}),
    ],
)
def test_ab_takes_a_budget_in_both_forms_the_environment_takes(
    text: str, want: int | dict[str, int]
) -> None:
    from pathlib import Path

    from sessionstate._config import parse_max_bytes
    from sessionstate.cli._ab import episode_command, episode_parser

    args = build_parser().parse_args(["ab", "--max-sessions", "4", "--max-bytes", text])
    assert args.max_bytes == want == parse_max_bytes(text)  # the environment's reading
    # Each path's child reads the same budget back.
    cmd = episode_command(args, Path("out.pt"))
    child = episode_parser().parse_args(cmd[cmd.index("_episode") + 1 :])
    assert child.max_bytes == want
