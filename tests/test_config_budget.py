"""The byte budget's config field, its environment override and the park-tier settings."""

from __future__ import annotations

import logging
import re

import pytest

from sessionstate import ENV_MAX_BYTES, OmniDiffusionConfig, resolve_session_state_config

GIB = 2**30


def test_field_accepts_ints_strings_and_per_device_mappings() -> None:
    assert OmniDiffusionConfig(session_state_max_bytes=5).session_state_max_bytes == 5
    assert OmniDiffusionConfig(session_state_max_bytes="24GiB").session_state_max_bytes == 24 * GIB
    per_device = OmniDiffusionConfig(session_state_max_bytes={"cuda:0": "1GiB", "cpu": 7})
    assert dict(per_device.session_state_max_bytes) == {"cuda:0": GIB, "cpu": 7}  # type: ignore[arg-type]
    loaded = OmniDiffusionConfig.from_dict(
        {"session_state_max_bytes": "2GiB", "session_state_park_tier": "disk"}
    )
    assert loaded.session_state_max_bytes == 2 * GIB
    assert loaded.session_state_park_tier == "disk"


def test_field_messages() -> None:
    msg = (
        "`session_state_max_bytes` must be a byte count: a non-negative int or a string like "
        "'24GiB', '512MiB' or '1.5GB'; got 'huge' (str)."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        OmniDiffusionConfig(session_state_max_bytes="huge")
    msg = "`session_state_park_tier` must be 'host' or 'disk', got 'tape' (str)."
    with pytest.raises(ValueError, match=re.escape(msg)):
        OmniDiffusionConfig(session_state_park_tier="tape")  # type: ignore[arg-type]


def test_resolved_settings_carry_the_budget_and_tier() -> None:
    config = OmniDiffusionConfig(
        enable_session_state_manager=True,
        session_state_max_bytes="1GiB",
        session_state_park_tier="disk",
        session_state_spool_dir="/tmp/spool",
    )
    settings = resolve_session_state_config(config, {})
    assert (settings.max_bytes, settings.park_tier, settings.spool_dir) == (
        GIB,
        "disk",
        "/tmp/spool",
    )
    assert resolve_session_state_config(None, {}).max_bytes is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("3GiB", 3 * GIB), (" 1024 ", 1024), ("cuda:0=1GiB,cpu=2KiB", {"cuda:0": GIB, "cpu": 2048})],
)
def test_env_overrides_the_config(raw: str, expected: object) -> None:
    config = OmniDiffusionConfig(session_state_max_bytes="1GiB")
    assert resolve_session_state_config(config, {ENV_MAX_BYTES: raw}).max_bytes == expected


@pytest.mark.parametrize("raw", ["lots", "cuda:0=", "=5", "-3"])
def test_unparsable_env_warns_and_keeps_the_config(
    raw: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = OmniDiffusionConfig(session_state_max_bytes=100)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings = resolve_session_state_config(config, {ENV_MAX_BYTES: raw})
    assert settings.max_bytes == 100
    expected = (
        f"Ignoring {ENV_MAX_BYTES}={raw!r}: expected a byte count such as 24GiB, or "
        "device=count pairs such as cuda:0=24GiB,cpu=8GiB; using the config value "
        "session_state_max_bytes=100."
    )
    assert expected in caplog.text


def test_empty_env_reads_as_unset(caplog: pytest.LogCaptureFixture) -> None:
    config = OmniDiffusionConfig(session_state_max_bytes=100)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        assert resolve_session_state_config(config, {ENV_MAX_BYTES: " "}).max_bytes == 100
    assert caplog.text == ""
