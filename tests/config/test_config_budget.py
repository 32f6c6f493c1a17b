"""The byte budget's config field, its environment override and the park-tier settings."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from sessionstate import (
    ENV_MAX_BYTES,
    OmniDiffusionConfig,
    SessionState,
    resolve_session_state_config,
)
from sessionstate._env import ENV_HOST_POOL_BYTES, ENV_KV_POOL_BYTES
from sessionstate.models._kit import build_manager

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


# -- budgets that name no device tensors report, or refuse every session (issue 20, item 11) ----

_DEVICE_RULE = (
    "name each budgeted device as tensors report it: a CUDA device with its index ('cuda:0'), "
    "or 'cpu'"
)


def _zero(raw: object) -> str:
    return (
        f"{raw!r} reads as 0 bytes, a budget that refuses every session; give a positive budget "
        "such as '24GiB', or none for no budget"
    )


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("foo=1GiB", f"'foo' is not a device name tensors report; {_DEVICE_RULE}"),
        ("cuda=1GiB", f"'cuda' is not a device name tensors report; {_DEVICE_RULE}"),
        ("CPU=1KiB", f"'CPU' is not a device name tensors report; {_DEVICE_RULE}"),
        ("cpu:0=1KiB", f"'cpu:0' is not a device name tensors report; {_DEVICE_RULE}"),
        ("0", _zero("0")),
        ("0.5", _zero("0.5")),
        ("cpu=1GiB,cuda:0=0", _zero("0")),
        ("cpu=1GiB,cpu=2", "device 'cpu' is named twice; name each device once"),
    ],
)
def test_env_budget_naming_no_device_or_refusing_everything_warns_and_keeps_the_config(
    raw: str, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = OmniDiffusionConfig(session_state_max_bytes=100)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings = resolve_session_state_config(config, {ENV_MAX_BYTES: raw})
    assert settings.max_bytes == 100
    messages = [r.getMessage() for r in caplog.records if r.name == "sessionstate"]
    assert messages == [
        f"Ignoring {ENV_MAX_BYTES}={raw!r}: {reason}; using the config value "
        "session_state_max_bytes=100."
    ]


def test_an_env_budget_on_a_bad_device_never_reaches_a_pipeline() -> None:
    from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline

    environ = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1", ENV_MAX_BYTES: "foo=1GiB"}
    pipe = DreamZeroPipeline(DreamZeroConfig.preset("tiny"), environ=environ)
    assert pipe.manager is not None
    assert pipe.manager.max_bytes is None


@pytest.mark.parametrize(
    ("value", "msg"),
    [
        (0, f"`session_state_max_bytes` must be at least 1 byte: {_zero(0)}."),
        ("0.5", f"`session_state_max_bytes` must be at least 1 byte: {_zero('0.5')}."),
        (
            {"cpu": "0"},
            f"`session_state_max_bytes['cpu']` must be at least 1 byte: {_zero('0')}.",
        ),
        (
            {"foo": "1GiB"},
            "`session_state_max_bytes` key 'foo' (str) is not a device name tensors report; "
            f"{_DEVICE_RULE}.",
        ),
        (
            {"cuda": 5},
            "`session_state_max_bytes` key 'cuda' (str) is not a device name tensors report; "
            f"{_DEVICE_RULE}.",
        ),
    ],
)
def test_python_and_yaml_refuse_the_budgets_the_environment_ignores(
    value: object, msg: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(msg)):
        OmniDiffusionConfig(session_state_max_bytes=value)
    with pytest.raises(ValueError, match=re.escape(msg)):
        OmniDiffusionConfig.from_dict({"session_state_max_bytes": value})


def test_yaml_refusal_names_the_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "deploy.yaml"
    path.write_text("session_state_max_bytes: 0\n")
    msg = (
        f"Deploy config {str(path)!r}: `session_state_max_bytes` must be at least 1 byte: "
        "0 reads as 0 bytes, a budget that refuses every session; give a positive budget "
        "such as '24GiB', or none for no budget."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        OmniDiffusionConfig.from_yaml(path)


@pytest.mark.parametrize("text", ["24GiB", "24 GiB", "25769803776"])
def test_one_budget_text_reads_alike_in_python_yaml_and_the_environment(
    text: str,
    tmp_path,  # type: ignore[no-untyped-def]
) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(f"session_state_max_bytes: {text}\n")
    from_yaml = OmniDiffusionConfig.from_yaml(path).session_state_max_bytes
    from_python = OmniDiffusionConfig(session_state_max_bytes=text).session_state_max_bytes
    from_env = resolve_session_state_config(None, {ENV_MAX_BYTES: text}).max_bytes
    assert from_yaml == from_python == from_env == 24 * GIB


def test_kv_pool_bytes_field_env_override_and_messages(caplog: pytest.LogCaptureFixture) -> None:
    cfg = OmniDiffusionConfig(session_state_kv_pool_bytes="2GiB")
    assert cfg.session_state_kv_pool_bytes == 2 * GIB
    assert resolve_session_state_config(cfg, {}).kv_pool_bytes == 2 * GIB
    assert resolve_session_state_config(None, {}).kv_pool_bytes is None
    env = {ENV_KV_POOL_BYTES: " 3GiB "}
    assert resolve_session_state_config(cfg, env).kv_pool_bytes == 3 * GIB
    assert resolve_session_state_config(cfg, {ENV_KV_POOL_BYTES: " "}).kv_pool_bytes == 2 * GIB
    loaded = OmniDiffusionConfig.from_dict({"session_state_kv_pool_bytes": 4096})
    assert loaded.session_state_kv_pool_bytes == 4096
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings = resolve_session_state_config(cfg, {ENV_KV_POOL_BYTES: "0"})
    assert settings.kv_pool_bytes == 2 * GIB
    assert (
        f"Ignoring {ENV_KV_POOL_BYTES}='0': `{ENV_KV_POOL_BYTES}` must be at least 1 byte: '0' "
        "reads as 0 bytes, a budget that refuses every session; give a positive budget such as "
        "'24GiB', or none for no budget. Using the config value "
        f"session_state_kv_pool_bytes={2 * GIB}."
    ) in caplog.text
    msg = (
        "`session_state_kv_pool_bytes` must be a byte count: a non-negative int or a string like "
        "'24GiB', '512MiB' or '1.5GB'; got 'big' (str)."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        OmniDiffusionConfig(session_state_kv_pool_bytes="big")


def test_the_config_field_takes_the_per_device_text_the_environment_takes() -> None:
    from sessionstate._config import parse_max_bytes

    text = "cuda:0=1GiB, cpu=2MiB"
    from_text = OmniDiffusionConfig.from_dict({"session_state_max_bytes": text})
    assert dict(from_text.session_state_max_bytes) == parse_max_bytes(text)
    assert dict(from_text.session_state_max_bytes) == {"cuda:0": 2**30, "cpu": 2 * 2**20}
    msg = (
        "`session_state_max_bytes` 'cpu=1,cpu=2' is not a budget: device 'cpu' is named "
        "twice; name each device once."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        OmniDiffusionConfig.from_dict({"session_state_max_bytes": "cpu=1,cpu=2"})


def test_host_pool_bytes_field_env_override_and_messages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = OmniDiffusionConfig(session_state_host_pool_bytes="1GiB")
    assert cfg.session_state_host_pool_bytes == GIB
    assert resolve_session_state_config(cfg, {}).host_pool_bytes == GIB
    assert resolve_session_state_config(None, {}).host_pool_bytes is None
    env = {ENV_HOST_POOL_BYTES: " 2GiB "}
    assert resolve_session_state_config(cfg, env).host_pool_bytes == 2 * GIB
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings = resolve_session_state_config(cfg, {ENV_HOST_POOL_BYTES: "lots"})
    assert settings.host_pool_bytes == GIB
    assert ENV_HOST_POOL_BYTES in caplog.text
    assert "session_state_host_pool_bytes=1073741824" in caplog.text
    assert resolve_session_state_config(cfg, {}).host_pool_full == "disk"
    refuse = OmniDiffusionConfig(session_state_host_pool_full="refuse")
    assert resolve_session_state_config(refuse, {}).host_pool_full == "refuse"
    msg = (
        "`session_state_host_pool_full` must be 'disk' or 'refuse', got 'ram' (str): 'disk' "
        "spills a park the host pool cannot hold to the disk tier, 'refuse' refuses it."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        OmniDiffusionConfig(session_state_host_pool_full="ram")  # type: ignore[arg-type]


def test_keep_parked_copies_reaches_the_manager() -> None:
    assert resolve_session_state_config(None, {}).keep_parked_copies is True
    off = OmniDiffusionConfig(session_state_keep_parked_copies=False)
    settings = resolve_session_state_config(off, {})
    assert settings.keep_parked_copies is False
    manager = build_manager(SessionState, settings, torch.device("cpu"))
    assert manager.keep_parked_copies is False
    with pytest.raises(TypeError, match="session_state_keep_parked_copies"):
        OmniDiffusionConfig(session_state_keep_parked_copies="no")  # type: ignore[arg-type]
