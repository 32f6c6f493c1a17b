"""`plan` against the harness: the sessions planned at a deadline are the sessions measured."""

from __future__ import annotations

import attrs
import pytest

from sessionstate.cli._plan import capacity_plan
from sessionstate.serving import LINGBOT, DeadlineAdmission, DeployShape, sustained_sessions


def _planned(shape: DeployShape, *, prefetch: bool) -> int:
    # The plan's arithmetic over the shape's sizes (as `sessionstate plan --sizes-json` reads
    # them): resident sessions and the swap time; then the deadline's, with no headroom.
    values = {name: {"bucket": "object", "managed_nbytes": n} for name, n in shape.objects.items()}
    table = {
        "preset": "deploy",
        "steps": 1,
        "session_nbytes": {"managed": shape.swap_nbytes},
        "values": values,
    }
    plan = capacity_plan(
        table,
        model=shape.name,
        kv=None,
        device_nbytes=shape.device_nbytes,
        host_nbytes=shape.host_nbytes,
        bandwidth=shape.bandwidth,
        reserved_nbytes=shape.reserved_nbytes,
    )
    admission = DeadlineAdmission(
        chunk_period_s=shape.chunk_period_s,
        step_s=shape.step_s,
        swap_s=plan["swap_in_s"],
        resident=plan["sessions_resident_without_parking"],
        prefetch=prefetch,
        headroom=1.0,
    )
    return admission.limit


# LingBot as declared (a swap's round trip is longer than a period: parking adds nothing),
# and the same sizes with a 4x faster link and a 5x faster step (parking adds sessions).
FAST = attrs.evolve(LINGBOT, name="lingbot-fast", step_s=(0.02,), bandwidth=200e9)


@pytest.mark.parametrize("shape", [LINGBOT, FAST], ids=lambda s: s.name)
@pytest.mark.parametrize("policy", ["lru", "schedule"])
def test_the_plan_and_the_harness_agree_within_ten_percent(shape: DeployShape, policy: str) -> None:
    planned = _planned(shape, prefetch=policy == "schedule")
    measured = sustained_sessions(shape, policy, chunks=30, most=12)  # type: ignore[arg-type]
    assert abs(planned - measured) <= 0.1 * measured, (planned, measured)
    assert measured >= shape.resident_capacity
    if shape is FAST and policy == "schedule":
        assert measured > shape.resident_capacity  # a case where parking buys sessions
