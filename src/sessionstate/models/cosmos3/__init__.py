"""A Cosmos3-shaped streaming world model with bespoke and manager-backed session state.

Per session it keeps the reasoner's text K/V for every transformer layer and both
classifier-free-guidance branches (an `EncodeOnceKV`, encoded once on the session's first
denoising step and reread by every later one), the generation pathway's RoPE tables, a ring of
context chunks and every generated chunk. The networks are small seeded stand-ins; the
``deploy`` preset carries the real model's layer count and K/V geometry (assumed, see
`Cosmos3Config`) for size tables on the meta device.
"""

# The names load on first use (PEP 562), as DreamZero's: reading the config imports no
# pipeline. Type checkers read the imports below.
from typing import TYPE_CHECKING

from sessionstate.models._registry import lazy_exports

if TYPE_CHECKING:
    from sessionstate.models.cosmos3.config import MAX_COSMOS3_SESSIONS, PRESETS, Cosmos3Config
    from sessionstate.models.cosmos3.pipeline import (
        Cosmos3Output,
        Cosmos3Pipeline,
        Cosmos3Request,
    )
    from sessionstate.models.cosmos3.state import (
        BRANCHES,
        BUCKETS,
        Cosmos3Session,
        Cosmos3State,
        new_session,
    )

__all__ = [
    "BRANCHES",
    "BUCKETS",
    "MAX_COSMOS3_SESSIONS",
    "PRESETS",
    "Cosmos3Config",
    "Cosmos3Output",
    "Cosmos3Pipeline",
    "Cosmos3Request",
    "Cosmos3Session",
    "Cosmos3State",
    "new_session",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "config": ("MAX_COSMOS3_SESSIONS", "PRESETS", "Cosmos3Config"),
        "pipeline": ("Cosmos3Output", "Cosmos3Pipeline", "Cosmos3Request"),
        "state": ("BRANCHES", "BUCKETS", "Cosmos3Session", "Cosmos3State", "new_session"),
    },
)
