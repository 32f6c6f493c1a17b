"""Cosmos3 per-session state, kept two ways.

`Cosmos3State` is the bespoke, mutable per-session state (prompt tokens, counters, a deque
of context chunks, a list of generated chunks, the random key its noise is drawn from); the
bespoke path keeps the encode-once
conditioning, the reasoner's per-layer K/V of both guidance branches and the RoPE tables, on
the transformer instance instead, as upstream's ``cached_kv`` fields. `Cosmos3Session` is
the whole state as an immutable `SessionState` record: the K/V is an `EncodeOnceKV`, the
context and generated chunks are `LatentBuffer`s, the random state is a `RandomKey` (split when
the session forks), everything else is a `SessionAttr`.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

import torch

from sessionstate import EncodeOnceKV, LatentBuffer, RandomKey, SessionAttr, SessionState
from sessionstate.models.cosmos3.config import Cosmos3Config

__all__ = [
    "BRANCHES",
    "BUCKETS",
    "Cosmos3Session",
    "Cosmos3State",
    "new_session",
]

BRANCHES = ("cond", "uncond")
"""The classifier-free-guidance branches: the prompt and the negative prompt."""

BUCKETS: dict[str, Literal["attrs", "object"]] = {
    "text_kv": "object",
    "context_latents": "object",
    "video_latents": "object",
    "random_key": "object",
    "rope_freqs": "attrs",
    "prompt_tokens": "attrs",
    "negative_tokens": "attrs",
    "chunk_count": "attrs",
}
"""Every Cosmos3 session value and its bucket (see the Models page for why)."""


class Cosmos3State:
    """The bespoke per-session state: mutable fields, updated in place by the pipeline.

    The K/V and RoPE tables are not here: the bespoke path keeps them on the transformer.
    ``random_key`` is the session's random state, seeded from ``seed`` (the config's): each
    chunk draws its noise from it and keeps the next key.
    """

    def __init__(self, context_chunks: int, seed: int = 0) -> None:
        self.seed = seed
        self.random_key = RandomKey.seeded(seed)
        self.prompt_tokens: torch.Tensor | None = None
        self.negative_tokens: torch.Tensor | None = None
        self.chunk_count = 0
        self.context_latents: deque[torch.Tensor] = deque(maxlen=context_chunks)
        self.video_latents: list[torch.Tensor] = []

    def reset(self) -> None:
        """Session reset: forget the prompt, the counters and every latent; the random key
        starts again from the seed's, as a new session's."""
        self.__init__(self.context_latents.maxlen or 1, self.seed)  # type: ignore[misc]


class Cosmos3Session(SessionState):
    """One Cosmos3 session as an immutable record (build it with `new_session`)."""

    prompt_tokens = SessionAttr[torch.Tensor | None](None, doc="Prompt token ids (1, text_len).")
    negative_tokens = SessionAttr[torch.Tensor | None](
        None, doc="Negative-prompt token ids (1, text_len), the unconditional branch."
    )
    chunk_count = SessionAttr(0, coerce=int, doc="Chunks generated since the last reset.")
    rope_freqs = SessionAttr[torch.Tensor | None](
        None, doc="RoPE cos/sin tables of the generation tokens, computed once per session."
    )

    def __attrs_post_init__(self) -> None:
        # Records written before sessions held their random state (every snapshot file of
        # 0.1.0.dev0 up to `cosmos3_v4`) drew their noise from the config's seed and the chunk
        # index: they get a key not allocated, which the next step seeds from the config's seed.
        if "random_key" not in self._objects and "text_kv" in self._objects:
            self._objects["random_key"] = RandomKey(name="random_key")
        super().__attrs_post_init__()

    @property
    def random_key(self) -> RandomKey:
        """The session's random key: each chunk draws its noise from it and keeps the next."""
        return self.object("random_key", RandomKey)

    @property
    def text_kv(self) -> EncodeOnceKV:
        """The reasoner's per-layer K/V of the prompt and the negative prompt."""
        return self.object("text_kv", EncodeOnceKV)

    @property
    def context_latents(self) -> LatentBuffer:
        """Ring of the last ``context_chunks`` generated chunks (the next chunk's context)."""
        return self.object("context_latents", LatentBuffer)

    @property
    def video_latents(self) -> LatentBuffer:
        """Every generated chunk of the session, on the host."""
        return self.object("video_latents", LatentBuffer)

    def values(self) -> dict[str, object]:
        """Every session value by name (for accounting and comparison)."""
        return {name: getattr(self, name) for name in BUCKETS}


def new_session(cfg: Cosmos3Config) -> Cosmos3Session:
    """An empty session: an allocated, empty K/V, empty buffers, a key seeded from
    ``cfg.seed``, attributes at defaults.

    >>> from sessionstate.models.cosmos3 import Cosmos3Config
    >>> s = new_session(Cosmos3Config.preset("tiny"))
    >>> s.text_kv.num_layers, s.text_kv.is_empty, s.context_latents.maxlen
    (3, True, 2)
    """
    return Cosmos3Session(
        objects={
            "text_kv": EncodeOnceKV(name="text_kv").allocate(
                num_layers=cfg.num_layers, branches=BRANCHES
            ),
            "context_latents": LatentBuffer(name="context_latents", dim=2).allocate(
                maxlen=cfg.context_chunks
            ),
            "video_latents": LatentBuffer(name="video_latents", dim=2).allocate(),
            "random_key": RandomKey.seeded(cfg.seed, name="random_key"),
        }
    )
