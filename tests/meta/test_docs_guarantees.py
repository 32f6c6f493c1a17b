"""Every test the guarantees page names exists, so a renamed or deleted test cannot leave a
guarantee pointing at nothing."""

from __future__ import annotations

import re

from tests.support import ROOT

PAGE = ROOT / "docs" / "guarantees.md"


def _named_tests() -> list[tuple[str, str | None]]:
    # A cell names `tests/file.py`, `tests/file.py::test_x`, or `::test_y` in the same file as
    # the cell before it.
    named: list[tuple[str, str | None]] = []
    current: str | None = None
    for cell in re.findall(r"`([^`]+)`", PAGE.read_text(encoding="utf-8")):
        full = re.fullmatch(r"(tests/[\w/]+\.py)(?:::(\w+)[*]?)?", cell)
        if full:
            current = full.group(1)
            named.append((current, full.group(2)))
            continue
        same = re.fullmatch(r"::(test_\w+)[*]?", cell)
        if same and current is not None:
            named.append((current, same.group(1)))
    return named


def test_the_page_names_tests() -> None:
    assert len(_named_tests()) > 50


def test_every_test_the_guarantees_page_names_exists() -> None:
    missing = []
    for path, name in _named_tests():
        file = ROOT / path
        if not file.is_file():
            missing.append(path)
        elif name is not None and name.rstrip("_") not in file.read_text(encoding="utf-8"):
            missing.append(f"{path}::{name}")
    assert not missing, f"docs/guarantees.md names tests that do not exist: {missing}"
