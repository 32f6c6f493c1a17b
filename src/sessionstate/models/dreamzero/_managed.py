"""The managed DreamZero path: a pure step over an immutable `DreamZeroSession`.

``step(state, obs) -> (state, out)`` never changes ``state``; `forward` reads the latest
record from a `SessionStateManager`, steps it, and stores the result only when the whole step
succeeded. The KV cache lives in an engine-owned `KVPool`; records hold handles to its blocks
in a `KVCache` object. The pool declares a step's tokens and the attention window, and the
manager it is handed to makes a step's room (`SessionStateManager.step`): when the pool lacks
the blocks a step can take, the least recently used other sessions' KV is parked, its blocks
moved to the park tier and back to the pool.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from sessionstate import (
    KVCache,
    KVPool,
    KVPoolExhaustedError,
    LatentBuffer,
    SessionStateSettings,
    StateObject,
    TensorCache,
)
from sessionstate.models._kit import ManagedPathBase, kv_shortfall, managed_forward
from sessionstate.models.dreamzero import kv as kv_cache
from sessionstate.models.dreamzero._model import (
    BODY_FRAMES,
    DreamZeroModel,
    DreamZeroOutput,
    conditioning_frame,
    lost_continuation,
    unknown_session,
)
from sessionstate.models.dreamzero.state import (
    DreamZeroSession,
    frames_for_model,
    new_session,
    reset_reason,
    window_reset,
)
from sessionstate.models.dreamzero.transform import Observation, stitch_views

__all__ = ["ManagedPath"]


class ManagedPath(ManagedPathBase[DreamZeroSession]):
    """Sessions as immutable records in a `SessionStateManager`, stepped by a pure step.

    Args:
        model: The networks and geometry.
        settings: The resolved session-state settings (cap, ``on_full``, budget, guard).

    >>> from sessionstate import resolve_session_state_config
    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> from sessionstate.models.dreamzero._model import DreamZeroModel
    >>> model = DreamZeroModel(DreamZeroConfig.preset("tiny"), "cpu", "cpu")
    >>> path = ManagedPath(model, resolve_session_state_config(None, {}))
    >>> path.session_ids(), path.stats()["max_sessions"]
    ([], 64)
    """

    model: DreamZeroModel

    def __init__(self, model: DreamZeroModel, settings: SessionStateSettings) -> None:
        # Engine-owned: the path owns the pool, records hold handles to its blocks, and the
        # manager makes its room. Sized by bytes: the configured figure, else today's room
        # for twice the cap's windows.
        nbytes = settings.kv_pool_bytes
        if nbytes is None:
            nbytes = kv_cache.default_pool_bytes(model.cfg, settings.max_sessions)
        self.kv_pool: KVPool = kv_cache.build_kv_pool(model.cfg, model.device, nbytes)
        super().__init__(model, settings, DreamZeroSession, unknown_session, pools=(self.kv_pool,))

    def forward(
        self, obs: Observation, session_id: Hashable, begin: bool | None
    ) -> DreamZeroOutput:
        """One step of ``session_id``; see `DreamZeroPipeline.forward`.

        Raises:
            KVPoolExhaustedError: if the pool lacks the blocks the step needs even after
                parking every other session's KV the manager can park (naming the bytes
                needed and held); the stored record and the pool are as they were.
        """
        try:
            return managed_forward(
                self.manager,
                session_id,
                begin,
                new=self.new_session,
                step=lambda state: self.step(state, obs),
                lost=lost_continuation,
            )
        except KVPoolExhaustedError as exc:
            if exc.pool is not self.kv_pool:
                raise
            raise kv_shortfall(
                exc.pool,
                exc.needed,
                session_id,
                label="DreamZero session",
                fix="raise `session_state_kv_pool_bytes` to at least {nbytes} bytes",
            ) from exc

    def new_session(self) -> DreamZeroSession:
        """An empty session for this model's geometry."""
        return new_session(self.model.cfg)

    def video_latents(self, session_id: Hashable) -> torch.Tensor | None:
        """Every latent chunk generated for the session, joined along time (None if none)."""
        latents = self._peek(session_id).object("video_latents_across_time", LatentBuffer)
        return latents.concat() if len(latents) else None

    def clear_accumulated_video_latents(self, session_id: Hashable) -> None:
        """Empty the session's accumulated video latents; marks it most recently used."""
        # A parked session is unparked to change it; `put` applies the budget again.
        state = self._peek(session_id).update_object(
            "video_latents_across_time", lambda b: b.reset()
        )
        self.manager.put(session_id, state)

    def stats(self) -> dict[str, int]:
        """The manager's `stats()`, and the KV pool's total and free blocks.

        ``kv_pool_resident_sessions`` is how many sessions' full windows the pool holds at once.
        """
        pool = self.kv_pool
        return {
            **self.manager.stats(),
            "kv_pool_blocks": pool.num_blocks,
            "kv_pool_free_blocks": pool.free_blocks,
            "kv_pool_block_nbytes": pool.block_nbytes,
            "kv_pool_resident_sessions": pool.num_blocks // (pool.session_blocks or 1),
        }

    def step(
        self, state: DreamZeroSession, obs: Observation
    ) -> tuple[DreamZeroSession, DreamZeroOutput]:
        """``step(state, obs) -> (state, out)``: pure; ``state`` is left unchanged.

        What the step changes is gathered and applied in two transitions (`with_values`):
        one before the denoiser runs, one with what it produced.
        """
        model = self.model
        nets, cfg = model.nets, model.cfg
        stitched = stitch_views(obs, cfg).to(model.device)
        tokens = nets.tokenize(obs.prompt)
        reason = reset_reason(
            state.language, tokens, state.current_start_frame, cfg.local_attn_size
        )
        if reason == "session":
            state = self.new_session()
        elif reason == "inference":
            state = window_reset(state)

        call_count = state.call_count + 1
        ring = state.stitched_buffer.commit(stitched)
        objects: dict[str, StateObject] = {"stitched_buffer": ring}
        values: dict[str, object] = {"language": tokens, "call_count": call_count}
        frames = frames_for_model(list(ring.view()), call_count == 1, nets.dtype)

        if state.prompt_embeds is None:
            values["prompt_embeds"] = nets.encode_prompt(tokens)

        csf = state.current_start_frame
        if csf == 0:
            clip_feas, ys, cond_latent = nets.encode_image(conditioning_frame(frames))
            if state.vae_stream_initialized:
                self._stream_append(state, frames[:, :, -1:], objects, values)
            else:
                self._stream_seed(state, frames[:, :, :1], objects, values)
            values["clip_feas"], values["ys"] = clip_feas, ys
            ref = cond_latent
            csf = 1
        else:
            encoder_out = self._stream_append(state, frames[:, :, -1:], objects, values)
            ref = nets.observation_latents(
                encoder_out.view(last=cfg.num_frame_per_block), cfg.num_frame_per_block
            )
        previous = None if state.current_start_frame == 0 else state.kv_cache  # `_kv_create`
        handle = kv_cache.append_handle(self.kv_pool, previous, nets.prefill_kv(ref), cfg)
        objects["kv_cache"] = state.object("kv_cache", KVCache).commit(handle)
        state = state.with_values(objects, **values)
        assert state.ys is not None
        assert state.clip_feas is not None
        assert state.prompt_embeds is not None
        noise, key = model.noise(state.random_key)
        video, out = model.generate(
            ref, state.ys, state.clip_feas, state.prompt_embeds, csf, obs, handle.read(), noise
        )
        # A copy, so the caller's `out.video_latents` can never reach the session's history.
        host_latents = video.detach().to(model.host_device, copy=True)
        produced: dict[str, StateObject] = {
            "video_latents_across_time": state.video_latents_across_time.commit(host_latents),
            "random_key": key,
        }
        pixels, dec_map = model.decode(video, state.vae_dec_feat_map)
        if pixels is not None:
            produced["vae_dec_feat_map"] = state.object("vae_dec_feat_map", TensorCache).commit(
                dec_map
            )
        state = state.with_values(produced, current_start_frame=csf + cfg.num_frame_per_block)
        return state, DreamZeroOutput(out.actions, out.video_latents, reset=reason, frames=pixels)

    def _stream_seed(
        self,
        state: DreamZeroSession,
        first: torch.Tensor,
        objects: dict[str, StateObject],
        values: dict[str, object],
    ) -> None:
        # Seeds the VAE stream: its changes go into `objects` and `values`.
        nets = self.model.nets
        out, feat_map = nets.encode_chunk(first, nets.init_feat_map())
        objects["vae_encoder_out"] = state.vae_encoder_out.reset().commit(out)
        objects["vae_enc_feat_map"] = state.object("vae_enc_feat_map", TensorCache).commit(feat_map)
        values["vae_pending_body_frames"] = None
        values["vae_stream_initialized"] = True

    def _stream_append(
        self,
        state: DreamZeroSession,
        frame: torch.Tensor,
        objects: dict[str, StateObject],
        values: dict[str, object],
    ) -> LatentBuffer:
        # Streams `frame` into the VAE: its changes go into `objects` and `values`; returns
        # the encoder output ring as it stands after the frame.
        pending = state.vae_pending_body_frames
        # A lone frame is cloned: as a slice of the 4-frame model input it would keep all
        # four frames alive.
        pending = frame.clone() if pending is None else torch.cat([pending, frame], dim=2)
        feat_map = state.vae_enc_feat_map
        assert feat_map is not None
        encoder_out = state.vae_encoder_out
        while pending is not None and pending.shape[2] >= BODY_FRAMES:
            body, rest = pending[:, :, :BODY_FRAMES], pending[:, :, BODY_FRAMES:]
            out, feat_map = self.model.nets.encode_chunk(body, feat_map)
            encoder_out = encoder_out.commit(out)
            objects["vae_encoder_out"] = encoder_out
            pending = rest if rest.shape[2] else None
        objects["vae_enc_feat_map"] = state.object("vae_enc_feat_map", TensorCache).commit(feat_map)
        values["vae_pending_body_frames"] = pending
        return encoder_out
