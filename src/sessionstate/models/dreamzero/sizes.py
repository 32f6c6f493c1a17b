"""The DreamZero size table: per-value bytes of one session on both paths (meta device)."""

from __future__ import annotations

from typing import Any

from sessionstate import nbytes_by_device
from sessionstate.models.dreamzero.config import DreamZeroConfig
from sessionstate.models.dreamzero.episode import scripted_episode
from sessionstate.models.dreamzero.pipeline import DreamZeroPipeline
from sessionstate.models.dreamzero.state import BUCKETS

__all__ = ["size_table"]


def size_table(preset: str, steps: int) -> dict[str, Any]:
    """Per-value bytes of one session on both paths after ``steps`` steps, on the meta device.

    >>> table = size_table("tiny", 2)
    >>> table["values"]["vae_encoder_out"]["bucket"]
    'object'
    """
    cfg = DreamZeroConfig.preset(preset)
    held: dict[str, dict[str, int]] = {}
    session_totals: dict[str, int] = {}
    feat_tensors = 0
    for flag, name in (("0", "bespoke"), ("1", "managed")):
        pipe = DreamZeroPipeline(
            cfg,
            device="meta",
            host_device="meta",
            environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": flag},
        )
        episode = scripted_episode(
            cfg, steps=steps, sessions=1, seed=0, prompt_change_every=steps + 1
        )
        for sid, obs in episode:
            pipe.forward(obs, sid)
        values = pipe.session_values("session-0")
        held[name] = {k: sum(nbytes_by_device(v).values()) for k, v in values.items()}
        session_totals[name] = sum(nbytes_by_device(list(values.values())).values())
        feat = values["vae_enc_feat_map"]
        feat_tensors = sum(t is not None for t in feat) if isinstance(feat, tuple) else 0
    return {
        "preset": preset,
        "steps": steps,
        "values": {
            k: {
                "bucket": BUCKETS[k],
                "managed_nbytes": held["managed"][k],
                "bespoke_nbytes": held["bespoke"][k],
            }
            for k in BUCKETS
        },
        "vae_enc_feat_map_tensors": feat_tensors,
        "session_nbytes": session_totals,
        "sessions_64_nbytes": {k: 64 * v for k, v in session_totals.items()},
        "vae_enc_feat_map_64_sessions_nbytes": 64 * held["managed"]["vae_enc_feat_map"],
    }
