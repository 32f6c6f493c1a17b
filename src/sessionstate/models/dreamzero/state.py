"""DreamZero per-session state, kept two ways.

`DreamZeroState` is the bespoke, mutable state a hand-rolled model keeps: a deque of frames,
a list of video latents, an encoder output grown by concatenation forever. `DreamZeroSession`
is the same state as an immutable `SessionState` record: the frames, video latents and
encoder output are `LatentBuffer`s (the encoder output a ring of ``num_frame_per_block``
latent frames), the Wan encoder's and decoder's causal-conv caches are `TensorCache`s
(replaced wholesale, and parkable under a byte budget), the denoiser's KV is a `KVCache` (a
handle to blocks of the pipeline's `KVPool`, parked with the session: its blocks move to the
tier and go back to the pool), the noise's random state is a `RandomKey` (split when the session
forks), everything else is a `SessionAttr`. Which value goes in which bucket
follows one rule: what the manager can act on is an object, what it can only carry is an
attribute, whatever its size.
"""

from __future__ import annotations

from collections import deque
from typing import Literal, TypeVar

import torch

from sessionstate import (
    KVCache,
    KVHandle,
    LatentBuffer,
    RandomKey,
    SessionAttr,
    SessionState,
    StateObject,
    TensorCache,
)
from sessionstate.models.dreamzero.config import FRAMES_PER_CHUNK, DreamZeroConfig
from sessionstate.models.dreamzero.networks import FeatMap

__all__ = [
    "BUCKETS",
    "DreamZeroSession",
    "DreamZeroState",
    "ResetReason",
    "frames_for_model",
    "new_session",
    "reset_reason",
    "window_reset",
]

ResetReason = Literal["session", "inference"]
_O = TypeVar("_O", bound=StateObject)

BUCKETS: dict[str, Literal["attrs", "object", "engine"]] = {
    "vae_enc_feat_map": "object",
    "vae_dec_feat_map": "object",
    "video_latents_across_time": "object",
    "stitched_buffer": "object",
    "vae_encoder_out": "object",
    "clip_feas": "attrs",
    "ys": "attrs",
    "language": "attrs",
    "prompt_embeds": "attrs",
    "vae_pending_body_frames": "attrs",
    "call_count": "attrs",
    "current_start_frame": "attrs",
    "vae_stream_initialized": "attrs",
    "kv_cache": "engine",
    "random_key": "object",
}
"""Every DreamZero session value and its bucket (the reference table).

``engine`` marks the denoiser's KV cache: engine-owned memory (a `KVPool`'s blocks) that the
managed record holds through a `KVHandle` in a parkable `KVCache` object. Its bytes are
reported as engine bytes; the manager parks it with the session's other objects (the blocks
move to the park tier and return to the pool; unparking takes fresh blocks of the same pool).
"""


def reset_reason(
    language: torch.Tensor | None,
    tokens: torch.Tensor,
    current_start_frame: int,
    local_attn_size: int,
    *,
    num_video_frames: int = 0,
    call_count: int = 0,
) -> ResetReason | None:
    """Why this forward must reset, checked in order; None to continue.

    A missing or changed prompt resets the session; so does a single-frame input after the
    first call (the stitched ring was cleared externally; ``forward`` passes 0 frames, as
    upstream, so this check fires only for direct callers). Reaching the local attention
    window resets the window only.

    >>> import torch
    >>> t = torch.tensor([[1, 2]])
    >>> reset_reason(None, t, 0, -1), reset_reason(t, t, 9, 9), reset_reason(t, t, 3, 9)
    ('session', 'inference', None)
    >>> reset_reason(t, t, 3, 9, num_video_frames=1, call_count=2)
    'session'
    """
    if language is None:
        return "session"
    if not torch.equal(tokens, language):
        return "session"
    if num_video_frames == 1 and call_count > 1:
        return "session"
    if local_attn_size != -1 and current_start_frame >= local_attn_size:
        return "inference"
    return None


def frames_for_model(
    frames: list[torch.Tensor], first_call: bool, dtype: torch.dtype
) -> torch.Tensor:
    """The model's pixel input from the stitched uint8 ring: (1, 3, T, H, W) in [-1, 1].

    The first call of a window uses its one frame; later calls the last 4, left-padded by
    repeating the oldest.
    """
    if first_call:
        chosen = frames[-1:]
    else:
        chosen = frames[-FRAMES_PER_CHUNK:]
        chosen = [chosen[0]] * (FRAMES_PER_CHUNK - len(chosen)) + chosen
    video = torch.stack(chosen, dim=0).permute(3, 0, 1, 2).unsqueeze(0)
    return video.to(dtype) / 127.5 - 1.0


# ---------------------------------------------------------------------------------------------
# Bespoke: mutable, hand-rolled.
# ---------------------------------------------------------------------------------------------


