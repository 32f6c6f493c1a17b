"""The hypothesis profile decides how hard the fault-fuzz machine works.

`TestFaultFuzz` runs a whole pipeline per example, so it takes a share of the profile's budget;
but the share must grow with the profile, or the heavier ``ci`` profile has no effect on it.
"""

from __future__ import annotations

import os

from hypothesis import settings

from tests.support import ROOT, load_module

FAULT_FUZZ = ROOT / "tests" / "models" / "dreamzero" / "test_reliability_stateful.py"


def _fault_fuzz_budget(profile: str) -> tuple[int, int]:
    """Import a fresh copy of the fault-fuzz module with ``profile`` loaded."""
    settings.load_profile(profile)
    try:
        module = load_module(FAULT_FUZZ, f"_fault_fuzz_under_{profile}")
    finally:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
    chosen = module.TestFaultFuzz.settings
    return chosen.max_examples, chosen.stateful_step_count


def test_fault_fuzz_follows_the_loaded_profile() -> None:
    default, ci = _fault_fuzz_budget("default"), _fault_fuzz_budget("ci")
    assert ci[0] > default[0]
    assert ci[1] > default[1]
    # Both stay a share of what the profile gives every other test.
    assert default[0] <= settings.get_profile("default").max_examples
    assert ci[0] <= settings.get_profile("ci").max_examples
