"""The managed Cosmos3 path: a pure step over an immutable `Cosmos3Session`.

``step(state, request) -> (state, out)`` never changes ``state``; `forward` reads the latest
record from a `SessionStateManager`, steps it, and stores the result only when the whole step
succeeded. The session's `EncodeOnceKV` is encoded once per session (layer by layer, staged,
read back by the step's own denoising loop, committed when the step succeeded).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from sessionstate import KVPair, SessionStateSettings
from sessionstate.models._kit import ManagedPathBase, managed_forward
from sessionstate.models.cosmos3._model import (
    Cosmos3Model,
    Cosmos3Output,
    Cosmos3Request,
    lost_continuation,
    prompt_changed,
    unknown_session,
)
from sessionstate.models.cosmos3.state import BRANCHES, Cosmos3Session, new_session

__all__ = ["ManagedPath"]


class ManagedPath(ManagedPathBase[Cosmos3Session]):
    """Sessions as immutable records in a `SessionStateManager`, stepped by a pure step.

    Args:
        model: The networks and geometry.
        settings: The resolved session-state settings (cap, ``on_full``, budget, guard).

    >>> from sessionstate import resolve_session_state_config
    >>> from sessionstate.models.cosmos3 import Cosmos3Config
    >>> from sessionstate.models.cosmos3._model import Cosmos3Model
    >>> model = Cosmos3Model(Cosmos3Config.preset("tiny"), "cpu", "cpu")
    >>> path = ManagedPath(model, resolve_session_state_config(None, {}))
    >>> path.session_ids(), path.stats()["max_sessions"]
    ([], 64)
    """

    model: Cosmos3Model

    def __init__(self, model: Cosmos3Model, settings: SessionStateSettings) -> None:
        super().__init__(model, settings, Cosmos3Session, unknown_session)

    def forward(
        self, request: Cosmos3Request, session_id: Hashable, begin: bool | None
    ) -> Cosmos3Output:
        """One step of ``session_id``; see `Cosmos3Pipeline.forward`."""
        return managed_forward(
            self.manager,
            session_id,
            begin,
            new=self.new_session,
            step=lambda state: self.step(state, request),
            lost=lost_continuation,
        )

    def new_session(self) -> Cosmos3Session:
        """An empty session for this model's geometry."""
        return new_session(self.model.cfg)

    def video_latents(self, session_id: Hashable) -> torch.Tensor | None:
        """Every chunk generated for the session, joined along time (None if none)."""
        chunks = self._peek(session_id).video_latents.view()
        return torch.cat(chunks, dim=2) if chunks else None

    def step(
        self, state: Cosmos3Session, request: Cosmos3Request
    ) -> tuple[Cosmos3Session, Cosmos3Output]:
        """``step(state, request) -> (state, out)``: pure; ``state`` is left unchanged.

        The K/V is encoded on the session's first denoising step, one layer at a time, and
        staged; the step's own later denoising steps read it back with
        ``include_staged=True``; it is committed only once the chunk is generated.
        """
        model = self.model
        nets, cfg = model.nets, model.cfg
        texts = model.texts(request)
        reason = None
        if prompt_changed(
            state.prompt_tokens, state.negative_tokens, texts["cond"], texts["uncond"]
        ):
            reason = "session"
            state = self.new_session()
        rope = state.rope_freqs if state.rope_freqs is not None else nets.rope()

        kv = state.text_kv
        if not kv.is_allocated:  # evicted: the prompt tokens are the recompute source
            kv = kv.allocate(num_layers=cfg.num_layers, branches=BRANCHES)

        def kv_for(branch: str) -> Sequence[KVPair]:
            nonlocal kv
            if kv.missing_layers(branch, include_staged=True):
                for i, pair in enumerate(model.encode_branch(texts[branch])):
                    kv = kv.stage({branch: {i: pair}})
            pairs: tuple[KVPair, ...] = kv.view(branch, include_staged=True)
            return pairs

        ring = state.context_latents
        context = ring.concat() if len(ring) else nets.empty_context()
        noise, key = model.noise(state.random_key)
        latents = model.denoise(noise, context, request.control, rope, kv_for)
        if kv.has_staged:
            kv = kv.commit()
        host = latents.detach().to(model.host_device, copy=True)
        # What the step changed, in one transition.
        objects = {
            "text_kv": kv,
            "context_latents": ring.commit(latents),
            "video_latents": state.video_latents.commit(host),
            "random_key": key,
        }
        state = state.with_values(
            objects,
            prompt_tokens=texts["cond"],
            negative_tokens=texts["uncond"],
            rope_freqs=rope,
            chunk_count=state.chunk_count + 1,
        )
        return state, Cosmos3Output(video_latents=latents, reset=reason)
