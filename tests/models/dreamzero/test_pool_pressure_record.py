"""DreamZero under KV pool pressure, recorded: the net under moving the room loop.

Six sessions step in turn on a pool of two sessions' worth of blocks (twice a full window and
one spare), with and without prefetching the next session, with a cap of six that never evicts
and with a cap of four that refuses. Every output of the managed path is `torch.equal` to the
bespoke path's, and both refuse the same steps. The managed path's park, unpark and prefetch
counts are pinned as recorded when the pipeline's own code made the pool's room
(`_make_kv_room` through `park_until`, and the kit's block arithmetic for `prefetch`); the
manager makes that room now (`SessionStateManager.step` and `prefetch` over the pool's
declared geometry) and gives the same counts. The message of a step that cannot get its
blocks is pinned whole, as the model words it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
import torch

from sessionstate import (
    ENV_ENABLE,
    ENV_MAX_SESSIONS,
    ENV_ON_FULL,
    KVPoolExhaustedError,
    SessionAdmissionError,
)
from sessionstate._env import ENV_KV_POOL_BYTES
from sessionstate.models.dreamzero import DreamZeroPipeline, kv
from sessionstate.models.dreamzero.episode import scripted_episode
from tests.models.dreamzero.dz_support import assert_same_output, tiny
from tests.support import torch_threads

RECORDED = {
    # (prefetch, on_full): managed kv_parks, kv_unparks, prefetches, prefetch_hits,
    # prefetches_dropped; steps refused (each path)
    (False, "evict"): (21, 18, 0, 0, 0, 0),
    (False, "refuse"): (13, 12, 0, 0, 0, 10),
    (True, "evict"): (25, 20, 20, 20, 0, 0),
    (True, "refuse"): (17, 14, 14, 14, 0, 10),
}


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.mark.parametrize(("prefetch", "on_full"), sorted(RECORDED))
def test_six_sessions_on_a_pool_of_two_match_the_bespoke_path_and_the_record(
    prefetch: bool, on_full: str
) -> None:
    cfg = tiny()
    cap = 6 if on_full == "evict" else 4
    blocks = 2 * kv.handle_blocks(cfg) + 1
    common = {ENV_MAX_SESSIONS: str(cap), ENV_ON_FULL: on_full}
    bespoke = DreamZeroPipeline(cfg, environ={**common, ENV_ENABLE: "0"}, max_bespoke_sessions=cap)
    managed = DreamZeroPipeline(
        cfg,
        environ={
            **common,
            ENV_ENABLE: "1",
            ENV_KV_POOL_BYTES: str(blocks * kv.block_nbytes(cfg)),
        },
    )
    assert managed.kv_pool.num_blocks == blocks
    episode = list(scripted_episode(cfg, steps=5, sessions=6, seed=11))
    refused = [0, 0]
    for i, (sid, obs) in enumerate(episode):
        outs = []
        for path, pipe in enumerate((bespoke, managed)):
            try:
                outs.append(pipe.forward(obs, sid))
            except SessionAdmissionError:
                refused[path] += 1
                outs.append(None)
        assert (outs[0] is None) == (outs[1] is None), f"step {i}: refused on one path only"
        if outs[0] is not None:
            assert_same_output(outs[0], outs[1], f"step {i} ({sid})")
        if prefetch and i + 1 < len(episode):
            managed.prefetch(episode[i + 1][0], make_room=True)
    s = managed.stats()
    got = (
        s["kv_parks"],
        s["kv_unparks"],
        s["prefetches"],
        s["prefetch_hits"],
        s["prefetches_dropped"],
        refused[1],
    )
    assert refused[0] == refused[1]
    assert s["evictions"] == 0
    assert got == RECORDED[(prefetch, on_full)]


def test_a_step_that_cannot_get_its_blocks_names_them_and_the_fix() -> None:
    cfg = tiny()
    need = kv.handle_blocks(cfg) + 1
    block = kv.block_nbytes(cfg)
    managed = DreamZeroPipeline(
        cfg, environ={ENV_ENABLE: "1", ENV_KV_POOL_BYTES: str(need * block)}
    )
    ((_, first),) = scripted_episode(cfg, steps=1, sessions=1, seed=4)
    pool = managed.kv_pool
    tokens = torch.zeros(
        pool.num_blocks * pool.block_tokens, *pool.token_shape, dtype=pool.storage.dtype
    )
    hog = pool.append(pool.empty(), tokens)  # held outside the manager: nothing to park
    free = pool.free_blocks
    held = (pool.num_blocks - free) * block
    msg = (
        f"DreamZero session 'b': a step can need {need} KV blocks ({need * block} bytes) of "
        f"pool {pool.name!r}, which has {free} free ({free * block} bytes); live handles hold "
        f"the other {held} bytes, and no other session's KV the manager holds is left to park "
        "(records kept outside the manager hold their blocks). Drop finished sessions, or "
        "raise `session_state_kv_pool_bytes` to at least "
        f"{(pool.num_blocks - free + need) * block} bytes."
    )
    with pytest.raises(KVPoolExhaustedError, match=re.escape(msg)):
        managed.forward(first, "b")
    assert "b" not in managed.session_ids()
    assert pool.free_blocks == free  # the failed step took nothing
    del hog
    out = managed.forward(first, "b")
    assert isinstance(out.actions, torch.Tensor)
