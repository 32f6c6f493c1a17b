"""Every docs page's code runs as written: each page's ```python blocks, in order, as one script.

A page is read as a reader follows it: from the top, each block seeing what the blocks above
it defined, in a fresh working directory that holds a copy of the clone's ``configs/`` (the
pages name those files by their path from the repository root), with no
``OMNI_DIFFUSION_*`` variable set. A block that raises fails its page's test, and so does a
page whose code asserts nothing. Every fence that opens Python code is a plain ```python
fence, so no block is left out of the run by a fence the pattern does not match.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT

DOCS = ROOT / "docs"
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
FENCE = re.compile(r"^```(\S*)(.*)$", flags=re.M)


def _blocks(page: Path) -> list[str]:
    """The page's python blocks, each padded with blank lines to sit at its line on the page."""
    text = page.read_text(encoding="utf-8")
    return ["\n" * text.count("\n", 0, m.start(1)) + m.group(1) for m in BLOCK.finditer(text)]


PAGES = sorted(p.name for p in DOCS.glob("*.md") if _blocks(p))


def test_the_pages_with_code_are_found() -> None:
    # The run below is parametrised by these; an empty or shrunken list would test nothing.
    for name in ("snapshots.md", "scaling-out.md", "budget.md", "your-own-model.md"):
        assert name in PAGES


@pytest.mark.parametrize("name", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_python_fence_is_an_executed_one(name: str) -> None:
    text = (DOCS / name).read_text(encoding="utf-8")
    fences = FENCE.findall(text)
    python = [lang + rest for lang, rest in fences if lang.lower() in {"python", "py", "pycon"}]
    assert all(f == "python" for f in python), (
        f"{name} opens Python code with {python!r}; only a plain ```python fence is run by "
        "this test, so write the block as one."
    )
    assert len(_blocks(DOCS / name)) == python.count("python")


@pytest.mark.parametrize("name", PAGES)
def test_the_page_runs_as_written(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    page = DOCS / name
    for var in [v for v in os.environ if v.startswith("OMNI_DIFFUSION_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    monkeypatch.chdir(tmp_path)
    blocks = _blocks(page)
    assert any(re.search(r"^\s*assert ", b, flags=re.M) for b in blocks), (
        f"{name}'s code asserts nothing; end it with an assert of what it shows."
    )
    namespace: dict[str, Any] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for block in blocks:  # one script: each block sees what the ones above it defined
        exec(compile(block, str(page), "exec"), namespace)


def _nav_pages() -> list[str]:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    return re.findall(r"^ +- [^:]+: (\S+\.md)$", nav.split("\n\n", 1)[0], flags=re.M)


def test_the_nav_is_four_groups() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:\n", 1)[1]
    groups = re.findall(r"^  - ([^:]+):$", nav.split("\n\n", 1)[0], flags=re.M)
    assert groups == ["Start", "Concepts", "Guides", "Reference"]
    assert 14 <= len(_nav_pages()) <= 17  # about fifteen pages, none covering another's ground


def test_where_to_go_next_links_every_page_in_the_nav() -> None:
    pages = _nav_pages()
    assert {"install.md", "your-own-model.md", "troubleshooting.md", "changelog.md"} <= set(pages)
    assert sorted(pages) == sorted(p.name for p in DOCS.glob("*.md"))  # no page left out
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    section = index.split("## Where to go next", 1)[1].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\(([\w-]+\.md)[)#]", section))
    assert linked == set(pages) - {"index.md"}


def test_the_api_reference_renders_every_public_name_once() -> None:
    import sessionstate as ss

    api = (DOCS / "api.md").read_text(encoding="utf-8")
    rendered = re.findall(r"^::: sessionstate\.(\w+)$", api, flags=re.M)
    subpackages = ["distributed", "testing"]  # rendered whole, in their own sections
    public = sorted(set(ss.__all__) - {"__version__"})
    assert sorted(n for n in rendered if n not in subpackages) == public, (
        "each public name on the API page exactly once"
    )
    assert sorted(n for n in rendered if n in subpackages) == subpackages
    # Grouped by topic, not one alphabetical list.
    for topic in ("Records", "State objects", "manager", "budget", "Snapshots", "KV", "Testing"):
        assert re.search(rf"^## .*{topic}", api, flags=re.M), topic


def test_troubleshooting_names_every_public_error_class() -> None:
    import sessionstate as ss
    import sessionstate.distributed as dist

    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    rows = set(re.findall(r"^\| `(\w+Error)` \(", page, flags=re.M))
    errors = {n for n in ss.__all__ if n.endswith("Error")}
    errors |= {n for n in dist.__all__ if n.endswith("Error")}
    assert len(errors) >= 17
    for name in errors:  # each is an exception class, and has its row of cause and fix
        module = ss if name in ss.__all__ else dist
        assert issubclass(getattr(module, name), Exception)
    assert rows == errors


def test_the_changelog_page_includes_the_repositorys_changelog() -> None:
    page = (DOCS / "changelog.md").read_text(encoding="utf-8")
    assert '--8<-- "CHANGELOG.md"' in page
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "pymdownx.snippets:" in config
    assert "check_paths: true" in config  # a missing CHANGELOG.md fails the strict build


def test_the_quoted_branch_sizes_command_runs_what_its_figures_say() -> None:
    # The figures name a 40-step session with eight branches of four steps; the command quoted
    # for them must run that, not its own defaults (400 steps at deploy).
    from sessionstate.cli import build_parser
    from sessionstate.models._registry import get_model

    text = " ".join((DOCS / "concepts.md").read_text(encoding="utf-8").split())
    found = re.search(r"`sessionstate (sizes --branches [^`]*)` says it", text)
    assert found is not None
    args = build_parser().parse_args(found.group(1).split())
    steps = get_model(args.model).size_steps if args.steps is None else args.steps
    words = {"eight": 8, "four": 4}
    said = re.search(r"(\w+) branches of a (\d+)-step session, (\w+) steps each", text)
    assert said is not None
    assert (args.branches, steps, args.branch_steps) == (
        words[said.group(1)],
        int(said.group(2)),
        words[said.group(3)],
    )
