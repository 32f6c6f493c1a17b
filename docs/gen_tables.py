"""The generated tables of the docs pages, written into the markdown sources.

A page holds each generated table between two markers, so the table reads the same on
GitHub, in an editor and on the built site::

    <!-- sizes-table: data/sizes-deploy-400.json -->
    | value | bucket | ... |
    <!-- end sizes-table -->

The kinds, each naming its source relative to ``docs/``:

- ``bench-report: ../benchmarks/results/latest.md``: the committed benchmark report (written
  by ``benchmarks/run.py``, or re-rendered from its JSON by ``benchmarks/report.py``), its
  title dropped and its headings one level down;
- ``sizes-table: data/FILE.json``: a `sessionstate sizes --json` result (``gen_sizes.render``);
- ``plan-table: data/A.json data/B.json``: `sessionstate plan --json` results of one model
  (``gen_sizes.render_plans``).

``python docs/gen_tables.py`` rewrites every page's tables from the committed data; run it
after ``benchmarks/run.py``, ``benchmarks/report.py`` or ``docs/gen_sizes.py``, and commit the
pages with the data. ``python docs/gen_tables.py --check`` lists the pages whose tables
differ from what the data gives and exits 1 (``tests/meta/test_docs_bench.py`` runs the same
check). As a mkdocs hook the module fails the build on such a page instead of publishing a
table that the committed data does not give.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
if str(DOCS) not in sys.path:  # docs/ is not a package; gen_sizes sits beside this module
    sys.path.insert(0, str(DOCS))

import gen_sizes  # noqa: E402

REGION = re.compile(
    r"(?P<begin><!--\s*(?P<kind>[\w-]+):\s*(?P<args>[^>]+?)\s*-->\n)"
    r"(?P<body>.*?)"
    r"(?P<end><!--\s*end (?P=kind)\s*-->)",
    flags=re.S,
)


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


def _bench_report(args: list[str]) -> str:
    (path,) = args
    return embed((DOCS / path).read_text(encoding="utf-8"))


def _sizes_table(args: list[str]) -> str:
    (path,) = args
    return gen_sizes.render(gen_sizes.load(DOCS / path))


def _plan_table(args: list[str]) -> str:
    return gen_sizes.render_plans([gen_sizes.load_plan(DOCS / p) for p in args])


KINDS: dict[str, Callable[[list[str]], str]] = {
    "bench-report": _bench_report,
    "sizes-table": _sizes_table,
    "plan-table": _plan_table,
}


def fill(markdown: str) -> str:
    """``markdown`` with every generated region rewritten from its source.

    >>> fill("a\\n<!-- sizes-table: x.json -->\\nold\\n<!-- end other -->\\n")  # no region
    'a\\n<!-- sizes-table: x.json -->\\nold\\n<!-- end other -->\\n'
    """

    def replace(match: re.Match[str]) -> str:
        kind = match.group("kind")
        if kind not in KINDS:
            return match.group(0)
        body = KINDS[kind](match.group("args").split()).strip("\n")
        return f"{match.group('begin')}\n{body}\n\n{match.group('end')}"

    return REGION.sub(replace, markdown)


def pages() -> list[Path]:
    """The docs pages that hold a generated region."""
    return sorted(
        p
        for p in DOCS.glob("*.md")
        if any(m.group("kind") in KINDS for m in REGION.finditer(p.read_text(encoding="utf-8")))
    )


def stale() -> list[Path]:
    """The pages whose generated tables differ from what the committed data gives."""
    return [p for p in pages() if fill(text := p.read_text(encoding="utf-8")) != text]


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs hook: refuse a page whose generated tables the committed data does not give."""
    if fill(markdown) != markdown:
        page = kwargs.get("page")
        name = page.file.src_path if page is not None else "a page"
        msg = (
            f"{name}'s generated tables differ from the committed data; run "
            "`python docs/gen_tables.py` and commit the page."
        )
        raise RuntimeError(msg)
    return markdown


def main(argv: list[str] | None = None) -> int:
    """Rewrite every page's generated tables, or with ``--check`` list the stale pages."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a page is stale"
    )
    args = parser.parse_args(argv)
    root = DOCS.parent
    if args.check:
        old = stale()
        for page in old:
            print(f"{page.relative_to(root)}: stale; run `python docs/gen_tables.py`")
        return 1 if old else 0
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = fill(text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            print(f"wrote {page.relative_to(root)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
