"""One byte format in every table the command prints: two decimals in the unit the count fills."""

from __future__ import annotations

import json
import re

import pytest

from sessionstate.cli import main
from sessionstate.cli._common import fmt_at_least, fmt_bytes

_BYTES = re.compile(r"^(\d+ B|\d+\.\d\d [KMGT]iB|-)$")


def _cells(out: str) -> list[list[str]]:
    """The cells of each body row of the rich tables in ``out``."""
    return [
        [cell.strip() for cell in line.strip("│").split("│")]
        for line in out.splitlines()
        if line.startswith("│")
    ]


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (18_432, "18.00 KiB"),
        (2_883_584, "2.75 MiB"),
        (6 * 2**30, "6.00 GiB"),
        (6_487_998_464, "6.04 GiB"),  # `sizes` printed it as 6187.5000 MiB
        (3 * 2**40, "3.00 TiB"),
    ],
)
def test_a_byte_count_is_two_decimals_in_the_largest_unit_it_fills(n: int, text: str) -> None:
    assert fmt_bytes(n) == text


@pytest.mark.parametrize("n", [1, 1023, 1024, 6_487_998_464, 2**40 + 1])
def test_a_least_figure_is_never_below_the_count(n: int) -> None:
    from sessionstate._manager import parse_nbytes

    assert parse_nbytes(fmt_at_least(n)) >= n


def test_demo_prints_every_byte_stat_in_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--sessions", "2", "--steps", "2"]) == 0
    rows = _cells(capsys.readouterr().out)
    stats = {row[0]: row[1] for row in rows if len(row) == 2}
    assert "engine_nbytes:cpu" in stats
    for key, value in stats.items():
        if "nbytes" in key:
            assert _BYTES.match(value), (key, value)
            assert value.endswith("iB"), (key, value)  # no raw byte count beside MiB


def test_sizes_prints_the_json_figures_in_the_one_format(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["sizes", "--preset", "tiny", "--steps", "2"]
    assert main([*argv, "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    rows = {row[0]: row for row in _cells(capsys.readouterr().out)}
    for name, value in table["values"].items():
        assert rows[name][2:] == [
            fmt_bytes(value["managed_nbytes"], zero="-"),
            fmt_bytes(value["bespoke_nbytes"], zero="-"),
        ]
    many = table["sessions_64_nbytes"]
    sixty_four = next(row for key, row in rows.items() if key.endswith(" sessions"))
    assert sixty_four[2:] == [fmt_bytes(many["managed"]), fmt_bytes(many["bespoke"])]
