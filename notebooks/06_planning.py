# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06: planning with forks
#
# A world model plans by imagining: from the session's present, roll out several candidate
# control sequences, score the imagined futures, keep the best and forget the rest (model
# predictive control). `sessionstate.models.planning.rollout` does exactly that on a
# reference model's pipeline: it forks the session into one branch per candidate
# (`pipe.fork`), steps every branch through its controls, scores each branch's outputs,
# keeps the best branch as the session and drops the others.
#
# Cosmos3 (tiny preset) is control-conditioned, so each candidate is a sequence of control
# vectors. We run the same plan on both paths of one model: the managed path forks with
# `SessionStateManager.fork` (a branch *is* the session's record until it writes; a step
# copies only what it writes), the bespoke path the way a hand-rolled cache would, with a deep
# copy per branch. The plans must agree bit for bit; the bytes each path holds must not.

# %%
from collections.abc import Sequence
from typing import Any

import torch
from nbsetup import WIDTH, KiB, plt, show

import sessionstate as ss
from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline, Cosmos3Request
from sessionstate.models.cosmos3.episode import scripted_episode
from sessionstate.models.planning import Rollout, rollout

# %%
HISTORY, N, K = 24, 4, 3  # steps before planning; candidates; steps per candidate
cfg = Cosmos3Config.preset("tiny")
episode = scripted_episode(cfg, steps=HISTORY, sessions=1, seed=0, prompt_change_every=HISTORY)
history = [request for _, request in episode]  # one prompt throughout: one growing history


def candidate(i: int) -> list[Cosmos3Request]:
    """Candidate ``i``: K steps of one steady control, from -1 to 1 across the candidates.

    Everything else is the last request's (its prompts): a new prompt would reset the session.
    """
    control = torch.full((cfg.control_dim,), -1.0 + 2.0 * i / (N - 1))
    last = history[-1]
    request = Cosmos3Request(last.prompt, control, negative_prompt=last.negative_prompt)
    return [request for _ in range(K)]


def score(outputs: Sequence[Any]) -> float:
    """Prefer the future whose last latents move least (a stand-in for a task's reward)."""
    return -float(outputs[-1].video_latents.abs().mean())


candidates = [candidate(i) for i in range(N)]
plans: dict[str, tuple[int, Rollout, Cosmos3Pipeline]] = {}
for path, enabled in (("managed", "1"), ("deep copy", "0")):
    pipe = Cosmos3Pipeline(cfg, environ={ss.ENV_ENABLE: enabled})
    for request in history:
        pipe.forward(request, "robot")
    before = pipe.stats()["total_nbytes"]
    plan = rollout(pipe, "robot", candidates, score)
    plans[path] = (before, plan, pipe)
    print(f"{path:>9}: best candidate {plan.best}, scores", [round(s, 4) for s in plan.scores])
    print(f"{'':>9}  sessions after the plan: {pipe.session_ids()}")

# %% [markdown]
# ## The same plan, bit for bit
#
# Every branch's every output on the managed path is `torch.equal` to the deep-copy way's,
# so the scores and the branch kept are the same: sharing the history changes nothing a
# branch computes.

# %%
managed, copied = plans["managed"][1], plans["deep copy"][1]
identical = all(
    ss.tree_equal(a, b)
    for outs_a, outs_b in zip(managed.outputs, copied.outputs, strict=True)
    for a, b in zip(outs_a, outs_b, strict=True)
)
print("every output of every branch bit-identical:", identical)
print(
    "same scores:",
    managed.scores == copied.scores,
    "| same branch kept:",
    managed.best == copied.best,
)

# %% [markdown]
# ## Bytes held per step
#
# The pipeline's `total_nbytes` before the plan (the session alone), after each step of the
# rollout (every branch stepped once) and after the best branch was kept. The deep-copy way
# holds N copies of the session's history from the first step; the managed way holds it once,
# plus what each branch wrote.

# %%
labels = ["present"] + [f"step {k + 1}" for k in range(K)] + ["kept"]
fig, ax = plt.subplots(figsize=(WIDTH, 3.5))
for path, marker in (("deep copy", "x--"), ("managed", "o-")):
    before, plan, _ = plans[path]
    series = [before, *plan.nbytes]
    ax.plot(range(len(series)), [n / KiB for n in series], marker, label=path)
ax.set_xticks(range(len(labels)), labels)
ax.set(ylabel="KiB held", title=f"{N} branches of a Cosmos3 session, {K} steps each")
ax.legend(frameon=False)
show(fig)
for path in ("managed", "deep copy"):
    before, plan, _ = plans[path]
    print(f"{path:>9}: {[before, *plan.nbytes]}")
ratio = max(copied.nbytes[:K]) / max(managed.nbytes[:K])
print(f"at the peak the deep-copy way holds {ratio:.2f}x the managed way's bytes")

# %% [markdown]
# ## What this notebook shows, checked

# %%
assert identical
assert managed.scores == copied.scores
assert managed.best == copied.best
for path in plans:
    assert plans[path][2].session_ids() == ["robot"]  # the branches are dropped
for step in range(K):
    assert managed.nbytes[step] < copied.nbytes[step]
assert plans["managed"][2].stats()["forks"] == N + 1  # N branches, then the kept one back
print("all checks passed")
