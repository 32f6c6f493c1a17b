"""The performance page embeds the committed benchmark report, which states what it measured."""

from __future__ import annotations

import importlib.util
import re

from tests.support import ROOT


def _hook() -> object:
    spec = importlib.util.spec_from_file_location("gen_bench", ROOT / "docs" / "gen_bench.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_report_is_embedded_without_its_title_and_one_level_down() -> None:
    hook = _hook()
    page = "intro\n\n<!-- bench-report: ../benchmarks/results/latest.md -->\n\nafter\n"
    out = hook.on_page_markdown(page)  # type: ignore[attr-defined]
    report = (ROOT / "benchmarks" / "results" / "latest.md").read_text(encoding="utf-8")
    assert "bench-report" not in out
    assert "# Benchmark results" not in out
    assert "### Targets" in out
    assert out.startswith("intro\n\n")
    assert out.endswith("\n\nafter\n")
    titles = [line for line in report.splitlines() if line.startswith("## ")]
    assert titles
    assert all("#" + title in out for title in titles)


def test_the_performance_page_embeds_the_committed_report() -> None:
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    paths = re.findall(r"<!--\s*bench-report:\s*(\S+)\s*-->", page)
    assert paths == ["../benchmarks/results/latest.md"]
    assert (ROOT / "docs" / paths[0]).resolve().is_file()
    assert "docs/gen_bench.py" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
