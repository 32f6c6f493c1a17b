"""The DreamZero size table: per-value bytes of one session on both paths (meta device)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from sessionstate import DEFAULT_MAX_SESSIONS
from sessionstate.models._sizes import measure_both_paths, values_table
from sessionstate.models.dreamzero.config import DreamZeroConfig
from sessionstate.models.dreamzero.episode import PROMPTS, scripted_episode
from sessionstate.models.dreamzero.pipeline import DreamZeroPipeline
from sessionstate.models.dreamzero.state import BUCKETS
from sessionstate.models.dreamzero.transform import CAMERAS, Observation

__all__ = ["REPLAYED", "meta_episode", "size_table"]

REPLAYED = (
    "encode_prompt",
    "encode_image",
    "encode_chunk",
    "decode_chunk",
    "observation_latents",
    "prefill_kv",
    "diffuse",
    "postprocess_actions",
    "denoiser.forward",
    "denoiser.attend",
    "denoiser.inp.forward",
    "denoiser.out.forward",
    "vae.quant_conv.forward",
)
"""The `DreamZeroNetworks` methods a size table replays from their first call's layout.

The dotted ones serve the runs of the others: ``diffuse`` runs anew whenever the bespoke
path's whole-history encoder output grows (its reference latents are a view of it), and
its denoising steps, their attention and each latent frame's ``quant_conv`` are alike.
"""


def meta_episode(cfg: DreamZeroConfig, steps: int) -> Iterator[tuple[str, Observation]]:
    """The size table's episode with its camera images on meta: shapes without pixels.

    The same steps as ``scripted_episode(cfg, steps=steps, sessions=1, seed=0,
    prompt_change_every=steps + 1)``: one session, ``session-0``, whose prompt never changes.
    Both paths move the stitched canvas to the model's device before anything reads it, so
    pixel values never reach a byte count; drawing and resizing them on the host is most of
    a step's time once the networks are replayed.

    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> [(sid, obs.images["wrist_image_left"].device.type) for sid, obs in
    ...  meta_episode(DreamZeroConfig.preset("tiny"), 2)]
    [('session-0', 'meta'), ('session-0', 'meta')]
    """
    shape = (cfg.camera_height, cfg.camera_width, 3)
    for _ in range(steps):
        images = {cam: torch.empty(shape, dtype=torch.uint8, device="meta") for cam in CAMERAS}
        yield (
            "session-0",
            Observation(images=images, prompt=PROMPTS[0], state=torch.zeros(cfg.action_dim)),
        )


def size_table(preset: str, steps: int, *, full: bool = False) -> dict[str, Any]:
    """Per-value bytes of one session on both paths after ``steps`` steps, on the meta device.

    The `REPLAYED` network calls run once per distinct argument layout and are replayed after
    (see `replay_on_meta`), on the images of `meta_episode`; neither changes a byte.
    ``full=True`` (or `size_run` ``(full=True)``) runs every call of the scripted episode,
    as a check: minutes at deploy.

    >>> table = size_table("tiny", 2)
    >>> table["values"]["vae_encoder_out"]["bucket"]
    'object'
    """
    cfg = DreamZeroConfig.preset(preset)
    held, session_totals, values, unparkable = measure_both_paths(
        lambda env: DreamZeroPipeline(cfg, device="meta", host_device="meta", environ=env),
        lambda: scripted_episode(
            cfg, steps=steps, sessions=1, seed=0, prompt_change_every=steps + 1
        ),
        steps=steps,
        replay=REPLAYED,
        meta_episode=lambda: meta_episode(cfg, steps),
        full=full,
    )
    feat = values["managed"]["vae_enc_feat_map"]
    feat_tensors = sum(t is not None for t in feat) if isinstance(feat, tuple) else 0
    return {
        "preset": preset,
        "steps": steps,
        "values": values_table(held, BUCKETS, unparkable),
        "vae_enc_feat_map_tensors": feat_tensors,
        "session_nbytes": session_totals,
        "sessions_64_nbytes": {k: DEFAULT_MAX_SESSIONS * v for k, v in session_totals.items()},
        "vae_enc_feat_map_64_sessions_nbytes": DEFAULT_MAX_SESSIONS
        * held["managed"]["vae_enc_feat_map"],
    }


def branch_table(
    preset: str, *, steps: int = 40, branches: int = 8, branch_steps: int = 4
) -> dict[str, Any]:
    """What ``branches`` forks of a session hold against as many deep copies, on meta.

    One managed session steps ``steps`` times, is forked into ``branches`` branches
    (`SessionStateManager.fork`) and each branch steps ``branch_steps`` times more. The
    manager holds the source once and what each branch wrote alone; the bespoke way (a deep
    copy of the source per branch, each then stepped) holds the source once per branch and
    once more for itself. Network calls are replayed as for `size_table`.

    >>> table = branch_table("tiny", steps=3, branches=2, branch_steps=1)
    >>> table["forks_nbytes"] < table["deep_copies_nbytes"]
    True
    """
    from sessionstate._env import ENV_ENABLE
    from sessionstate.models._sizes import replay_on_meta

    cfg = DreamZeroConfig.preset(preset)
    pipe = DreamZeroPipeline(cfg, device="meta", host_device="meta", environ={ENV_ENABLE: "1"})
    replay_on_meta(pipe.nets, REPLAYED, {})
    inputs = [obs for _, obs in meta_episode(cfg, steps + branch_steps)]
    for obs in inputs[:steps]:
        pipe.forward(obs, "source")
    manager = pipe.manager
    assert manager is not None
    source = sum(manager.session_stats("source")["nbytes"].values())
    ids = [f"branch-{i}" for i in range(branches)]
    pipe.fork("source", *ids)
    for sid in ids:
        for obs in inputs[steps:]:
            pipe.forward(obs, sid)
    held = [sum(manager.session_stats(sid)["nbytes"].values()) for sid in ids]
    forks = int(manager.stats()["total_nbytes"])
    copies = source + sum(held)
    return {
        "preset": preset,
        "steps": steps,
        "branches": branches,
        "branch_steps": branch_steps,
        "source_nbytes": source,
        "forks_nbytes": forks,
        "deep_copies_nbytes": copies,
        "forks_over_deep_copies": round(forks / copies, 4),
    }
