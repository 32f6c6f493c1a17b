"""Begin versus continue, lost sessions, `on_full`, and clearing exported video, on both paths.

A continuation (``forward(..., begin=False)``) of a session that was never started, dropped or
evicted raises `SessionStateLostError` instead of silently restarting the rollout; every reader
does the same; ``on_full="refuse"`` refuses alike on the bespoke table and the manager; the
first eviction is logged once per table. Every scenario runs on both paths and compares them
with `torch.equal` / `tree_equal`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
import torch

from sessionstate import (
    ENV_ENABLE,
    ENV_MAX_SESSIONS,
    ENV_ON_FULL,
    MissingKeyError,
    OmniDiffusionConfig,
    SessionAdmissionError,
    SessionStateLostError,
    tree_equal,
)
from sessionstate.models.dreamzero import DreamZeroPipeline, Observation
from tests.models.dreamzero.dz_support import (
    assert_same_output,
    assert_same_sessions,
    observations,
    tiny,
)
from tests.support import clone_tree, torch_threads

CFG = tiny()


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def _pair(
    cap: int | None = None, on_full: str | None = None
) -> tuple[DreamZeroPipeline, DreamZeroPipeline]:
    """``(bespoke, managed)`` with the same cap and ``on_full``, flipped by the flag only."""
    common: dict[str, str] = {}
    if on_full is not None:
        common[ENV_ON_FULL] = on_full
    kwargs: dict[str, int] = {}
    managed_env = {**common, ENV_ENABLE: "1"}
    if cap is not None:
        managed_env[ENV_MAX_SESSIONS] = str(cap)
        kwargs["max_bespoke_sessions"] = cap
    bespoke = DreamZeroPipeline(CFG, environ={**common, ENV_ENABLE: "0"}, **kwargs)
    managed = DreamZeroPipeline(CFG, environ=managed_env)
    assert not bespoke.managed
    assert managed.managed
    return bespoke, managed


def _both(
    pipes: tuple[DreamZeroPipeline, DreamZeroPipeline],
    obs: Observation,
    sid: str,
    begin: bool | None = None,
) -> None:
    bespoke, managed = pipes
    a = bespoke.forward(obs, sid, begin=begin)
    b = managed.forward(obs, sid, begin=begin)
    assert_same_output(a, b, sid)
    assert_same_sessions(bespoke, managed, CFG)


def _unknown(sid: str) -> str:
    return (
        f"DreamZero session {sid!r} is not held (never started, dropped or evicted); call "
        "`forward(obs, session_id)` to start it."
    )


def _lost(sid: str) -> str:
    return (
        f"Cannot continue DreamZero session {sid!r}: it is not held (never started, dropped or "
        f"evicted), so its state is lost. Start it again with `forward(obs, {sid!r}, "
        "begin=True)`, or raise the session cap."
    )


def _counters(pipe: DreamZeroPipeline) -> tuple[int, ...]:
    stats = pipe.stats()
    return tuple(stats[k] for k in ("sessions", "hits", "misses", "evictions"))


# -- readers --------------------------------------------------------------------------------------


def test_every_reader_raises_session_state_lost_and_creates_nothing() -> None:
    pipes = _pair(cap=1)
    obs = observations(CFG, 2, seed=11)
    _both(pipes, obs[0], "dropped")
    for pipe in pipes:
        assert pipe.drop_session("dropped")
    _both(pipes, obs[0], "evicted")
    _both(pipes, obs[1], "resident")  # evicts "evicted"
    for pipe in pipes:
        before = _counters(pipe)
        for sid in ("never", "dropped", "evicted"):
            for read in (pipe.session_values, pipe.video_latents, pipe.decode_video):
                with pytest.raises(SessionStateLostError, match=re.escape(_unknown(sid))) as info:
                    read(sid)
                assert isinstance(info.value, MissingKeyError)
                assert isinstance(info.value, KeyError)
                assert str(info.value) == _unknown(sid)
        assert pipe.session_ids() == ["resident"]
        assert _counters(pipe) == before


# -- begin / continue -----------------------------------------------------------------------------


def test_continue_of_a_session_never_started_raises_on_both_paths() -> None:
    pipes = _pair()
    obs = observations(CFG, 1, seed=12)[0]
    for pipe in pipes:
        with pytest.raises(SessionStateLostError, match=re.escape(_lost("s"))):
            pipe.forward(obs, "s", begin=False)
        assert pipe.session_ids() == []
    assert _counters(pipes[0]) == _counters(pipes[1]) == (0, 0, 1, 0)


def test_begin_then_continue_matches_the_default_get_or_create() -> None:
    default = _pair()
    explicit = _pair()
    obs = observations(CFG, 5, seed=13)
    for i, o in enumerate(obs):
        _both(default, o, "s")
        _both(explicit, o, "s", begin=i == 0)
    for a, b in zip(default, explicit, strict=True):
        assert tree_equal(a.session_values("s"), b.session_values("s"))


def test_begin_restarts_a_held_session_from_scratch() -> None:
    pipes = _pair()
    fresh = _pair()
    obs = observations(CFG, 4, seed=14)
    for o in obs[:3]:
        _both(pipes, o, "s")
    _both(pipes, obs[0], "other")
    _both(pipes, obs[3], "s", begin=True)
    _both(fresh, obs[3], "s", begin=True)
    for pipe, ref in zip(pipes, fresh, strict=True):
        assert tree_equal(pipe.session_values("s"), ref.session_values("s"))
        assert pipe.session_ids() == ["other", "s"]  # a restart marks it most recently used
        assert pipe.stats()["evictions"] == 0
    assert _counters(pipes[0]) == _counters(pipes[1])


def test_a_continuation_never_silently_restarts() -> None:
    """At the cap an evicted session's continuation raises on both paths; nothing is created.

    The default (``begin=None``) still gets-or-creates, as upstream did: the same call without
    ``begin=False`` restarts the rollout (reset ``"session"``), which is what ``begin=False``
    turns into an error.
    """
    pipes = _pair(cap=1)
    obs = observations(CFG, 3, seed=15)
    _both(pipes, obs[0], "session-0", begin=True)
    _both(pipes, obs[1], "session-0", begin=False)
    _both(pipes, obs[0], "session-1", begin=True)  # evicts session-0
    for pipe in pipes:
        held = clone_tree(pipe.session_values("session-1"))
        with pytest.raises(SessionStateLostError, match=re.escape(_lost("session-0"))):
            pipe.forward(obs[2], "session-0", begin=False)
        assert pipe.session_ids() == ["session-1"]
        assert tree_equal(pipe.session_values("session-1"), held)
        assert pipe.stats()["evictions"] == 1
    assert _counters(pipes[0]) == _counters(pipes[1])
    bespoke, managed = pipes
    restarted = bespoke.forward(obs[2], "session-0")
    assert_same_output(restarted, managed.forward(obs[2], "session-0"))
    assert restarted.reset == "session"


def test_raised_cap_through_the_managed_pipeline_matches_a_bespoke_cap() -> None:
    bespoke = DreamZeroPipeline(CFG, environ={ENV_ENABLE: "0"}, max_bespoke_sessions=3)
    managed = DreamZeroPipeline(CFG, environ={ENV_ENABLE: "1", ENV_MAX_SESSIONS: "1"})
    assert managed.manager is not None
    assert managed.manager.raise_max_sessions(3)
    obs = observations(CFG, 4, seed=16)
    for i, sid in enumerate(["a", "b", "c", "d"]):
        _both((bespoke, managed), obs[i], sid)
    for pipe in (bespoke, managed):
        assert pipe.session_ids() == ["b", "c", "d"]
        assert pipe.stats()["evictions"] == 1
        assert pipe.stats()["max_sessions"] == 3


# -- on_full --------------------------------------------------------------------------------------


def _refused_bespoke(sid: str, cap: int) -> str:
    return (
        f"Cannot admit DreamZero session {sid!r}: the bespoke session table holds {cap} sessions "
        "(its cap) and `on_full='refuse'`. Drop a finished session first with `drop_session`, or "
        "raise the cap."
    )


def _refused_managed(sid: str, cap: int) -> str:
    return (
        f"Cannot admit session {sid!r}: the manager holds {cap} sessions (its cap) and "
        "`on_full='refuse'`. Drop a finished session first, or raise `max_sessions`."
    )


@pytest.mark.parametrize("begin", [None, True])
def test_refuse_on_both_paths_keeps_the_residents(begin: bool | None) -> None:
    pipes = _pair(cap=2, on_full="refuse")
    assert [p.on_full for p in pipes] == ["refuse", "refuse"]
    obs = observations(CFG, 4, seed=17)
    _both(pipes, obs[0], "a")
    _both(pipes, obs[1], "b")
    messages = (_refused_bespoke("c", 2), _refused_managed("c", 2))
    for pipe, msg in zip(pipes, messages, strict=True):
        held = clone_tree({sid: pipe.session_values(sid) for sid in ("a", "b")})
        with pytest.raises(SessionAdmissionError, match=re.escape(msg)):
            pipe.forward(obs[2], "c", begin=begin)
        assert pipe.session_ids() == ["a", "b"]
        assert tree_equal({sid: pipe.session_values(sid) for sid in ("a", "b")}, held)
        assert pipe.stats()["evictions"] == 0
    assert _counters(pipes[0]) == _counters(pipes[1])
    _both(pipes, obs[3], "a")  # the residents continue, identically
    _both(pipes, obs[3], "b", begin=True)  # a held session restarts at the cap
    for pipe in pipes:
        assert pipe.drop_session("a")
    _both(pipes, obs[2], "c", begin=begin)  # a freed slot admits the new session


def test_refuse_from_the_deploy_config_on_both_paths() -> None:
    config = OmniDiffusionConfig(model={"preset": "tiny"}, session_state_on_full="refuse")
    obs = observations(CFG, 2, seed=18)
    bespoke = DreamZeroPipeline(config, environ={ENV_ENABLE: "0"}, max_bespoke_sessions=1)
    managed = DreamZeroPipeline(config, environ={ENV_ENABLE: "1", ENV_MAX_SESSIONS: "1"})
    _both((bespoke, managed), obs[0], "a")
    for pipe in (bespoke, managed):
        assert pipe.on_full == "refuse"
        with pytest.raises(SessionAdmissionError):
            pipe.forward(obs[1], "b")
        assert pipe.session_ids() == ["a"]
    overridden = DreamZeroPipeline(config, environ={ENV_ENABLE: "0", ENV_ON_FULL: "evict"})
    assert overridden.on_full == "evict"


# -- the eviction warning -------------------------------------------------------------------------


def test_eviction_warns_once_per_table_on_both_paths(caplog: pytest.LogCaptureFixture) -> None:
    pipes = _pair(cap=1)
    obs = observations(CFG, 1, seed=19)[0]
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        for i in range(5):
            _both(pipes, obs, f"s{i}")
    messages = [r.getMessage() for r in caplog.records if r.name == "sessionstate"]
    assert messages == [
        "DreamZero session 's0' was evicted by the bespoke session cap (1) although nobody "
        "ended it; its state is lost. End finished sessions explicitly with "
        "`drop_session(session_id)`, or raise the cap. Warned once per pipeline; "
        "`stats()['evictions']` counts every eviction.",
        "Session 's0' was evicted by the session cap (max_sessions=1) although nobody ended it; "
        "its state is lost. End finished sessions explicitly with `drop(session_id)` "
        "(`drop_session(session_id)` on a model pipeline), or raise the cap. Warned once per "
        "manager; `stats()['evictions']` counts every eviction.",
    ]
    for pipe in pipes:
        assert pipe.stats()["evictions"] == 4


# -- clear_accumulated_video_latents --------------------------------------------------------------


def test_clear_accumulated_video_latents_keeps_everything_else() -> None:
    pipes = _pair()
    uncleared = _pair()
    obs = observations(CFG, 6, seed=20)
    for o in obs[:3]:
        _both(pipes, o, "s")
        _both(uncleared, o, "s")
    _both(pipes, obs[0], "other")
    for pipe in pipes:
        before = clone_tree(pipe.session_values("s"))
        pipe.clear_accumulated_video_latents("s")
        assert pipe.video_latents("s") is None
        assert pipe.decode_video("s") is None
        after = pipe.session_values("s")
        for name, value in before.items():
            if name != "video_latents_across_time":
                assert tree_equal(after[name], value), name
        assert pipe.session_ids() == ["other", "s"]
    assert_same_sessions(*pipes, CFG)
    for o in obs[3:]:
        _both(pipes, o, "s")
        _both(uncleared, o, "s")
    # Generation never reads the accumulated latents: the rollout continues exactly, and the
    # latents held since the clear are the uncleared run's newest ones.
    for pipe, ref in zip(pipes, uncleared, strict=True):
        latents, full = pipe.video_latents("s"), ref.video_latents("s")
        assert latents is not None
        assert full is not None
        assert torch.equal(latents, full[:, :, full.shape[2] - latents.shape[2] :])
        values, ref_values = pipe.session_values("s"), ref.session_values("s")
        for name in values:
            if name != "video_latents_across_time":
                assert tree_equal(values[name], ref_values[name]), name


def test_clear_accumulated_video_latents_of_an_unknown_session() -> None:
    for pipe in _pair():
        with pytest.raises(SessionStateLostError, match=re.escape(_unknown("nobody"))):
            pipe.clear_accumulated_video_latents("nobody")
        assert pipe.session_ids() == []
