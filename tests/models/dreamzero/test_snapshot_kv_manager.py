"""A managed DreamZero session, KV handle included, snapshots and restores through the manager."""

from __future__ import annotations

from pathlib import Path

import torch

import sessionstate as ss
from sessionstate import KVHandle
from sessionstate.models.dreamzero import DreamZeroPipeline, DreamZeroSession
from tests.models.dreamzero.dz_support import assert_same_output, observations, tiny

STEPS = 5
AT = 2


def test_manager_restore_continues_bit_identically(tmp_path: Path) -> None:
    cfg = tiny()
    obs = observations(cfg, STEPS, seed=3)
    reference = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    restored = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    assert reference.manager is not None
    assert restored.manager is not None
    outputs = [reference.forward(o, "s") for o in obs[:AT]]
    saved = reference.manager.peek("s")
    assert isinstance(saved, DreamZeroSession)
    assert isinstance(saved.kv_cache, KVHandle)
    assert saved.kv_cache.tokens > 0

    path = tmp_path / "s.safetensors"
    reference.manager.snapshot("s", path)
    back = restored.manager.restore("s", path)
    assert isinstance(back, DreamZeroSession)
    assert isinstance(back.kv_cache, KVHandle)
    assert back.kv_cache.pool is not restored.kv_pool  # a standalone pool until the next step
    assert ss.tree_equal(back, saved)
    assert ss.nbytes_by_device(back) == ss.nbytes_by_device(saved)

    for i, o in enumerate(obs[AT:], start=AT):
        outputs.append(reference.forward(o, "s"))
        assert_same_output(restored.forward(o, "s"), outputs[i], f"step {i + 1}")
        a, b = restored.manager.peek("s"), reference.manager.peek("s")
        assert isinstance(a, DreamZeroSession)
        assert isinstance(b, DreamZeroSession)
        assert a.kv_cache is not None
        assert a.kv_cache.pool is restored.kv_pool
        assert ss.tree_equal(a, b)
        assert torch.equal(a.kv_cache.read(), b.kv_cache.read())  # type: ignore[union-attr]
