"""The bespoke Cosmos3 path: mutable `Cosmos3State` objects changed in place.

As upstream: a capped OrderedDict of sessions (the kit's `SessionTable`), and the encode-once
conditioning (the reasoner's K/V of both guidance branches, the RoPE tables) on the
transformer instance, as its ``cached_kv`` fields. One instance serves every session, so its
cache belongs to whichever session wrote it last. With ``session_keyed=True`` the cache
remembers that session's id and a step of any other session drops and re-encodes it: correct,
but interleaved sessions re-encode on every switch. With ``session_keyed=False`` the cache is
dropped only when a session resets (a new or changed prompt), so a session that continues
after another one ran reads the other session's K/V: the interleaving hazard.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from sessionstate import KVPair
from sessionstate.models._kit import BespokePathBase, SessionTable
from sessionstate.models.cosmos3._model import (
    Cosmos3Model,
    Cosmos3Output,
    Cosmos3Request,
    lost_continuation,
    prompt_changed,
    unknown_session,
)
from sessionstate.models.cosmos3.networks import GenerationBlock, GenerationTransformer
from sessionstate.models.cosmos3.state import Cosmos3State

__all__ = ["BespokePath", "instance_cache"]


def instance_cache(transformer: GenerationTransformer) -> tuple[dict[str, KVPair], ...]:
    """The transformer instance's K/V cache: every block's ``cached_kv``, in layer order.

    >>> from sessionstate.models.cosmos3 import Cosmos3Config
    >>> from sessionstate.models.cosmos3.networks import build_networks
    >>> nets = build_networks(Cosmos3Config.preset("tiny"))
    >>> instance_cache(nets.transformer)
    ({}, {}, {})
    """
    blocks = transformer.blocks
    return tuple(dict(b.cached_kv) for b in blocks if isinstance(b, GenerationBlock))


class BespokePath(BespokePathBase[Cosmos3State]):
    """Sessions as mutable `Cosmos3State` objects, the K/V on the transformer instance.

    Args:
        model: The networks and geometry.
        max_sessions: The table's cap.
        on_full: What a new session does at the cap.
        session_keyed: Whether the instance cache remembers the session it was encoded for
            and re-encodes for any other (see the module docs).

    >>> from sessionstate.models.cosmos3 import Cosmos3Config
    >>> from sessionstate.models.cosmos3._model import Cosmos3Model
    >>> model = Cosmos3Model(Cosmos3Config.preset("tiny"), "cpu", "cpu")
    >>> BespokePath(model, 4, "evict", session_keyed=True).stats()["max_sessions"]
    4
    """

    def __init__(
        self, model: Cosmos3Model, max_sessions: int, on_full: str, *, session_keyed: bool
    ) -> None:
        self.model = model
        chunks, seed = model.cfg.context_chunks, model.cfg.seed
        super().__init__(
            SessionTable(
                "Cosmos3",
                lambda: Cosmos3State(chunks, seed),
                max_sessions,
                on_full,
                lost=lost_continuation,
                unknown=unknown_session,
            )
        )
        self.session_keyed = session_keyed

    def forward(
        self, request: Cosmos3Request, session_id: Hashable, begin: bool | None
    ) -> Cosmos3Output:
        """One step of ``session_id``; see `Cosmos3Pipeline.forward`."""
        model = self.model
        nets = model.nets
        tr = nets.transformer
        state = self.table.state(session_id, begin)
        texts = model.texts(request)
        if self.session_keyed and tr.cached_kv_key != session_id:
            tr.clear_cached_kv()
            tr.cached_kv_key = session_id
        reason = None
        if prompt_changed(
            state.prompt_tokens, state.negative_tokens, texts["cond"], texts["uncond"]
        ):
            reason = "session"
            state.reset()
            tr.clear_cached_kv()
        state.prompt_tokens, state.negative_tokens = texts["cond"], texts["uncond"]
        if tr.cached_rope is None:
            tr.cached_rope = nets.rope()

        def kv_for(branch: str) -> Sequence[KVPair]:
            blocks = [b for b in tr.blocks if isinstance(b, GenerationBlock)]
            if any(branch not in b.cached_kv for b in blocks):
                encoded = model.encode_branch(texts[branch])
                for block, pair in zip(blocks, encoded, strict=True):
                    block.cached_kv.setdefault(branch, pair)
            return [b.cached_kv[branch] for b in blocks]

        ctx = state.context_latents
        context = torch.cat(list(ctx), dim=2) if ctx else nets.empty_context()
        noise, state.random_key = model.noise(state.random_key)
        latents = model.denoise(noise, context, request.control, tr.cached_rope, kv_for)
        state.context_latents.append(latents)
        state.video_latents.append(latents.detach().to(model.host_device, copy=True))
        state.chunk_count += 1
        return Cosmos3Output(video_latents=latents, reset=reason)

    def session_values(self, session_id: Hashable) -> dict[str, object]:
        """Every value the session holds or reads, by name (without touching LRU order).

        ``text_kv`` and ``rope_freqs`` are the transformer instance's cache (shared by every
        session: what the next step of any session would read).
        """
        s = self.table.held(session_id)
        tr = self.model.nets.transformer
        return {
            "text_kv": instance_cache(tr),
            "context_latents": tuple(s.context_latents),
            "video_latents": tuple(s.video_latents),
            "random_key": s.random_key,
            "rope_freqs": tr.cached_rope,
            "prompt_tokens": s.prompt_tokens,
            "negative_tokens": s.negative_tokens,
            "chunk_count": s.chunk_count,
        }

    def video_latents(self, session_id: Hashable) -> torch.Tensor | None:
        """Every chunk generated for the session, joined along time (None if none)."""
        chunks = self.table.held(session_id).video_latents
        return torch.cat(chunks, dim=2) if chunks else None

    def stats(self) -> dict[str, int]:
        """The manager's `stats()` keys, computed by hand (the sessions' values plus the
        instance's cache, each storage once)."""
        return self.table.stats(self.session_values)
