"""Bespoke vs manager-backed DreamZero session state: bit-identical, step by step.

End-to-end scenarios feed the same observations to a bespoke and a managed pipeline built
from the same config (the flag flipped in ``environ`` only, or in ``os.environ`` only) and
compare every output with `torch.equal` and every session value with `tree_equal` after every
step. Below them, the upstream-style unit checks on the state layer.
"""

from __future__ import annotations

import re
from collections import OrderedDict, deque
from collections.abc import Iterator

import pytest
import torch

from sessionstate import (
    ENV_ENABLE,
    ENV_MAX_SESSIONS,
    LatentBuffer,
    MissingKeyError,
    OmniDiffusionConfig,
    RandomKey,
    nbytes_by_device,
    tree_equal,
    tree_map,
)
from sessionstate.models import _kit as kit_module
from sessionstate.models.dreamzero import (
    FRAMES_PER_CHUNK,
    DreamZeroPipeline,
    DreamZeroSession,
    DreamZeroState,
    new_session,
    reset_reason,
    stitch_views,
)
from sessionstate.models.dreamzero import _managed as managed_module
from sessionstate.models.dreamzero import pipeline as pipeline_module
from sessionstate.models.dreamzero.episode import scripted_episode
from sessionstate.models.dreamzero.state import frames_for_model, window_reset
from tests.models.dreamzero.dz_support import (
    assert_same_output,
    assert_same_session,
    observations,
    pipeline_pair,
    random_observation,
    run_both,
    tiny,
)
from tests.support import torch_threads


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    # Both paths always run at the same thread count. One thread keeps these thousands of
    # tiny ops fast on a shared 2-core machine; `test_two_threads_stay_identical` runs two.
    with torch_threads(1):
        yield


def _snapshot(tree: object) -> object:
    """A deep copy of every tensor in ``tree`` (to check later that nothing changed)."""
    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree)


def _latent_frames(steps: int) -> int:
    # One seed frame, then one latent frame per 4 appended pixel frames (one per step).
    return 1 + (steps - 1) // 4


# ---------------------------------------------------------------------------------------------
# End-to-end scenarios
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "local_attn_size", [9, -1], ids=["window-rollover-every-4", "no-window-rollover"]
)
def test_single_session_past_body_chunks_and_ring_wraps(local_attn_size: int) -> None:
    cfg = tiny(local_attn_size=local_attn_size)
    steps = 22
    bespoke, managed = pipeline_pair(cfg)
    obs = observations(cfg, steps, seed=11)

    outs = run_both(bespoke, managed, cfg, [("s", o) for o in obs])

    # The scenario exercised what it claims: body chunks, ring wraps, rollovers.
    resets = [o.reset for o in outs]
    if local_attn_size == -1:
        assert resets == ["session"] + [None] * (steps - 1)
    else:
        rollovers = ["inference" if i % 4 == 0 else None for i in range(1, steps)]
        assert resets == ["session", *rollovers]
    values_b = bespoke.session_values("s")
    values_m = managed.session_values("s")
    history = values_b["vae_encoder_out"]
    ring = values_m["vae_encoder_out"]
    assert isinstance(history, torch.Tensor)
    assert isinstance(ring, LatentBuffer)
    assert history.shape[2] == _latent_frames(steps) == 6  # the ring (2) wrapped 4 times
    assert len(ring) == cfg.num_frame_per_block
    assert len(values_b["video_latents_across_time"]) == steps  # kept across window resets
    if local_attn_size == -1:
        assert values_b["call_count"] == steps  # the stitched ring (4) wrapped
        assert len(values_m["stitched_buffer"]) == FRAMES_PER_CHUNK
    latents_b, latents_m = bespoke.video_latents("s"), managed.video_latents("s")
    assert latents_b is not None
    assert latents_m is not None
    assert torch.equal(latents_b, latents_m)
    # Two frames per block, plus the conditioning frame at every window start.
    assert latents_b.shape[2] == 2 * steps + sum(r is not None for r in resets)


def test_two_threads_stay_identical() -> None:
    cfg = tiny(local_attn_size=-1)
    with torch_threads(2):
        bespoke, managed = pipeline_pair(cfg)
        run_both(bespoke, managed, cfg, [("s", o) for o in observations(cfg, 6, seed=13)])