class DreamZeroState:
    """The bespoke per-session state: mutable fields, updated in place by the pipeline.

    ``random_key`` is the session's random state, seeded from ``seed`` (the config's): each
    step draws its noise from it and keeps the next key.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.random_key = RandomKey.seeded(seed)
        self.call_count = 0
        self.current_start_frame = 0
        self.stitched_buffer: deque[torch.Tensor] = deque(maxlen=FRAMES_PER_CHUNK)
        self.video_latents_across_time: list[torch.Tensor] = []
        self.clip_feas: torch.Tensor | None = None
        self.ys: torch.Tensor | None = None
        self.language: torch.Tensor | None = None
        self.prompt_embeds: torch.Tensor | None = None
        self.vae_stream_initialized = False
        self.vae_enc_feat_map: FeatMap | None = None
        self.vae_dec_feat_map: FeatMap | None = None  # with `decode_frames` on
        self.vae_encoder_out: torch.Tensor | None = None
        self.vae_pending_body_frames: torch.Tensor | None = None
        self.kv_cache: list[torch.Tensor] = []  # blocks of the window's KV (`_kv_create`)
        self.kv_tokens = 0

    def reset(self, *, clear_video_latents: bool = True) -> None:
        """Session reset (everything, the random key back to the seed's), or window reset
        (``clear_video_latents=False``: the key draws on)."""
        if clear_video_latents:
            self.__init__(self.seed)  # type: ignore[misc]
            return
        self.stitched_buffer = deque(maxlen=FRAMES_PER_CHUNK)
        self.call_count = 0
        self.current_start_frame = 0
        self.clip_feas = None
        self.ys = None
        self.kv_cache = []
        self.kv_tokens = 0

    def accumulate_frames(self, frame: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Push a stitched frame; return the model's pixel input."""
        self.call_count += 1
        self.stitched_buffer.append(frame)
        return frames_for_model(list(self.stitched_buffer), self.call_count == 1, dtype)

    def append_vae_encoder_chunk(self, out: torch.Tensor) -> None:
        """Grow the encoder output by concatenation (for the whole session)."""
        if self.vae_encoder_out is None:
            self.vae_encoder_out = out
        else:
            self.vae_encoder_out = torch.cat([self.vae_encoder_out, out], dim=2)

    def get_concatenated_video_latents(self) -> torch.Tensor | None:
        """Every generated latent chunk joined along time, or None."""
        if not self.video_latents_across_time:
            return None
        return torch.cat(self.video_latents_across_time, dim=2)

    def values(self) -> dict[str, object]:
        """Every session value by name (for accounting and comparison)."""
        return {name: getattr(self, name) for name in BUCKETS}


# ---------------------------------------------------------------------------------------------
# Managed: an immutable record.
# ---------------------------------------------------------------------------------------------


class DreamZeroSession(SessionState):
    """One DreamZero session as an immutable record (build it with `new_session`)."""

    call_count = SessionAttr(0, coerce=int, doc="Forward calls in this window.")
    current_start_frame = SessionAttr(
        0, coerce=int, doc="Autoregressive window position, in latent frames."
    )
    clip_feas = SessionAttr[torch.Tensor | None](None, doc="CLIP features of the window start.")
    ys = SessionAttr[torch.Tensor | None](None, doc="VAE conditioning of the window start.")
    language = SessionAttr[torch.Tensor | None](None, doc="Prompt token ids (1, text_len).")
    prompt_embeds = SessionAttr[torch.Tensor | None](None, doc="Prompt embeddings, encoded once.")
    vae_stream_initialized = SessionAttr(
        False, coerce=bool, doc="Whether the VAE stream is seeded."
    )
    vae_pending_body_frames = SessionAttr[torch.Tensor | None](
        None, doc="Pixel frames awaiting a 4-frame body chunk (fewer than 4)."
    )

    def __attrs_post_init__(self) -> None:
        # The upgrade of the earlier layout: records written before the KV moved into an
        # object (snapshot format 2 to 4 files) hold its handle as the attribute `kv_cache`;
        # built from such a file, the record holds it in its `KVCache` object instead.
        if "kv_cache" in self._attrs:
            handle = self._attrs.pop("kv_cache")
            if "kv_cache" not in self._objects:
                self._objects["kv_cache"] = KVCache(name="kv_cache").allocate().commit(handle)
        # Records written before the streaming decode (snapshot files up to format 4 of
        # 0.1.0.dev0) have no decoder cache: they get an empty one, and a session that
        # decodes starts its decode stream at its next step.
        if "vae_dec_feat_map" not in self._objects and "vae_enc_feat_map" in self._objects:
            self._objects["vae_dec_feat_map"] = TensorCache(name="vae_dec_feat_map").allocate()
        # Records written before sessions held their random state (every snapshot file of
        # 0.1.0.dev0 up to `dreamzero_v4`) drew their noise from the config's seed alone: they
        # get a key not allocated, which the next step seeds from the config's seed.
        if "random_key" not in self._objects and "vae_enc_feat_map" in self._objects:
            self._objects["random_key"] = RandomKey(name="random_key")
        super().__attrs_post_init__()

    @property
    def kv_cache(self) -> KVHandle | None:
        """The window's denoiser KV: a handle to blocks of the pipeline's `KVPool`, or None.

        Held in the `KVCache` object of the same name, so the manager can park it.
        """
        return self._typed("kv_cache", KVCache).view()

    @property
    def stitched_buffer(self) -> LatentBuffer:
        """Ring of the last `FRAMES_PER_CHUNK` stitched uint8 frames."""
        return self._buffer("stitched_buffer")

    @property
    def video_latents_across_time(self) -> LatentBuffer:
        """Every generated latent chunk of the session, on the host."""
        return self._buffer("video_latents_across_time")

    @property
    def vae_encoder_out(self) -> LatentBuffer:
        """Ring of the last ``num_frame_per_block`` pre-quant encoder output frames."""
        return self._buffer("vae_encoder_out")

    @property
    def vae_enc_feat_map(self) -> FeatMap | None:
        """Wan encoder causal-conv cache (24 tensors), or None before the stream is seeded.

        Held in the `TensorCache` object of the same name: replaced wholesale per chunk.
        """
        contents: FeatMap | None = self._typed("vae_enc_feat_map", TensorCache).view()
        return contents

    @property
    def vae_dec_feat_map(self) -> FeatMap | None:
        """Wan decoder causal-conv cache, or None before the first decoded step.

        Held in the `TensorCache` object of the same name, replaced wholesale per step; empty
        unless the config's ``decode_frames`` is on.
        """
        contents: FeatMap | None = self._typed("vae_dec_feat_map", TensorCache).view()
        return contents

    @property
    def random_key(self) -> RandomKey:
        """The session's random key: each step draws its noise from it and keeps the next."""
        return self._typed("random_key", RandomKey)

    def _buffer(self, name: str) -> LatentBuffer:
        return self._typed(name, LatentBuffer)

    def _typed(self, name: str, cls: type[_O]) -> _O:
        obj = self._objects.get(name)
        if type(obj) is cls:  # what a step reads: the checks below for anything else
            return obj
        obj = self.object(name)
        if not isinstance(obj, cls):
            obj.view()  # a parked object refuses here, saying how to unpark it
            msg = (
                f"DreamZero session value `{name}` must be a {cls.__name__}, got "
                f"{type(obj).__name__}; build sessions with `new_session(cfg)`."
            )
            raise TypeError(msg)
        return obj

    def values(self) -> dict[str, object]:
        """Every session value by name (for accounting and comparison)."""
        return {name: getattr(self, name) for name in BUCKETS}


def new_session(cfg: DreamZeroConfig) -> DreamZeroSession:
    """An empty session: allocated buffers, a key seeded from ``cfg.seed``, attributes at
    their defaults.

    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> s = new_session(DreamZeroConfig.preset("tiny"))
    >>> s.vae_encoder_out.maxlen, s.stitched_buffer.maxlen, s.call_count
    (2, 4, 0)
    """
    return DreamZeroSession(
        objects={
            "stitched_buffer": LatentBuffer(name="stitched_buffer", dim=0).allocate(
                maxlen=FRAMES_PER_CHUNK
            ),
            "video_latents_across_time": LatentBuffer(
                name="video_latents_across_time", dim=2
            ).allocate(),
            "vae_encoder_out": LatentBuffer(name="vae_encoder_out", dim=2).allocate(
                maxlen=cfg.num_frame_per_block
            ),
            "vae_enc_feat_map": TensorCache(name="vae_enc_feat_map").allocate(),
            "vae_dec_feat_map": TensorCache(name="vae_dec_feat_map").allocate(),
            "kv_cache": KVCache(name="kv_cache").allocate(),
            "random_key": RandomKey.seeded(cfg.seed, name="random_key"),
        }
    )


def window_reset(state: DreamZeroSession) -> DreamZeroSession:
    """The window ("inference") reset: a fresh frames ring, counters and window conditioning.

    Keeps the video latents, the prompt and its embeddings, and the whole VAE stream, encode
    and decode: the Wan feature-cache history does not depend on the denoiser's attention
    window. Clears the KV
    cache (its blocks return to the pool once no record holds them).
    """
    state = state.update_object("stitched_buffer", lambda b: b.reset())
    state = state.update_object("kv_cache", lambda c: c.reset())
    return state.clear_attrs("call_count", "current_start_frame", "clip_feas", "ys")
