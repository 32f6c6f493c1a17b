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

from collections.abc import Callable, Generator, Hashable, Mapping, Sequence
from typing import Any, cast

import torch

from sessionstate import (
    KVCache,
    KVPool,
    KVPoolExhaustedError,
    LatentBuffer,
    RandomKey,
    SessionStateSettings,
    StateObject,
    TensorCache,
)
from sessionstate.models._kit import (
    ManagedPathBase,
    buckets,
    check_batch,
    kv_shortfall,
    managed_forward,
)
from sessionstate.models.dreamzero import kv as kv_cache
from sessionstate.models.dreamzero._model import (
    BODY_FRAMES,
    DreamZeroModel,
    DreamZeroOutput,
    conditioning_frame,
    lost_continuation,
    unknown_session,
)
from sessionstate.models.dreamzero.networks import FeatMap, Noise
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
        super().__init__(
            model,
            settings,
            DreamZeroSession,
            unknown_session,
            pools=(self.kv_pool,),
            lost=lost_continuation,
        )

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

    def forward_many(
        self, inputs: Mapping[Hashable, Observation], begin: bool | None, batch_invariant: bool
    ) -> dict[Hashable, Any]:
        """One batched step of every session in ``inputs``; see `DreamZeroPipeline.forward_many`.

        Raises:
            KVPoolExhaustedError: if the pool lacks the blocks the batch's steps need even
                after parking every other session's KV the manager can park (naming the
                sessions and the bytes needed); every session and the pool are as they were.
        """
        try:
            return super().forward_many(inputs, begin, batch_invariant)
        except KVPoolExhaustedError as exc:
            if exc.pool is not self.kv_pool:
                raise
            raise kv_shortfall(
                exc.pool,
                exc.needed,
                list(inputs),
                label="DreamZero batch",
                fix="step a smaller batch, or raise `session_state_kv_pool_bytes` to at "
                "least {nbytes} bytes",
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
        prep = _drive(self._prepare(state, obs), self._encode)
        video, out = self.model.generate(*prep.inputs(), prep.csf, obs, prep.kv, prep.noise)
        return self._finish(prep, video, out)

    def step_batch(
        self,
        states: Sequence[DreamZeroSession],
        observations: Sequence[Observation],
        *,
        batch_invariant: bool = False,
    ) -> tuple[list[DreamZeroSession], list[DreamZeroOutput]]:
        """`step` of many sessions, their networks run once per shape bucket: pure.

        Each session is prepared as `step` prepares it (reset, observation encode, the KV
        append to its own handle), in lockstep: the VAE encodes the sessions ask for at one
        point, of one shape (a window's start frame; a body of frames with its causal-conv
        cache), run as one batch. Sessions whose denoiser inputs have one shape (the same
        place in a window) are denoised as one batch (`DreamZeroModel.generate_batch`); each
        then commits its own latents and decodes its own frames. With ``batch_invariant``
        every record and output equals `step`'s bit for bit; without it they agree to within
        rounding (see the Batches page).

        Raises:
            ValueError: if ``states`` and ``observations`` differ in length.
        """
        check_batch(states, observations)
        preps = self._prepare_batch(states, observations, batch_invariant)
        results: list[tuple[torch.Tensor, DreamZeroOutput] | None] = [None] * len(preps)
        for group in buckets(preps, key=_Prepared.shapes):
            done = self.model.generate_batch(
                [preps[i].inputs() for i in group],
                [preps[i].csf for i in group],
                [observations[i] for i in group],
                [preps[i].kv for i in group],
                [preps[i].noise for i in group],
                batch_invariant=batch_invariant,
            )
            for i, result in zip(group, done, strict=True):
                results[i] = result
        made = [cast(tuple[torch.Tensor, DreamZeroOutput], r) for r in results]
        decoded = self._decode_batch(preps, [video for video, _ in made], batch_invariant)
        finished = [
            self._finish(p, video, out, d)
            for p, (video, out), d in zip(preps, made, decoded, strict=True)
        ]
        return [f[0] for f in finished], [f[1] for f in finished]

    def _decode_batch(
        self, preps: list[_Prepared], videos: list[torch.Tensor], batch_invariant: bool
    ) -> list[tuple[torch.Tensor | None, FeatMap | None]]:
        # Every session's streaming decode; those of one shape and cache layout as one batch
        # (one by one when batch-invariant).
        model = self.model
        caches = [p.state.vae_dec_feat_map for p in preps]
        if not model.cfg.decode_frames or batch_invariant:
            return [model.decode(v, c) for v, c in zip(videos, caches, strict=True)]
        out: list[tuple[torch.Tensor | None, FeatMap | None]] = [(None, None)] * len(preps)

        def key(i: int) -> tuple[object, ...]:
            return videos[i].shape, _layout(caches[i])

        for group in buckets(range(len(preps)), key=key):
            if len(group) == 1:
                out[group[0]] = model.decode(videos[group[0]], caches[group[0]])
                continue
            maps = [caches[i] or model.nets.init_decode_map() for i in group]
            pixels, cache = model.decode(torch.cat([videos[i] for i in group]), _joined(maps))
            assert pixels is not None
            assert cache is not None
            for j, i in enumerate(group):
                out[i] = (_own(pixels, j), _split(cache, j))
        return out

    def _prepare_batch(
        self,
        states: Sequence[DreamZeroSession],
        observations: Sequence[Observation],
        batch_invariant: bool,
    ) -> list[_Prepared]:
        # Every session's `_prepare`, driven in lockstep: the encodes they ask for at one
        # point are grouped by shape and each group runs as one batch (one by one when
        # batch-invariant: a batched convolution rounds differently).
        gens = [self._prepare(s, o) for s, o in zip(states, observations, strict=True)]
        done: dict[int, _Prepared] = {}
        asks: dict[int, _Encode] = {}
        for i in range(len(gens)):
            _advance(gens, i, None, asks, done)
        while asks:
            waiting = list(asks.items())
            asks = {}
            for group in buckets(waiting, key=lambda item: item[1].key()):
                requests = [waiting[j][1] for j in group]
                if batch_invariant or len(requests) == 1:
                    results = [self._encode(r) for r in requests]
                else:
                    results = self._encode_many(requests)
                for j, result in zip(group, results, strict=True):
                    _advance(gens, waiting[j][0], result, asks, done)
        return [done[i] for i in range(len(gens))]

    def _encode(self, request: _Encode) -> Any:
        # One session's encode, as its step runs it.
        nets = self.model.nets
        if request.kind == "image":
            return nets.encode_image(request.frames)
        assert request.feat_map is not None
        return nets.encode_chunk(request.frames, request.feat_map)

    def _encode_many(self, requests: list[_Encode]) -> list[Any]:
        # A group of one shape as one batch; each session gets its own tensors back. The
        # batch runs channels-last (oneDNN's batched conv3d and the VAE's norms over channels
        # are about twice as fast so laid out on CPU; its results round within the batched
        # bound); each session's tensors come back in the standard layout.
        nets = self.model.nets
        frames = _channels_last(torch.cat([r.frames for r in requests]))
        if requests[0].kind == "image":
            joined = nets.encode_image(frames)
            return [tuple(_own(x, i) for x in joined) for i in range(len(requests))]
        cache = _joined([r.feat_map for r in requests if r.feat_map is not None])
        cache = tuple(None if t is None else _channels_last(t) for t in cache)
        out, new = nets.encode_chunk(frames, cache)
        return [(_own(out, i), _split(new, i)) for i in range(len(requests))]

    def _prepare(
        self, state: DreamZeroSession, obs: Observation
    ) -> Generator[_Encode, Any, _Prepared]:
        # Everything a step does before the denoiser: the reset, the observation's encode,
        # the KV append, applied in one transition. A generator: it yields each VAE encode
        # it needs and is sent the result (`_drive` runs one alone, `_prepare_batch` many).
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
            clip_feas, ys, cond_latent = yield _Encode("image", conditioning_frame(frames))
            if state.vae_stream_initialized:
                yield from self._stream_append(state, frames[:, :, -1:], objects, values)
            else:
                yield from self._stream_seed(state, frames[:, :, :1], objects, values)
            values["clip_feas"], values["ys"] = clip_feas, ys
            ref = cond_latent
            csf = 1
        else:
            encoder_out = yield from self._stream_append(state, frames[:, :, -1:], objects, values)
            ref = nets.observation_latents(
                encoder_out.view(last=cfg.num_frame_per_block), cfg.num_frame_per_block
            )
        previous = None if state.current_start_frame == 0 else state.kv_cache  # `_kv_create`
        handle = kv_cache.append_handle(self.kv_pool, previous, nets.prefill_kv(ref), cfg)
        objects["kv_cache"] = state.object("kv_cache", KVCache).commit(handle)
        state = state.with_values(objects, **values)
        noise, key = model.noise(state.random_key)
        return _Prepared(state, ref, csf, handle.read(), reason, noise, key)

    def _finish(
        self,
        prep: _Prepared,
        video: torch.Tensor,
        out: DreamZeroOutput,
        decoded: tuple[torch.Tensor | None, FeatMap | None] | None = None,
    ) -> tuple[DreamZeroSession, DreamZeroOutput]:
        # What the denoiser produced: the latents' history and the decoded frames (decoded
        # here unless a batch decoded them).
        model, state = self.model, prep.state
        # A copy, so the caller's `out.video_latents` can never reach the session's history.
        host_latents = video.detach().to(model.host_device, copy=True)
        produced: dict[str, StateObject] = {
            "video_latents_across_time": state.video_latents_across_time.commit(host_latents),
            "random_key": prep.key,
        }
        if decoded is None:
            decoded = model.decode(video, state.vae_dec_feat_map)
        pixels, dec_map = decoded
        if pixels is not None:
            produced["vae_dec_feat_map"] = state.object("vae_dec_feat_map", TensorCache).commit(
                dec_map
            )
        state = state.with_values(
            produced, current_start_frame=prep.csf + model.cfg.num_frame_per_block
        )
        return state, DreamZeroOutput(
            out.actions, out.video_latents, reset=prep.reason, frames=pixels
        )

    def _stream_seed(
        self,
        state: DreamZeroSession,
        first: torch.Tensor,
        objects: dict[str, StateObject],
        values: dict[str, object],
    ) -> Generator[_Encode, Any, None]:
        # Seeds the VAE stream: its changes go into `objects` and `values`.
        nets = self.model.nets
        out, feat_map = yield _Encode("chunk", first, nets.init_feat_map())
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
    ) -> Generator[_Encode, Any, LatentBuffer]:
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
            out, feat_map = yield _Encode("chunk", body, feat_map)
            encoder_out = encoder_out.commit(out)
            objects["vae_encoder_out"] = encoder_out
            pending = rest if rest.shape[2] else None
        objects["vae_enc_feat_map"] = state.object("vae_enc_feat_map", TensorCache).commit(feat_map)
        values["vae_pending_body_frames"] = pending
        return encoder_out


