"""MkDocs hook: the performance page shows the committed benchmark report, as it was written.

A page line ``<!-- bench-report: ../benchmarks/results/latest.md -->`` is replaced by that
report (written by ``benchmarks/run.py``, or re-rendered from its JSON by
``benchmarks/report.py``), its title dropped and its headings one level down, so the page's
tables are always the committed run's and carry its commit, date, machine and load.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

MARKER = re.compile(r"<!--\s*bench-report:\s*(?P<path>\S+)\s*-->")
DOCS = Path(__file__).resolve().parent


def embed(report: str) -> str:
    """``report`` without its ``#`` title, every heading one level deeper.

    >>> embed("# Benchmark results\\n\\nMeasured.\\n\\n## Targets\\n")
    'Measured.\\n\\n### Targets\\n'
    """
    lines = report.splitlines(keepends=True)
    if lines and lines[0].startswith("# "):
        lines = lines[1:]
        while lines and not lines[0].strip():
            lines = lines[1:]
    return "".join("#" + line if line.startswith("#") else line for line in lines)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """Replace each bench-report marker with the report it names (relative to ``docs/``)."""

    def replace(match: re.Match[str]) -> str:
        return embed((DOCS / match.group("path")).read_text(encoding="utf-8"))

    return MARKER.sub(replace, markdown)
