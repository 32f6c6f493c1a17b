"""Every notebook in ``notebooks/`` is run and checked, including those added after the first three.

``tests/meta/test_notebooks.py`` runs the notebooks it names; this module runs every other
``notebooks/NN_name.ipynb`` through the same two checks (it executes without error, prints
what its committed outputs show and ends with "all checks passed"; it is the jupytext pairing
of its ``.py`` source, committed executed), so a new notebook cannot go unrun.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import ROOT, load_module

NOTEBOOKS = ROOT / "notebooks"


# Loaded under a private name, so pytest does not collect its tests a second time here.
_checks = load_module(Path(__file__).with_name("test_notebooks.py"), "_notebook_checks")
ALL = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
OTHERS = [name for name in ALL if name not in _checks.NAMES]


def test_every_notebook_has_a_source_and_is_run_by_one_of_the_two_modules() -> None:
    assert {"04_budget.ipynb", "05_snapshots.ipynb", "06_planning.ipynb"} <= set(OTHERS)
    assert sorted([*_checks.NAMES, *OTHERS]) == ALL
    for name in ALL:
        assert (NOTEBOOKS / name).with_suffix(".py").is_file(), f"{name} has no .py source"


@pytest.mark.parametrize("name", OTHERS)
def test_notebook_executes_without_error(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _checks.test_notebook_executes_without_error(name, monkeypatch, tmp_path)


@pytest.mark.parametrize("name", OTHERS)
def test_notebook_is_the_pairing_of_its_source_and_is_committed_executed(name: str) -> None:
    _checks.test_notebook_is_the_pairing_of_its_source_and_is_committed_executed(name)
