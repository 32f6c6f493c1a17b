"""Snapshot class names are stable: a table names library classes, not their module paths."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from safetensors import safe_open

import sessionstate as ss
from sessionstate._storage import SNAPSHOT_NAMES, record_name, resolve_leaf_class, resolve_record
from tests.support import DATA

GOLDEN = sorted((DATA / "snapshots").glob("*/*.safetensors"))


def _classes(node: Any) -> set[str]:
    """Every class name a snapshot's JSON document stores."""
    if isinstance(node, dict):
        found = {node["class"]} if isinstance(node.get("class"), str) else set()
        return found.union(*(_classes(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_classes(v) for v in node))
    return set()


def _stored_names() -> set[str]:
    names: set[str] = set()
    for path in GOLDEN:
        with safe_open(str(path), framework="pt") as f:
            document = json.loads(f.metadata()["sessionstate"])
        names |= _classes(document["tree"]) | set(document.get("leaves", {}))
    return names


def _library_classes() -> dict[str, type]:
    """Every record and snapshot-leaf class the library defines, by ``module:qualname``."""
    from sessionstate._storage._format import _LEAF_CLASSES, _registered_records

    for name in ss.__all__:
        getattr(ss, name)
    for model in ("dreamzero", "cosmos3"):  # every module: some are imported lazily
        package = importlib.import_module(f"sessionstate.models.{model}")
        for info in pkgutil.iter_modules(package.__path__, f"{package.__name__}."):
            importlib.import_module(info.name)
    found = {**_registered_records(), **_LEAF_CLASSES}.values()
    return {
        f"{c.__module__}:{c.__qualname__}": c
        for c in found
        if c.__module__.startswith("sessionstate.")
        and c is not ss.ParkedObject
        and _defined_in_its_module(c)
    }


def _defined_in_its_module(cls: type) -> bool:
    # A record a doctest of a library module defines (`sessionstate._tree`'s examples) names
    # that module but lives only in the doctest's namespace: not a library class.
    found: object = importlib.import_module(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def test_the_golden_files_store_exactly_the_tables_names() -> None:
    stored = _stored_names()
    assert stored <= set(SNAPSHOT_NAMES)
    # Classes may move (their table location follows them), but each name a golden file
    # stores is still the name its class is stored under today, so new files match old ones.
    classes = _library_classes()
    for name in stored:
        assert record_name(classes[SNAPSHOT_NAMES[name]]) == name


def test_every_library_class_has_a_stable_name_that_resolves_to_it() -> None:
    classes = _library_classes()
    assert set(classes) == set(SNAPSHOT_NAMES.values())
    for name, where in SNAPSHOT_NAMES.items():
        cls = classes[where]
        assert record_name(cls) == name
        resolved = resolve_leaf_class(name) if cls is ss.KVHandle else resolve_record(name)
        assert resolved is cls


def test_a_user_class_keeps_module_and_qualname() -> None:
    @ss.record
    class Mine:
        x: int = 0

    assert record_name(Mine) == f"{__name__}:{Mine.__qualname__}"


_MOVED = """
from sessionstate import record, static_field


@record
class Moved:
    step: int = static_field(default=0)
"""

_PATCH = """
import sys
import sessionstate
from sessionstate._storage import _format as f
sessionstate.__path__.append({home!r})
f.SNAPSHOT_NAMES["sessionstate._old_home:Moved"] = "sessionstate._new_home:Moved"
f._STABLE_BY_LOCATION["sessionstate._new_home:Moved"] = "sessionstate._old_home:Moved"
"""

_WRITE = """
from sessionstate._new_home import Moved
sessionstate.save_state({{"m": Moved(step=4)}}, {path!r})
"""

_READ = """
import importlib.util
assert importlib.util.find_spec("sessionstate._old_home") is None
assert "sessionstate._new_home" not in sys.modules
loaded = sessionstate.load_state({path!r})
assert type(loaded["m"]).__module__ == "sessionstate._new_home", type(loaded["m"])
assert loaded["m"].step == 4
print("ok")
"""


def _python(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_moved_library_class_loads_from_its_new_module_by_its_stable_name(
    tmp_path: Path,
) -> None:
    # A library class that moved from `_old_home` (no longer importable) to `_new_home`: the
    # file stores the stable name, and a fresh process finds the class through the table.
    home = tmp_path / "home"
    home.mkdir()
    (home / "_new_home.py").write_text(textwrap.dedent(_MOVED))
    path = str(tmp_path / "moved.safetensors")
    patch = _PATCH.format(home=str(home))
    _python(patch + _WRITE.format(path=path))
    with safe_open(path, framework="pt") as f:
        document = json.loads(f.metadata()["sessionstate"])
    assert _classes(document["tree"]) == {"sessionstate._old_home:Moved"}
    assert _python(patch + _READ.format(path=path)).strip() == "ok"


def test_the_storage_modules_import_no_package_face() -> None:
    # The storage package sits below the face in the import graph: code there imports the
    # private module defining a name, never `sessionstate` itself (its doctests may).
    package = Path(ss.__file__).with_name("_storage")
    faces = []
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                faces += [
                    f"{path.name}: import {a.name}" for a in node.names if a.name == "sessionstate"
                ]
            elif isinstance(node, ast.ImportFrom) and node.module == "sessionstate":
                faces.append(f"{path.name}: from sessionstate import ...")
    assert faces == []
    assert ss.__version__ == importlib.metadata.version("sessionstate")
