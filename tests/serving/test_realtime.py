"""The real-time clock: every policy leaves each session's outputs as an unbudgeted run's."""

from __future__ import annotations

import torch

from sessionstate.serving import Arrival
from sessionstate.serving._realtime import serve_realtime

# A tiny DreamZero session holds about 0.6 MB after three chunks: the budget holds one and a
# half, so two sessions stepped in turns park and unpark at every step. (A session's first
# chunk is the costly one, seeding its VAE stream: two sessions keep the test short.)
BUDGET = 900_000
SESSIONS = [Arrival("a", 0.0, 3), Arrival("b", 0.0, 3)]


def _run(policy: str, **kwargs: int) -> tuple[dict, dict]:
    figures, server = serve_realtime(
        SESSIONS,
        policy,
        chunk_period_s=3600.0,
        ttfc_s=3600.0,
        **kwargs,  # type: ignore[arg-type]
    )
    return figures, server.outputs


def test_every_policy_gives_each_session_the_outputs_of_an_unbudgeted_run() -> None:
    _, reference = _run("fixed", capacity=10)
    assert [len(reference[a.session_id]) for a in SESSIONS] == [3, 3]
    runs = {
        "fixed": _run("fixed", capacity=1),
        "cap": _run("cap", cap=1),
        "lru": _run("lru", max_bytes=BUDGET),
        "schedule": _run("schedule", max_bytes=BUDGET),
    }
    for policy, (figures, outputs) in runs.items():
        m = figures["metrics"]
        served = {sid for sid in outputs if outputs[sid]}
        assert served == ({"a"} if policy in ("fixed", "cap") else {"a", "b"}), policy
        assert m["refused_sessions"] == 2 - len(served)
        assert m["evictions"] == 0, policy
        if policy in ("lru", "schedule"):
            assert m["parks"] > 0, policy  # the budget made it park
        for sid in served:
            assert len(outputs[sid]) == len(reference[sid])
            for got, want in zip(outputs[sid], reference[sid], strict=True):
                assert torch.equal(got.actions, want.actions), (policy, sid)
                assert torch.equal(got.video_latents, want.video_latents), (policy, sid)
                assert got.reset == want.reset