def test_three_interleaved_sessions() -> None:
    cfg = tiny()
    bespoke, managed = pipeline_pair(cfg)
    episode = list(scripted_episode(cfg, steps=9, sessions=3, seed=3))

    outs = run_both(bespoke, managed, cfg, episode)

    resets = [(sid, o.reset) for (sid, _), o in zip(episode, outs, strict=True)]
    # Prompt changes reset sessions mid-episode, and windows roll over.
    assert sum(r == "session" for _, r in resets) > 3
    assert any(r == "inference" for _, r in resets)
    assert bespoke.session_ids() == managed.session_ids()
    assert sorted(managed.session_ids()) == ["session-0", "session-1", "session-2"]
    for sid in managed.session_ids():
        assert torch.equal(bespoke.video_latents(sid), managed.video_latents(sid))
    sid = "session-2"
    decoded_b, decoded_m = bespoke.decode_video(sid), managed.decode_video(sid)
    assert decoded_b is not None
    assert decoded_m is not None
    assert torch.equal(decoded_b, decoded_m)

    # Interleaving changes nothing: a session run alone gives the same outputs.
    alone = DreamZeroPipeline(cfg, environ={ENV_ENABLE: "1"})
    for (s, obs), out in zip(episode, outs, strict=True):
        if s == sid:
            assert_same_output(alone.forward(obs, sid), out, f"{sid} alone")
    assert tree_equal(alone.session_values(sid), managed.session_values(sid))


def test_prompt_change_mid_episode_resets_the_session() -> None:
    cfg = tiny(local_attn_size=-1)
    prompts = ["pick up the block"] * 6 + ["open the drawer"] * 3
    obs = observations(cfg, len(prompts), seed=21, prompts=prompts)
    bespoke, managed = pipeline_pair(cfg)

    outs = run_both(bespoke, managed, cfg, [("s", o) for o in obs])

    assert [o.reset for o in outs] == ["session", *[None] * 5, "session", None, None]
    # Everything of the old prompt is gone: the state equals a fresh session's fed the same
    # observations from the prompt change on.
    fresh_b, fresh_m = pipeline_pair(cfg)
    fresh_outs = run_both(fresh_b, fresh_m, cfg, [("s", o) for o in obs[6:]])
    for i, (a, b) in enumerate(zip(outs[6:], fresh_outs, strict=True)):
        assert_same_output(a, b, f"step {6 + i} vs fresh")
    assert tree_equal(bespoke.session_values("s"), fresh_b.session_values("s"))
    assert tree_equal(managed.session_values("s"), fresh_m.session_values("s"))
    values = managed.session_values("s")
    assert values["call_count"] == 3
    assert len(values["video_latents_across_time"]) == 3
    assert tree_equal(values["language"], managed.nets.tokenize("open the drawer"))
    decoded_b, decoded_m = bespoke.decode_video("s"), managed.decode_video("s")
    assert decoded_b is not None
    assert decoded_m is not None
    assert torch.equal(decoded_b, decoded_m)
    assert decoded_b.shape[2] == 1 + 4 * (3 + 2 * 2 - 1)


