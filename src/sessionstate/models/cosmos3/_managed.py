"""The managed Cosmos3 path: a pure step over an immutable `Cosmos3Session`.

``step(state, request) -> (state, out)`` never changes ``state``; `forward` reads the latest
record from a `SessionStateManager`, steps it, and stores the result only when the whole step
succeeded. The session's `EncodeOnceKV` is encoded once per session (layer by layer, staged,
read back by the step's own denoising loop, committed when the step succeeded).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import cast

import torch

from sessionstate import EncodeOnceKV, KVPair, RandomKey, SessionStateSettings
from sessionstate.models._kit import ManagedPathBase, buckets, check_batch, managed_forward
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
        super().__init__(model, settings, Cosmos3Session, unknown_session, lost=lost_continuation)

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
        prep = self._prepare(state, request)
        latents = self.model.denoise(
            prep.noise, prep.context, request.control, prep.rope, prep.kv_for
        )
        return self._finish(prep, latents)

    def step_batch(
        self,
        states: Sequence[Cosmos3Session],
        requests: Sequence[Cosmos3Request],
        *,
        batch_invariant: bool = False,
    ) -> tuple[list[Cosmos3Session], list[Cosmos3Output]]:
        """`step` of many sessions, their networks run once per shape bucket: pure.

        Each session is prepared as `step` prepares it (reset, encode-once K/V, context);
        sessions whose contexts have one shape are denoised as one batch
        (`Cosmos3Model.denoise_batch`); each then commits its own chunk. With
        ``batch_invariant`` every record and output equals `step`'s bit for bit; without it
        the latents agree to within rounding (see the Batches page).

        Raises:
            ValueError: if ``states`` and ``requests`` differ in length.
        """
        check_batch(states, requests)
        preps = [self._prepare(s, r) for s, r in zip(states, requests, strict=True)]
        latents: list[torch.Tensor | None] = [None] * len(preps)
        for group in buckets(preps, key=lambda p: tuple(p.context.shape)):
            done = self.model.denoise_batch(
                [preps[i].noise for i in group],
                [preps[i].context for i in group],
                [requests[i].control for i in group],
                preps[group[0]].rope,
                [preps[i].kv_for for i in group],
                batch_invariant=batch_invariant,
            )
            for i, out in zip(group, done, strict=True):
                latents[i] = out
        pairs = zip(preps, latents, strict=True)
        finished = [self._finish(p, cast(torch.Tensor, x)) for p, x in pairs]
        return [f[0] for f in finished], [f[1] for f in finished]

    def _prepare(self, state: Cosmos3Session, request: Cosmos3Request) -> _Prepared:
        # Everything a step does before its denoising loop: the reset, the RoPE tables, the
        # K/V source (encoding on first read, staged) and the context.
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
        ring = state.context_latents
        context = ring.concat() if len(ring) else nets.empty_context()
        noise, key = model.noise(state.random_key)
        return _Prepared(model, state, texts, reason, rope, kv, context, noise, key)

    def _finish(
        self, prep: _Prepared, latents: torch.Tensor
    ) -> tuple[Cosmos3Session, Cosmos3Output]:
        # What the step changed, in one transition.
        kv = prep.kv
        if kv.has_staged:
            kv = kv.commit()
        state = prep.state
        host = latents.detach().to(self.model.host_device, copy=True)
        objects = {
            "text_kv": kv,
            "context_latents": state.context_latents.commit(latents),
            "video_latents": state.video_latents.commit(host),
            "random_key": prep.key,
        }
        state = state.with_values(
            objects,
            prompt_tokens=prep.texts["cond"],
            negative_tokens=prep.texts["uncond"],
            rope_freqs=prep.rope,
            chunk_count=state.chunk_count + 1,
        )
        return state, Cosmos3Output(video_latents=latents, reset=prep.reason)


class _Prepared:
    """One session's step up to its denoising loop; `kv_for` stages what it encodes."""

    def __init__(
        self,
        model: Cosmos3Model,
        state: Cosmos3Session,
        texts: dict[str, torch.Tensor],
        reason: str | None,
        rope: torch.Tensor,
        kv: EncodeOnceKV,
        context: torch.Tensor,
        noise: torch.Tensor,
        key: RandomKey,
    ) -> None:
        self.model, self.state, self.texts, self.reason = model, state, texts, reason
        self.rope, self.kv, self.context = rope, kv, context
        self.noise, self.key = noise, key

    def kv_for(self, branch: str) -> Sequence[KVPair]:
        """Every layer's K/V of ``branch``: encoded and staged on its first read."""
        if self.kv.missing_layers(branch, include_staged=True):
            for i, pair in enumerate(self.model.encode_branch(self.texts[branch])):
                self.kv = self.kv.stage({branch: {i: pair}})
        pairs: tuple[KVPair, ...] = self.kv.view(branch, include_staged=True)
        return pairs
