"""The DreamZero-shaped streaming pipeline: one entry point, two session-state paths.

``forward(obs, session_id)`` picks the path with `resolve_session_state_config`, so the
environment variable alone flips it:

- bespoke: mutable `DreamZeroState` objects in an OrderedDict capped at
  ``MAX_DREAMZERO_SESSIONS``;
- managed: the pure ``step(state, obs) -> (state, out)`` over an immutable
  `DreamZeroSession`, with a `SessionStateManager` holding the latest record per session.

Both paths call the same networks with the same tensors; with the flag flipped they are
bit-identical (the encoder output ring differs from the bespoke full history, and the reader
is written so that does not matter; see `DreamZeroNetworks.normalize_latents`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping

import attrs
import torch

from sessionstate import (
    KVPool,
    LatentBuffer,
    OmniDiffusionConfig,
    SessionAdmissionError,
    SessionStateLostError,
    SessionStateManager,
    SessionStateSettings,
    TensorCache,
    resolve_session_state_config,
)
from sessionstate._manager import check_session_id  # the manager's session-id rule
from sessionstate.models.dreamzero import kv as kv_cache
from sessionstate.models.dreamzero.config import MAX_DREAMZERO_SESSIONS, DreamZeroConfig
from sessionstate.models.dreamzero.networks import DreamZeroNetworks, FeatMap, build_networks
from sessionstate.models.dreamzero.state import (
    DreamZeroSession,
    DreamZeroState,
    frames_for_model,
    new_session,
    reset_reason,
    window_reset,
)
from sessionstate.models.dreamzero.transform import Observation, stitch_views

__all__ = ["DreamZeroOutput", "DreamZeroPipeline"]

_BODY_FRAMES = 4

logger = logging.getLogger("sessionstate")


@attrs.frozen(eq=False)
class DreamZeroOutput:
    """What one forward returns: the action chunk and the newly generated video latents."""

    actions: torch.Tensor
    video_latents: torch.Tensor
    reset: str | None


def _unknown_session(session_id: Hashable) -> str:
    return (
        f"DreamZero session {session_id!r} is not held (never started, dropped or evicted); "
        "call `forward(obs, session_id)` to start it."
    )


def _lost_continuation(session_id: Hashable) -> str:
    return (
        f"Cannot continue DreamZero session {session_id!r}: it is not held (never started, "
        "dropped or evicted), so its state is lost. Start it again with "
        f"`forward(obs, {session_id!r}, begin=True)`, or raise the session cap."
    )


def _committer(chunk: torch.Tensor) -> Callable[[LatentBuffer], LatentBuffer]:
    return lambda buffer: buffer.commit(chunk)


def _device_key(device: torch.device) -> str:
    # Tensors report CUDA devices with their index; a budget must name it the same way.
    if device.type == "cuda" and device.index is None:
        return f"cuda:{torch.cuda.current_device()}"
    return str(device)


def _replacer(contents: FeatMap) -> Callable[[TensorCache], TensorCache]:
    return lambda cache: cache.commit(contents)


def _conditioning_frame(frames: torch.Tensor) -> torch.Tensor:
    # Upstream: the last frame when T is 4 or 9, otherwise the first.
    t = frames.shape[2]
    return frames[:, :, -1:] if t in (4, 9) else frames[:, :, :1]


def _ys_slice(ys: torch.Tensor, start: int, n: int) -> torch.Tensor:
    if start + n <= ys.shape[2]:
        return ys[:, :, start : start + n]
    return ys[:, :, ys.shape[2] - n :]


class DreamZeroPipeline:
    """A DreamZero-shaped streaming world model over many interleaved sessions.

    Args:
        config: A deploy config (its ``model`` section holds the DreamZero settings) or a
            `DreamZeroConfig` directly (the manager flag then comes from the environment).
        device: Where the networks and per-step tensors live. ``meta`` computes shapes and
            byte counts without allocating.
        environ: The environment to resolve the flag from; ``os.environ`` when None.
        host_device: Where accumulated video latents are kept (the host, as upstream).
        max_bespoke_sessions: The bespoke path's cap. Upstream it is the fixed constant
            `MAX_DREAMZERO_SESSIONS`; tests lower it to exercise eviction on both paths.

    What a new session does at the cap (``on_full``: evict the least recently used session,
    or refuse the new one with `SessionAdmissionError`) comes from the deploy config's
    ``session_state_on_full`` and ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL``, and is the
    same on both paths. The first eviction logs a warning naming the evicted session.

    >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    >>> from sessionstate.models.dreamzero.episode import scripted_episode
    >>> cfg = DreamZeroConfig.preset("tiny")
    >>> pipe = DreamZeroPipeline(cfg, environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"})
    >>> for sid, obs in scripted_episode(cfg, steps=3, sessions=1, seed=0):
    ...     out = pipe.forward(obs, sid)
    >>> pipe.managed, tuple(out.actions.shape), pipe.stats()["sessions"]
    (True, (4, 8), 1)
    """

    def __init__(
        self,
        config: OmniDiffusionConfig | DreamZeroConfig,
        *,
        device: torch.device | str = "cpu",
        environ: Mapping[str, str] | None = None,
        host_device: torch.device | str = "cpu",
        max_bespoke_sessions: int = MAX_DREAMZERO_SESSIONS,
    ) -> None:
        if (
            isinstance(max_bespoke_sessions, bool)
            or not isinstance(max_bespoke_sessions, int)
            or max_bespoke_sessions <= 0
        ):
            msg = (
                f"`max_bespoke_sessions` must be a positive int, got {max_bespoke_sessions!r}; "
                f"the bespoke path's cap is {MAX_DREAMZERO_SESSIONS} upstream."
            )
            raise ValueError(msg)
        if isinstance(config, DreamZeroConfig):
            self.cfg = config
            self.settings: SessionStateSettings = resolve_session_state_config(None, environ)
        else:
            self.cfg = config.parse_model(DreamZeroConfig.from_dict)
            self.settings = resolve_session_state_config(config, environ)
        self.device = torch.device(device)
        self.host_device = torch.device(host_device)
        self.nets: DreamZeroNetworks = build_networks(self.cfg, self.device)
        self.manager: SessionStateManager | None = None
        self._states: OrderedDict[Hashable, DreamZeroState] | None = None
        self.kv_pool: KVPool | None = None
        if self.settings.enabled:
            budget = self.settings.max_bytes
            self.manager = SessionStateManager(
                self.settings.max_sessions,
                on_full=self.settings.on_full,
                check_immutable=self.settings.check_immutable,
                max_bytes={_device_key(self.device): budget} if isinstance(budget, int) else budget,
                park_tier=self.settings.park_tier,
                spool_dir=self.settings.spool_dir,
            )
            # Engine-owned: the pipeline owns the pool, records hold handles to its blocks.
            self.kv_pool = kv_cache.build_kv_pool(self.cfg, self.device, self.settings.max_sessions)
        else:
            self._states = OrderedDict()
            self._max_bespoke_sessions = max_bespoke_sessions
            self._bespoke_counts = {"hits": 0, "misses": 0, "evictions": 0}
            self._warned_eviction = False

    @property
    def managed(self) -> bool:
        """Whether this pipeline runs the manager-backed path."""
        return self.manager is not None

    @property
    def on_full(self) -> str:
        """What a new session does at the cap, on either path: ``"evict"`` or ``"refuse"``.

        >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
        >>> env = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL": "refuse"}
        >>> DreamZeroPipeline(DreamZeroConfig.preset("tiny"), environ=env).on_full
        'refuse'
        """
        return self.settings.on_full

    # -- entry point ---------------------------------------------------------------------------

    def forward(
        self, obs: Observation, session_id: Hashable = "default", *, begin: bool | None = None
    ) -> DreamZeroOutput:
        """Run one streaming step of ``session_id`` on ``obs``.

        Args:
            obs: The observation of this step.
            session_id: The session to step: any hashable value, as a dict key.
            begin: ``True`` starts the session, or restarts it from scratch if it is held;
                ``False`` continues it and never starts one; ``None`` (default) continues a
                held session and starts one that is not.

        Raises:
            SessionStateLostError: if ``begin=False`` and the session is not held (never
                started, dropped or evicted); nothing is created.
            SessionAdmissionError: if the session is new, the cap is reached and
                ``on_full`` is ``"refuse"``; nothing is stored or evicted.

        >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
        >>> from sessionstate.models.dreamzero.episode import scripted_episode
        >>> cfg = DreamZeroConfig.preset("tiny")
        >>> pipe = DreamZeroPipeline(cfg)
        >>> (sid, first), (_, second) = scripted_episode(cfg, steps=2, sessions=1, seed=0)
        >>> pipe.forward(first, sid, begin=True).reset
        'session'
        >>> pipe.forward(second, sid, begin=False).reset is None
        True
        """
        check_session_id(session_id)
        if self.manager is not None:
            state = None if begin else self.manager.get(session_id)
            if state is None:
                if begin is False:
                    raise SessionStateLostError(_lost_continuation(session_id))
                state = self.new_session()
            assert isinstance(state, DreamZeroSession)
            assert self.kv_pool is not None
            # A failed step returns the KV blocks it took, so the pool is as it was too.
            with self.kv_pool.transaction():
                state, out = self.step(state, obs)
                # Published only after the whole step succeeded: a failed step leaves the
                # stored record (or the absence of one) exactly as it was.
                self.manager.put(session_id, state)
            return out
        return self._bespoke_forward(self._bespoke_state(session_id, begin), obs)

    def new_session(self) -> DreamZeroSession:
        """An empty managed session for this pipeline's geometry."""
        return new_session(self.cfg)

    def drop_session(self, session_id: Hashable) -> bool:
        """End a session on either path; returns whether it was held."""
        check_session_id(session_id)
        if self.manager is not None:
            return self.manager.drop(session_id)
        assert self._states is not None
        return self._states.pop(session_id, None) is not None

    def session_ids(self) -> list[Hashable]:
        """Retained sessions, least recently used first."""
        if self.manager is not None:
            return self.manager.session_ids()
        assert self._states is not None
        return list(self._states)

    def session_values(self, session_id: Hashable) -> dict[str, object]:
        """Every value the session holds, by name (without touching LRU order)."""
        check_session_id(session_id)
        if self.manager is not None:
            state = self.manager.peek(session_id)
            if state is None:
                raise SessionStateLostError(_unknown_session(session_id))
            assert isinstance(state, DreamZeroSession)
            # A parked session is read through a resident copy; the stored record stays parked.
            return state.unpark().values()
        assert self._states is not None
        if session_id not in self._states:
            raise SessionStateLostError(_unknown_session(session_id))
        return self._states[session_id].values()

    def video_latents(self, session_id: Hashable) -> torch.Tensor | None:
        """Every latent chunk generated for the session, joined along time (None if none)."""
        values = self.session_values(session_id)
        latents = values["video_latents_across_time"]
        if isinstance(latents, LatentBuffer):
            return latents.concat() if len(latents) else None
        assert self._states is not None
        return self._states[session_id].get_concatenated_video_latents()

    def clear_accumulated_video_latents(self, session_id: Hashable) -> None:
        """Empty the session's accumulated video latents, for a caller that exported them.

        Keeps everything else: the VAE stream, the conditioning, the counters. The session is
        marked most recently used, on either path.

        Raises:
            SessionStateLostError: if the session is not held; nothing is created.

        >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
        >>> from sessionstate.models.dreamzero.episode import scripted_episode
        >>> cfg = DreamZeroConfig.preset("tiny")
        >>> pipe = DreamZeroPipeline(cfg)
        >>> for sid, obs in scripted_episode(cfg, steps=2, sessions=1, seed=0):
        ...     _ = pipe.forward(obs, sid)
        >>> pipe.clear_accumulated_video_latents(sid)
        >>> pipe.video_latents(sid) is None, pipe.session_values(sid)["call_count"]
        (True, 2)
        """
        if self.manager is not None:
            state = self.manager.peek(session_id)
            if state is None:
                raise SessionStateLostError(_unknown_session(session_id))
            # A parked session is unparked to change it; `put` applies the budget again.
            state = state.unpark().update_object("video_latents_across_time", lambda b: b.reset())
            self.manager.put(session_id, state)
            return
        assert self._states is not None
        bespoke = self._states.get(session_id)
        if bespoke is None:
            raise SessionStateLostError(_unknown_session(session_id))
        bespoke.video_latents_across_time = []
        self._states.move_to_end(session_id)

    def decode_video(self, session_id: Hashable) -> torch.Tensor | None:
        """Decode the session's accumulated latents with the Wan decoder: (1, 3, T, H, W)."""
        latents = self.video_latents(session_id)
        if latents is None:
            return None
        return self.nets.decode(latents.to(self.device))

    def stats(self) -> dict[str, int]:
        """The manager's `stats()`; on the bespoke path, the same keys computed by hand."""
        if self.manager is not None:
            return self.manager.stats()
        from sessionstate import nbytes_by_device

        assert self._states is not None
        totals = nbytes_by_device([s.values() for s in self._states.values()])
        out = {
            "sessions": len(self._states),
            "max_sessions": self._max_bespoke_sessions,
            **self._bespoke_counts,
        }
        out["total_nbytes"] = sum(totals.values())
        out.update({f"nbytes:{d}": n for d, n in sorted(totals.items())})
        return out

    # -- managed path: a pure step ---------------------------------------------------------------

    def step(
        self, state: DreamZeroSession, obs: Observation
    ) -> tuple[DreamZeroSession, DreamZeroOutput]:
        """``step(state, obs) -> (state, out)``: pure; ``state`` is left unchanged."""
        nets, cfg = self.nets, self.cfg
        stitched = stitch_views(obs, cfg).to(self.device)
        tokens = nets.tokenize(obs.prompt)
        reason = reset_reason(
            state.language, tokens, state.current_start_frame, cfg.local_attn_size
        )
        if reason == "session":
            state = self.new_session()
        elif reason == "inference":
            state = window_reset(state)
        state = state.with_attrs(language=tokens)

        call_count = state.call_count + 1
        state = state.update_object("stitched_buffer", lambda b: b.commit(stitched))
        state = state.with_attrs(call_count=call_count)
        frames = frames_for_model(list(state.stitched_buffer.view()), call_count == 1, nets.dtype)

        if state.prompt_embeds is None:
            state = state.with_attrs(prompt_embeds=nets.encode_prompt(tokens))

        csf = state.current_start_frame
        if csf == 0:
            clip_feas, ys, cond_latent = nets.encode_image(_conditioning_frame(frames))
            if state.vae_stream_initialized:
                state = self._stream_append(state, frames[:, :, -1:])
            else:
                state = self._stream_seed(state, frames[:, :, :1])
            state = state.with_attrs(clip_feas=clip_feas, ys=ys)
            ref = cond_latent
            csf = 1
        else:
            state = self._stream_append(state, frames[:, :, -1:])
            ref = nets.observation_latents(
                state.vae_encoder_out.view(last=cfg.num_frame_per_block), cfg.num_frame_per_block
            )
        assert self.kv_pool is not None
        previous = None if state.current_start_frame == 0 else state.kv_cache  # `_kv_create`
        handle = kv_cache.append_handle(self.kv_pool, previous, nets.prefill_kv(ref), cfg)
        state = state.with_attrs(kv_cache=handle)
        assert state.ys is not None
        assert state.clip_feas is not None
        assert state.prompt_embeds is not None
        video, out = self._generate(
            ref, state.ys, state.clip_feas, state.prompt_embeds, csf, obs, handle.read()
        )
        state = state.with_attrs(current_start_frame=csf + cfg.num_frame_per_block)
        # A copy, so the caller's `out.video_latents` can never reach the session's history.
        host_latents = video.detach().to(self.host_device, copy=True)
        state = state.update_object("video_latents_across_time", lambda b: b.commit(host_latents))
        return state, attrs.evolve(out, reset=reason)

    def _generate(
        self,
        ref: torch.Tensor,
        ys: torch.Tensor,
        clip_feas: torch.Tensor,
        prompt_embeds: torch.Tensor,
        csf: int,
        obs: Observation,
        kv: torch.Tensor,
    ) -> tuple[torch.Tensor, DreamZeroOutput]:
        """Denoise the next block and post-process the actions (both paths, no state)."""
        n = self.cfg.num_frame_per_block
        video, actions = self.nets.diffuse(ref, _ys_slice(ys, csf, n), clip_feas, prompt_embeds, kv)
        if csf == 1:  # the window's first block carries its conditioning latent in front
            video = torch.cat([ref, video], dim=2)
        out = DreamZeroOutput(
            actions=self.nets.postprocess_actions(actions, obs.state.to(self.device)),
            video_latents=video,
            reset=None,
        )
        return video, out

    def _stream_seed(self, state: DreamZeroSession, first: torch.Tensor) -> DreamZeroSession:
        out, feat_map = self.nets.encode_chunk(first, self.nets.init_feat_map())
        state = state.update_object("vae_encoder_out", lambda b: b.reset().commit(out))
        state = state.update_object("vae_enc_feat_map", _replacer(feat_map))
        return state.with_attrs(vae_pending_body_frames=None, vae_stream_initialized=True)

    def _stream_append(self, state: DreamZeroSession, frame: torch.Tensor) -> DreamZeroSession:
        pending = state.vae_pending_body_frames
        # A lone frame is cloned: as a slice of the 4-frame model input it would keep all
        # four frames alive.
        pending = frame.clone() if pending is None else torch.cat([pending, frame], dim=2)
        feat_map = state.vae_enc_feat_map
        assert feat_map is not None
        while pending is not None and pending.shape[2] >= _BODY_FRAMES:
            body, rest = pending[:, :, :_BODY_FRAMES], pending[:, :, _BODY_FRAMES:]
            out, feat_map = self.nets.encode_chunk(body, feat_map)
            state = state.update_object("vae_encoder_out", _committer(out))
            pending = rest if rest.shape[2] else None
        state = state.update_object("vae_enc_feat_map", _replacer(feat_map))
        return state.with_attrs(vae_pending_body_frames=pending)

    # -- bespoke path: mutable, in place -----------------------------------------------------------

    def _bespoke_state(self, session_id: Hashable, begin: bool | None = None) -> DreamZeroState:
        assert self._states is not None
        state = None if begin else self._states.get(session_id)
        if state is not None:
            self._bespoke_counts["hits"] += 1
            self._states.move_to_end(session_id)
            return state
        state = DreamZeroState()
        if begin and session_id in self._states:  # a restart replaces the held state
            self._states[session_id] = state
            self._states.move_to_end(session_id)
            return state
        if not begin:  # counted as the manager's `get` counts it
            self._bespoke_counts["misses"] += 1
        if begin is False:
            raise SessionStateLostError(_lost_continuation(session_id))
        if self.settings.on_full == "refuse" and len(self._states) >= self._max_bespoke_sessions:
            msg = (
                f"Cannot admit DreamZero session {session_id!r}: the bespoke session table "
                f"holds {self._max_bespoke_sessions} sessions (its cap) and "
                "`on_full='refuse'`. Drop a finished session first with `drop_session`, or "
                "raise the cap."
            )
            raise SessionAdmissionError(msg)
        self._states[session_id] = state
        if len(self._states) > self._max_bespoke_sessions:
            evicted, _ = self._states.popitem(last=False)
            self._bespoke_counts["evictions"] += 1
            if not self._warned_eviction:
                self._warned_eviction = True
                logger.warning(
                    "DreamZero session %r was evicted by the bespoke session cap (%d) although "
                    "nobody ended it; its state is lost. End finished sessions explicitly with "
                    "`drop_session(session_id)`, or raise the cap. Warned once per pipeline; "
                    "`stats()['evictions']` counts every eviction.",
                    evicted,
                    self._max_bespoke_sessions,
                )
        return state

    def _bespoke_forward(self, state: DreamZeroState, obs: Observation) -> DreamZeroOutput:
        nets, cfg = self.nets, self.cfg
        stitched = stitch_views(obs, cfg).to(self.device)
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
            clip_feas, ys, cond_latent = nets.encode_image(_conditioning_frame(frames))
            if state.vae_stream_initialized:
                self._bespoke_stream_append(state, frames[:, :, -1:])
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
            self._bespoke_stream_append(state, frames[:, :, -1:])
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
        video, out = self._generate(
            ref, state.ys, state.clip_feas, state.prompt_embeds, csf, obs, kv
        )
        state.current_start_frame += cfg.num_frame_per_block
        state.video_latents_across_time.append(video.detach().to(self.host_device, copy=True))
        return attrs.evolve(out, reset=reason)

    def _bespoke_stream_append(self, state: DreamZeroState, frame: torch.Tensor) -> None:
        pending = state.vae_pending_body_frames
        state.vae_pending_body_frames = (
            frame.clone() if pending is None else torch.cat([pending, frame], dim=2)
        )
        while (
            state.vae_pending_body_frames is not None
            and state.vae_pending_body_frames.shape[2] >= _BODY_FRAMES
        ):
            body = state.vae_pending_body_frames[:, :, :_BODY_FRAMES]
            rest = state.vae_pending_body_frames[:, :, _BODY_FRAMES:]
            assert state.vae_enc_feat_map is not None
            out, state.vae_enc_feat_map = self.nets.encode_chunk(body, state.vae_enc_feat_map)
            state.append_vae_encoder_chunk(out)
            state.vae_pending_body_frames = rest if rest.shape[2] else None
