"""The denoiser's KV cache on both paths: bit-identical reads, equal bytes, pool release."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from sessionstate import (
    ENV_ENABLE,
    ENV_MAX_SESSIONS,
    KVHandle,
    OmniDiffusionConfig,
    SessionStateManager,
)
from sessionstate._env import ENV_KV_POOL_BYTES
from sessionstate.cli import size_table
from sessionstate.models.dreamzero import DreamZeroPipeline, DreamZeroSession, kv
from sessionstate.models.dreamzero.kv import read_blocks
from tests.models.dreamzero.dz_support import assert_same_output, observations, pipeline_pair, tiny


def _pool_state(pipe: DreamZeroPipeline) -> tuple[list[int], list[int], list[int]]:
    pool = pipe.kv_pool
    assert pool is not None
    return sorted(pool._free), list(pool._refs), list(pool._filled)


def test_both_paths_read_the_same_kv_and_hold_the_same_bytes() -> None:
    cfg = tiny()
    bespoke, managed = pipeline_pair(cfg)
    # 11 steps: window resets (local_attn_size 9) and the sliding KV window both happen.
    for i, o in enumerate(observations(cfg, 11, seed=5)):
        assert_same_output(bespoke.forward(o, "s"), managed.forward(o, "s"), f"step {i}")
        state = bespoke._states["s"]  # type: ignore[index]
        handle = managed.session_values("s")["kv_cache"]
        assert isinstance(handle, KVHandle)
        assert torch.equal(read_blocks(state.kv_cache, state.kv_tokens), handle.read())
        assert len(handle.blocks) == len(state.kv_cache) > 0
    b_stats, m_stats = bespoke.stats(), managed.stats()
    assert m_stats["engine_nbytes:cpu"] == sum(
        t.untyped_storage().nbytes()
        for t in bespoke._states["s"].kv_cache  # type: ignore[index]
    )
    assert m_stats["engine_nbytes:cpu"] > 0
    # Bytes differ only by the encoder output (ring vs history), never by the KV.
    assert b_stats["nbytes:cpu"] > 0


def test_size_table_has_kv_cache_in_the_engine_bucket_equal_on_both_paths() -> None:
    table = size_table("tiny", 3)
    row = table["values"]["kv_cache"]
    assert row["bucket"] == "engine"
    assert row["managed_nbytes"] == row["bespoke_nbytes"] > 0
    cfg = tiny()
    # 1 + 2 + 2 latent frames of 8 tokens, blocks of 16 tokens: 40 tokens in 3 blocks.
    block = cfg.kv_block_tokens * 4 * 2 * cfg.kv_layers * cfg.kv_heads * cfg.kv_head_dim
    assert row["managed_nbytes"] == 3 * block


def test_deploy_kv_bytes_on_meta_are_the_real_geometry() -> None:
    table = size_table("deploy", 2)
    row = table["values"]["kv_cache"]
    # 40 layers x (K, V) x 40 heads x 128 x bf16, 880 tokens per block, 3 latent frames.
    per_frame = 880 * 40 * 2 * 40 * 128 * 2
    assert row["managed_nbytes"] == row["bespoke_nbytes"] == 3 * per_frame


def test_failed_step_leaves_the_pool_as_before_and_the_retry_matches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = tiny()
    reference, pipe = pipeline_pair(cfg)
    obs = observations(cfg, 4, seed=9)
    for o in obs[:3]:
        pipe.forward(o, "s")
        expected = reference.forward(o, "s")
    before = _pool_state(pipe)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("denoiser fault")

    monkeypatch.setattr(pipe.nets, "diffuse", broken)
    with pytest.raises(RuntimeError, match="denoiser fault"):
        pipe.forward(obs[3], "s")
    monkeypatch.undo()
    gc.collect()
    assert _pool_state(pipe) == before
    expected = reference.forward(obs[3], "s")
    assert_same_output(pipe.forward(obs[3], "s"), expected)


def test_drop_evict_and_held_records_return_every_block_once() -> None:
    cfg = tiny()
    environ = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
    pipe = DreamZeroPipeline(
        cfg, environ={**environ, "OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS": "2"}
    )
    assert pipe.kv_pool is not None
    assert isinstance(pipe.manager, SessionStateManager)
    initial = pipe.kv_pool.free_blocks
    obs = observations(cfg, 3, seed=2)
    for o in obs:
        pipe.forward(o, "a")
        pipe.forward(o, "b")
    held = pipe.manager.peek("a")
    assert isinstance(held, DreamZeroSession)
    held_blocks = len(held.kv_cache.blocks)  # type: ignore[union-attr]
    pipe.forward(obs[0], "c")  # evicts "a"; the caller still holds its record
    assert "a" not in pipe.session_ids()
    in_use = initial - pipe.kv_pool.free_blocks
    del held
    assert initial - pipe.kv_pool.free_blocks == in_use - held_blocks
    for sid in ("b", "c"):
        assert pipe.drop_session(sid)
    assert pipe.kv_pool.free_blocks == initial


def test_the_pool_is_sized_by_bytes_and_publishes_its_capacity() -> None:
    cfg = tiny()
    block = kv.block_nbytes(cfg)
    env = {ENV_ENABLE: "1", ENV_KV_POOL_BYTES: str(10 * block + block // 2)}
    pipe = DreamZeroPipeline(cfg, environ=env)
    pool = pipe.kv_pool
    assert pool is not None
    assert pool.num_blocks == 10  # whole blocks only, whatever the session cap
    assert pool.storage.untyped_storage().nbytes() == 10 * block
    (obs,) = observations(cfg, 1, seed=0)
    pipe.forward(obs, "s")
    stats = pipe.stats()
    assert stats["kv_pool_blocks"] == 10
    assert stats["kv_pool_free_blocks"] == pool.free_blocks < 10
    assert stats["kv_pool_block_nbytes"] == block
    assert stats["kv_pool_resident_sessions"] == 10 // kv.handle_blocks(cfg)


def test_the_config_field_sizes_the_pool_and_the_env_overrides_it() -> None:
    cfg = tiny()
    block = kv.block_nbytes(cfg)
    deploy = OmniDiffusionConfig(
        enable_session_state_manager=True,
        model={"preset": "tiny"},
        session_state_kv_pool_bytes=8 * block,
    )
    pool = DreamZeroPipeline(deploy, environ={}).kv_pool
    assert pool is not None
    assert pool.num_blocks == 8
    pool = DreamZeroPipeline(deploy, environ={ENV_KV_POOL_BYTES: str(12 * block)}).kv_pool
    assert pool is not None
    assert pool.num_blocks == 12


def test_without_a_figure_the_pool_keeps_room_for_twice_the_cap() -> None:
    cfg = tiny()
    pipe = DreamZeroPipeline(cfg, environ={ENV_ENABLE: "1", ENV_MAX_SESSIONS: "3"})
    assert pipe.kv_pool is not None
    assert pipe.kv_pool.num_blocks == 2 * 4 * kv.handle_blocks(cfg)


def test_a_pool_too_small_for_one_window_says_the_bytes_needed() -> None:
    cfg = tiny()
    block, need = kv.block_nbytes(cfg), kv.handle_blocks(cfg)
    msg = (
        f"A DreamZero KV pool of {need * block - 1} bytes holds {need - 1} blocks of {block} "
        f"bytes, but one session's window needs {need} blocks ({need * block} bytes); set "
        f"`session_state_kv_pool_bytes` (or {ENV_KV_POOL_BYTES}) to at least {need * block}."
    )
    env = {ENV_ENABLE: "1", ENV_KV_POOL_BYTES: str(need * block - 1)}
    with pytest.raises(ValueError, match=re.escape(msg)):
        DreamZeroPipeline(cfg, environ=env)
    pool = DreamZeroPipeline(cfg, environ={**env, ENV_KV_POOL_BYTES: str(need * block)}).kv_pool
    assert pool is not None
    assert pool.num_blocks == need


def test_one_window_of_blocks_runs_a_session_to_its_sliding_window() -> None:
    cfg = tiny()
    need = kv.handle_blocks(cfg)
    env = {ENV_ENABLE: "1", ENV_KV_POOL_BYTES: str(need * kv.block_nbytes(cfg))}
    small = DreamZeroPipeline(cfg, environ=env)
    bespoke, _ = pipeline_pair(cfg)
    for i, o in enumerate(observations(cfg, 11, seed=3)):
        assert_same_output(bespoke.forward(o, "s"), small.forward(o, "s"), f"step {i}")
