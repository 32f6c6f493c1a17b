"""Cosmos3: both paths bit-identical over interleaved sessions and changing prompts; the
bespoke instance cache's interleaving hazard; encode-once; failed steps; sizes; ``ab``."""

from __future__ import annotations

import itertools
import json
import re

import attrs
import pytest
import torch

from sessionstate import (
    ENV_ENABLE,
    EncodeOnceKV,
    SessionStateLostError,
    tree_equal,
    tree_map,
)
from sessionstate.cli import size_table
from sessionstate.models.cosmos3 import (
    BUCKETS,
    Cosmos3Config,
    Cosmos3Pipeline,
    Cosmos3Request,
    Cosmos3Session,
)
from sessionstate.models.cosmos3.episode import NEGATIVE_PROMPT, scripted_episode
from tests.support import run_cli

CFG = Cosmos3Config.preset("tiny")
ON = {ENV_ENABLE: "1"}
OFF = {ENV_ENABLE: "0"}


def _pipe(environ: dict[str, str], **kwargs: object) -> Cosmos3Pipeline:
    return Cosmos3Pipeline(CFG, environ=environ, **kwargs)  # type: ignore[arg-type]


def _episode(steps: int = 6, sessions: int = 3) -> list[tuple[str, Cosmos3Request]]:
    return list(
        scripted_episode(CFG, steps=steps, sessions=sessions, seed=3, prompt_change_every=3)
    )


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[Cosmos3Pipeline, list[tuple[str, torch.Tensor, str | None]]]]:
    episode = _episode()
    out = {}
    for name, environ, keyed in (
        ("bespoke", OFF, True),
        ("managed", ON, True),
        ("unkeyed", OFF, False),
    ):
        pipe = _pipe(environ, bespoke_session_keyed=keyed)
        records = []
        for sid, request in episode:
            result = pipe.forward(request, sid)
            records.append((sid, result.video_latents, result.reset))
        out[name] = (pipe, records)
    return out


def test_episode_interleaves_sessions_and_changes_prompts() -> None:
    episode = _episode()
    sids = [sid for sid, _ in episode]
    assert any(a != b for a, b in itertools.pairwise(sids))  # consecutive steps switch sessions
    prompts = {sid: {r.prompt for s, r in episode if s == sid} for sid in set(sids)}
    assert all(len(p) > 1 for p in prompts.values())


def test_paths_bit_identical(runs) -> None:  # type: ignore[no-untyped-def]
    bespoke, managed = runs["bespoke"], runs["managed"]
    assert not bespoke[0].managed
    assert managed[0].managed
    for (sid, a, ra), (sid2, b, rb) in zip(bespoke[1], managed[1], strict=True):
        assert sid == sid2
        assert torch.equal(a, b)
        assert ra == rb
    resets = [r for _, _, r in managed[1]]
    assert resets.count("session") > 3  # first steps plus prompt changes
    for sid in managed[0].session_ids():
        assert torch.equal(bespoke[0].video_latents(sid), managed[0].video_latents(sid))


def test_unkeyed_instance_cache_reads_another_sessions_kv(runs) -> None:  # type: ignore[no-untyped-def]
    """The hazard: without the session key, a session continuing after another one ran
    reads that other session's K/V from the shared instance cache."""
    unkeyed, managed = runs["unkeyed"], runs["managed"]
    differs = [
        not torch.equal(a, b) for (_, a, _), (_, b, _) in zip(unkeyed[1], managed[1], strict=True)
    ]
    assert any(differs)
    # Exactly one step, replayed: A starts, B starts (encoding B's prompt into the instance),
    # A continues; unkeyed A now denoises with B's K/V.
    ctrl = torch.zeros(CFG.control_dim)
    a, b = Cosmos3Request("prompt A", ctrl), Cosmos3Request("prompt B", ctrl)
    results = {}
    for name, environ, keyed in (("managed", ON, True), ("unkeyed", OFF, False)):
        pipe = _pipe(environ, bespoke_session_keyed=keyed)
        pipe.forward(a, "A")
        pipe.forward(b, "B")
        results[name] = pipe.forward(a, "A").video_latents
        if name == "unkeyed":
            cached = pipe.instance_cache()[0]["cond"]
            fresh = next(pipe.nets.encode_layers(pipe.nets.tokenize("prompt B")))
            assert torch.equal(cached.key, fresh.key)  # the instance holds B's K/V
    # What A would get with B's K/V: a managed session of A whose K/V is B's.
    probe = _pipe(ON)
    probe.forward(a, "A")
    probe.forward(b, "B")
    state_a, state_b = probe.manager.peek("A"), probe.manager.peek("B")  # type: ignore[union-attr]
    assert isinstance(state_a, Cosmos3Session)
    assert isinstance(state_b, Cosmos3Session)
    _, wrong = probe.step(state_a.with_object("text_kv", state_b.text_kv), a)
    assert not torch.equal(results["unkeyed"], results["managed"])
    assert torch.equal(results["unkeyed"], wrong.video_latents)


def test_managed_encodes_once_per_session_and_prompt(runs) -> None:  # type: ignore[no-untyped-def]
    bespoke, managed = runs["bespoke"][0], runs["managed"][0]
    resets = sum(r == "session" for _, _, r in runs["managed"][1])
    assert managed.encodes == 2 * resets  # both branches, once per session start
    assert bespoke.encodes > managed.encodes  # the keyed instance cache re-encodes on switches


