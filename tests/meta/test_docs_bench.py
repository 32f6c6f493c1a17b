"""The docs pages' generated tables are in their markdown sources, as the committed data gives.

`docs/gen_tables.py` writes each table between a begin and an end marker; these tests fail
when a committed page's table differs from what the committed report, size tables and plans
render, so a page cannot drift from its data (run `python docs/gen_tables.py` and commit).
"""

from __future__ import annotations

import doctest
import re
from types import ModuleType

import pytest

from tests.support import ROOT, load_module


def _tables() -> ModuleType:
    return load_module(ROOT / "docs" / "gen_tables.py", "gen_tables")


def test_the_report_is_embedded_without_its_title_and_one_level_down() -> None:
    tables = _tables()
    page = (
        "intro\n\n<!-- bench-report: ../benchmarks/results/latest.md -->\nstale\n"
        "<!-- end bench-report -->\n\nafter\n"
    )
    out = tables.fill(page)
    report = (ROOT / "benchmarks" / "results" / "latest.md").read_text(encoding="utf-8")
    assert "stale" not in out
    assert "# Benchmark results" not in out
    assert "### Targets" in out
    assert out.startswith("intro\n\n<!-- bench-report: ../benchmarks/results/latest.md -->\n\n")
    assert out.endswith("\n\n<!-- end bench-report -->\n\nafter\n")
    assert tables.fill(out) == out  # writing twice changes nothing
    titles = [line for line in report.splitlines() if line.startswith("## ")]
    assert titles
    assert all("#" + title in out for title in titles)


def test_the_performance_page_holds_the_committed_report() -> None:
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    paths = re.findall(r"<!--\s*bench-report:\s*(\S+)\s*-->", page)
    assert paths == ["../benchmarks/results/latest.md"]
    assert (ROOT / "docs" / paths[0]).resolve().is_file()
    assert "### Targets" in page  # in the source, readable without a site build
    assert "docs/gen_tables.py" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_every_generated_table_is_what_the_committed_data_gives() -> None:
    tables = _tables()
    names = {p.name for p in tables.pages()}
    assert {"performance.md", "budget.md", "models.md"} <= names
    stale = [p.name for p in tables.stale()]
    assert not stale, f"{stale}: run `python docs/gen_tables.py` and commit the pages"


def test_a_changed_table_is_found_stale_and_the_build_refuses_it() -> None:
    tables = _tables()
    page = (ROOT / "docs" / "budget.md").read_text(encoding="utf-8")
    edited = page.replace("| **sessions resident** |", "| **sessions resident (edited)** |", 1)
    assert edited != page
    assert tables.fill(edited) == page
    with pytest.raises(RuntimeError, match=re.escape("run `python docs/gen_tables.py`")):
        tables.on_page_markdown(edited)
    assert tables.on_page_markdown(page) == page


def test_the_table_writer_doctests() -> None:
    result = doctest.testmod(_tables())
    assert result.failed == 0
    assert result.attempted > 0
