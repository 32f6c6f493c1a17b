"""The README's example runs as written and prints what the README says it prints."""

from __future__ import annotations

import ast
import contextlib
import io
import re

from tests.support import ROOT

README = ROOT / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_the_twenty_line_example_runs_and_prints_its_stats() -> None:
    block = next(b for b in _python_blocks() if "def step(" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    printed = ast.literal_eval(out.getvalue().strip())
    # The README shows the printed stats as a comment under the code; they must agree.
    shown = re.search(r"print\(manager\.stats\(\)\)\n((?:# .*\n)+)", block)
    assert shown is not None
    expected = ast.literal_eval("".join(line[2:] for line in shown.group(1).splitlines(True)))
    assert printed == expected


def test_the_example_is_twenty_lines_of_code() -> None:
    block = next(b for b in _python_blocks() if "def step(" in b)
    code = [line for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert len(code) <= 22
