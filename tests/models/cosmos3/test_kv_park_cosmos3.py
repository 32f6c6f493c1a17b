"""Cosmos3's encode-once K/V parks under a byte budget: six sessions over a budget of two."""

from __future__ import annotations

import attrs
import torch

from sessionstate import OmniDiffusionConfig
from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline
from sessionstate.models.cosmos3.episode import scripted_episode

_ON = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
_OFF = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "0"}
_CFG = Cosmos3Config.preset("tiny")


def _run(pipe: Cosmos3Pipeline) -> list[object]:
    return [pipe.forward(x, sid) for sid, x in scripted_episode(_CFG, steps=3, sessions=6, seed=1)]


def _equal(a: object, b: object) -> bool:
    for f in attrs.fields(type(a)):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if not (torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y):
            return False
    return True


def test_six_sessions_under_a_budget_of_two_park_the_encode_once_kv() -> None:
    unbudgeted = Cosmos3Pipeline(OmniDiffusionConfig(model={"preset": "tiny"}), environ=_ON)
    _run(unbudgeted)
    per_session = unbudgeted.stats()["nbytes:cpu"] // 6
    deploy = OmniDiffusionConfig(
        model={"preset": "tiny"},
        session_state_max_bytes=2 * per_session,
        session_state_park_tier="host",
    )
    managed = Cosmos3Pipeline(deploy, environ=_ON)
    bespoke = Cosmos3Pipeline(deploy, environ=_OFF)
    got, want = _run(managed), _run(bespoke)
    assert all(_equal(a, b) for a, b in zip(got, want, strict=True))
    stats = managed.stats()
    assert stats["nbytes:cpu"] <= 2 * per_session
    assert stats["kv_parks"] > 0
    assert stats["kv_unparks"] > 0
    assert stats["evictions"] == 0
    assert any("text_kv" in managed.manager.peek(s).parked for s in managed.session_ids())  # type: ignore[union-attr]
