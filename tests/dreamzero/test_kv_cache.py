"""The denoiser's KV cache on both paths: bit-identical reads, equal bytes, pool release."""

from __future__ import annotations

import gc

import pytest
import torch
from dz_support import assert_same_output, observations, pipeline_pair, tiny

from sessionstate import KVHandle, SessionStateManager
from sessionstate.cli import size_table
from sessionstate.models.dreamzero import DreamZeroPipeline, DreamZeroSession
from sessionstate.models.dreamzero.kv import read_blocks


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
