"""Write each notebook from its percent-format source, execute it, and store its outputs.

    .venv/bin/python notebooks/build.py                       # all
    .venv/bin/python notebooks/build.py 01_state_evolution    # one
    .venv/bin/python notebooks/build.py --no-execute          # cells only

A notebook's source is ``notebooks/NN_name.py`` (jupytext percent format, linted and type
checked with the rest); ``NN_name.ipynb`` is its jupytext pairing, committed with outputs.
Edit the ``.py`` and rebuild. Executing also writes ``docs/img/state_evolution.png`` (the
README's plot) from notebook 01, through ``SESSIONSTATE_FIGURES``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# nbformat's writer is not annotated; this is its type as used here.
_write: Callable[[nbformat.NotebookNode, Path], None] = nbformat.write
SOURCES = sorted(p for p in HERE.glob("[0-9][0-9]_*.py"))


def pair(source: Path) -> nbformat.NotebookNode:
    """The notebook paired with ``source``, without outputs, with stable cell ids."""
    nb: nbformat.NotebookNode = jupytext.read(source, fmt="py:percent")
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"  # stable ids keep diffs small
        cell.metadata = {}
    return nb


def write_kernelspec(directory: Path) -> Path:
    """Write a ``python3`` kernelspec that runs this interpreter; return ``directory``.

    Put the result first on ``JUPYTER_PATH`` so the notebooks run in this venv's Python even
    where a user-level ``python3`` kernelspec points at another interpreter.
    """
    spec = directory / "kernels" / "python3"
    spec.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "Python 3", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel), encoding="utf-8")
    return directory


def execute(nb: nbformat.NotebookNode, *, timeout: int = 300) -> None:
    """Execute ``nb`` in place in a python3 kernel, from the notebooks directory."""
    NotebookClient(
        nb,
        kernel_name="python3",
        timeout=timeout,
        allow_errors=False,
        record_timing=False,
        resources={"metadata": {"path": str(HERE)}},
    ).execute()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--no-execute", action="store_true", help="write the cells only")
    parser.add_argument("names", nargs="*", help="notebooks to build, by stem (default: all)")
    args = parser.parse_args(argv)
    os.environ["MPLBACKEND"] = "Agg"
    figures = ROOT / "docs" / "img"
    figures.mkdir(parents=True, exist_ok=True)
    os.environ["SESSIONSTATE_FIGURES"] = str(figures)
    sources = [HERE / f"{Path(n).stem}.py" for n in args.names] or SOURCES
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["JUPYTER_PATH"] = str(write_kernelspec(Path(tmp)))
        for source in sources:
            nb = pair(source)
            if not args.no_execute:
                start = time.perf_counter()
                execute(nb)
                print(f"{source.stem}: executed in {time.perf_counter() - start:.1f} s")
            nbformat.validate(nb)
            _write(nb, source.with_suffix(".ipynb"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
