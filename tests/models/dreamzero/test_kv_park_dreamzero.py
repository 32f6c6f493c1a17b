"""DreamZero's KV parks with its session: six sessions over a pool (or a budget) of about two.

The managed path's outputs stay `torch.equal` to the bespoke path's (which has no pool), with
KV parked and unparked, no eviction and no pool exhaustion; when nothing is left to park, the
step fails with the bytes needed and held, and the stored record and the pool are intact.
"""

from __future__ import annotations

import pytest
import torch

from sessionstate import KVCache, KVPoolExhaustedError, OmniDiffusionConfig, tree_equal
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline, Observation
from sessionstate.models.dreamzero import kv as kv_cache
from sessionstate.models.dreamzero.episode import scripted_episode
from sessionstate.models.dreamzero.state import BUCKETS, new_session

_ON = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
_OFF = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "0"}
_CFG = DreamZeroConfig.preset("tiny")
_SESSIONS = 6


def _run(pipe: DreamZeroPipeline, steps: int = 3) -> list[torch.Tensor]:
    outs = []
    for sid, obs in scripted_episode(pipe.cfg, steps=steps, sessions=_SESSIONS, seed=1):
        out = pipe.forward(obs, sid)
        outs += [out.actions, out.video_latents]
    return outs


def _same(deploy: OmniDiffusionConfig) -> dict[str, int]:
    managed = DreamZeroPipeline(deploy, environ=_ON)
    bespoke = DreamZeroPipeline(deploy, environ=_OFF)
    got, want = _run(managed), _run(bespoke)
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for sid in bespoke.session_ids():
        assert torch.equal(managed.video_latents(sid), bespoke.video_latents(sid))  # type: ignore[arg-type]
    return managed.stats()


def test_the_kv_cache_is_a_parkable_object_of_the_record() -> None:
    state = new_session(_CFG)
    assert isinstance(state.objects["kv_cache"], KVCache)
    assert state.objects["kv_cache"].parkable
    assert state.kv_cache is None
    assert "kv_cache" not in state.attrs
    assert BUCKETS["kv_cache"] == "engine"  # its bytes are engine bytes, wherever they sit


def test_a_record_of_the_earlier_layout_holds_its_handle_in_the_object() -> None:
    pipe = DreamZeroPipeline(_CFG, environ=_ON)
    _run(pipe, steps=1)
    state = pipe.manager.peek("session-0")  # type: ignore[union-attr]
    assert state is not None
    handle = state.kv_cache
    assert handle is not None
    objects = {k: v for k, v in state.objects.items() if k != "kv_cache"}
    old = type(state)(objects=objects, attrs={**state.attrs, "kv_cache": handle})
    assert old.kv_cache is handle
    assert "kv_cache" not in old.attrs
    assert tree_equal(old, state)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_six_sessions_over_a_pool_of_two_park_kv_and_match_the_bespoke_path(tier: str) -> None:
    blocks = 2 * (kv_cache.handle_blocks(_CFG) + 1)
    deploy = OmniDiffusionConfig(
        model={"preset": "tiny"},
        session_state_kv_pool_bytes=blocks * kv_cache.block_nbytes(_CFG),
        session_state_park_tier=tier,
    )
    stats = _same(deploy)
    assert stats["kv_pool_resident_sessions"] == 2
    assert stats["kv_parks"] > 0
    assert stats["kv_unparks"] > 0
    assert stats["evictions"] == 0


def test_six_sessions_under_a_budget_of_two_park_kv_and_match_the_bespoke_path() -> None:
    unbudgeted = DreamZeroPipeline(OmniDiffusionConfig(model={"preset": "tiny"}), environ=_ON)
    _run(unbudgeted)
    per_session = unbudgeted.stats()["nbytes:cpu"] // _SESSIONS
    deploy = OmniDiffusionConfig(
        model={"preset": "tiny"},
        session_state_max_bytes=2 * per_session,
        session_state_park_tier="disk",
    )
    stats = _same(deploy)
    assert stats["nbytes:cpu"] <= 2 * per_session
    assert stats["kv_parks"] > 0
    assert stats["kv_unparks"] > 0
    assert stats["evictions"] == 0


def test_with_nothing_left_to_park_a_step_fails_with_the_bytes_and_changes_nothing() -> None:
    deploy = OmniDiffusionConfig(
        model={"preset": "tiny"},
        session_state_kv_pool_bytes=kv_cache.handle_blocks(_CFG) * kv_cache.block_nbytes(_CFG),
    )
    pipe = DreamZeroPipeline(deploy, environ=_ON)
    manager, pool = pipe.manager, pipe.kv_pool
    assert manager is not None
    assert pool is not None
    obs: dict[object, list[Observation]] = {}
    for sid, x in scripted_episode(_CFG, steps=4, sessions=2, seed=1):
        obs.setdefault(sid, []).append(x)
    for x in obs["session-0"][:3]:  # 3 of the pool's 4 blocks
        pipe.forward(x, "session-0")
    pipe.forward(obs["session-1"][0], "session-1")  # parks session-0, fits
    assert manager.peek("session-0").parked == ("kv_cache",)  # type: ignore[union-attr]
    # A handle held outside the manager takes the free blocks (session-0's back in the pool:
    # its parked copy is all that holds its tokens now).
    free = pool.free_blocks
    kept = pool.append(
        pool.empty(),
        torch.zeros(free * pool.block_tokens, *pool.token_shape, dtype=pool.storage.dtype),
    )
    with pytest.raises(KVPoolExhaustedError) as info:
        pipe.forward(obs["session-0"][3], "session-0")  # its 3 blocks cannot come back
    message = str(info.value)
    assert "session 'session-0'" in message
    assert f"{pool.block_nbytes} bytes" in message  # the one block free
    assert f"hold the other {3 * pool.block_nbytes} bytes" in message
    assert "session_state_kv_pool_bytes" in message
    # Both sessions are held (session-1 parked to make room), nobody was evicted, and only
    # the handle kept outside holds blocks.
    assert manager.peek("session-0").parked == ("kv_cache",)  # type: ignore[union-attr]
    assert manager.peek("session-1").parked == ("kv_cache",)  # type: ignore[union-attr]
    assert pool.free_blocks == pool.num_blocks - 3
    assert pipe.stats()["evictions"] == 0
    del kept  # its blocks go back: the session continues
    pipe.forward(obs["session-0"][3], "session-0")
