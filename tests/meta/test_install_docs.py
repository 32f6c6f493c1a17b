"""What the install instructions say agrees with pyproject.toml, the Makefile and constraints."""

from __future__ import annotations

import re
import tomllib

import pytest

from tests.support import ROOT

README = ROOT / "README.md"
INSTALL = ROOT / "docs" / "install.md"


def _extras_rows(text: str) -> set[str]:
    """The extras an ``| extra | adds | for |`` table lists."""
    table = text.split("| extra | adds | for |", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", table, flags=re.M))


@pytest.mark.parametrize("page", [README, INSTALL], ids=lambda p: p.name)
def test_the_extras_tables_list_every_extra(page: object) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = set(project["optional-dependencies"])
    assert _extras_rows(page.read_text(encoding="utf-8")) == extras  # type: ignore[attr-defined]


def test_no_page_installs_a_release_that_does_not_exist() -> None:
    # No release is on PyPI: an install names the clone (`-e '.[extra]'`), never the package.
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    sources = sorted((ROOT / "src").rglob("*.py"))
    found = [
        str(path.relative_to(ROOT))
        for path in [*pages, *sources]
        if re.search(r"pip install ['\"]?sessionstate\b", path.read_text(encoding="utf-8"))
    ]
    assert found == []


def _demo_recipe() -> str:
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    return make.split("$(VENV)/.installed-models:", 1)[1].split("\n\n", 1)[0]


def test_the_demo_banner_says_what_constraints_txt_pins() -> None:
    # The pin is a version; which build pip installs depends on where it looks.
    pin = re.search(r"^torch==(\S+)$", (ROOT / "constraints.txt").read_text(), flags=re.M)
    assert pin is not None
    assert "+" not in pin.group(1)  # no build in the pin
    banner = re.search(r'@echo "(.*)"', _demo_recipe())
    assert banner is not None
    assert "CPU build" not in banner.group(1)
    assert "the version constraints.txt pins" in banner.group(1)
    install = " ".join(INSTALL.read_text(encoding="utf-8").split())
    assert "`constraints.txt` pins the torch *version*" in install


def test_the_readme_says_what_make_prints_while_pip_runs() -> None:
    readme = " ".join(README.read_text(encoding="utf-8").split())
    demo = readme.split("**`make demo`**", 1)[1].split("**`make test`**", 1)[0]
    recipe = _demo_recipe()
    assert "--progress-bar on" in recipe
    assert "@echo" in recipe
    assert "prints nothing" not in demo
    assert "progress bars" in demo
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    dev = make.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "--quiet" in dev
    test = readme.split("**`make test`**", 1)[1].split("## ", 1)[0]
    assert "prints nothing" in test