def test_window_rollover_keeps_latents_prompt_and_vae_stream() -> None:
    cfg = tiny()  # local_attn_size 9: current_start_frame 3, 5, 7, 9, then the rollover
    obs = observations(cfg, 5, seed=31)
    bespoke, managed = pipeline_pair(cfg)
    run_both(bespoke, managed, cfg, [("s", o) for o in obs[:4]])
    before = {}
    for pipe in (bespoke, managed):
        values = dict(pipe.session_values("s"))
        assert values["current_start_frame"] == 9
        latents = values["video_latents_across_time"]
        values["video_latents_across_time"] = list(
            latents.view() if isinstance(latents, LatentBuffer) else latents
        )
        before[pipe.managed] = values

    (out,) = run_both(bespoke, managed, cfg, [("s", obs[4])])

    assert out.reset == "inference"
    fresh_b, _ = pipeline_pair(cfg)
    fresh_b.forward(obs[4], "s")
    fresh = fresh_b.session_values("s")
    for pipe in (bespoke, managed):
        old, new = before[pipe.managed], pipe.session_values("s")
        # Kept: prompt and its embeddings (not re-encoded), video latents, the VAE stream.
        assert new["prompt_embeds"] is old["prompt_embeds"]
        assert tree_equal(new["language"], old["language"])
        latents = new["video_latents_across_time"]
        latents = list(latents.view() if isinstance(latents, LatentBuffer) else latents)
        assert len(latents) == 5
        assert all(a is b for a, b in zip(latents, old["video_latents_across_time"], strict=False))
        assert new["vae_stream_initialized"] is True
        # The restart frame was appended to the live stream (steps 2-5 made a body chunk),
        # not used to seed a new one.
        assert new["vae_pending_body_frames"] is None
        assert not tree_equal(new["vae_enc_feat_map"], fresh["vae_enc_feat_map"])
        # Cleared, then started again from the restart frame.
        assert new["call_count"] == 1
        assert new["current_start_frame"] == 1 + cfg.num_frame_per_block
        ring = new["stitched_buffer"]
        frames = list(ring.view() if isinstance(ring, LatentBuffer) else ring)
        assert tree_equal(frames, [stitch_views(obs[4], cfg)])
        assert tree_equal(new["clip_feas"], fresh["clip_feas"])
        assert tree_equal(new["ys"], fresh["ys"])
        assert not tree_equal(new["clip_feas"], old["clip_feas"])
    history = bespoke.session_values("s")["vae_encoder_out"]
    assert isinstance(history, torch.Tensor)
    assert history.shape[2] == 2
    assert torch.equal(history[:, :, :1], before[False]["vae_encoder_out"])
    ring = managed.session_values("s")["vae_encoder_out"]
    assert ring.view()[0] is before[True]["vae_encoder_out"].view()[0]


def test_lru_eviction_then_continue_restarts_identically() -> None:
    cfg = tiny()
    bespoke, managed = pipeline_pair(cfg, cap=2)
    assert managed.manager is not None
    assert managed.manager.max_sessions == 2
    g = torch.Generator().manual_seed(41)
    schedule = ["a", "b", "a", "c", "b", "a", "b", "b"]
    steps = [(sid, random_observation(cfg, g)) for sid in schedule]
    held = []
    outs = []
    for i, step in enumerate(steps):
        outs += run_both(bespoke, managed, cfg, [step])
        held.append(managed.session_ids())
        assert bespoke.session_ids() == held[-1], f"step {i}"
    assert held == [
        ["a"],
        ["a", "b"],
        ["b", "a"],
        ["a", "c"],
        ["c", "b"],
        ["b", "a"],
        ["a", "b"],
        ["a", "b"],
    ]
    assert managed.manager.stats()["evictions"] == 3
    assert [o.reset for o in outs] == ["session"] * 2 + [None] + ["session"] * 3 + [None] * 2
    # The evicted `b` restarted from scratch: identical to a fresh session fed the same steps.
    fresh_b, fresh_m = pipeline_pair(cfg)
    continued = [(sid, o) for sid, o in steps[4:] if sid == "b"]
    fresh_outs = run_both(fresh_b, fresh_m, cfg, continued)
    ours = [o for (sid, _), o in zip(steps[4:], outs[4:], strict=True) if sid == "b"]
    for a, b in zip(ours, fresh_outs, strict=True):
        assert_same_output(a, b, "continued b vs fresh")
    assert tree_equal(managed.session_values("b"), fresh_m.session_values("b"))
    assert tree_equal(bespoke.session_values("b"), fresh_b.session_values("b"))


def test_flag_from_os_environ_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    deploy = OmniDiffusionConfig(model={"preset": "tiny"})
    monkeypatch.setenv(ENV_MAX_SESSIONS, "2")
    monkeypatch.setenv(ENV_ENABLE, "0")
    bespoke = DreamZeroPipeline(deploy, max_bespoke_sessions=2)
    monkeypatch.setenv(ENV_ENABLE, "1")
    managed = DreamZeroPipeline(deploy)
    assert (bespoke.managed, managed.managed) == (False, True)
    assert managed.manager is not None
    assert managed.manager.max_sessions == 2
    cfg = managed.cfg
    assert cfg == bespoke.cfg == tiny()
    run_both(bespoke, managed, cfg, scripted_episode(cfg, steps=4, sessions=3, seed=7))
    # The variable overrides the config in both directions.
    monkeypatch.setenv(ENV_ENABLE, "0")
    enabled = OmniDiffusionConfig(enable_session_state_manager=True, model={"preset": "tiny"})
    assert not DreamZeroPipeline(enabled).managed
    monkeypatch.delenv(ENV_ENABLE)
    assert DreamZeroPipeline(enabled).managed
    assert not DreamZeroPipeline(deploy).managed


