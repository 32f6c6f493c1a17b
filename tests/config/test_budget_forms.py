"""`max_bytes` takes the forms a model's config and its environment variable take.

A mapping or ``device=count`` text budgets the devices it names; a bare count (``"24GiB"``,
an int) is what a config applies to its model's device, which a manager does not know, so the
manager refuses it with a message naming both ways to give the device.
"""

from __future__ import annotations

import re

import pytest
import torch

from sessionstate import SessionState, SessionStateManager, resolve_session_state_config
from sessionstate._config import parse_max_bytes
from sessionstate.models._kit import build_manager

GIB = 2**30


@pytest.mark.parametrize(
    "text",
    ["cuda:0=24GiB,cpu=8GiB", "cpu=1KiB", " cuda:1 = 2 GB , cpu=8 ", "meta=16"],
)
def test_device_count_text_budgets_what_the_config_reads_from_it(text: str) -> None:
    parsed = parse_max_bytes(text)
    assert isinstance(parsed, dict)
    assert SessionStateManager(max_bytes=text).max_bytes == parsed


def test_text_mapping_and_mapping_of_strings_are_one_budget() -> None:
    expected = {"cuda:0": 24 * GIB, "cpu": 8 * GIB}
    assert SessionStateManager(max_bytes="cuda:0=24GiB,cpu=8GiB").max_bytes == expected
    assert SessionStateManager(max_bytes={"cuda:0": "24GiB", "cpu": 8 * GIB}).max_bytes == expected


def test_a_text_budget_is_enforced() -> None:
    manager = SessionStateManager(max_bytes="cpu=16")
    manager.put("a", SessionState(attrs={"x": torch.zeros(4)}))
    manager.put("b", SessionState(attrs={"x": torch.zeros(4)}))  # evicts "a": 16 bytes fit
    assert manager.session_ids() == ["b"]
    assert manager.stats()["nbytes:cpu"] == 16


def _bare(shown: object) -> str:
    return (
        f"`max_bytes` {shown!r} ({type(shown).__name__}) is one byte count with no device, and "
        "a manager cannot know which device it should budget (a model's config applies a bare "
        "count to the model's device). Name the device: "
        f"`max_bytes={{'cuda:0': {shown!r}}}` or `max_bytes='cuda:0={shown}'`."
    )


@pytest.mark.parametrize("bare", ["24GiB", 1024])
def test_a_bare_count_asks_for_its_device(bare: object) -> None:
    with pytest.raises(ValueError, match=re.escape(_bare(bare))):
        SessionStateManager(max_bytes=bare)  # type: ignore[arg-type]


def test_a_bare_count_from_a_config_budgets_the_models_device() -> None:
    # What the config does with the same count: the kit names the model's device.
    env = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES": "24GiB"}
    settings = resolve_session_state_config(None, env)
    manager = build_manager(SessionState, settings, torch.device("cpu"))
    assert manager.max_bytes == {"cpu": 24 * GIB}


@pytest.mark.parametrize(
    ("text", "error", "msg"),
    [
        (
            "cpu=1,cpu=2",
            ValueError,
            "`max_bytes` 'cpu=1,cpu=2' names device 'cpu' twice; name each device once, e.g. "
            "'cuda:0=24GiB,cpu=8GiB'.",
        ),
        (
            "cuda=1GiB",
            ValueError,
            "`max_bytes` key 'cuda' (str) is not a device string with its index; name each "
            "budgeted device as tensors report it, e.g. 'cuda:0' or 'cpu'.",
        ),
        (
            "cpu:0=1KiB",  # tensors report 'cpu': a budget for 'cpu:0' would never apply
            ValueError,
            "`max_bytes` key 'cpu:0' (str) is not a device string with its index; name each "
            "budgeted device as tensors report it, e.g. 'cuda:0' or 'cpu'.",
        ),
        (
            "cpu=lots",
            ValueError,
            "`max_bytes['cpu']` must be a byte count: a non-negative int or a string like "
            "'24GiB', '512MiB' or '1.5GB'; got 'lots' (str).",
        ),
    ],
)
def test_bad_device_count_text_is_refused(text: str, error: type[Exception], msg: str) -> None:
    with pytest.raises(error, match=re.escape(msg)):
        SessionStateManager(max_bytes=text)


@pytest.mark.parametrize("key", ["cpu:0", "CPU", "cuda", torch.device("cuda")])
def test_a_mapping_key_tensors_never_report_is_refused(key: object) -> None:
    msg = f"`max_bytes` key {key!r} ({type(key).__name__}) is not a device string with its index"
    with pytest.raises(ValueError, match=re.escape(msg)):
        SessionStateManager(max_bytes={key: 1})  # type: ignore[dict-item]


def test_a_torch_device_key_is_its_string() -> None:
    assert SessionStateManager(max_bytes={torch.device("cpu"): 8}).max_bytes == {"cpu": 8}  # type: ignore[dict-item]


def test_a_budget_of_another_type_names_both_forms() -> None:
    msg = (
        "`max_bytes` must map device strings to byte budgets, got 2.5 (float); e.g. "
        "`max_bytes={'cuda:0': 24 * 2**30}` or `max_bytes='cuda:0=24GiB'`."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        SessionStateManager(max_bytes=2.5)  # type: ignore[arg-type]
