"""The Cosmos3 size table: per-value bytes of one session on both paths (meta device)."""

from __future__ import annotations

from typing import Any

from sessionstate import DEFAULT_MAX_SESSIONS
from sessionstate.models._sizes import measure_both_paths, values_table
from sessionstate.models.cosmos3.config import Cosmos3Config
from sessionstate.models.cosmos3.episode import scripted_episode
from sessionstate.models.cosmos3.pipeline import Cosmos3Pipeline
from sessionstate.models.cosmos3.state import BUCKETS

__all__ = ["PER_INSTANCE", "REPLAYED", "size_table"]

PER_INSTANCE = ("text_kv", "rope_freqs")
"""Values the bespoke path keeps once per transformer instance, not once per session."""

REPLAYED = ("guided_velocity", "transformer.forward")
"""The `Cosmos3Networks` methods a size table replays from their first call's layout."""


def size_table(preset: str, steps: int, *, full: bool = False) -> dict[str, Any]:
    """Per-value bytes of one session on both paths after ``steps`` steps, on the meta device.

    Each step runs one denoising step instead of the preset's: no value's size depends on
    their number, and on the meta device every step costs the same Python work as a real one.
    The bespoke path keeps `PER_INSTANCE` values on the transformer, one copy for every
    session (which is why interleaved sessions clobber it), so its 64-session figure counts
    them once; the managed path keeps them per session. The `REPLAYED` network calls run
    once per distinct argument layout and are replayed after (see `replay_on_meta`), which
    changes no byte; ``full=True`` (or `size_run` ``(full=True)``) runs every call.

    >>> table = size_table("tiny", 2)
    >>> table["values"]["text_kv"]["bucket"], table["text_kv_layers"]
    ('object', 3)
    """
    cfg = Cosmos3Config.preset(preset, num_inference_steps=1)
    held, session_totals, _, unparkable = measure_both_paths(
        lambda env: Cosmos3Pipeline(cfg, device="meta", host_device="meta", environ=env),
        lambda: scripted_episode(
            cfg, steps=steps, sessions=1, seed=0, prompt_change_every=steps + 1
        ),
        steps=steps,
        replay=REPLAYED,
        full=full,
    )
    shared = sum(held["bespoke"][k] for k in PER_INSTANCE)
    kv_pair = 2 * cfg.num_kv_heads * cfg.text_len * cfg.head_dim * cfg.torch_dtype.itemsize
    return {
        "model": "cosmos3",
        "preset": preset,
        "steps": steps,
        "values": values_table(held, BUCKETS, unparkable),
        "text_kv_layers": cfg.num_layers,
        "text_kv_branches": 2,
        "text_kv_geometry": {
            "num_kv_heads": cfg.num_kv_heads,
            "text_len": cfg.text_len,
            "head_dim": cfg.head_dim,
            "dtype": cfg.dtype,
        },
        "text_kv_pair_nbytes": kv_pair,
        "bespoke_per_instance": list(PER_INSTANCE),
        "session_nbytes": session_totals,
        "sessions_64_nbytes": {
            "managed": DEFAULT_MAX_SESSIONS * session_totals["managed"],
            "bespoke": DEFAULT_MAX_SESSIONS * (session_totals["bespoke"] - shared) + shared,
        },
        "text_kv_64_sessions_nbytes": DEFAULT_MAX_SESSIONS * held["managed"]["text_kv"],
    }
