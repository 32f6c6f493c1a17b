"""Examples and properties for `sessionstate._config`: deploy config and env precedence."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sessionstate as ss
from sessionstate import (
    ENV_ENABLE,
    ENV_MAX_SESSIONS,
    OmniDiffusionConfig,
    SessionStateSettings,
    resolve_session_state_config,
)
from sessionstate._config import parse_env_flag

TRUE_TOKENS = ("1", "true", "yes", "on")
FALSE_TOKENS = ("0", "false", "no", "off")
ACCEPTED = frozenset(TRUE_TOKENS + FALSE_TOKENS)
WHITESPACE = " \t\n\r\f\v"

ON = OmniDiffusionConfig(enable_session_state_manager=True)
OFF = OmniDiffusionConfig(enable_session_state_manager=False)

uses_caplog = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "sessionstate"
    ]


# --- OmniDiffusionConfig --------------------------------------------------------------------


def test_config_defaults() -> None:
    config = OmniDiffusionConfig()
    assert config.enable_session_state_manager is False
    assert dict(config.model) == {}


def test_config_is_frozen() -> None:
    import attrs

    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        OmniDiffusionConfig().enable_session_state_manager = True  # type: ignore[misc]


def test_from_dict() -> None:
    config = OmniDiffusionConfig.from_dict(
        {"enable_session_state_manager": True, "model": {"preset": "tiny"}}
    )
    assert config.enable_session_state_manager is True
    assert config.model == {"preset": "tiny"}
    assert OmniDiffusionConfig.from_dict({}) == OmniDiffusionConfig()


def test_from_dict_unknown_key_names_key_and_value() -> None:
    with pytest.raises(KeyError) as info:
        OmniDiffusionConfig.from_dict({"enable_session_state_manger": True})
    text = str(info.value)
    assert "'enable_session_state_manger'" in text
    assert "(value True)" in text
    assert "enable_session_state_manager" in text.split("known keys:")[1]


@pytest.mark.parametrize("value", ["true", 1, 0, None, "yes"], ids=repr)
def test_from_dict_wrong_flag_type(value: object) -> None:
    with pytest.raises(TypeError, match=re.escape(f"got {value!r}")) as info:
        OmniDiffusionConfig.from_dict({"enable_session_state_manager": value})
    assert "`enable_session_state_manager` must be a bool" in str(info.value)


def test_from_dict_wrong_model_type() -> None:
    with pytest.raises(TypeError, match="`model` must be a mapping"):
        OmniDiffusionConfig.from_dict({"model": ["tiny"]})


@pytest.mark.parametrize("data", [["enable_session_state_manager"], "text", 3], ids=repr)
def test_from_dict_requires_a_mapping(data: object) -> None:
    with pytest.raises(TypeError, match="must be a mapping of keys to values"):
        OmniDiffusionConfig.from_dict(data)  # type: ignore[arg-type]


def test_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("enable_session_state_manager: true\nmodel:\n  preset: tiny\n  height: 16\n")
    config = OmniDiffusionConfig.from_yaml(path)
    assert config.enable_session_state_manager is True
    assert config.model == {"preset": "tiny", "height": 16}
    assert OmniDiffusionConfig.from_yaml(str(path)) == config


def test_from_yaml_empty_file_gives_defaults(tmp_path: Path) -> None:
    for text in ["", "\n", "# only a comment\n"]:
        path = tmp_path / "empty.yaml"
        path.write_text(text)
        assert OmniDiffusionConfig.from_yaml(path) == OmniDiffusionConfig()


def test_from_yaml_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("enable_session_state_manager: [true\n")
    with pytest.raises(ValueError, match="is not valid YAML") as info:
        OmniDiffusionConfig.from_yaml(path)
    assert str(path) in str(info.value)


def test_from_yaml_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("max_sessions: 8\n")
    with pytest.raises(KeyError, match="max_sessions"):
        OmniDiffusionConfig.from_yaml(path)


def test_from_yaml_wrong_type(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text('enable_session_state_manager: "true"\n')
    with pytest.raises(TypeError, match="must be a bool"):
        OmniDiffusionConfig.from_yaml(path)


def test_from_yaml_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        OmniDiffusionConfig.from_yaml(tmp_path / "absent.yaml")


# --- resolve_session_state_config: precedence ----------------------------------------------


def test_defaults_without_environment() -> None:
    assert resolve_session_state_config(None, {}) == SessionStateSettings(False, 64)
    assert resolve_session_state_config(ON, {}) == SessionStateSettings(True, 64)
    assert resolve_session_state_config(OFF, {}).enabled is False


def test_env_on_overrides_config_off() -> None:
    assert resolve_session_state_config(OFF, {ENV_ENABLE: "1"}).enabled is True
    assert resolve_session_state_config(None, {ENV_ENABLE: "on"}).enabled is True


def test_env_off_overrides_config_on() -> None:
    assert resolve_session_state_config(ON, {ENV_ENABLE: "0"}).enabled is False
    assert resolve_session_state_config(ON, {ENV_ENABLE: "false"}).enabled is False


def test_unrelated_variables_are_ignored() -> None:
    env = {"OMNI_DIFFUSION_SESSION_STATE": "1", "SESSION_STATE_MANAGER": "1"}
    assert resolve_session_state_config(OFF, env).enabled is False


def test_environ_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ENABLE, "yes")
    monkeypatch.setenv(ENV_MAX_SESSIONS, "5")
    assert resolve_session_state_config(OFF) == SessionStateSettings(True, 5)
    monkeypatch.setenv(ENV_ENABLE, "no")
    monkeypatch.delenv(ENV_MAX_SESSIONS)
    assert resolve_session_state_config(ON) == SessionStateSettings(False, 64)
    monkeypatch.delenv(ENV_ENABLE)
    assert resolve_session_state_config(ON) == SessionStateSettings(True, 64)


def test_an_explicit_environ_ignores_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ENABLE, "1")
    assert resolve_session_state_config(OFF, {}).enabled is False


def test_env_var_names() -> None:
    assert ENV_ENABLE == "OMNI_DIFFUSION_SESSION_STATE_MANAGER"
    assert ENV_MAX_SESSIONS == "OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS"


# --- env flag parsing (properties) ---------------------------------------------------------


@st.composite
def spelled_tokens(draw: st.DrawFn) -> tuple[str, bool]:
    """An accepted token in random casing with random surrounding whitespace."""
    token = draw(st.sampled_from(sorted(ACCEPTED)))
    upper = draw(st.lists(st.booleans(), min_size=len(token), max_size=len(token)))
    cased = "".join(c.upper() if u else c for c, u in zip(token, upper, strict=True))
    before = draw(st.text(alphabet=WHITESPACE, max_size=3))
    after = draw(st.text(alphabet=WHITESPACE, max_size=3))
    return before + cased + after, token in TRUE_TOKENS


def _is_accepted(text: str) -> bool:
    return text.strip().lower() in ACCEPTED


@given(spelled_tokens())
def test_parse_env_flag_accepts_any_casing_and_whitespace(spelled: tuple[str, bool]) -> None:
    text, expected = spelled
    assert parse_env_flag(text) is expected


@uses_caplog
@given(spelled=spelled_tokens(), config_on=st.booleans())
def test_a_spelled_token_overrides_the_config(
    caplog: pytest.LogCaptureFixture, spelled: tuple[str, bool], config_on: bool
) -> None:
    caplog.clear()
    text, expected = spelled
    config = OmniDiffusionConfig(enable_session_state_manager=config_on)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings_ = resolve_session_state_config(config, {ENV_ENABLE: text})
    assert settings_.enabled is expected
    assert _warnings(caplog) == []


@given(st.text().filter(lambda s: not _is_accepted(s)))
def test_parse_env_flag_rejects_anything_else(text: str) -> None:
    assert parse_env_flag(text) is None


@uses_caplog
@given(text=st.text().filter(lambda s: s.strip() and not _is_accepted(s)), config_on=st.booleans())
def test_garbage_falls_back_to_the_config_with_a_warning(
    caplog: pytest.LogCaptureFixture, text: str, config_on: bool
) -> None:
    caplog.clear()
    config = OmniDiffusionConfig(enable_session_state_manager=config_on)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings_ = resolve_session_state_config(config, {ENV_ENABLE: text})
    assert settings_.enabled is config_on
    messages = _warnings(caplog)
    assert len(messages) == 1
    assert ENV_ENABLE in messages[0]
    assert repr(text) in messages[0]


@pytest.mark.parametrize("text", ["", " ", "2", "tru", "y", "enable", "onn", "0.0", "1 1"])
def test_near_misses_are_not_accepted(text: str) -> None:
    assert parse_env_flag(text) is None


def test_unset_flag_is_none() -> None:
    assert parse_env_flag(None) is None


def test_unset_flag_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        resolve_session_state_config(ON, {})
    assert _warnings(caplog) == []


# --- MAX_SESSIONS ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "cap"), [("1", 1), ("16", 16), (" 7 ", 7), ("\t3\n", 3), ("0128", 128)]
)
def test_max_sessions_accepts_positive_ints(
    caplog: pytest.LogCaptureFixture, raw: str, cap: int
) -> None:
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        resolved = resolve_session_state_config(None, {ENV_MAX_SESSIONS: raw})
    assert resolved.max_sessions == cap
    assert _warnings(caplog) == []


@uses_caplog
@given(cap=st.integers(min_value=1, max_value=10**6), pad=st.text(alphabet=WHITESPACE))
def test_max_sessions_property(caplog: pytest.LogCaptureFixture, cap: int, pad: str) -> None:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        resolved = resolve_session_state_config(None, {ENV_MAX_SESSIONS: pad + str(cap) + pad})
    assert resolved.max_sessions == cap
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    "raw",
    [
        "0",
        "-1",
        " -64 ",
        "abc",
        "",
        " ",
        "1.5",
        "1e3",
        "0x10",
        "None",
        "+5",
        "1_000",
        "\u0661\u0662",
    ],
)
def test_max_sessions_rejects_and_warns(caplog: pytest.LogCaptureFixture, raw: str) -> None:
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        resolved = resolve_session_state_config(ON, {ENV_MAX_SESSIONS: raw})
    assert resolved == SessionStateSettings(True, ss.DEFAULT_MAX_SESSIONS)
    messages = _warnings(caplog)
    assert len(messages) == 1
    assert ENV_MAX_SESSIONS in messages[0]
    assert repr(raw) in messages[0]


def test_max_sessions_is_independent_of_the_flag() -> None:
    env = {ENV_ENABLE: "off", ENV_MAX_SESSIONS: "3"}
    assert resolve_session_state_config(ON, env) == SessionStateSettings(False, 3)


def test_both_variables_bad_warns_twice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        resolved = resolve_session_state_config(OFF, {ENV_ENABLE: "maybe", ENV_MAX_SESSIONS: "x"})
    assert resolved == SessionStateSettings(False, 64)
    messages = _warnings(caplog)
    assert len(messages) == 2
    assert ENV_ENABLE in messages[0]
    assert ENV_MAX_SESSIONS in messages[1]


def test_the_cap_is_not_a_config_field() -> None:
    with pytest.raises(KeyError):
        OmniDiffusionConfig.from_dict({"max_sessions": 8})
    assert not hasattr(OmniDiffusionConfig(), "max_sessions")


@pytest.mark.parametrize("blank", ["", " ", "\t\n"])
@pytest.mark.parametrize("config_on", [True, False])
def test_blank_flag_reads_as_unset(
    caplog: pytest.LogCaptureFixture, blank: str, config_on: bool
) -> None:
    config = OmniDiffusionConfig(enable_session_state_manager=config_on)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings_ = resolve_session_state_config(config, {ENV_ENABLE: blank})
    assert settings_.enabled is config_on
    assert _warnings(caplog) == []