def test_kv_is_staged_during_the_step_and_committed_after(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Layers are staged as they are encoded, the first denoising step reads them staged,
    and the one commit comes after the last denoising step."""
    pipe = _pipe(ON)
    log: list[str] = []
    stage, commit = EncodeOnceKV.stage, EncodeOnceKV.commit
    velocity = pipe.nets.guided_velocity

    def spy_stage(self, payload):  # type: ignore[no-untyped-def]
        log.append("stage")
        return stage(self, payload)

    def spy_commit(self, payload=None):  # type: ignore[no-untyped-def]
        log.append("commit")
        return commit(self, payload)

    def spy_velocity(*args, **kwargs):  # type: ignore[no-untyped-def]
        log.append("denoise")
        return velocity(*args, **kwargs)

    monkeypatch.setattr(EncodeOnceKV, "stage", spy_stage)
    monkeypatch.setattr(EncodeOnceKV, "commit", spy_commit)
    monkeypatch.setattr(pipe.nets, "guided_velocity", spy_velocity)
    state = pipe.new_session()
    request = Cosmos3Request("stage me", torch.zeros(CFG.control_dim), NEGATIVE_PROMPT)
    after, _ = pipe.step(state, request)
    n, steps = CFG.num_layers, CFG.num_inference_steps
    assert log == ["stage"] * (2 * n) + ["denoise"] * steps + ["commit"]
    assert state.text_kv.is_empty
    assert after.text_kv.is_complete
    assert not after.text_kv.has_staged
    log.clear()
    pipe.step(after, request)  # encoded once: the next step only reads
    assert log == ["denoise"] * steps


def test_failed_step_leaves_stored_record_intact(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pipe = _pipe(ON)
    ctrl = torch.zeros(CFG.control_dim)
    pipe.forward(Cosmos3Request("first", ctrl), "s")
    stored = pipe.manager.peek("s")  # type: ignore[union-attr]
    snapshot = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, stored)

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("denoiser failed")

    monkeypatch.setattr(pipe.nets, "guided_velocity", boom)
    with pytest.raises(RuntimeError, match="denoiser failed"):
        pipe.forward(Cosmos3Request("second prompt, re-encoded", ctrl), "s")
    assert pipe.manager.peek("s") is stored  # type: ignore[union-attr]
    assert tree_equal(stored, snapshot)


def test_evicted_kv_is_re_encoded_identically() -> None:
    pipe = _pipe(ON)
    ctrl = torch.zeros(CFG.control_dim)
    request = Cosmos3Request("evict me", ctrl)
    state, _ = pipe.step(pipe.new_session(), request)
    kept, out_kept = pipe.step(state, request)
    evicted = state.update_object("text_kv", lambda kv: kv.evict())
    assert evicted.text_kv.nbytes_by_device() == {}
    rebuilt, out_rebuilt = pipe.step(evicted, request)
    assert torch.equal(out_kept.video_latents, out_rebuilt.video_latents)
    assert tree_equal(kept.text_kv, rebuilt.text_kv)


def test_size_table_counts_kv_per_layer_and_branch() -> None:
    table = size_table("tiny", 2, model="cosmos3")
    assert {k: v["bucket"] for k, v in table["values"].items()} == BUCKETS
    pair = 2 * CFG.num_kv_heads * CFG.text_len * CFG.head_dim * 4
    assert table["text_kv_pair_nbytes"] == pair
    kv = table["values"]["text_kv"]
    assert kv["managed_nbytes"] == kv["bespoke_nbytes"] == 2 * CFG.num_layers * pair
    many = table["sessions_64_nbytes"]
    one = table["session_nbytes"]["managed"]
    assert many["managed"] == 64 * one
    assert many["bespoke"] < many["managed"]  # one shared instance cache


def test_deploy_preset_geometry() -> None:
    cfg = Cosmos3Config.preset("deploy")
    pair = 2 * cfg.num_kv_heads * cfg.text_len * cfg.head_dim * cfg.torch_dtype.itemsize
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.text_len) == (28, 4, 128, 512)
    assert 2 * cfg.num_layers * pair == 56 * 1024 * 1024


def test_ab_model_cosmos3_reports_identical() -> None:
    run = run_cli("ab", "--model", "cosmos3", "--steps", "4", "--sessions", "3", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["model"] == "cosmos3"
    assert report["identical"] is True
    assert report["outputs_compared"] == 2 * 4 * 3 + 3
    held = {name: path["nbytes_by_device"]["cpu"] for name, path in report["paths"].items()}
    assert held["bespoke"] < held["managed"]  # per-session K/V vs one instance cache


@pytest.mark.parametrize("environ", [ON, OFF], ids=["managed", "bespoke"])
def test_readers_of_a_session_not_held_raise_session_state_lost(environ: dict[str, str]) -> None:
    pipe = _pipe(environ)
    msg = (
        "Cosmos3 session 'gone' is not held (never started, dropped or evicted); "
        "call `forward(request, session_id)` to start it."
    )
    for read in (pipe.session_values, pipe.video_latents):
        with pytest.raises(SessionStateLostError, match=re.escape(msg)):
            read("gone")
    assert pipe.session_ids() == []  # nothing was created


def test_an_unknown_model_setting_suggests_the_closest_key() -> None:
    from sessionstate.models.cosmos3 import Cosmos3Config

    known = sorted(a.name for a in attrs.fields(Cosmos3Config) if a.name != "name")
    msg = (
        "Unknown Cosmos3 model setting 'num_layer' (value 3); did you mean 'num_layers'? "
        f"Known: {['preset', *known]}."
    )
    with pytest.raises(KeyError, match=re.escape(msg)):
        Cosmos3Config.from_dict({"preset": "tiny", "num_layer": 3})
