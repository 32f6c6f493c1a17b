"""Planning with forks: roll out candidate futures of a session, keep the best.

Model predictive control on a reference model: fork the session into one branch per
candidate sequence of inputs, step every branch through its sequence, score each branch's
outputs, keep the best branch as the session and drop the rest. The fork splits the session's
random key, so each branch imagines its future with its own noise; the kept branch's key
becomes the session's. On the managed path a fork
copies nothing (the branches share the session's history until they write), on the bespoke
path each branch is a deep copy: `rollout` reports the bytes held after every step, so the two
can be compared.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs

from sessionstate._checks import check_session_id

__all__ = ["Rollout", "keep_branch", "rollout"]


@attrs.frozen
class Rollout:
    """What `rollout` did: the scores, the branch kept, the outputs and the bytes held.

    Args:
        scores: One score per candidate (higher is better).
        best: The index of the candidate kept.
        outputs: Per candidate, the outputs of its steps.
        nbytes: The pipeline's ``total_nbytes`` after each step of the rollout (every
            branch stepped once), then after the best branch was kept.
    """

    scores: tuple[float, ...]
    best: int
    outputs: tuple[tuple[Any, ...], ...]
    nbytes: tuple[int, ...]


def rollout(
    pipe: Any,
    session_id: Hashable,
    candidates: Sequence[Sequence[Any]],
    score: Callable[[Sequence[Any]], float],
    *,
    batched: bool = False,
) -> Rollout:
    """Roll ``session_id`` out along each candidate input sequence; keep the best as it.

    Args:
        pipe: A reference model's pipeline (`DreamZeroPipeline`, `Cosmos3Pipeline`), either
            path.
        session_id: A held session: the present the futures start from.
        candidates: Per candidate, the inputs of its steps (all of one length).
        score: The score of one candidate's outputs; the highest is kept (the first of equal
            ones).
        batched: Step the branches as one batch per step (``forward_many``, batch-invariant:
            every output as the branches stepped one by one give it).

    Returns:
        The scores, the index kept, every branch's outputs, and the bytes held per step. The
        session then holds the best branch's state (`keep_branch`); the branches are dropped.

    Raises:
        ValueError: for no candidates, or candidates of different lengths.
        SessionStateLostError: if the session is not held.

    >>> import torch
    >>> from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline, Cosmos3Request
    >>> pipe = Cosmos3Pipeline(Cosmos3Config.preset("tiny"),
    ...                        environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"})
    >>> def move(v):
    ...     control = torch.full((pipe.cfg.control_dim,), v)
    ...     return Cosmos3Request(prompt="a red cube", control=control)
    >>> _ = pipe.forward(move(0.0), "s")
    >>> moves = [[move(v)] for v in (-1.0, 0.0, 1.0)]
    >>> plan = rollout(pipe, "s", moves, lambda outs: -float(outs[-1].video_latents.abs().mean()))
    >>> len(plan.scores), pipe.session_ids()
    (3, ['s'])
    """
    check_session_id(session_id)
    lengths = {len(c) for c in candidates}
    if not candidates or len(lengths) != 1 or 0 in lengths:
        msg = (
            f"`rollout` needs candidates of one positive length, got {len(candidates)} "
            f"candidates of lengths {sorted(lengths)}; give each the same number of inputs."
        )
        raise ValueError(msg)
    horizon = lengths.pop()
    branches = [_branch_id(session_id, i) for i in range(len(candidates))]
    pipe.fork(session_id, *branches)
    outputs: list[list[Any]] = [[] for _ in candidates]
    nbytes: list[int] = []
    try:
        for k in range(horizon):
            if batched:
                step = {b: candidates[i][k] for i, b in enumerate(branches)}
                outs = pipe.forward_many(step, begin=False, batch_invariant=True)
                for i, branch in enumerate(branches):
                    outputs[i].append(outs[branch])
                nbytes.append(int(pipe.stats()["total_nbytes"]))
                continue
            for i, branch in enumerate(branches):
                outputs[i].append(pipe.forward(candidates[i][k], branch, begin=False))
            nbytes.append(int(pipe.stats()["total_nbytes"]))
        scores = tuple(float(score(outs)) for outs in outputs)
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        keep_branch(pipe, branches[best], session_id)
    finally:
        for branch in branches:
            pipe.drop_session(branch)
    nbytes.append(int(pipe.stats()["total_nbytes"]))
    return Rollout(
        scores=scores,
        best=best,
        outputs=tuple(tuple(outs) for outs in outputs),
        nbytes=tuple(nbytes),
    )


def keep_branch(pipe: Any, branch_id: Hashable, session_id: Hashable, /) -> None:
    """Make the branch ``branch_id`` the session ``session_id``: the branch's id is given up.

    What `rollout` does with the branch it keeps, for a fork made by hand: ``session_id``
    (if held) is dropped and then holds the branch's state, its random key included (not a
    split of it, so it draws what the branch would have), and ``branch_id`` is dropped. On the
    managed path nothing is copied (a fork that shares the key, then a drop); on the bespoke
    path the branch's state is deep-copied once. ``session_id`` becomes the most recently
    used session.

    Raises:
        SessionStateLostError: if ``branch_id`` is not held (nothing changes).
        ValueError: if ``branch_id`` and ``session_id`` are the same.

    >>> import torch
    >>> from sessionstate.models.cosmos3 import Cosmos3Config, Cosmos3Pipeline, Cosmos3Request
    >>> pipe = Cosmos3Pipeline(Cosmos3Config.preset("tiny"),
    ...                        environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"})
    >>> still = torch.zeros(pipe.cfg.control_dim)
    >>> _ = pipe.forward(Cosmos3Request(prompt="a red cube", control=still), "s")
    >>> pipe.fork("s", "left", "right")
    >>> keep_branch(pipe, "right", "s")
    >>> pipe.session_ids()
    ['left', 's']
    """
    check_session_id(session_id)
    check_session_id(branch_id)
    if branch_id == session_id:
        msg = (
            f"`keep_branch` needs a branch other than the session, got {branch_id!r} for "
            "both; pass the id of a branch forked from it."
        )
        raise ValueError(msg)
    if branch_id not in pipe.session_ids():
        pipe.session_values(branch_id)  # raises: the branch is not held
    pipe.drop_session(session_id)
    pipe.fork(branch_id, session_id, share_random=True)
    pipe.drop_session(branch_id)


def _branch_id(session_id: Hashable, i: int) -> Hashable:
    return (session_id, "branch", i)