def test_ring_over_request_raises() -> None:
    cfg = tiny()
    _, managed = pipeline_pair(cfg)
    for obs in observations(cfg, 6, seed=51):
        managed.forward(obs, "s")
    ring = managed.session_values("s")["vae_encoder_out"]
    assert isinstance(ring, LatentBuffer)
    assert (ring.maxlen, len(ring)) == (2, 2)
    msg = (
        "Requested 3 chunks but the ring `vae_encoder_out` retains at most 2; ask for at most "
        "2, or allocate a larger ring."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        ring.view(last=3)
    with pytest.raises(ValueError, match=re.escape(msg)):
        ring.concat(last=3)
    assert len(ring.view(last=2)) == 2


def test_latent_buffer_over_request_message() -> None:
    frames = LatentBuffer(name="stitched_buffer", dim=0).allocate(maxlen=FRAMES_PER_CHUNK)
    msg = (
        "Requested 5 chunks but the ring `stitched_buffer` retains at most 4; ask for at most "
        "4, or allocate a larger ring."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        frames.view(last=5)
    # The ring's size follows num_frame_per_block; 0 is refused at the config.
    assert new_session(tiny(num_frame_per_block=3)).vae_encoder_out.maxlen == 3
    msg = "`num_frame_per_block` must be a positive int, got 0 (int)."
    with pytest.raises(ValueError, match=re.escape(msg)):
        tiny(num_frame_per_block=0)


@pytest.mark.parametrize("nfpb", [1, 3])
def test_other_block_sizes_stay_identical(nfpb: int) -> None:
    cfg = tiny(num_frame_per_block=nfpb, local_attn_size=-1)
    bespoke, managed = pipeline_pair(cfg)
    run_both(bespoke, managed, cfg, [("s", o) for o in observations(cfg, 14, seed=61)])
    assert len(managed.session_values("s")["vae_encoder_out"]) == min(nfpb, _latent_frames(14))


def test_bad_observation_leaves_a_held_session_untouched() -> None:
    cfg = tiny()
    bespoke, managed = pipeline_pair(cfg)
    obs = observations(cfg, 3, seed=71)
    run_both(bespoke, managed, cfg, [("s", o) for o in obs[:2]])
    saved = {p.managed: _snapshot(p.session_values("s")) for p in (bespoke, managed)}
    bad = type(obs[2])(images=dict(obs[2].images), prompt=obs[2].prompt, state=torch.zeros(3))
    for pipe in (bespoke, managed):
        with pytest.raises(ValueError, match="Observation `state`"):
            pipe.forward(bad, "s")
        assert tree_equal(pipe.session_values("s"), saved[pipe.managed])
    run_both(bespoke, managed, cfg, [("s", obs[2])])


@pytest.mark.parametrize("flag", ["0", "1"])
def test_reading_an_unknown_session_raises_and_creates_nothing(flag: str) -> None:
    pipe = DreamZeroPipeline(tiny(), environ={ENV_ENABLE: flag})
    msg = (
        "DreamZero session 'nobody' is not held (never started, dropped or evicted); call "
        "`forward(obs, session_id)` to start it."
    )
    for read in (pipe.session_values, pipe.video_latents, pipe.decode_video):
        with pytest.raises(MissingKeyError, match=re.escape(msg)):
            read("nobody")
    assert pipe.session_ids() == []
    assert not pipe.drop_session("nobody")


@pytest.mark.parametrize("flag", ["0", "1"])
def test_pending_body_frames_keep_only_their_own_frames(flag: str) -> None:
    cfg = tiny(local_attn_size=-1)
    pipe = DreamZeroPipeline(cfg, environ={ENV_ENABLE: flag})
    for obs in observations(cfg, 2, seed=121):
        pipe.forward(obs, "s")
    pending = pipe.session_values("s")["vae_pending_body_frames"]
    assert isinstance(pending, torch.Tensor)
    assert pending.shape[2] == 1
    assert nbytes_by_device(pending) == {"cpu": pending.numel() * pending.element_size()}


@pytest.mark.parametrize("flag", ["0", "1"])
def test_output_latents_do_not_alias_the_session(flag: str) -> None:
    cfg = tiny()
    pipe = DreamZeroPipeline(cfg, environ={ENV_ENABLE: flag})
    out = pipe.forward(observations(cfg, 1, seed=131)[0], "s")
    stored = pipe.video_latents("s")
    assert stored is not None
    chunks = pipe.session_values("s")["video_latents_across_time"]
    last = chunks.view()[-1] if isinstance(chunks, LatentBuffer) else chunks[-1]
    shared = last.untyped_storage().data_ptr() == out.video_latents.untyped_storage().data_ptr()
    assert not shared


def test_bespoke_cap_is_validated() -> None:
    with pytest.raises(ValueError, match="max_bespoke_sessions"):
        DreamZeroPipeline(tiny(), environ={ENV_ENABLE: "0"}, max_bespoke_sessions=0)


# ---------------------------------------------------------------------------------------------
# The state layer (upstream-style unit checks)
# ---------------------------------------------------------------------------------------------


def _frame(value: int, h: int = 5, w: int = 6) -> torch.Tensor:
    return torch.full((h, w, 3), value, dtype=torch.uint8)


def test_frames_for_model_first_call_uses_one_frame() -> None:
    frames = [_frame(10), _frame(20)]
    video = frames_for_model(frames, True, torch.float32)
    assert video.shape == (1, 3, 1, 5, 6)
    assert torch.equal(video, torch.full_like(video, 20 / 127.5 - 1.0))
    ends = frames_for_model([_frame(0), _frame(255)], False, torch.float32)
    assert ends.amin().item() == -1.0
    assert ends.amax().item() == 1.0


def test_frames_for_model_later_calls_left_pad_with_the_oldest() -> None:
    video = frames_for_model([_frame(1), _frame(2)], False, torch.float32)
    assert video.shape == (1, 3, FRAMES_PER_CHUNK, 5, 6)
    firsts = [round((v.item() + 1.0) * 127.5) for v in video[0, 0, :, 0, 0]]
    assert firsts == [1, 1, 1, 2]
    video = frames_for_model([_frame(v) for v in range(1, 7)], False, torch.float32)
    assert [round((v.item() + 1.0) * 127.5) for v in video[0, 0, :, 0, 0]] == [3, 4, 5, 6]


def test_accumulate_frames_bespoke_and_ring_agree_and_cap_at_four() -> None:
    bespoke = DreamZeroState()
    managed = new_session(tiny())
    for i in range(2 * FRAMES_PER_CHUNK + 1):
        frame = _frame(i * 7)
        got_b = bespoke.accumulate_frames(frame, torch.float32)
        count = managed.call_count + 1
        managed = managed.update_object("stitched_buffer", lambda b, f=frame: b.commit(f))
        managed = managed.with_attrs(call_count=count)
        got_m = frames_for_model(list(managed.stitched_buffer.view()), count == 1, torch.float32)
        assert torch.equal(got_b, got_m)
        assert bespoke.call_count == managed.call_count == i + 1
        assert len(bespoke.stitched_buffer) == len(managed.stitched_buffer) == min(i + 1, 4)
        assert tree_equal(list(bespoke.stitched_buffer), list(managed.stitched_buffer.view()))
    assert bespoke.stitched_buffer.maxlen == managed.stitched_buffer.maxlen == FRAMES_PER_CHUNK


_T = torch.tensor([[1, 2, 3]])
_U = torch.tensor([[1, 2, 4]])


@pytest.mark.parametrize(
    ("language", "tokens", "csf", "local", "expected"),
    [
        (None, _T, 0, -1, "session"),  # 1. no prompt yet
        (None, _T, 99, 9, "session"),  # 1 before 4
        (_T, _U, 0, -1, "session"),  # 2. prompt changed
        (_T, _U, 99, 9, "session"),  # 2 before 4
        (_T, _T, 9, 9, "inference"),  # 4. window reached
        (_T, _T, 10, 9, "inference"),
        (_T, _T, 8, 9, None),
        (_T, _T, 10_000, -1, None),  # no window
        (_T, _T, 0, 9, None),
    ],
)
def test_reset_reason_order(
    language: torch.Tensor | None, tokens: torch.Tensor, csf: int, local: int, expected: str | None
) -> None:
    assert reset_reason(language, tokens, csf, local) == expected


def _filled_bespoke() -> DreamZeroState:
    state = DreamZeroState()
    state.accumulate_frames(_frame(1), torch.float32)
    state.accumulate_frames(_frame(2), torch.float32)
    state.current_start_frame = 5
    state.video_latents_across_time.append(torch.ones(1, 2, 3, 2, 2))
    state.clip_feas, state.ys = torch.ones(1, 3, 4), torch.ones(1, 6, 3, 2, 2)
    state.language, state.prompt_embeds = _T, torch.ones(1, 3, 4)
    state.vae_stream_initialized = True
    state.vae_enc_feat_map = (torch.ones(2), None)
    state.vae_encoder_out = torch.ones(1, 4, 2, 2, 2)
    state.vae_pending_body_frames = torch.ones(1, 3, 1, 5, 6)
    return state


def _filled_managed(cfg_nfpb: int = 2) -> DreamZeroSession:
    state = new_session(tiny(num_frame_per_block=cfg_nfpb))
    for value in (1, 2):
        state = state.update_object("stitched_buffer", lambda b, v=value: b.commit(_frame(v)))
    state = state.update_object(
        "video_latents_across_time", lambda b: b.commit(torch.ones(1, 2, 3, 2, 2))
    )
    state = state.update_object("vae_encoder_out", lambda b: b.commit(torch.ones(1, 4, 1, 2, 2)))
    state = state.update_object("vae_enc_feat_map", lambda c: c.commit((torch.ones(2), None)))
    return state.with_attrs(
        call_count=2,
        current_start_frame=5,
        clip_feas=torch.ones(1, 3, 4),
        ys=torch.ones(1, 6, 3, 2, 2),
        language=_T,
        prompt_embeds=torch.ones(1, 3, 4),
        vae_stream_initialized=True,
        vae_pending_body_frames=torch.ones(1, 3, 1, 5, 6),
    )


_WINDOW_CLEARED = {"call_count", "current_start_frame", "clip_feas", "ys", "stitched_buffer"}


def test_window_reset_clears_exactly_the_window_fields() -> None:
    bespoke = _filled_bespoke()
    kept_b = dict(bespoke.values())
    bespoke.reset(clear_video_latents=False)
    managed = _filled_managed()
    after = window_reset(managed)
    for name, old in kept_b.items():
        new_b, new_m, old_m = bespoke.values()[name], after.values()[name], managed.values()[name]
        if name == "stitched_buffer":
            assert len(new_b) == len(new_m) == 0
            assert new_b.maxlen == new_m.maxlen == FRAMES_PER_CHUNK
        elif name == "kv_cache":  # the window's KV starts again empty (`_kv_create`)
            assert new_b == []
            assert bespoke.kv_tokens == 0
            assert new_m is None
        elif name in _WINDOW_CLEARED:
            assert new_b is None or new_b == 0, name
            assert new_m is None or new_m == 0, name
            assert type(new_b) is type(new_m), name
        else:
            assert new_b is old, name
            assert new_m is old_m, name
    assert len(managed.stitched_buffer) == 2  # the input record is unchanged


def test_session_reset_clears_everything() -> None:
    bespoke = _filled_bespoke()
    bespoke.random_key = bespoke.random_key.normal(())[1]
    bespoke.reset()
    assert tree_equal(bespoke.values(), DreamZeroState().values())
    for name, value in bespoke.values().items():
        if name == "random_key":  # a new session's: the seed's, no draw made
            assert tree_equal(value, RandomKey.seeded(0))
            continue
        assert value in (0, False, None) or len(value) == 0, name


def test_managed_state_persists_across_forward_calls() -> None:
    cfg = tiny()
    _, managed = pipeline_pair(cfg)
    assert managed.manager is not None
    obs = observations(cfg, 4, seed=91)
    first = managed.forward(obs[0], "s")
    record = managed.manager.get("s")
    assert isinstance(record, DreamZeroSession)
    assert record.call_count == 1
    second = managed.forward(obs[1], "s")
    later = managed.manager.get("s")
    assert later is not record
    assert (later.call_count, later.current_start_frame) == (2, 5)
    assert second.reset is None
    # The manager is the source of truth: rewinding its record rewinds the session.
    managed.manager.put("s", record)
    again = managed.forward(obs[1], "s")
    assert_same_output(again, second, "after rewind")
    assert tree_equal(managed.manager.get("s"), later)
    # Dropping it starts the session over.
    assert managed.drop_session("s")
    assert_same_output(managed.forward(obs[0], "s"), first, "after drop")


def test_evicted_record_held_by_the_caller_is_unchanged() -> None:
    cfg = tiny()
    _, managed = pipeline_pair(cfg, cap=2)
    reference = DreamZeroPipeline(cfg, environ={ENV_ENABLE: "0"})
    assert managed.manager is not None
    obs = observations(cfg, 6, seed=101)
    for o in obs[:2]:
        managed.forward(o, "a")
        reference.forward(o, "a")
    held = managed.manager.get("a")
    assert isinstance(held, DreamZeroSession)
    saved = _snapshot(held)
    managed.forward(obs[2], "b")
    managed.forward(obs[3], "c")
    assert "a" not in managed.manager
    assert tree_equal(held, saved)
    # The caller keeps working on its record, exactly as an uninterrupted session.
    state = held
    for o in obs[4:]:
        state, out = managed.step(state, o)
        assert_same_output(out, reference.forward(o, "a"), "held record")
    assert tree_equal(held, saved)
    assert_same_session(reference.session_values("a"), state.values(), cfg)


def test_step_is_pure() -> None:
    cfg = tiny()
    _, managed = pipeline_pair(cfg)
    obs = observations(cfg, 7, seed=111)
    state = managed.new_session()
    for o in obs:
        saved = _snapshot(state)
        new, out = managed.step(state, o)
        assert tree_equal(state, saved)
        again, out_again = managed.step(state, o)
        assert_same_output(out, out_again)
        assert tree_equal(new, again)
        state = new


def test_with_the_flag_off_nothing_of_the_manager_is_constructed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the bespoke path constructed a manager-side object")

    monkeypatch.setattr(pipeline_module, "ManagedPath", refuse)
    monkeypatch.setattr(pipeline_module, "new_session", refuse)
    monkeypatch.setattr(kit_module, "SessionStateManager", refuse)  # `build_manager`'s
    monkeypatch.setattr(managed_module, "new_session", refuse)
    monkeypatch.setattr(managed_module, "window_reset", refuse)
    cfg = tiny()
    pipe = DreamZeroPipeline(cfg, environ={ENV_ENABLE: "0"})
    assert pipe.manager is None
    assert not pipe.managed
    for sid, obs in scripted_episode(cfg, steps=6, sessions=2, seed=0):
        pipe.forward(obs, sid)
    assert isinstance(pipe._states, OrderedDict)
    assert all(isinstance(s, DreamZeroState) for s in pipe._states.values())
    assert isinstance(pipe.session_values("session-0")["stitched_buffer"], deque)
    assert set(pipe.stats()) >= {"sessions", "max_sessions", "total_nbytes", "nbytes:cpu"}


def test_diffuse_is_a_pure_function_of_its_inputs() -> None:
    """The shared scheduler template is never advanced: the same call twice gives the same bits."""
    cfg = tiny()
    nets = DreamZeroPipeline(cfg, environ={ENV_ENABLE: "1"}).nets
    frame = torch.linspace(-1, 1, 3 * cfg.canvas_height * cfg.canvas_width).reshape(
        1, 3, 1, cfg.canvas_height, cfg.canvas_width
    )
    clip_feas, ys, cond = nets.encode_image(frame)
    embeds = nets.encode_prompt(nets.tokenize("pick"))
    kv = nets.prefill_kv(cond)
    noise, _ = nets.noise(RandomKey.seeded(0))
    first = nets.diffuse(cond, ys[:, :, 1:3], clip_feas, embeds, kv, noise)
    nets.diffuse(cond * 0.5, ys[:, :, 1:3], clip_feas, embeds, kv, noise)  # an unrelated call
    again = nets.diffuse(cond, ys[:, :, 1:3], clip_feas, embeds, kv, noise)
    assert torch.equal(first[0], again[0])
    assert torch.equal(first[1], again[1])
