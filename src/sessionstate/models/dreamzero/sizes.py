"""The DreamZero size table: per-value bytes of one session on both paths (meta device)."""

from __future__ import annotations

from typing import Any

from sessionstate import DEFAULT_MAX_SESSIONS
from sessionstate.models._sizes import measure_both_paths, values_table
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
    held, session_totals, values = measure_both_paths(
        lambda env: DreamZeroPipeline(cfg, device="meta", host_device="meta", environ=env),
        lambda: scripted_episode(
            cfg, steps=steps, sessions=1, seed=0, prompt_change_every=steps + 1
        ),
    )
    feat = values["managed"]["vae_enc_feat_map"]
    feat_tensors = sum(t is not None for t in feat) if isinstance(feat, tuple) else 0
    return {
        "preset": preset,
        "steps": steps,
        "values": values_table(held, BUCKETS),
        "vae_enc_feat_map_tensors": feat_tensors,
        "session_nbytes": session_totals,
        "sessions_64_nbytes": {k: DEFAULT_MAX_SESSIONS * v for k, v in session_totals.items()},
        "vae_enc_feat_map_64_sessions_nbytes": DEFAULT_MAX_SESSIONS
        * held["managed"]["vae_enc_feat_map"],
    }
