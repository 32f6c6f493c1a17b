"""A DreamZero-shaped streaming world model with bespoke and manager-backed session state.

Real parts where they exist (diffusers' Wan VAE with seeded weights, a diffusers
flow-matching scheduler), small seeded stand-ins for the billion-parameter text, image and
denoising networks.
"""

# The names load on first use (PEP 562): reading the config or the KV geometry (`sessionstate
# plan`) imports neither the pipeline nor diffusers. Type checkers read the imports below.
from typing import TYPE_CHECKING

from sessionstate.models._registry import lazy_exports

if TYPE_CHECKING:
    from sessionstate.models.dreamzero.config import (
        FRAMES_PER_CHUNK,
        MAX_DREAMZERO_SESSIONS,
        PRESETS,
        DreamZeroConfig,
    )
    from sessionstate.models.dreamzero.pipeline import DreamZeroOutput, DreamZeroPipeline
    from sessionstate.models.dreamzero.state import (
        BUCKETS,
        DreamZeroSession,
        DreamZeroState,
        new_session,
        reset_reason,
    )
    from sessionstate.models.dreamzero.transform import CAMERAS, Observation, stitch_views

__all__ = [
    "BUCKETS",
    "CAMERAS",
    "FRAMES_PER_CHUNK",
    "MAX_DREAMZERO_SESSIONS",
    "PRESETS",
    "DreamZeroConfig",
    "DreamZeroOutput",
    "DreamZeroPipeline",
    "DreamZeroSession",
    "DreamZeroState",
    "Observation",
    "new_session",
    "reset_reason",
    "stitch_views",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "config": ("FRAMES_PER_CHUNK", "MAX_DREAMZERO_SESSIONS", "PRESETS", "DreamZeroConfig"),
        "pipeline": ("DreamZeroOutput", "DreamZeroPipeline"),
        "state": ("BUCKETS", "DreamZeroSession", "DreamZeroState", "new_session", "reset_reason"),
        "transform": ("CAMERAS", "Observation", "stitch_views"),
    },
)
