"""Deterministic scripted Cosmos3 episodes: interleaved sessions and changing prompts."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import torch

from sessionstate.models.cosmos3.config import Cosmos3Config
from sessionstate.models.cosmos3.pipeline import Cosmos3Output, Cosmos3Pipeline, Cosmos3Request

__all__ = ["NEGATIVE_PROMPT", "PROMPTS", "finals", "outputs", "scripted_episode"]

PROMPTS = (
    "a delivery robot crosses a rainy street at dusk",
    "a forklift lifts a pallet in a warehouse",
    "a drone flies low over a wheat field",
)

NEGATIVE_PROMPT = "blurry, distorted, low quality"


def scripted_episode(
    cfg: Cosmos3Config,
    *,
    steps: int,
    sessions: int,
    seed: int,
    prompt_change_every: int = 5,
) -> Iterator[tuple[str, Cosmos3Request]]:
    """Yield ``(session_id, request)`` for ``steps`` rounds over ``sessions`` sessions.

    Sessions are interleaved round-robin, in an order shuffled per round from the seed; each
    session starts on its own prompt and changes it every ``prompt_change_every`` of its
    steps (offset per session), which resets it. Control vectors drift (a seeded random walk).

    >>> cfg = Cosmos3Config.preset("tiny")
    >>> [sid for sid, _ in scripted_episode(cfg, steps=2, sessions=2, seed=0)]
    ['session-0', 'session-1', 'session-0', 'session-1']
    """
    g = torch.Generator().manual_seed(seed)
    controls = {sid: torch.randn(cfg.control_dim, generator=g) for sid in range(sessions)}
    for step in range(steps):
        order = torch.randperm(sessions, generator=g).tolist()
        for sid in order:
            controls[sid] = controls[sid] + 0.1 * torch.randn(cfg.control_dim, generator=g)
            prompt = PROMPTS[((step + sid) // prompt_change_every + sid) % len(PROMPTS)]
            yield (
                f"session-{sid}",
                Cosmos3Request(
                    prompt=prompt,
                    control=controls[sid].clone(),
                    negative_prompt=NEGATIVE_PROMPT,
                ),
            )


def outputs(out: Cosmos3Output) -> dict[str, Any]:
    """One step's outputs `sessionstate ab` compares, by name: tensors first, then ``reset``."""
    return {"video": out.video_latents, "reset": out.reset}


def finals(pipe: Cosmos3Pipeline) -> dict[str, dict[Hashable, Any]]:
    """Per-session results at the end of an episode: the generated latents."""
    return {"latents": {sid: pipe.video_latents(sid) for sid in pipe.session_ids()}}
