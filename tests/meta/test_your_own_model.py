"""The "Your own model" page's code runs as written, in order, and its machine passes."""

from __future__ import annotations

import os
import re
import sys
import types
import unittest
from typing import Any

import pytest

from tests.support import ROOT

PAGE = ROOT / "docs" / "your-own-model.md"


def _run_page() -> dict[str, Any]:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)
    assert len(blocks) >= 5
    # A module of its own, as a reader's script is: `torch.compile` looks globals up by module.
    module = types.ModuleType("your_own_model")
    sys.modules["your_own_model"] = module
    namespace: dict[str, Any] = module.__dict__
    for block in blocks:  # one script: each block sees what the ones above it defined
        exec(compile(block, str(PAGE), "exec"), namespace)
    return namespace


def test_the_page_runs_and_its_contract_machine_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    # As a reader runs it: from the clone's root (its last section reads `configs/`), with no
    # `OMNI_DIFFUSION_*` variable set (it asserts the flag's default).
    monkeypatch.chdir(ROOT)
    for var in [v for v in os.environ if v.startswith("OMNI_DIFFUSION_")]:
        monkeypatch.delenv(var)
    ns = _run_page()
    # The page's own asserts ran; its machine, against the page's records, passes too.
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(ns["TestRunningMeanSessions"])
    result = unittest.TextTestRunner(verbosity=0).run(suite)
    assert result.wasSuccessful(), result.failures + result.errors
    assert result.testsRun == 1


def test_the_page_is_in_the_docs_nav() -> None:
    nav = (PAGE.parents[1] / "mkdocs.yml").read_text(encoding="utf-8")
    assert "your-own-model.md" in nav
