"""tests/ mirrors src/sessionstate: each folder is an area of the source or a named concern.

"Where are the pool's tests?" is answered by ``ls tests/kv/``: a folder of tests names a
subpackage or module of `sessionstate` (its private underscore dropped), a group of modules
(`core`, for the records, trees, state objects and their accounting), or one of the concerns
that cut across the source. No test file sits at the root, beside the shared helpers.
"""

from __future__ import annotations

from pathlib import Path

from tests.support import ROOT

TESTS = ROOT / "tests"
SOURCE = ROOT / "src" / "sessionstate"

GROUPS = {
    "core": "the records, trees, state objects, sessions and their byte accounting",
}
"""Folders that gather several top-level modules of `sessionstate`."""

CROSS_CUTTING = {
    "messages": "every user-facing message, pinned word for word",
    "meta": "the public API, docs, notebooks, README, benchmarks, mutants, profiles",
    "data": "committed golden snapshot files and the script that wrote them",
    "typing": "the public API's inferred types, checked by mypy",
}
"""Folders for concerns that cut across the source."""

ROOT_FILES = {"__init__.py", "conftest.py", "support.py", "ray_support.py", "README.md"}
"""What may sit at the root of tests/: the shared helpers and the map."""


def _areas() -> set[str]:
    """Each subpackage and module of `sessionstate`, named without its leading underscore."""
    names = {p.name for p in SOURCE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in SOURCE.glob("*.py") if p.stem not in {"__init__", "__main__"}}
    return {name.lstrip("_") for name in names}


def _folders(under: Path) -> list[Path]:
    return sorted(p for p in under.iterdir() if p.is_dir() and p.name != "__pycache__")


def test_every_folder_is_an_area_of_the_source_or_a_named_concern() -> None:
    allowed = _areas() | set(GROUPS) | set(CROSS_CUTTING)
    stray = [p.name for p in _folders(TESTS) if p.name not in allowed]
    assert not stray, f"tests/ folders that mirror nothing in src/sessionstate: {stray}"


def test_each_model_has_its_folder_under_models() -> None:
    models = {p.name for p in _folders(SOURCE / "models")}
    tested = {p.name for p in _folders(TESTS / "models")}
    assert tested <= models, f"tests/models/ folders for no model: {sorted(tested - models)}"


def test_no_test_file_sits_at_the_root() -> None:
    stray = sorted(p.name for p in TESTS.iterdir() if p.is_file() and p.name not in ROOT_FILES)
    assert not stray, f"files at the root of tests/; move each into its area's folder: {stray}"


def test_every_test_folder_is_a_package() -> None:
    # Test modules import their helpers as `tests.support`, and two folders may hold modules of
    # one name (`cli/test_cli.py`, `models/dreamzero/...`): both need packages all the way down.
    data = {TESTS / name for name in ("data", "typing")}
    folders = [TESTS, *(p for p in TESTS.rglob("*") if p.is_dir())]
    missing = [
        p.relative_to(ROOT).as_posix()
        for p in folders
        if p.name != "__pycache__"
        and not any(p == d or d in p.parents for d in data)
        and any(p.glob("test_*.py"))
        and not (p / "__init__.py").exists()
    ]
    assert not missing, f"test folders without an __init__.py: {missing}"
