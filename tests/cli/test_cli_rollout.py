"""`sessionstate rollout`: planning with forks on both paths, outputs compared, bytes reported."""

from __future__ import annotations

import json

import pytest
import torch

from sessionstate.cli import main
from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline, Cosmos3Request
from sessionstate.models.planning import keep_branch, rollout


@pytest.mark.parametrize("model", ["cosmos3", "dreamzero"])
def test_rollout_keeps_the_same_branch_on_both_paths_and_forks_hold_less(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["rollout", "--model", model, "--history", "2", "--branches", "3", "--horizon", "2"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is True
    assert report["best"] == max(range(3), key=lambda i: report["scores"][i])
    assert report["sessions_after"] == ["session"]
    managed, copies = report["nbytes"]["managed"], report["nbytes"]["bespoke (deep copies)"]
    assert len(managed) == len(copies) == 2 + 1
    # While the branches live, the forks hold less than the deep copies; once the best is
    # kept, both hold one session.
    assert all(a < b for a, b in zip(managed[:-1], copies[:-1], strict=True))
    assert managed[-1] == copies[-1]


def test_rollout_keeps_the_best_branch_as_the_session() -> None:
    cfg = Cosmos3Config.preset("tiny")
    pipe = Cosmos3Pipeline(cfg, environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"})

    def move(v: float) -> Cosmos3Request:
        return Cosmos3Request(prompt="a red cube", control=torch.full((cfg.control_dim,), v))

    pipe.forward(move(0.0), "s")
    plan = rollout(pipe, "s", [[move(-1.0)], [move(2.0)]], lambda outs: 1.0 if outs else 0.0)
    assert plan.best == 0  # equal scores: the first
    # The session continues from branch 0: as a twin stepped the same way would, its random
    # key branch 0's (the second of three split from the session's: the session, 2 branches).
    twin = Cosmos3Pipeline(cfg, environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"})
    twin.forward(move(0.0), "s")
    assert twin.manager is not None
    twin.manager.put("s", twin.manager.peek("s").split_random(3)[1])
    twin.forward(move(-1.0), "s")
    a, b = pipe.forward(move(0.5), "s"), twin.forward(move(0.5), "s")
    assert torch.equal(a.video_latents, b.video_latents)
    assert pipe.session_ids() == ["s"]
    with pytest.raises(ValueError, match="one positive length"):
        rollout(pipe, "s", [[move(1.0)], []], lambda outs: 0.0)
    assert pipe.session_ids() == ["s"]


@pytest.mark.parametrize("managed", ["0", "1"])
def test_keep_branch_gives_a_hand_made_branch_the_sessions_id(managed: str) -> None:
    import sessionstate as ss

    cfg = Cosmos3Config.preset("tiny")
    pipe = Cosmos3Pipeline(cfg, environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": managed})
    request = Cosmos3Request(prompt="a red cube", control=torch.zeros(cfg.control_dim))
    pipe.forward(request, "s")
    pipe.fork("s", "left", "right")
    pipe.forward(request, "right")
    kept = pipe.session_values("right")
    keep_branch(pipe, "right", "s")
    assert pipe.session_ids() == ["left", "s"]
    now = pipe.session_values("s")
    assert ss.tree_equal(now, kept)  # the branch's state, its random key as it was (not split)
    if managed == "1":  # nothing copied
        ptrs = [
            {t.untyped_storage().data_ptr() for t in ss.tree_leaves(v) if torch.is_tensor(t)}
            for v in (now, kept)
        ]
        assert ptrs[0] == ptrs[1]
    with pytest.raises(ss.SessionStateLostError):
        keep_branch(pipe, "right", "s")
    assert pipe.session_ids() == ["left", "s"]


def test_sizes_says_what_forks_hold_against_deep_copies() -> None:
    from tests.support import run_cli

    proc = run_cli("sizes", "--preset", "tiny", "--steps", "6", "--branches", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    table = json.loads(proc.stdout)
    assert (table["steps"], table["branches"], table["branch_steps"]) == (6, 3, 4)
    # The source once and what each branch wrote, against the source once per copy and once.
    assert table["source_nbytes"] < table["forks_nbytes"] < table["deep_copies_nbytes"]
    ratio = table["forks_nbytes"] / table["deep_copies_nbytes"]
    assert table["forks_over_deep_copies"] == round(ratio, 4)
    refused = run_cli("sizes", "--model", "cosmos3", "--branches", "2")
    assert refused.returncode == 2
    assert "`--branches` measures DreamZero's forks" in refused.stderr
