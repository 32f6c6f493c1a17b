"""Every planted bug of `tools/mutants.py` still has a place to go in today's source.

`make mutants` is slow and not part of `make test`, so a change that moves a mutant's anchor
text would otherwise only show when someone next runs it. This applies each mutant to a copy of
its file (nothing is run): every anchor must occur exactly once, and the tests named to catch
it must exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT, load_module

TOOL = load_module(ROOT / "tools" / "mutants.py", "mutants", register=True)


@pytest.mark.parametrize("mutant", TOOL.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_to_todays_source_and_its_tests_exist(
    mutant: Any, tmp_path: Path
) -> None:
    # Applied as `make mutants` applies it (its substitutions in turn), to a copy of the file.
    target = tmp_path / mutant.path
    target.parent.mkdir(parents=True)
    original = (ROOT / "src" / mutant.path).read_text(encoding="utf-8")
    target.write_text(original, encoding="utf-8")
    TOOL._apply(mutant, tmp_path)  # raises MutantError, naming the anchor, if one is not there
    assert target.read_text(encoding="utf-8") != original
    for test in mutant.tests:  # a file, or a test's node id in one
        path = test.split("::", 1)[0]
        assert (ROOT / path).exists(), f"{mutant.name}: no {path}"
