"""The notebooks run, the docs site builds with --strict: a notebook that fails is a failing test.

Each notebook in ``notebooks/`` is executed in a fresh ``python3`` kernel pinned to this
interpreter (the venv's), with ``MPLBACKEND=Agg``; any cell that raises,
including the final assertions of what the notebook shows, fails the test, and so does any text
output that differs from the committed one (a re-run must not change a committed output). Each
committed ``.ipynb`` must be the jupytext pairing of its percent-format source
``notebooks/NN_name.py`` and carry its outputs.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import ROOT, load_module

NOTEBOOKS = ROOT / "notebooks"
NAMES = ["01_state_evolution.ipynb", "02_manager.ipynb", "03_accounting.ipynb"]
# A committed notebook stores its figures at the docs' width; this catches a stray large one.
MAX_NOTEBOOK_BYTES = 600_000


def _text_outputs(nb: Any) -> list[list[str]]:
    """Per code cell, the text of its stream and plain-text outputs (figures left out).

    Consecutive stream outputs are joined: how the kernel splits printed text into messages
    depends on timing (a loaded machine splits it more), never on what was printed.
    """
    cells = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        texts: list[str] = []
        streaming = False
        for out in cell.outputs:
            if out.output_type == "stream":
                if streaming:
                    texts[-1] += out.text
                else:
                    texts.append(out.text)
                streaming = True
            elif "data" in out and "image/png" not in out["data"]:
                texts.append(out["data"].get("text/plain", ""))
                streaming = False
        cells.append(texts)
    return cells


def _body(percent: str) -> list[str]:
    """A percent-format notebook's lines without its ``# ---`` YAML header and blank lines.

    Blank lines are left out: ruff and jupytext space a cell that opens with a ``def`` apart
    from the cell above differently.
    """
    lines = percent.splitlines()
    if lines and lines[0] == "# ---":
        lines = lines[lines.index("# ---", 1) + 1 :]
    return [line for line in lines if line.strip()]


def _load(path: Path) -> ModuleType:
    return load_module(path, f"_under_test_{path.stem}", register=True)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_without_error(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient

    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("SESSIONSTATE_FIGURES", raising=False)  # write no figure files
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path))
    build = _load(NOTEBOOKS / "build.py")
    monkeypatch.setenv("JUPYTER_PATH", str(build.write_kernelspec(tmp_path)))
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=240,
        allow_errors=False,
        record_timing=False,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()  # raises CellExecutionError, naming the cell, if any cell fails
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("all checks passed" in o.get("text", "") for o in outputs)
    # Deterministic: the re-run prints what the committed notebook shows, character for character.
    assert _text_outputs(nb) == _text_outputs(committed)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_the_pairing_of_its_source_and_is_committed_executed(name: str) -> None:
    import jupytext
    import nbformat

    source = (NOTEBOOKS / name).with_suffix(".py")
    committed = nbformat.read(NOTEBOOKS / name, as_version=4)
    paired = jupytext.read(source, fmt="py:percent")
    assert [(c.cell_type, c.source) for c in committed.cells] == [
        (c.cell_type, c.source) for c in paired.cells
    ], f"{name} is not the pairing of {source.name}; run `python notebooks/build.py {source.stem}`"
    assert committed.metadata["jupytext"]["formats"] == "ipynb,py:percent"
    # And back: the committed notebook, written as percent format, is the source (the YAML
    # header aside, where jupytext records its own version).
    assert _body(jupytext.writes(committed, fmt="py:percent")) == _body(
        source.read_text(encoding="utf-8")
    )
    code = [c for c in committed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{name} is not executed"
    assert (NOTEBOOKS / name).stat().st_size < MAX_NOTEBOOK_BYTES


def test_docs_build_strict(tmp_path: Path) -> None:
    import mkdocs  # noqa: F401  (a missing mkdocs fails this test; it never skips)

    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    models = (site / "models" / "index.html").read_text(encoding="utf-8")
    assert "603.28 MiB" in models  # the size table, written into the page's source
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    assert 'id="sessionstate.SessionStateManager"' in api


def test_docs_home_page_example_is_the_readmes() -> None:
    # The README's example is executed by test_readme.py; the home page must show the same.
    def example(path: Path) -> str:
        blocks = re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)
        return next(b for b in blocks if "def step(" in b)

    assert example(ROOT / "docs" / "index.md") == example(ROOT / "README.md")


def test_docs_helpers_doctests_and_size_table_renders_every_value() -> None:
    import json

    gen_sizes = _load(ROOT / "docs" / "gen_sizes.py")
    fences = _load(ROOT / "docs" / "griffe_doctest.py")
    for module in (gen_sizes, fences):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0
        assert result.attempted > 0
    data = json.loads(gen_sizes.DEFAULT_DATA.read_text(encoding="utf-8"))
    table = gen_sizes.render(data)
    for name in data["values"]:
        assert f"`{name}`" in table
