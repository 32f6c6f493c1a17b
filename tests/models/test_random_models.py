"""Random state is session state, through both reference models on both paths.

Each session draws its noise from its own `RandomKey` (seeded from the config's ``seed``):
the managed path keeps it in the record, the bespoke path in its mutable state. A snapshot
carries it, so a restored session continues bit for bit; a fork splits it, so branches fed the
same inputs draw different futures, or shares it on request, so they draw the same. Every
comparison is `torch.equal` on outputs (`tree_equal`), bespoke against managed, in float32
and bfloat16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import sessionstate as ss
from sessionstate.models._registry import get_model

MODELS = ["dreamzero", "cosmos3"]
DTYPES = ["float32", "bfloat16"]


def _setup(model: str, dtype: str) -> tuple[Any, Any, list[Any]]:
    spec = get_model(model)
    cfg = spec.config_from_dict({"preset": "tiny", "dtype": dtype})
    # One prompt throughout, so no step resets the session (a reset starts a new key).
    inputs = [
        x for _, x in spec.episode(cfg, steps=6, sessions=1, seed=0, prompt_change_every=1000)
    ]
    return spec, cfg, inputs


def _pipes(spec: Any, cfg: Any) -> tuple[Any, Any]:
    return (
        spec.pipeline(cfg, environ={ss.ENV_ENABLE: "0"}),
        spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"}),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_a_restored_snapshot_continues_bit_identically(
    model: str, dtype: str, tmp_path: Path
) -> None:
    spec, cfg, inputs = _setup(model, dtype)
    bespoke, managed = _pipes(spec, cfg)
    for x in inputs[:3]:
        assert ss.tree_equal(bespoke.forward(x, "s"), managed.forward(x, "s"))
    key = managed.manager.peek("s").random_key
    assert key.counter == 3  # one draw per step
    assert ss.tree_equal(bespoke.session_values("s")["random_key"], key)
    path = tmp_path / "s.safetensors"
    managed.manager.snapshot("s", path)
    restored = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    restored.manager.restore("s", path)
    for x in inputs[3:]:
        want = bespoke.forward(x, "s")
        assert ss.tree_equal(managed.forward(x, "s"), want)
        assert ss.tree_equal(restored.forward(x, "s"), want)
    assert ss.tree_equal(
        restored.manager.peek("s").random_key, managed.manager.peek("s").random_key
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("model", MODELS)
def test_split_branches_draw_their_own_noise_and_shared_ones_the_same(
    model: str, dtype: str
) -> None:
    spec, cfg, inputs = _setup(model, dtype)
    bespoke, managed = _pipes(spec, cfg)
    for pipe in (bespoke, managed):
        for x in inputs[:2]:
            pipe.forward(x, "src")
        pipe.fork("src", "a", "b")
        pipe.fork("src", "c", "d", share_random=True)
    outs: dict[str, list[Any]] = {}
    for sid in ("a", "b", "c", "d", "src"):
        outs[sid] = []
        for x in inputs[2:4]:  # every branch fed the same inputs
            want = bespoke.forward(x, sid)
            assert ss.tree_equal(managed.forward(x, sid), want), sid
            outs[sid].append(want)
    assert not ss.tree_equal(outs["a"], outs["b"])  # split: each its own noise
    assert not ss.tree_equal(outs["a"], outs["src"])
    assert ss.tree_equal(outs["c"], outs["d"])  # shared: the same noise
    assert ss.tree_equal(outs["c"], outs["src"])  # ... as the source's (split before, kept)
    # Fed different inputs, split branches still agree across paths (the keys split alike).
    for x, y in zip(inputs[4:], inputs[2:4], strict=False):
        assert ss.tree_equal(bespoke.forward(x, "a"), managed.forward(x, "a"))
        assert ss.tree_equal(bespoke.forward(y, "b"), managed.forward(y, "b"))


@pytest.mark.parametrize("model", MODELS)
def test_a_fork_splits_the_key_as_split_random_does(model: str) -> None:
    spec, cfg, inputs = _setup(model, "float32")
    _, managed = _pipes(spec, cfg)
    managed.forward(inputs[0], "src")
    before = managed.manager.peek("src")
    managed.fork("src", "a", "b")
    records = before.split_random(3)
    for sid, record in zip(("src", "a", "b"), records, strict=True):
        assert ss.tree_equal(managed.manager.peek(sid), record), sid
    managed.fork("src", "c", share_random=True)
    assert managed.manager.peek("c") is managed.manager.peek("src")


@pytest.mark.parametrize("model", MODELS)
def test_a_session_reset_starts_a_new_key_and_a_window_reset_keeps_it(model: str) -> None:
    spec, cfg, _ = _setup(model, "float32")
    bespoke, managed = _pipes(spec, cfg)
    episode = list(spec.episode(cfg, steps=5, sessions=1, seed=0, prompt_change_every=3))
    for _, x in episode:
        out = managed.forward(x, "s")
        assert ss.tree_equal(bespoke.forward(x, "s"), out)
    # Reset at step 3 (the prompt changed): two draws since, from a new session's key.
    want = ss.RandomKey.seeded(cfg.seed).normal(())[1].normal(())[1]
    assert ss.tree_equal(managed.manager.peek("s").random_key, want)
    assert ss.tree_equal(bespoke.session_values("s")["random_key"], want)
