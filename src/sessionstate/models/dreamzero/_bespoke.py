"""The bespoke DreamZero path: mutable `DreamZeroState` objects changed in place.

As upstream: a capped OrderedDict of sessions (the kit's `SessionTable`), and a forward that
writes each step's results into the session's state object.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from sessionstate.models._kit import BespokePathBase, SessionTable
from sessionstate.models.dreamzero import kv as kv_cache
from sessionstate.models.dreamzero._model import (
    BODY_FRAMES,
    DreamZeroModel,
    DreamZeroOutput,
    conditioning_frame,
    lost_continuation,
    unknown_session,
)
from sessionstate.models.dreamzero.state import DreamZeroState, reset_reason
from sessionstate.models.dreamzero.transform import Observation, stitch_views

__all__ = ["BespokePath"]


class BespokePath(BespokePathBase[DreamZeroState]):
    """Sessions as mutable `DreamZeroState` objects in a capped `SessionTable`.

    Args:
        model: The networks and geometry.
        max_sessions: The table's cap.
        on_full: What a new session does at the cap.

    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> from sessionstate.models.dreamzero._model import DreamZeroModel
    >>> model = DreamZeroModel(DreamZeroConfig.preset("tiny"), "cpu", "cpu")
    >>> BespokePath(model, 4, "evict").stats()["max_sessions"]
    4
    """

    def __init__(self, model: DreamZeroModel, max_sessions: int, on_full: str) -> None:
        self.model = model
        seed = model.cfg.seed
        super().__init__(
            SessionTable(
                "DreamZero",
                lambda: DreamZeroState(seed),
                max_sessions,
                on_full,
                lost=lost_continuation,
                unknown=unknown_session,
            )
        )

    def forward(
        self, obs: Observation, session_id: Hashable, begin: bool | None
    ) -> DreamZeroOutput:
        """One step of ``session_id``; see `DreamZeroPipeline.forward`."""
        return self._forward(self.table.state(session_id, begin), obs)

    def session_values(self, session_id: Hashable) -> dict[str, object]:
        """Every value the session holds, by name (without touching LRU order)."""
        return self.table.held(session_id).values()

    def video_latents(self, session_id: Hashable) -> torch.Tensor | None:
        """Every latent chunk generated for the session, joined along time (None if none)."""
        return self.table.held(session_id).get_concatenated_video_latents()

    def clear_accumulated_video_latents(self, session_id: Hashable) -> None:
        """Empty the session's accumulated video latents; marks it most recently used."""
        self.table.held(session_id).video_latents_across_time = []
        self.table.states.move_to_end(session_id)

    def stats(self) -> dict[str, int]:
        """The manager's `stats()` keys, computed by hand."""
        return self.table.stats(self.session_values)

    def _forward(self, state: DreamZeroState, obs: Observation) -> DreamZeroOutput:
        model = self.model
        nets, cfg = model.nets, model.cfg
        stitched = stitch_views(obs, cfg).to(model.device)
        tokens = nets.tokenize(obs.prompt)
        reason = reset_reason(
            state.language, tokens, state.current_start_frame, cfg.local_attn_size
        )
        if reason is not None:
            state.reset(clear_video_latents=reason == "session")
        state.language = tokens
        frames = state.accumulate_frames(stitched, nets.dtype)
        if state.prompt_embeds is None:
            state.prompt_embeds = nets.encode_prompt(tokens)

        window_start = state.current_start_frame == 0
        if window_start:
            clip_feas, ys, cond_latent = nets.encode_image(conditioning_frame(frames))
            if state.vae_stream_initialized:
                self._stream_append(state, frames[:, :, -1:])
            else:
                seed_out, feat_map = nets.encode_chunk(frames[:, :, :1], nets.init_feat_map())
                state.vae_encoder_out = seed_out
                state.vae_enc_feat_map = feat_map
                state.vae_pending_body_frames = None
                state.vae_stream_initialized = True
            state.clip_feas, state.ys = clip_feas, ys
            ref = cond_latent
            state.current_start_frame = 1
        else:
            self._stream_append(state, frames[:, :, -1:])
            assert state.vae_encoder_out is not None
            # The bespoke reader quantises the whole history, then keeps the last frames.
            history = state.vae_encoder_out
            ref = nets.observation_latents([history], cfg.num_frame_per_block)
        assert state.ys is not None
        assert state.clip_feas is not None
        assert state.prompt_embeds is not None
        csf = state.current_start_frame
        if window_start:  # `_kv_create`: the window's cache starts empty
            state.kv_cache, state.kv_tokens = [], 0
        state.kv_tokens = kv_cache.append_blocks(
            state.kv_cache, state.kv_tokens, nets.prefill_kv(ref), cfg
        )
        kv = kv_cache.read_blocks(state.kv_cache, state.kv_tokens)
        noise, state.random_key = model.noise(state.random_key)
        video, out = model.generate(
            ref, state.ys, state.clip_feas, state.prompt_embeds, csf, obs, kv, noise
        )
        pixels, state.vae_dec_feat_map = model.decode(video, state.vae_dec_feat_map)
        state.current_start_frame += cfg.num_frame_per_block
        state.video_latents_across_time.append(video.detach().to(model.host_device, copy=True))
        return DreamZeroOutput(out.actions, out.video_latents, reset=reason, frames=pixels)

    def _stream_append(self, state: DreamZeroState, frame: torch.Tensor) -> None:
        pending = state.vae_pending_body_frames
        state.vae_pending_body_frames = (
            frame.clone() if pending is None else torch.cat([pending, frame], dim=2)
        )
        while (
            state.vae_pending_body_frames is not None
            and state.vae_pending_body_frames.shape[2] >= BODY_FRAMES
        ):
            body = state.vae_pending_body_frames[:, :, :BODY_FRAMES]
            rest = state.vae_pending_body_frames[:, :, BODY_FRAMES:]
            assert state.vae_enc_feat_map is not None
            out, state.vae_enc_feat_map = self.model.nets.encode_chunk(body, state.vae_enc_feat_map)
            state.append_vae_encoder_chunk(out)
            state.vae_pending_body_frames = rest if rest.shape[2] else None
