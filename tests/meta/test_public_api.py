"""The public surface: the names integrations rely on, `__all__`, and a light import."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

import sessionstate as ss

# The names integrations import by name: a contract, never renamed.
FIXED_NAMES = [
    "StateObject",
    "LatentBuffer",
    "SessionState",
    "SessionAttr",
    "SessionStateManager",
    "OmniDiffusionConfig",
    "resolve_session_state_config",
    "nbytes_by_device",
    "record",
    "tree_leaves",
    "tree_map",
    "tree_flatten",
    "tree_unflatten",
    "tree_equal",
    "BudgetTextError",  # raised for a budget text such as "cpu=lots", wherever it is read
]


@pytest.mark.parametrize("name", FIXED_NAMES)
def test_fixed_name_is_exported(name: str) -> None:
    assert name in ss.__all__
    namespace: dict[str, object] = {}
    exec(f"from sessionstate import {name}", namespace)
    assert namespace[name] is getattr(ss, name)


@pytest.mark.parametrize("name", ss.__all__)
def test_all_entries_resolve(name: str) -> None:
    assert getattr(ss, name) is not None


def test_all_has_no_duplicates() -> None:
    assert len(ss.__all__) == len(set(ss.__all__))


def test_public_callables_are_documented() -> None:
    undocumented = [
        name
        for name in ss.__all__
        if (inspect.isclass(getattr(ss, name)) or inspect.isfunction(getattr(ss, name)))
        and not inspect.getdoc(getattr(ss, name))
    ]
    assert undocumented == []


def test_omni_diffusion_config_field() -> None:
    import attrs

    field = attrs.fields(ss.OmniDiffusionConfig).enable_session_state_manager
    assert field.default is False


def test_resolve_signature() -> None:
    params = inspect.signature(ss.resolve_session_state_config).parameters
    assert list(params)[:2] == ["config", "environ"]
    assert params["environ"].default is None
    settings = ss.resolve_session_state_config(None, {})
    assert isinstance(settings.enabled, bool)
    assert isinstance(settings.max_sessions, int)


def test_default_cap() -> None:
    assert ss.DEFAULT_MAX_SESSIONS == 64
    assert ss.SessionStateManager().max_sessions == 64


def test_typed_package() -> None:
    from importlib import resources

    assert resources.files("sessionstate").joinpath("py.typed").is_file()


def test_import_does_not_pull_in_diffusers() -> None:
    code = (
        "import json, sys\n"
        "import sessionstate\n"
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.split('.')[0] in {'diffusers', 'transformers', 'rich', 'hypothesis'} "
        "or m.startswith('sessionstate.models'))))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_the_type_checkers_imports_are_the_public_table() -> None:
    # Type checkers and the docs read the TYPE_CHECKING imports; `import sessionstate` serves
    # the `_PUBLIC` table. A name added to one and not the other would mean something else
    # to mypy than at run time: each name is imported, from the module the table says.
    import ast
    from pathlib import Path

    source = Path(ss.__file__).read_text(encoding="utf-8")
    guarded = next(
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    static = {
        alias.name: node.module
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name  # explicit re-exports only
    }
    assert static == ss._LAZY
    assert sorted(ss.__all__) == sorted([*ss._LAZY, "__version__"])
    for name, module in ss._LAZY.items():
        assert getattr(ss, name) is getattr(__import__(module, fromlist=[name]), name), name
