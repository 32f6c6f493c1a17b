"""Deterministic scripted episodes: interleaved sessions, prompt changes, window rollovers."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import torch

from sessionstate.models.dreamzero.config import DreamZeroConfig
from sessionstate.models.dreamzero.pipeline import DreamZeroOutput, DreamZeroPipeline
from sessionstate.models.dreamzero.transform import CAMERAS, Observation

__all__ = ["PROMPTS", "finals", "outputs", "scripted_episode"]

PROMPTS = (
    "pick up the red block and place it in the bowl",
    "open the top drawer",
    "wipe the table with the sponge",
)


def scripted_episode(
    cfg: DreamZeroConfig,
    *,
    steps: int,
    sessions: int,
    seed: int,
    prompt_change_every: int = 7,
) -> Iterator[tuple[str, Observation]]:
    """Yield ``(session_id, observation)`` for ``steps`` rounds over ``sessions`` sessions.

    Sessions are interleaved round-robin, in an order shuffled per round from the seed.
    Observations drift smoothly (a seeded random walk), and every session's prompt changes
    every ``prompt_change_every`` of its steps (offset per session), which resets it.

    >>> cfg = DreamZeroConfig.preset("tiny")
    >>> [sid for sid, _ in scripted_episode(cfg, steps=2, sessions=2, seed=0)]
    ['session-1', 'session-0', 'session-0', 'session-1']
    """
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.camera_height, cfg.camera_width, 3)
    images = {
        sid: {cam: torch.randint(0, 256, shape, generator=g).float() for cam in CAMERAS}
        for sid in range(sessions)
    }
    joints = {sid: torch.randn(cfg.action_dim, generator=g) for sid in range(sessions)}
    for step in range(steps):
        order = torch.randperm(sessions, generator=g).tolist()
        for sid in order:
            for cam in CAMERAS:
                drift = torch.randn(shape, generator=g) * 12.0
                images[sid][cam] = (images[sid][cam] + drift).clamp(0, 255)
            joints[sid] = joints[sid] + 0.05 * torch.randn(cfg.action_dim, generator=g)
            prompt = PROMPTS[((step + sid) // prompt_change_every + sid) % len(PROMPTS)]
            yield (
                f"session-{sid}",
                Observation(
                    images={cam: images[sid][cam].to(torch.uint8) for cam in CAMERAS},
                    prompt=prompt,
                    state=joints[sid].clone(),
                ),
            )


def outputs(out: DreamZeroOutput) -> dict[str, Any]:
    """One step's outputs `sessionstate ab` compares, by name: tensors first, then ``reset``.

    ``frames`` is None unless the config decodes them (``decode_frames``).
    """
    return {
        "actions": out.actions,
        "video": out.video_latents,
        "frames": out.frames,
        "reset": out.reset,
    }


def finals(pipe: DreamZeroPipeline) -> dict[str, dict[Hashable, Any]]:
    """Per-session results at the end of an episode: decoded video and latents."""
    decoded = {sid: pipe.decode_video(sid) for sid in pipe.session_ids()}
    latents = {sid: pipe.video_latents(sid) for sid in pipe.session_ids()}
    return {"decoded": decoded, "latents": latents}