class _Prepared:
    """One session's step up to the denoiser: its record so far and the denoiser's inputs."""

    def __init__(
        self,
        state: DreamZeroSession,
        ref: torch.Tensor,
        csf: int,
        kv: torch.Tensor,
        reason: str | None,
        noise: Noise,
        key: RandomKey,
    ) -> None:
        self.state, self.ref, self.csf, self.kv, self.reason = state, ref, csf, kv, reason
        self.noise, self.key = noise, key

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ref, ys, clip_feas, prompt_embeds)``, as `DreamZeroModel.generate` takes them."""
        state = self.state
        assert state.ys is not None
        assert state.clip_feas is not None
        assert state.prompt_embeds is not None
        return self.ref, state.ys, state.clip_feas, state.prompt_embeds

    def shapes(self) -> tuple[object, ...]:
        """What must be equal for sessions to share one denoiser batch."""
        ref, ys, clip, prompt = self.inputs()
        return self.csf == 1, ref.shape, ys.shape, clip.shape, prompt.shape, self.kv.shape


class _Encode:
    """A VAE encode a step asks for: a window's start frame, or frames and their cache."""

    def __init__(self, kind: str, frames: torch.Tensor, feat_map: FeatMap | None = None) -> None:
        self.kind, self.frames, self.feat_map = kind, frames, feat_map

    def key(self) -> tuple[object, ...]:
        """What must be equal for encodes to run as one batch."""
        return self.kind, self.frames.shape, self.frames.dtype, _layout(self.feat_map)


