"""The park tier's messages: the argument named as written, and a budget it cannot help."""

from __future__ import annotations

import re
import warnings

import pytest

from sessionstate import OmniDiffusionConfig, SessionStateManager


def test_an_unknown_tier_names_the_argument_it_came_from() -> None:
    with pytest.raises(
        ValueError, match=re.escape("`park_tier` must be 'host' or 'disk', got 'ssd' (str).")
    ):
        SessionStateManager(park_tier="ssd")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=re.escape("`session_state_park_tier` must be 'host' or 'disk', got 'ssd' (str)."),
    ):
        OmniDiffusionConfig(session_state_park_tier="ssd")  # type: ignore[arg-type]


def test_host_parking_under_a_cpu_only_budget_warns_with_the_fix() -> None:
    msg = (
        "`park_tier='host'` with a budget on cpu alone (cpu=1048576) frees nothing: the host "
        "tier parks into host memory, which is the cpu's. Pass `park_tier='disk'` to free cpu "
        "memory, or budget the accelerator (`max_bytes={'cuda:0': '24GiB'}`)."
    )
    with pytest.warns(UserWarning, match=re.escape(msg)) as caught:
        SessionStateManager(max_bytes={"cpu": "1MiB"}, park_tier="host")
    assert caught[0].filename == __file__  # stacklevel: the caller's line


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_bytes": {"cpu": "1MiB"}},  # the default tier: not asked for
        {"max_bytes": {"cpu": "1MiB"}, "park_tier": "disk"},
        {"max_bytes": {"cpu": "1MiB", "meta": "1MiB"}, "park_tier": "host"},
        {"park_tier": "host"},  # no budget, nothing parked
    ],
)
def test_host_parking_that_can_help_does_not_warn(kwargs: dict[str, object]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SessionStateManager(**kwargs)  # type: ignore[arg-type]
