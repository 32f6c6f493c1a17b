"""The public face after issue 37: what left it (with a warning), what joined it."""

from __future__ import annotations

import re

import pytest

import sessionstate as ss
from sessionstate import _env, _errors
from sessionstate._config import parse_env_flag


def test_parse_env_flag_left_the_public_face_with_a_warning() -> None:
    assert "parse_env_flag" not in ss.__all__
    msg = (
        "`sessionstate.parse_env_flag` is deprecated and will be removed: it is the deploy "
        "config's internal reading of an environment flag. Set the flag and read the result "
        "from `resolve_session_state_config(...)`."
    )
    with pytest.warns(DeprecationWarning, match=re.escape(msg)):
        served = ss.parse_env_flag
    assert served is parse_env_flag
    with pytest.warns(DeprecationWarning, match=re.escape(msg)):
        from sessionstate import parse_env_flag as imported
    assert imported is parse_env_flag


def test_every_environment_variable_is_exported() -> None:
    assert set(_env.__all__) <= set(ss.__all__)
    for name in _env.__all__:
        assert getattr(ss, name) == getattr(_env, name)
    assert len(_env.__all__) == 7


def test_every_public_error_is_defined_in_the_errors_module() -> None:
    errors = [n for n in ss.__all__ if isinstance(getattr(ss, n), type) and n.endswith("Error")]
    assert errors
    assert all(getattr(ss, n).__module__ == "sessionstate._errors" for n in errors)
    defined = {
        n
        for n, v in vars(_errors).items()
        if isinstance(v, type) and issubclass(v, Exception) and v.__module__ == _errors.__name__
    }
    assert set(errors) == defined  # and every error defined there is public


def test_the_host_pool_error_keeps_its_import_paths() -> None:
    from sessionstate import _storage
    from sessionstate._storage import _hostpool

    error = ss.HostPoolFullError
    assert _storage.HostPoolFullError is _hostpool.HostPoolFullError is error
    assert error is _errors.HostPoolFullError
    assert issubclass(ss.HostPoolFullError, MemoryError)
