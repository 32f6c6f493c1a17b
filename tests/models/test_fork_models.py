"""Forks through both reference models: a branch steps as a deep copy of its source would.

The bespoke path forks the bespoke way (a deep copy of the source's state per branch); the
managed one shares the source's record (`SessionStateManager.fork`). Every output of every
branch is compared with `tree_equal` (`torch.equal` on each tensor), under a byte budget
that parks (the source parked when it forks), with a prefetch before every step.
"""

from __future__ import annotations

from typing import Any

import pytest

import sessionstate as ss
from sessionstate.models._registry import get_model
from tests.support import assert_stats_equal_a_recount

BRANCHES = ("b0", "b1", "b2")


def _inputs(spec: Any, cfg: Any, steps: int, seed: int, **kwargs: Any) -> list[Any]:
    return [x for _, x in spec.episode(cfg, steps=steps, sessions=1, seed=seed, **kwargs)]


@pytest.mark.parametrize("model", ["dreamzero", "cosmos3"])
def test_a_branch_steps_as_a_deep_copy_of_its_source_would(model: str) -> None:
    spec = get_model(model)
    cfg = spec.config_from_dict({"preset": "tiny"})
    source_inputs = _inputs(spec, cfg, 3, seed=0)
    probe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    for x in source_inputs:
        probe.forward(x, "src")
    one = probe.stats()["total_nbytes"]
    # Room for about two sessions of their own: the source and fillers park each other, and
    # the branches, once they diverge, too.
    budget = f"cpu={int(one * 2.2)}"
    bespoke = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "0"})
    managed = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1", ss.ENV_MAX_BYTES: budget})
    manager = managed.manager
    assert manager is not None
    for pipe in (bespoke, managed):
        for x in source_inputs:
            pipe.forward(x, "src")
        for filler, x in zip(("f1", "f2"), _inputs(spec, cfg, 2, seed=99), strict=True):
            pipe.forward(x, filler)
    assert manager.session_stats("src")["parked"], "the source forks parked"
    bespoke.fork("src", *BRANCHES)
    managed.fork("src", *BRANCHES)
    # A branch holds the source's every object but its random key (split per branch).
    src, b0 = manager.peek("src"), manager.peek("b0")
    assert all(b0.objects[n] is o for n, o in src.objects.items() if n != "random_key")
    assert all(b0.attrs[n] is v for n, v in src.attrs.items())
    assert not ss.tree_equal(b0.objects["random_key"], src.objects["random_key"])

    branch_inputs = {b: _inputs(spec, cfg, 3, seed=10 + i) for i, b in enumerate(BRANCHES)}
    order = [(b, x) for step in range(3) for b, xs in branch_inputs.items() for x in [xs[step]]]
    for i, (branch, x) in enumerate(order):
        if i + 1 < len(order):
            managed.prefetch(order[i + 1][0], make_room=True)
        a, b = bespoke.forward(x, branch), managed.forward(x, branch)
        assert ss.tree_equal(a, b), f"step {i} of {branch}"
    # The source, never stepped since, continues as it would have.
    a, b = bespoke.forward(source_inputs[0], "src"), managed.forward(source_inputs[0], "src")
    assert ss.tree_equal(a, b)
    stats = manager.stats()
    assert stats["parks"] > 0
    assert stats["prefetches"] > 0
    assert_stats_equal_a_recount(manager)


def test_eight_branches_hold_the_source_once_and_their_own_steps() -> None:
    spec = get_model("dreamzero")
    cfg = spec.config_from_dict({"preset": "tiny"})
    pipe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    manager = pipe.manager
    # One prompt throughout: a changed prompt would reset a branch (sharing nothing).
    for x in _inputs(spec, cfg, 40, seed=0, prompt_change_every=1000):
        pipe.forward(x, "src")
    branches = [f"b{i}" for i in range(8)]
    pipe.fork("src", *branches)
    source = manager.session_stats("src")["nbytes"]["cpu"]
    key = ss.nbytes_by_device(manager.peek("src").random_key)["cpu"]
    assert manager.stats()["total_nbytes"] == source + 8 * key  # each branch's own key
    for i, branch in enumerate(branches):
        for x in _inputs(spec, cfg, 4, seed=100 + i, prompt_change_every=1000):
            pipe.forward(x, branch)
    stats = [manager.session_stats(b) for b in branches]
    own = [s["nbytes"]["cpu"] - s["nbytes_shared"].get("cpu", 0) for s in stats]
    assert all(s["shared_with"][0] == "src" for s in stats)
    # The manager holds the source once and what each branch wrote alone: nothing else.
    assert manager.stats()["total_nbytes"] == source + sum(own)
    assert_stats_equal_a_recount(manager)
    # Eight deep copies hold what the branches share once per branch (the bespoke way's
    # bytes). DreamZero replaces its large objects every step (the Wan caches, the KV
    # window), so four steps in, what a branch still shares is its history.
    copies = sum(s["nbytes"]["cpu"] for s in stats) + source
    shared = [s["nbytes_shared"]["cpu"] for s in stats]
    assert copies - manager.stats()["total_nbytes"] == sum(shared) > 0


def test_a_fork_on_the_bespoke_path_is_a_deep_copy() -> None:
    spec = get_model("dreamzero")
    cfg = spec.config_from_dict({"preset": "tiny"})
    pipe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: "0"})
    for x in _inputs(spec, cfg, 2, seed=0):
        pipe.forward(x, "src")
    pipe.fork("src", "b")
    a, b = pipe.session_values("src"), pipe.session_values("b")
    assert ss.tree_equal(a["prompt_embeds"], b["prompt_embeds"])
    assert a["prompt_embeds"] is not b["prompt_embeds"]
    with pytest.raises(ValueError, match=r"names no branch"):
        pipe.fork("src")
    with pytest.raises(ValueError, match=r"held already or named twice"):
        pipe.fork("src", "b")
    with pytest.raises(ss.SessionStateLostError):
        pipe.fork("nobody", "c")


# Sessions sharing a storage after forking "src" into two branches beside "other": on the
# managed path the family of three; on the bespoke path none for DreamZero (deep copies), and
# every session for Cosmos3 (each reads the transformer's instance cache, counted by hand).
SHARING = {("dreamzero", "0"): 0, ("dreamzero", "1"): 3, ("cosmos3", "0"): 4, ("cosmos3", "1"): 3}


@pytest.mark.parametrize("model", ["dreamzero", "cosmos3"])
def test_the_pipelines_stats_count_forks_and_the_sessions_sharing(model: str) -> None:
    spec = get_model(model)
    cfg = spec.config_from_dict({"preset": "tiny"})
    inputs = _inputs(spec, cfg, 3, seed=3)
    for enabled in ("0", "1"):
        pipe = spec.pipeline(cfg, environ={ss.ENV_ENABLE: enabled})
        for x in inputs[:2]:
            pipe.forward(x, "src")
        pipe.forward(inputs[0], "other")
        before = pipe.stats()
        assert (before["forks"], before["shared_sessions"]) == (0, 0)  # present from the start
        pipe.fork("src", "b0", "b1")
        for branch in ("b0", "b1"):  # a step replaces what a branch writes, not its history
            pipe.forward(inputs[2], branch)
        stats = pipe.stats()
        assert (stats["forks"], stats["shared_sessions"]) == (2, SHARING[model, enabled])
        if enabled == "1":
            assert pipe.manager is not None
            counted = pipe.manager.stats()
            assert (counted["forks"], counted["shared_sessions"]) == (2, 3)
        pipe.fork("b0", "c0")
        assert pipe.stats()["forks"] == 3
