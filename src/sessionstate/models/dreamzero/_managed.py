"""The managed DreamZero path: a pure step over an immutable `DreamZeroSession`.

``step(state, obs) -> (state, out)`` never changes ``state``; `forward` reads the latest
record from a `SessionStateManager`, steps it, and stores the result only when the whole step
succeeded. The KV cache lives in an engine-owned `KVPool`; records hold handles to its blocks
in a `KVCache` object. Before a step, when the pool lacks the blocks the step can need, the
least recently used other sessions' KV is parked (`SessionStateManager.park_until`): their
blocks move to the park tier and return to the pool.
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
from sessionstate.models._kit import ManagedPathBase, managed_forward
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
        super().__init__(model, settings, DreamZeroSession, unknown_session)
        # Engine-owned: the path owns the pool, records hold handles to its blocks. Sized by
        # bytes: the configured figure, else today's room for twice the cap's windows.
        nbytes = settings.kv_pool_bytes
        if nbytes is None:
            nbytes = kv_cache.default_pool_bytes(model.cfg, settings.max_sessions)
        self.kv_pool: KVPool = kv_cache.build_kv_pool(model.cfg, model.device, nbytes)

    def forward(
        self, obs: Observation, session_id: Hashable, begin: bool | None
    ) -> DreamZeroOutput:
        """One step of ``session_id``; see `DreamZeroPipeline.forward`.

        Raises:
            KVPoolExhaustedError: if the pool lacks the blocks the step needs even after
                parking every other session's KV the manager can park (naming the bytes
                needed and held); the stored record and the pool are as they were.
        """
        self._make_kv_room(session_id)
        try:
            return managed_forward(
                self.manager,
                session_id,
                begin,
                new=self.new_session,
                step=lambda state: self.step(state, obs),
                lost=lost_continuation,
                # A failed step returns the KV blocks it took, so the pool is as it was too.
                guard=self.kv_pool.transaction(),
            )
        except KVPoolExhaustedError as exc:
            raise self._kv_shortfall(session_id) from exc

    def _kv_need(self, session_id: Hashable) -> int:
        # The blocks a step of `session_id` can take: a whole window (unparking it) and a
        # step's new blocks with a copied partial one, less what it holds resident here.
        need = kv_cache.handle_blocks(self.model.cfg) + 1
        state = self.manager.peek(session_id)
        cache = None if state is None else state.objects.get("kv_cache")
        handle = cache.handle if isinstance(cache, KVCache) else None
        if handle is not None and handle.pool is self.kv_pool:
            need -= len(handle.blocks)
        return max(need, 0)

    def _make_kv_room(self, session_id: Hashable) -> None:
        # Before the step (outside its transaction): while the pool lacks the blocks the step
        # can need, park the least recently used other sessions' KV. Free blocks to spare
        # cost one lookup; only a pool under pressure reads the session's record.
        pool = self.kv_pool
        if pool.free_blocks > kv_cache.handle_blocks(self.model.cfg):
            return
        need = self._kv_need(session_id)
        self.manager.park_until(
            lambda: pool.free_blocks >= need, frees=pool.owns_entry, keep=(session_id,)
        )

    def _kv_shortfall(self, session_id: Hashable) -> KVPoolExhaustedError:
        pool, block = self.kv_pool, self.kv_pool.block_nbytes
        need, free = self._kv_need(session_id), pool.free_blocks
        held = (pool.num_blocks - free) * block
        msg = (
            f"DreamZero session {session_id!r}: a step can need {need} KV blocks "
            f"({need * block} bytes) of pool {pool.name!r}, which has {free} free "
            f"({free * block} bytes); live handles hold the other {held} bytes, and no other "
            "session's KV the manager holds is left to park (records kept outside the manager "
            "hold their blocks). Drop finished sessions, or raise `session_state_kv_pool_bytes` "
            f"to at least {(pool.num_blocks - free + need) * block} bytes."
        )
        return KVPoolExhaustedError(msg)

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
            "kv_pool_resident_sessions": kv_cache.resident_sessions(
                self.model.cfg, pool.num_blocks
            ),
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
        video, out = model.generate(
            ref, state.ys, state.clip_feas, state.prompt_embeds, csf, obs, handle.read()
        )
        # A copy, so the caller's `out.video_latents` can never reach the session's history.
        host_latents = video.detach().to(model.host_device, copy=True)
        latents = state.video_latents_across_time.commit(host_latents)
        state = state.with_values(
            {"video_latents_across_time": latents},
            current_start_frame=csf + cfg.num_frame_per_block,
        )
        return state, DreamZeroOutput(out.actions, out.video_latents, reset=reason)

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
