"""Batches through both reference models: `forward_many` against `forward` one by one.

With ``batch_invariant`` a batched step is bit for bit the sessions' own steps (`tree_equal`:
`torch.equal` on every tensor of every output and, at the end, of every record), with KV,
under a byte budget that parks the other half of the sessions, with a KV pool too small for
all of them, and with sessions at different places in their stream in one batch (shape
buckets). Without it the networks run on the whole batch, and the outputs agree to within a
bound per dtype (the figures the Batches page states).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import sessionstate as ss
from sessionstate.models._registry import get_model
from tests.support import assert_stats_equal_a_recount

MODELS = ["dreamzero", "cosmos3"]


def _rounds(
    spec: Any, cfg: Any, *, steps: int, sessions: int, seed: int, stagger: int = 3
) -> list[dict[Any, Any]]:
    # Each session's k-th input in round k; session i joins in round i % stagger, so a
    # round mixes places in the stream (and window) and runs as several shape buckets.
    per: dict[Any, list[Any]] = {}
    for sid, x in spec.episode(cfg, steps=steps, sessions=sessions, seed=seed):
        per.setdefault(sid, []).append(x)
    rounds: list[dict[Any, Any]] = []
    for i, (sid, xs) in enumerate(per.items()):
        late = i % stagger
        for k, x in enumerate(xs[: steps - late]):
            while len(rounds) <= k + late:
                rounds.append({})
            rounds[k + late][sid] = x
    return rounds


def _config(spec: Any, dtype: str = "float32") -> Any:
    return spec.config_from_dict({"preset": "tiny", "dtype": dtype})


def _single_bytes(spec: Any, cfg: Any) -> int:
    probe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    for x in [x for _, x in spec.episode(cfg, steps=4, sessions=1, seed=5)]:
        probe.forward(x, "probe")
    return int(probe.stats()["total_nbytes"])


@pytest.mark.parametrize("model", MODELS)
def test_a_batch_invariant_batch_is_its_sessions_stepped_one_by_one(model: str) -> None:
    spec = get_model(model)
    cfg = _config(spec)
    one = _single_bytes(spec, cfg)
    env = {ss.ENV_ENABLE: "1", ss.ENV_MAX_BYTES: f"cpu={int(one * 4.6)}"}
    if model == "dreamzero":
        pool = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"}).kv_pool
        # Blocks for about four sessions' windows: the other batch's KV parks.
        env[ss.ENV_KV_POOL_BYTES] = str(4 * pool.session_blocks * pool.block_nbytes)
    single = spec.pipeline(cfg, environ=env)
    batched = spec.pipeline(cfg, environ=env)
    rounds = _rounds(spec, cfg, steps=5, sessions=6, seed=3)
    for k, inputs in enumerate(rounds):
        ids = list(inputs)
        for half in (ids[:3], ids[3:]):
            if not half:
                continue
            batch = {sid: inputs[sid] for sid in half}
            outs = batched.forward_many(batch, batch_invariant=True)
            for sid, x in batch.items():
                assert ss.tree_equal(single.forward(x, sid), outs[sid]), f"round {k}, {sid}"
    for sid in single.session_ids():
        mine, theirs = single.session_values(sid), batched.session_values(sid)
        assert ss.tree_equal(mine, theirs), sid
        # A batched session keeps its own tensors, never a view into the batch's.
        assert ss.nbytes_by_device(theirs) == ss.nbytes_by_device(mine), sid
    stats = batched.stats()
    assert stats["parks"] > 0, "the budget parked the other batch"
    if model == "dreamzero":
        assert stats["kv_parks"] > 0, "the pool was too small for every session's KV"
    assert batched.session_ids() == single.session_ids()
    manager = batched.manager
    assert manager is not None
    assert_stats_equal_a_recount(manager)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("dtype", "bound"), [("float32", 1e-5), ("bfloat16", 0.03)])
def test_a_batch_without_invariance_agrees_within_its_bound(
    model: str, dtype: str, bound: float
) -> None:
    spec = get_model(model)
    cfg = _config(spec, dtype)
    env = {ss.ENV_ENABLE: "1"}
    single = spec.pipeline(cfg, environ=env)
    batched = spec.pipeline(cfg, environ=env)
    worst = 0.0
    # Every session in one bucket: the networks run on a batch of four.
    for inputs in _rounds(spec, cfg, steps=4, sessions=4, seed=11, stagger=1):
        outs = batched.forward_many(inputs)
        for sid, x in inputs.items():
            mine = single.forward(x, sid)
            for name in spec.tensor_outputs:
                a, b = getattr(mine, name, None), getattr(outs[sid], name, None)
                if a is None:
                    assert b is None
                    continue
                assert a.dtype == b.dtype
                assert a.shape == b.shape
                worst = max(worst, (a.float() - b.float()).abs().max().item())
    # The Batches page quotes these bounds; the figure itself is printed for its table.
    print(f"{model} {dtype}: max |batched - one by one| = {worst:.3g}")
    assert worst <= bound


@pytest.mark.parametrize("model", MODELS)
def test_a_failed_batch_leaves_every_session_as_it_was(model: str) -> None:
    spec = get_model(model)
    cfg = _config(spec)
    pipe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    manager = pipe.manager
    assert manager is not None
    rounds = _rounds(spec, cfg, steps=3, sessions=3, seed=4)
    pipe.forward_many(rounds[0])
    before = {sid: manager.peek(sid) for sid in manager.session_ids()}
    order = manager.session_ids()
    stats = pipe.stats()
    bad = dict(rounds[1])
    sid = next(iter(bad))
    bad[sid] = _broken(bad[sid])
    with pytest.raises((TypeError, ValueError, RuntimeError, AttributeError)):
        pipe.forward_many(bad)
    assert {s: manager.peek(s) for s in manager.session_ids()} == before
    assert manager.session_ids() == order
    after = pipe.stats()
    for key in ("total_nbytes", "sessions", "kv_pool_free_blocks"):
        assert after.get(key) == stats.get(key), key
    # The same batch, mended, steps as it would have.
    outs = pipe.forward_many(rounds[1])
    assert set(outs) == set(rounds[1])


def _broken(x: Any) -> Any:
    # An input that passes the front door and fails inside the networks: a wrong shape.
    import attrs

    if hasattr(x, "control"):
        return attrs.evolve(x, control=torch.zeros(x.control.numel() + 1))
    state = x.state
    return attrs.evolve(x, state=torch.zeros(0, dtype=state.dtype))


@pytest.mark.parametrize("model", MODELS)
def test_the_bespoke_path_steps_a_batch_one_by_one(model: str) -> None:
    spec = get_model(model)
    cfg = _config(spec)
    bespoke = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "0"})
    managed = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    for inputs in _rounds(spec, cfg, steps=3, sessions=3, seed=8):
        a = bespoke.forward_many(inputs)
        b = managed.forward_many(inputs, batch_invariant=True)
        assert list(a) == list(inputs)
        assert all(ss.tree_equal(a[sid], b[sid]) for sid in inputs)


def test_forward_many_refuses_what_it_cannot_step() -> None:
    spec = get_model("cosmos3")
    cfg = _config(spec)
    pipe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    (sid, x), *_ = spec.episode(cfg, steps=1, sessions=1, seed=0)
    msg = (
        "`forward_many` takes a non-empty mapping of session id to input, got {}; pass "
        "`{{session_id: input, ...}}`."
    )
    for bad in ({}, [(sid, x)]):
        with pytest.raises(ValueError, match="^" + _escape(msg.format(repr(bad))) + "$"):
            pipe.forward_many(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch_invariant"):
        pipe.forward_many({sid: x}, batch_invariant=1)  # type: ignore[arg-type]
    with pytest.raises(ss.SessionStateLostError):
        pipe.forward_many({sid: x}, begin=False)
    assert pipe.session_ids() == []
    managed = pipe._managed
    assert managed is not None
    msg = "A batched step got 1 records and 2 inputs; pass one input per record, in order."
    with pytest.raises(ValueError, match="^" + _escape(msg) + "$"):
        managed.step_batch([managed.new_session()], [x, x])


def _escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize("model", MODELS)
def test_a_plan_stepped_as_one_batch_keeps_what_one_by_one_keeps(model: str) -> None:
    from sessionstate.models.planning import rollout

    spec = get_model(model)
    cfg = _config(spec)
    history = [x for _, x in spec.episode(cfg, steps=3, sessions=1, seed=0)]
    futures = [
        [x for _, x in spec.episode(cfg, steps=2, sessions=1, seed=50 + i)] for i in range(4)
    ]
    plans = []
    for batched in (False, True):
        pipe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
        for x in history:
            pipe.forward(x, "s")
        plan = rollout(pipe, "s", futures, _score, batched=batched)
        plans.append((plan, pipe.session_values("s"), pipe.session_ids()))
    (one, kept_one, ids_one), (batch, kept_batch, ids_batch) = plans
    assert batch.scores == one.scores
    assert batch.best == one.best
    assert batch.nbytes == one.nbytes
    assert ss.tree_equal(batch.outputs, one.outputs)
    assert ss.tree_equal(kept_batch, kept_one)
    assert ids_batch == ids_one == ["s"]


def _score(outputs: Any) -> float:
    return -float(outputs[-1].video_latents.float().abs().mean())


@pytest.mark.parametrize("invariant", [True, False])
def test_a_batch_decodes_each_sessions_frames_as_its_own_step_does(invariant: bool) -> None:
    spec = get_model("dreamzero")
    cfg = spec.config_from_dict({"preset": "tiny", "decode_frames": True})
    single = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    batched = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    worst = 0.0
    for inputs in _rounds(spec, cfg, steps=3, sessions=3, seed=21, stagger=2):
        outs = batched.forward_many(inputs, batch_invariant=invariant)
        for sid, x in inputs.items():
            mine, theirs = single.forward(x, sid), outs[sid]
            assert mine.frames is not None
            assert theirs.frames is not None
            if invariant:
                assert ss.tree_equal(mine, theirs), sid
            worst = max(worst, (mine.frames - theirs.frames).abs().max().item())
    assert worst <= 1e-5
    for sid in single.session_ids():
        mine, theirs = single.session_values(sid), batched.session_values(sid)
        cache_a, cache_b = mine["vae_dec_feat_map"], theirs["vae_dec_feat_map"]
        assert ss.nbytes_by_device(cache_a) == ss.nbytes_by_device(cache_b), sid
        if invariant:
            assert ss.tree_equal(mine, theirs), sid


def test_a_dreamzero_batch_the_pool_cannot_hold_names_the_setting_to_raise() -> None:
    spec = get_model("dreamzero")
    cfg = _config(spec)
    probe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"}).kv_pool
    # Room for one session's window and step (5 blocks): six new sessions at once, a block
    # each, cannot be stepped.
    nbytes = probe.blocks_for_step(0) * probe.block_nbytes
    pipe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1", ss.ENV_KV_POOL_BYTES: str(nbytes)})
    (inputs,) = _rounds(spec, cfg, steps=1, sessions=6, seed=0, stagger=1)
    with pytest.raises(ss.KVPoolExhaustedError) as refused:
        pipe.forward_many(inputs)
    text = str(refused.value)
    assert text.startswith(f"DreamZero batch {list(inputs)!r}: a step can need ")
    assert text.endswith(
        "Drop finished sessions, or step a smaller batch, or raise "
        "`session_state_kv_pool_bytes` to at least "
        f"{refused.value.needed * probe.block_nbytes} bytes."
    )
    assert pipe.session_ids() == []
    assert pipe.kv_pool.free_blocks == pipe.kv_pool.num_blocks
