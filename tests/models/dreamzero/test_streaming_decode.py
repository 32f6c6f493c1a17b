"""DreamZero's streaming decode: each step's latents decoded with the session's own cache.

The promise: the frames of a session's steps, joined, are the frames one call of the Wan
decoder gives over the session's whole latent history (`torch.equal`, however the history is
split into steps); both paths give the same frames; the decoder cache is a parkable state
object that parks, snapshots and comes back bit-identical; the size table counts it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import sessionstate as ss
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.networks import build_networks
from tests.models.dreamzero.dz_support import (
    assert_same_output,
    assert_same_session,
    observations,
    pipeline_pair,
    tiny,
)

SPLITS = [
    [1, 2, 1, 5],  # a one-frame chunk leaves the decoder's "Rep" mark in the cache
    [3, 2, 2, 2],  # the pipeline's shape: a window's first block is 3
    [9],
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "-".join(map(str, s)))
def test_chunk_by_chunk_frames_equal_one_decoder_call(dtype: str, split: list[int]) -> None:
    cfg = tiny(dtype=dtype)
    nets = build_networks(cfg)
    g = torch.Generator().manual_seed(5)
    shape = (1, cfg.vae_z_dim, sum(split), cfg.latent_height, cfg.latent_width)
    latents = torch.randn(shape, generator=g).to(nets.dtype)
    # diffusers' own one-call decode (module cache and all), and ours without the module cache
    z = latents / nets.latents_inv_std + nets.latents_mean
    reference = nets.vae.decode(z).sample
    assert torch.equal(nets.decode(latents), reference)

    cache, frames, start = nets.init_decode_map(), [], 0
    for n in split:
        before = cache
        out, cache = nets.decode_chunk(latents[:, :, start : start + n], cache)
        assert out.shape[2] == (4 * n - 3 if start == 0 else 4 * n)
        assert cache is not before
        frames.append(out)
        start += n
    assert all(slot is None or isinstance(slot, torch.Tensor) for slot in cache)
    assert torch.equal(torch.cat(frames, dim=2), reference)


def test_decode_chunk_leaves_the_cache_it_was_given() -> None:
    nets = build_networks(tiny())
    latents = torch.randn(1, 16, 3, 4, 8, generator=torch.Generator().manual_seed(1))
    _, cache = nets.decode_chunk(latents[:, :, :1], nets.init_decode_map())
    marks = [i for i, slot in enumerate(cache) if slot is not None and slot.numel() == 0]
    assert marks, "a one-frame stream leaves upsampling slots marked"
    kept = [None if s is None else s.clone() for s in cache]
    once, _ = nets.decode_chunk(latents[:, :, 1:], cache)
    again, _ = nets.decode_chunk(latents[:, :, 1:], cache)
    assert torch.equal(once, again)
    assert ss.tree_equal(list(cache), kept)


def test_both_paths_decode_the_same_frames_and_a_session_equals_one_call() -> None:
    cfg = tiny(decode_frames=True)
    bespoke, managed = pipeline_pair(cfg)
    frames: dict[str, list[torch.Tensor]] = {}
    # Two sessions interleaved; the window (9 latent frames) rolls over at step 4.
    prompts = ["pick up the block"] * 7
    for i, obs in enumerate(observations(cfg, 7, seed=3, prompts=prompts)):
        for sid in ("a", "b") if i % 2 else ("b", "a"):
            a, b = bespoke.forward(obs, sid), managed.forward(obs, sid)
            assert_same_output(a, b, f"step {i} of {sid}")
            assert b.frames is not None
            assert b.frames.shape[2] == 4 * b.video_latents.shape[2] - (3 if i == 0 else 0)
            frames.setdefault(sid, []).append(b.frames)
    for sid in ("a", "b"):
        assert_same_session(bespoke.session_values(sid), managed.session_values(sid), cfg)
        history = managed.video_latents(sid)
        assert history is not None
        assert torch.equal(torch.cat(frames[sid], dim=2), managed.nets.decode(history))
        assert torch.equal(managed.decode_video(sid), torch.cat(frames[sid], dim=2))


def test_decode_off_keeps_the_cache_empty_and_the_outputs_frameless() -> None:
    cfg = tiny()
    assert not cfg.decode_frames
    assert DreamZeroConfig.preset("deploy").decode_frames
    bespoke, managed = pipeline_pair(cfg)
    for obs in observations(cfg, 2, seed=0):
        a, b = bespoke.forward(obs, "s"), managed.forward(obs, "s")
        assert a.frames is None
        assert b.frames is None
    assert managed.session_values("s")["vae_dec_feat_map"] is None
    record = managed.manager.peek("s")  # type: ignore[union-attr]
    assert ss.nbytes_by_device(record.object("vae_dec_feat_map")) == {}


def test_a_session_reset_restarts_the_decode_stream_and_a_window_reset_keeps_it() -> None:
    cfg = tiny(decode_frames=True)
    _, managed = pipeline_pair(cfg)
    prompts = ["pick"] * 5 + ["place"]
    outs = [managed.forward(obs, "s") for obs in observations(cfg, 6, seed=2, prompts=prompts)]
    resets = [o.reset for o in outs]
    assert resets == ["session", None, None, None, "inference", "session"]
    # A window reset continues the stream (4 frames per latent frame), a session reset
    # starts it again (its first latent frame gives 1).
    assert outs[4].frames is not None
    assert outs[5].frames is not None
    assert outs[4].frames.shape[2] == 4 * outs[4].video_latents.shape[2]
    assert outs[5].frames.shape[2] == 4 * outs[5].video_latents.shape[2] - 3


def test_the_decode_cache_parks_and_comes_back_bit_identical(tmp_path: Path) -> None:
    cfg = tiny(decode_frames=True)
    # A budget that never parks by itself, so the manager keeps parking figures.
    pipe = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1", ss.ENV_MAX_BYTES: "cpu=1GiB"})
    for obs in observations(cfg, 3, seed=4):
        pipe.forward(obs, "s")
    manager = pipe.manager
    assert manager is not None
    before = manager.peek("s").vae_dec_feat_map
    assert before is not None
    assert any(t is not None for t in before)
    held = ss.nbytes_by_device(manager.peek("s").object("vae_dec_feat_map"))["cpu"]
    assert held > 0
    assert manager.park_until(lambda: manager.stats()["parked_sessions"] == 1, frees=bool)
    assert manager.stats()["nbytes:cpu"] < held  # the cache left the device with the rest
    assert ss.tree_equal(manager.get("s").vae_dec_feat_map, before)

    # A snapshot holds it, and a pipeline that loads it continues the stream.
    path = tmp_path / "s.safetensors"
    manager.snapshot("s", path)
    nxt = observations(cfg, 4, seed=4)[3]
    expected = pipe.forward(nxt, "s")
    fresh = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    assert fresh.manager is not None
    fresh.manager.restore("s", path)
    got = fresh.forward(nxt, "s")
    assert got.frames is not None
    assert expected.frames is not None
    assert torch.equal(got.frames, expected.frames)


def test_the_budget_parks_the_decode_cache_and_the_paths_stay_identical() -> None:
    cfg = tiny(decode_frames=True)
    bespoke = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "0"})
    # About two sessions' bytes for three sessions: every step parks someone.
    managed = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1", ss.ENV_MAX_BYTES: "cpu=5000000"})
    for i, obs in enumerate(observations(cfg, 4, seed=6)):
        for sid in ("a", "b", "c"):
            assert_same_output(bespoke.forward(obs, sid), managed.forward(obs, sid), f"{i} {sid}")
    stats = managed.stats()
    assert stats["parks"] > 0
    for sid in ("a", "b", "c"):
        assert_same_session(bespoke.session_values(sid), managed.session_values(sid), cfg)


def test_a_record_without_a_decode_cache_gets_an_empty_one() -> None:
    # Files written before the streaming decode hold no `vae_dec_feat_map` (the golden files
    # of 0.1.0.dev0); the record built from one holds an empty cache.
    from sessionstate.models.dreamzero import DreamZeroSession, new_session

    full = new_session(tiny())
    older = {k: v for k, v in full.objects.items() if k != "vae_dec_feat_map"}
    record = DreamZeroSession(objects=older)
    assert record.vae_dec_feat_map is None
    assert set(record.objects) == set(full.objects)


def test_decode_frames_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"`decode_frames` must be true or false, got 'yes'"):
        tiny(decode_frames="yes")


def test_the_size_table_counts_the_decode_cache_at_deploy() -> None:
    from sessionstate.models.dreamzero.sizes import size_table

    table = size_table("deploy", 2)
    row = table["values"]["vae_dec_feat_map"]
    assert row["bucket"] == "object"
    assert row["managed_nbytes"] == row["bespoke_nbytes"] > row["bespoke_nbytes"] // 2 > 0
    # The same bytes as one decode of two steps' latents on meta, counted here by hand.
    cfg = DreamZeroConfig.preset("deploy")
    nets = build_networks(cfg, device="meta")
    shape = (1, cfg.vae_z_dim, 1, cfg.latent_height, cfg.latent_width)
    cache = nets.init_decode_map()
    for n in (cfg.num_frame_per_block + 1, cfg.num_frame_per_block):
        _, cache = nets.decode_chunk(
            torch.empty((*shape[:2], n, *shape[3:]), device="meta", dtype=nets.dtype), cache
        )
    by_hand = sum(t.numel() * t.element_size() for t in cache if t is not None)
    assert row["managed_nbytes"] == by_hand
    assert row["managed_nbytes"] > table["values"]["vae_enc_feat_map"]["managed_nbytes"]
