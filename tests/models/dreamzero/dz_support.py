"""Shared helpers of the DreamZero tests: pipeline pairs, observations, state comparison.

Bit-identical means `torch.equal` on outputs and `sessionstate.tree_equal` on state, never
``allclose``. The bespoke state keeps a deque, a list and a concatenated encoder output
where the managed record keeps `LatentBuffer`s; `assert_same_session` maps one onto the
other and compares value by value.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

import torch

from sessionstate import ENV_CHECK_IMMUTABLE, ENV_ENABLE, ENV_MAX_SESSIONS, LatentBuffer, tree_equal
from sessionstate.models.dreamzero import (
    BUCKETS,
    CAMERAS,
    FRAMES_PER_CHUNK,
    DreamZeroConfig,
    DreamZeroOutput,
    DreamZeroPipeline,
    Observation,
)

ATTR_TENSORS = ("clip_feas", "ys", "language", "prompt_embeds", "vae_pending_body_frames")
"""Attributes that hold a tensor or None on both paths (compared with `tree_equal`)."""

COUNTERS = ("call_count", "current_start_frame", "vae_stream_initialized")
"""Plain int/bool attributes (compared by type and value)."""


def tiny(**overrides: object) -> DreamZeroConfig:
    """The tiny preset, with fields overridden."""
    return DreamZeroConfig.preset("tiny", **overrides)


def pipeline_pair(
    cfg: DreamZeroConfig, *, cap: int | None = None
) -> tuple[DreamZeroPipeline, DreamZeroPipeline]:
    """``(bespoke, managed)`` pipelines of ``cfg``, flipped by the flag in ``environ`` only.

    With ``cap``, both paths retain at most ``cap`` sessions: the bespoke one through
    ``max_bespoke_sessions``, the managed one through the MAX_SESSIONS environment variable.
    The managed manager also checks that nothing writes into a stored record in place.
    """
    bespoke_env = {ENV_ENABLE: "0"}
    managed_env = {ENV_ENABLE: "1", ENV_CHECK_IMMUTABLE: "1"}
    kwargs: dict[str, int] = {}
    if cap is not None:
        managed_env[ENV_MAX_SESSIONS] = str(cap)
        kwargs["max_bespoke_sessions"] = cap
    bespoke = DreamZeroPipeline(cfg, environ=bespoke_env, **kwargs)
    managed = DreamZeroPipeline(cfg, environ=managed_env)
    assert not bespoke.managed
    assert managed.manager is not None
    assert managed.manager.check_immutable
    return bespoke, managed


def random_observation(
    cfg: DreamZeroConfig, generator: torch.Generator, prompt: str = "pick up the block"
) -> Observation:
    """One observation with random uint8 camera images and a random joint state."""
    shape = (cfg.camera_height, cfg.camera_width, 3)
    images = {
        cam: torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8) for cam in CAMERAS
    }
    state = torch.randn(cfg.action_dim, generator=generator)
    return Observation(images=images, prompt=prompt, state=state)


def observations(
    cfg: DreamZeroConfig, n: int, *, seed: int, prompts: Iterable[str] | None = None
) -> list[Observation]:
    """``n`` random observations; ``prompts`` (one per observation) default to one prompt."""
    g = torch.Generator().manual_seed(seed)
    chosen = list(prompts) if prompts is not None else ["pick up the block"] * n
    assert len(chosen) == n
    return [random_observation(cfg, g, p) for p in chosen]


def assert_same_output(a: DreamZeroOutput, b: DreamZeroOutput, where: str = "") -> None:
    """Actions, video latents, decoded frames and reset reason bit-identical."""
    assert a.reset == b.reset, f"{where}: reset {a.reset!r} vs {b.reset!r}"
    assert torch.equal(a.actions, b.actions), f"{where}: actions differ"
    assert torch.equal(a.video_latents, b.video_latents), f"{where}: video latents differ"
    assert a.actions.dtype == b.actions.dtype
    assert a.video_latents.dtype == b.video_latents.dtype
    assert (a.frames is None) == (b.frames is None), f"{where}: frames on one path only"
    assert a.frames is None or torch.equal(a.frames, b.frames), f"{where}: frames differ"


def assert_same_session(
    bespoke: Mapping[str, object], managed: Mapping[str, object], cfg: DreamZeroConfig
) -> None:
    """The bespoke session values equal the managed record's, value by value.

    - attributes: `tree_equal` (tensors bitwise, None equal to None; the feat map a tuple);
    - counters: same type and value;
    - ``stitched_buffer``: the deque's frames equal the ring's, both capped at 4;
    - ``video_latents_across_time``: the list's chunks equal the buffer's (unbounded);
    - ``vae_encoder_out``: the bespoke concatenation's last ``min(T, num_frame_per_block)``
      frames equal the managed ring concatenated, one latent frame per ring chunk.
    """
    assert set(bespoke) == set(managed) == set(BUCKETS)
    for name in COUNTERS:
        b, m = bespoke[name], managed[name]
        assert type(b) is type(m), f"{name}: {type(b).__name__} vs {type(m).__name__}"
        assert b == m, f"{name}: {b!r} vs {m!r}"
    for name in ATTR_TENSORS:
        assert tree_equal(bespoke[name], managed[name]), f"{name} differs"
    for cache in ("vae_enc_feat_map", "vae_dec_feat_map"):
        assert tree_equal(bespoke[cache], managed[cache]), f"{cache} differs"

    frames_b, frames_m = bespoke["stitched_buffer"], managed["stitched_buffer"]
    assert isinstance(frames_b, deque)
    assert isinstance(frames_m, LatentBuffer)
    assert frames_b.maxlen == frames_m.maxlen == FRAMES_PER_CHUNK
    assert tree_equal(list(frames_b), list(frames_m.view())), "stitched_buffer differs"

    latents_b = bespoke["video_latents_across_time"]
    latents_m = managed["video_latents_across_time"]
    assert isinstance(latents_b, list)
    assert isinstance(latents_m, LatentBuffer)
    assert latents_m.maxlen is None
    assert tree_equal(latents_b, list(latents_m.view())), "video_latents_across_time differs"

    enc_b, enc_m = bespoke["vae_encoder_out"], managed["vae_encoder_out"]
    assert isinstance(enc_m, LatentBuffer)
    assert enc_m.maxlen == cfg.num_frame_per_block
    if enc_b is None:
        assert len(enc_m) == 0
        return
    assert isinstance(enc_b, torch.Tensor)
    kept = min(enc_b.shape[2], cfg.num_frame_per_block)
    assert len(enc_m) == kept
    assert all(chunk.shape[2] == 1 for chunk in enc_m.view())
    assert tree_equal(enc_b[:, :, enc_b.shape[2] - kept :].contiguous(), enc_m.concat()), (
        "vae_encoder_out: the ring is not the last frames of the bespoke history"
    )


def assert_same_sessions(
    bespoke: DreamZeroPipeline, managed: DreamZeroPipeline, cfg: DreamZeroConfig
) -> None:
    """Both paths hold the same sessions in the same LRU order, each with equal values."""
    assert bespoke.session_ids() == managed.session_ids()
    for sid in bespoke.session_ids():
        assert_same_session(bespoke.session_values(sid), managed.session_values(sid), cfg)


def run_both(
    bespoke: DreamZeroPipeline,
    managed: DreamZeroPipeline,
    cfg: DreamZeroConfig,
    steps: Iterable[tuple[str, Observation]],
    *,
    check_state: bool = True,
) -> list[DreamZeroOutput]:
    """Feed both paths the same steps; outputs (and, by default, state) equal after each."""
    outs = []
    for i, (sid, obs) in enumerate(steps):
        a = bespoke.forward(obs, sid)
        b = managed.forward(obs, sid)
        assert_same_output(a, b, f"step {i} ({sid})")
        if check_state:
            assert_same_sessions(bespoke, managed, cfg)
        outs.append(a)
    return outs
