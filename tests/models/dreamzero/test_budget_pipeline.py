"""DreamZero under a byte budget: parked sessions come back bit-identical to the bespoke path."""

from __future__ import annotations

import torch

from sessionstate import OmniDiffusionConfig
from sessionstate.cli import build_parser
from sessionstate.models.dreamzero import DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode

_ON = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
_OFF = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "0"}


def _run(pipe: DreamZeroPipeline) -> list[torch.Tensor]:
    outs = []
    for sid, obs in scripted_episode(pipe.cfg, steps=5, sessions=3, seed=1):
        out = pipe.forward(obs, sid)
        outs += [out.actions, out.video_latents]
    return outs


def test_budgeted_managed_path_matches_bespoke_and_parks() -> None:
    model = {"preset": "tiny"}
    unbudgeted = DreamZeroPipeline(OmniDiffusionConfig(model=model), environ=_ON)
    _run(unbudgeted)
    per_session = unbudgeted.stats()["nbytes:cpu"] // 3
    budget = per_session * 3 // 2
    deploy = OmniDiffusionConfig(
        model=model, session_state_max_bytes=budget, session_state_park_tier="host"
    )
    managed = DreamZeroPipeline(deploy, environ=_ON)
    bespoke = DreamZeroPipeline(deploy, environ=_OFF)
    got, want = _run(managed), _run(bespoke)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    stats = managed.stats()
    assert stats["max_bytes:cpu"] == budget
    assert stats["nbytes:cpu"] <= budget
    assert stats["parks"] > 0
    assert stats["unparks"] > 0
    assert stats["evictions"] == 0
    for sid in bespoke.session_ids():
        assert torch.equal(managed.video_latents(sid), bespoke.video_latents(sid))


def test_ab_and_demo_accept_a_budget() -> None:
    args = build_parser().parse_args(["ab", "--max-bytes", "2MiB", "--park-tier", "disk"])
    assert (args.max_bytes, args.park_tier, args.device) == (2 * 2**20, "disk", "cpu")
    assert build_parser().parse_args(["demo", "--max-bytes", "1000"]).max_bytes == 1000
