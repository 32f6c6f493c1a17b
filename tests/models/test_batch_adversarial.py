"""Probes that try to break `forward_many` on both reference models.

Every batch runs with ``batch_invariant=True`` against a twin pipeline stepping the same
sessions one by one (`forward`): each output, and at the end each record and its bytes,
must be `torch.equal`; the manager's ledger must equal a recount. The batches mix what a
scheduler mixes: a new session beside held ones, a prompt change (a session reset), a
window reset (DreamZero's ``local_attn_size``), branches of one fork beside their source
(the KV pool's copy-on-write of a shared partial block inside one batch), a KV pool and a
byte budget too small for every session, ``begin``, bf16 and the immutability guard.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from typing import Any

import attrs
import pytest

import sessionstate as ss
from sessionstate.models._registry import get_model
from tests.support import assert_stats_equal_a_recount

MODELS = ["dreamzero", "cosmos3"]


def _inputs(spec: Any, cfg: Any, *, steps: int, sessions: int, seed: int) -> dict[Any, list[Any]]:
    per: dict[Any, list[Any]] = {}
    for sid, x in spec.episode(cfg, steps=steps, sessions=sessions, seed=seed):
        per.setdefault(sid, []).append(x)
    return per


def _env(spec: Any, cfg: Any, *, check: bool, tight: bool) -> dict[str, str]:
    env = {ss.ENV_ENABLE: "1", ss.ENV_CHECK_IMMUTABLE: "1" if check else "0"}
    if tight:
        probe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
        for x in _inputs(spec, cfg, steps=3, sessions=1, seed=5).popitem()[1]:
            probe.forward(x, "probe")
        env[ss.ENV_MAX_BYTES] = f"cpu={int(probe.stats()['total_nbytes'] * 5)}"
        if spec.name == "dreamzero":
            pool = probe.kv_pool
            env[ss.ENV_KV_POOL_BYTES] = str(3 * pool.session_blocks * pool.block_nbytes)
    return env


def _check_round(single: Any, outs: Mapping[Hashable, Any], batch: Mapping[Hashable, Any]) -> None:
    assert list(outs) == list(batch)
    for sid, x in batch.items():
        assert ss.tree_equal(single.forward(x, sid), outs[sid]), sid


def _check_records(single: Any, batched: Any) -> None:
    assert sorted(map(str, single.session_ids())) == sorted(map(str, batched.session_ids()))
    for sid in single.session_ids():
        mine, theirs = single.session_values(sid), batched.session_values(sid)
        assert ss.tree_equal(mine, theirs), sid
        assert ss.nbytes_by_device(theirs) == ss.nbytes_by_device(mine), sid
    assert batched.stats()["total_nbytes"] == single.stats()["total_nbytes"]
    assert_stats_equal_a_recount(batched.manager)


@pytest.mark.parametrize(
    ("model", "dtype", "check", "tight", "steps"),
    [
        ("dreamzero", "float32", False, True, 7),  # 7 rounds: a window resets
        ("dreamzero", "bfloat16", True, False, 4),
        ("cosmos3", "float32", False, True, 7),
        ("cosmos3", "bfloat16", True, False, 7),
    ],
)
def test_a_mixed_batch_with_resets_and_forks_is_its_sessions_one_by_one(
    model: str, dtype: str, check: bool, tight: bool, steps: int
) -> None:
    spec = get_model(model)
    cfg = spec.config_from_dict({"preset": "tiny", "dtype": dtype})
    env = _env(spec, cfg, check=check, tight=tight)
    single, batched = spec.pipeline(cfg, environ=env), spec.pipeline(cfg, environ=env)
    per = _inputs(spec, cfg, steps=steps, sessions=3, seed=21)
    ids = list(per)
    resets: set[str] = set()
    for k in range(steps):
        batch: dict[Hashable, Any] = {}
        if k == 2:
            for pipe in (single, batched):
                pipe.fork(ids[0], "fork-1", "fork-2")
        for i, sid in enumerate(ids):
            if k >= i:  # session i joins in round i: places in the window differ
                x = per[sid][k - i]
                if sid == ids[1] and k == 3:  # a prompt change: that session resets
                    x = attrs.evolve(x, prompt="a different task")
                batch[sid] = x
            if i == 0 and k >= 2:  # the branches and their source step in one batch
                batch["fork-1"] = per[ids[2]][k % 3]
                batch["fork-2"] = per[ids[1]][k % 3]
        order = list(batch)
        for half in (order[:3], order[3:]):  # under the budget: the other half parks
            if half:
                part = {sid: batch[sid] for sid in half}
                outs = batched.forward_many(part, batch_invariant=True)
                resets |= {str(out.reset) for out in outs.values()}
                _check_round(single, outs, part)
                assert_stats_equal_a_recount(batched.manager)
    _check_records(single, batched)
    assert "session" in resets
    if model == "dreamzero" and steps == 7:
        assert "inference" in resets, "a window reset ran inside a batch"
    if tight:
        assert batched.stats()["parks"] > 0
    # A batch holds its members' old records resident together while it stores the new
    # ones, so its peak is higher than one by one; a budget that evicts at that peak (one
    # whose park tier frees nothing) would part the two runs. Not here:
    assert batched.stats()["evictions"] == single.stats()["evictions"] == 0


@pytest.mark.parametrize("model", MODELS)
def test_begin_in_a_batch_is_begin_for_each_session(model: str) -> None:
    spec = get_model(model)
    cfg = spec.config_from_dict({"preset": "tiny"})
    env = {ss.ENV_ENABLE: "1"}
    single, batched = spec.pipeline(cfg, environ=env), spec.pipeline(cfg, environ=env)
    per = _inputs(spec, cfg, steps=3, sessions=3, seed=2)
    a, b, c = per
    for pipe in (single, batched):
        pipe.forward(per[a][0], a)
        pipe.forward(per[b][0], b)
    # begin=True: the held ones start anew beside a new one.
    batch = {a: per[a][1], c: per[c][0], b: per[b][1]}
    outs = batched.forward_many(batch, begin=True, batch_invariant=True)
    for sid, x in batch.items():
        assert ss.tree_equal(single.forward(x, sid, begin=True), outs[sid]), sid
    # begin=False over a batch with a session not held: nothing changes.
    before = {sid: batched.session_values(sid) for sid in batched.session_ids()}
    with pytest.raises(ss.SessionStateLostError, match="'nobody'"):
        batched.forward_many({a: per[a][2], "nobody": per[b][2]}, begin=False)
    assert {sid: batched.session_values(sid) for sid in batched.session_ids()}.keys() == (
        before.keys()
    )
    assert all(ss.tree_equal(before[s], batched.session_values(s)) for s in before)
    batch = {a: per[a][2], b: per[b][2]}
    outs = batched.forward_many(batch, begin=False, batch_invariant=True)
    for sid, x in batch.items():
        assert ss.tree_equal(single.forward(x, sid, begin=False), outs[sid]), sid
    _check_records(single, batched)


class _Keys(Mapping[Hashable, Any]):
    """A broken user mapping: iterates ``keys`` (repeated, or unhashable), one input each."""

    def __init__(self, keys: list[Any], x: Any) -> None:
        self._keys, self._x = keys, x

    def __getitem__(self, key: Hashable) -> Any:
        return self._x

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


@pytest.mark.parametrize("model", MODELS)
def test_a_mapping_that_names_a_session_twice_is_refused_changing_nothing(model: str) -> None:
    spec = get_model(model)
    cfg = spec.config_from_dict({"preset": "tiny"})
    pipe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    (sid, x), *_ = spec.episode(cfg, steps=1, sessions=1, seed=0)
    with pytest.raises(ValueError, match="distinct session ids"):
        pipe.forward_many(_Keys([sid, sid], x))
    assert pipe.session_ids() == []
    with pytest.raises(TypeError):
        pipe.forward_many(_Keys([sid, ["unhashable"]], x))
    assert pipe.session_ids() == []