def _drive(gen: Generator[_Encode, Any, _Prepared], encode: Callable[[_Encode], Any]) -> _Prepared:
    # Run one `_prepare` to its end, answering each encode it asks for.
    try:
        request = next(gen)
        while True:
            request = gen.send(encode(request))
    except StopIteration as stop:
        prepared: _Prepared = stop.value
        return prepared


def _advance(
    gens: list[Generator[_Encode, Any, _Prepared]],
    i: int,
    result: Any,
    asks: dict[int, _Encode],
    done: dict[int, _Prepared],
) -> None:
    # Send session i's result (None to start it); note what it asks next, or its end.
    try:
        asks[i] = next(gens[i]) if result is None else gens[i].send(result)
    except StopIteration as stop:
        done[i] = stop.value


def _layout(feat_map: FeatMap | None) -> tuple[object, ...]:
    # A causal-conv cache's slots by shape (None where empty): caches of one layout batch.
    return tuple(None if t is None else t.shape for t in feat_map or ())


def _joined(maps: Sequence[FeatMap]) -> FeatMap:
    # The caches of one layout as one batch's cache, slot by slot.
    return tuple(
        None if slots[0] is None else torch.cat(slots) for slots in zip(*maps, strict=True)
    )


def _split(cache: FeatMap, i: int) -> FeatMap:
    # Example i's cache of a batch's, its own tensors.
    return tuple(None if t is None else _own(t, i) for t in cache)


def _own(x: torch.Tensor, i: int) -> torch.Tensor:
    # Example i of a batched result as its own tensor (a slice would keep the batch alive),
    # in the standard layout whatever the batch's.
    return x[i : i + 1].clone(memory_format=torch.contiguous_format)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    # A video tensor (N, C, T, H, W) laid out channels-last; anything else as it is.
    if x.dim() != 5:
        return x
    return x.contiguous(memory_format=torch.channels_last_3d)
