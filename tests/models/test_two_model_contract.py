"""One session contract for both reference models, on both paths.

The cap, ``on_full``, ``begin``, the byte budget and parking, lost-session errors and the
eviction warning, parametrised over DreamZero and Cosmos3. Every scenario runs a bespoke and
a managed pipeline that differ only in the environment flag, and compares them: outputs with
`torch.equal`, session ids and counters by value. Each model's settings come from the deploy
config and the environment, as a deployment sets them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from sessionstate import (
    ENV_ENABLE,
    ENV_MAX_BYTES,
    ENV_MAX_SESSIONS,
    ENV_ON_FULL,
    OmniDiffusionConfig,
    SessionAdmissionError,
    SessionStateLostError,
    tree_equal,
    tree_leaves,
    tree_map,
)
from sessionstate.models._registry import ModelSpec, get_model
from tests.support import torch_threads


@attrs.frozen
class Model:
    """One reference model as the contract sees it."""

    spec: ModelSpec
    label: str  # how its messages name it
    arg: str  # how its messages name the step input

    def deploy(self, **fields: Any) -> OmniDiffusionConfig:
        return OmniDiffusionConfig(model={"preset": "tiny"}, **fields)

    def inputs(self, n: int, seed: int) -> list[Any]:
        cfg = self.spec.config_from_dict({"preset": "tiny"})
        episode = self.spec.episode(cfg, steps=n, sessions=1, seed=seed)
        return [step_input for _, step_input in episode]

    def outputs(self, out: Any) -> dict[str, Any]:
        outputs: dict[str, Any] = self.spec.outputs(out)
        return outputs


MODELS = {
    "dreamzero": Model(get_model("dreamzero"), "DreamZero", "obs"),
    "cosmos3": Model(get_model("cosmos3"), "Cosmos3", "request"),
}


@pytest.fixture(params=sorted(MODELS))
def model(request: pytest.FixtureRequest) -> Model:
    return MODELS[request.param]


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


Pair = tuple[Any, Any]


def _pair(
    model: Model,
    *,
    cap: int | None = None,
    environ: Mapping[str, str] | None = None,
    **deploy: Any,
) -> Pair:
    """``(bespoke, managed)`` pipelines of ``model``, flipped by the flag only."""
    common = dict(environ or {})
    kwargs: dict[str, int] = {}
    managed_env = {**common, ENV_ENABLE: "1"}
    if cap is not None:
        managed_env[ENV_MAX_SESSIONS] = str(cap)
        kwargs["max_bespoke_sessions"] = cap
    config = model.deploy(**deploy)
    bespoke = model.spec.pipeline(config, environ={**common, ENV_ENABLE: "0"}, **kwargs)
    managed = model.spec.pipeline(config, environ=managed_env)
    assert not bespoke.managed
    assert managed.managed
    return bespoke, managed


def _same(model: Model, a: Any, b: Any, where: str) -> None:
    got, want = model.outputs(a), model.outputs(b)
    assert got.keys() == want.keys()
    for key, value in got.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, want[key]), f"{where}: {key} differs between the paths"
        else:
            assert value == want[key], f"{where}: {key} differs between the paths"


def _both(model: Model, pipes: Pair, step_input: Any, sid: str, begin: bool | None = None) -> Any:
    bespoke, managed = pipes
    a = bespoke.forward(step_input, sid, begin=begin)
    b = managed.forward(step_input, sid, begin=begin)
    _same(model, a, b, sid)
    assert bespoke.session_ids() == managed.session_ids()
    return a


def _counters(pipe: Any) -> tuple[int, ...]:
    stats = pipe.stats()
    return tuple(stats[k] for k in ("sessions", "hits", "misses", "evictions"))


def _lost(model: Model, sid: str) -> str:
    return (
        f"Cannot continue {model.label} session {sid!r}: it is not held (never started, "
        f"dropped or evicted), so its state is lost. Start it again with "
        f"`forward({model.arg}, {sid!r}, begin=True)`, or raise the session cap."
    )


def _unknown(model: Model, sid: str) -> str:
    return (
        f"{model.label} session {sid!r} is not held (never started, dropped or evicted); call "
        f"`forward({model.arg}, session_id)` to start it."
    )


def _refused(model: Model, sid: str, cap: int) -> tuple[str, str]:
    bespoke = (
        f"Cannot admit {model.label} session {sid!r}: the bespoke session table holds {cap} "
        "sessions (its cap) and `on_full='refuse'`. Drop a finished session first with "
        "`drop_session`, or raise the cap."
    )
    managed = (
        f"Cannot admit session {sid!r}: the manager holds {cap} sessions (its cap) and "
        "`on_full='refuse'`. Drop a finished session first, or raise `max_sessions`."
    )
    return bespoke, managed


# -- the cap and on_full --------------------------------------------------------------------------


def test_the_cap_evicts_the_least_recently_used_session_alike(model: Model) -> None:
    pipes = _pair(model, cap=2)
    steps = model.inputs(5, seed=1)
    _both(model, pipes, steps[0], "a")
    _both(model, pipes, steps[0], "b")
    _both(model, pipes, steps[1], "a")  # `b` is now the least recently used
    _both(model, pipes, steps[0], "c")
    for pipe in pipes:
        assert pipe.session_ids() == ["a", "c"]
        assert pipe.stats()["evictions"] == 1
        assert pipe.stats()["max_sessions"] == 2
    assert _counters(pipes[0]) == _counters(pipes[1])
    _both(model, pipes, steps[2], "a")
    _both(model, pipes, steps[1], "c")


@pytest.mark.parametrize("begin", [None, True])
def test_refuse_at_the_cap_keeps_the_residents_alike(model: Model, begin: bool | None) -> None:
    pipes = _pair(model, cap=2, environ={ENV_ON_FULL: "refuse"})
    steps = model.inputs(4, seed=2)
    _both(model, pipes, steps[0], "a")
    _both(model, pipes, steps[0], "b")
    for pipe, msg in zip(pipes, _refused(model, "c", 2), strict=True):
        assert pipe.on_full == "refuse"
        with pytest.raises(SessionAdmissionError, match=re.escape(msg)):
            pipe.forward(steps[1], "c", begin=begin)
        assert pipe.session_ids() == ["a", "b"]
        assert pipe.stats()["evictions"] == 0
    assert _counters(pipes[0]) == _counters(pipes[1])
    _both(model, pipes, steps[1], "a")  # the residents continue, identically
    _both(model, pipes, steps[1], "b", begin=True)  # a held session restarts at the cap
    for pipe in pipes:
        assert pipe.drop_session("a")
    _both(model, pipes, steps[2], "c", begin=begin)  # a freed slot admits the new session


def test_refuse_from_the_deploy_config_alike(model: Model) -> None:
    pipes = _pair(model, cap=1, session_state_on_full="refuse")
    steps = model.inputs(2, seed=3)
    _both(model, pipes, steps[0], "a")
    for pipe in pipes:
        assert pipe.on_full == "refuse"
        with pytest.raises(SessionAdmissionError):
            pipe.forward(steps[1], "b")
        assert pipe.session_ids() == ["a"]


def test_the_first_eviction_warns_once_per_table(
    model: Model, caplog: pytest.LogCaptureFixture
) -> None:
    pipes = _pair(model, cap=1)
    step = model.inputs(1, seed=4)[0]
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        for i in range(4):
            _both(model, pipes, step, f"s{i}")
    messages = [r.getMessage() for r in caplog.records if r.name == "sessionstate"]
    assert messages == [
        f"{model.label} session 's0' was evicted by the bespoke session cap (1) although nobody "
        "ended it; its state is lost. End finished sessions explicitly with "
        "`drop_session(session_id)`, or raise the cap. Warned once per pipeline; "
        "`stats()['evictions']` counts every eviction.",
        "Session 's0' was evicted by the session cap (max_sessions=1) although nobody ended it; "
        "its state is lost. End finished sessions explicitly with `drop(session_id)` "
        "(`drop_session(session_id)` on a model pipeline), or raise the cap. Warned once per "
        "manager; `stats()['evictions']` counts every eviction.",
    ]
    for pipe in pipes:
        assert pipe.stats()["evictions"] == 3


# -- begin and lost sessions ----------------------------------------------------------------------


def test_a_continuation_of_a_session_never_started_raises_and_creates_nothing(
    model: Model,
) -> None:
    pipes = _pair(model)
    step = model.inputs(1, seed=5)[0]
    for pipe in pipes:
        with pytest.raises(SessionStateLostError, match=re.escape(_lost(model, "ghost"))):
            pipe.forward(step, "ghost", begin=False)
        assert pipe.session_ids() == []
        assert pipe.stats()["misses"] == 1
    assert _counters(pipes[0]) == _counters(pipes[1])


def test_a_continuation_of_an_evicted_session_never_silently_restarts(model: Model) -> None:
    pipes = _pair(model, cap=1)
    steps = model.inputs(3, seed=6)
    _both(model, pipes, steps[0], "a")
    _both(model, pipes, steps[1], "a", begin=False)
    _both(model, pipes, steps[0], "b")  # evicts `a`
    for pipe in pipes:
        with pytest.raises(SessionStateLostError, match=re.escape(_lost(model, "a"))):
            pipe.forward(steps[2], "a", begin=False)
        assert pipe.session_ids() == ["b"]
    _both(model, pipes, steps[0], "a", begin=True)


def test_begin_restarts_a_held_session_from_scratch(model: Model) -> None:
    pipes = _pair(model)
    fresh = _pair(model)
    steps = model.inputs(3, seed=7)
    _both(model, pipes, steps[0], "a")
    _both(model, pipes, steps[1], "a")
    restarted = _both(model, pipes, steps[2], "a", begin=True)
    first = _both(model, fresh, steps[2], "a")
    _same(model, restarted, first, "a restarted versus a fresh session")
    assert restarted.reset == "session"


def test_every_reader_of_a_session_not_held_raises_lost(model: Model) -> None:
    pipes = _pair(model, cap=1)
    step = model.inputs(1, seed=8)[0]
    _both(model, pipes, step, "dropped")
    _both(model, pipes, step, "evicted")  # evicts `dropped`, then it is dropped for good
    for pipe in pipes:
        assert not pipe.drop_session("dropped")
        assert pipe.drop_session("evicted")
        for reader in (pipe.session_values, pipe.video_latents):
            for sid in ("dropped", "evicted", "never"):
                with pytest.raises(SessionStateLostError, match=re.escape(_unknown(model, sid))):
                    reader(sid)
        assert pipe.session_ids() == []
    assert _counters(pipes[0]) == _counters(pipes[1])


# -- the byte budget and parking ------------------------------------------------------------------


def _per_session_nbytes(model: Model, sessions: int, steps: int) -> int:
    probe = model.spec.pipeline(model.deploy(), environ={ENV_ENABLE: "1"})
    for i, step in enumerate(model.inputs(steps, seed=9)):
        for s in range(sessions):
            probe.forward(step, f"s{s}", begin=i == 0 or None)
    nbytes: int = probe.stats()["nbytes:cpu"]
    return nbytes // sessions


def _run_interleaved(model: Model, pipes: Pair, sessions: int, steps: int) -> None:
    for i, step in enumerate(model.inputs(steps, seed=9)):
        for s in range(sessions):
            _both(model, pipes, step, f"s{s}", begin=i == 0 or None)


def _check_parked(pipe: Any, budget: int) -> None:
    stats = pipe.stats()
    assert stats["max_bytes:cpu"] == budget
    assert stats["nbytes:cpu"] <= budget
    assert stats["parks"] > 0
    assert stats["unparks"] > 0
    assert stats["evictions"] == 0


def test_a_budget_from_the_deploy_config_parks_and_stays_bit_identical(model: Model) -> None:
    budget = _per_session_nbytes(model, 3, 3) * 3 // 2
    pipes = _pair(model, session_state_max_bytes=budget, session_state_park_tier="host")
    _run_interleaved(model, pipes, 3, 3)
    bespoke, managed = pipes
    assert managed.manager.park_tier == "host"
    _check_parked(managed, budget)
    for sid in bespoke.session_ids():
        assert torch.equal(managed.video_latents(sid), bespoke.video_latents(sid))


def test_a_budget_from_the_environment_parks(model: Model) -> None:
    budget = _per_session_nbytes(model, 3, 2) * 3 // 2
    pipes = _pair(model, environ={ENV_MAX_BYTES: str(budget)})
    _run_interleaved(model, pipes, 3, 2)
    _check_parked(pipes[1], budget)


def test_the_disk_tier_spools_into_the_configured_directory(model: Model, tmp_path: Path) -> None:
    budget = _per_session_nbytes(model, 2, 2) * 3 // 2
    pipes = _pair(
        model,
        session_state_max_bytes=budget,
        session_state_park_tier="disk",
        session_state_spool_dir=str(tmp_path),
    )
    _run_interleaved(model, pipes, 2, 2)
    managed = pipes[1]
    assert managed.manager.park_tier == "disk"
    _check_parked(managed, budget)
    # One of the two sessions is parked now: its bytes lie in the configured directory.
    assert [p for p in tmp_path.rglob("*") if p.is_file()]


# -- every setting reaches the manager ------------------------------------------------------------


def test_every_manager_setting_reaches_the_manager(model: Model, tmp_path: Path) -> None:
    config = model.deploy(
        session_state_max_bytes="1MiB",
        session_state_park_tier="disk",
        session_state_spool_dir=str(tmp_path),
        session_state_on_full="refuse",
    )
    pipe = model.spec.pipeline(config, environ={ENV_ENABLE: "1", ENV_MAX_SESSIONS: "3"})
    manager = pipe.manager
    assert manager.max_sessions == 3
    assert manager.on_full == "refuse"
    assert manager.max_bytes == {"cpu": 2**20}
    assert manager.park_tier == "disk"


# -- reading a parked session while another caller gets it ----------------------------------------


@pytest.mark.parametrize("reader", ["session_values", "video_latents"])
def test_a_read_of_a_parked_session_survives_a_concurrent_get(
    model: Model, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = _per_session_nbytes(model, 3, 2) * 3 // 2
    pipes = _pair(model, session_state_max_bytes=budget, session_state_park_tier="host")
    _run_interleaved(model, pipes, 3, 2)
    bespoke, managed = pipes
    manager = managed.manager
    parked = [sid for sid in managed.session_ids() if manager.peek(sid).parked]
    assert parked, "the budget parked no session"
    sid = parked[0]
    real_peek = manager.peek
    raced: list[object] = []

    def peek_then_another_callers_get(session_id: object) -> object:
        state = real_peek(session_id)
        if not raced:  # another thread's `get` lands between the peek and the read
            raced.append(manager.get(session_id))
        return state

    monkeypatch.setattr(manager, "peek", peek_then_another_callers_get)
    got = getattr(managed, reader)(sid)
    monkeypatch.undo()
    assert raced
    assert raced[0] is not None
    assert not manager.peek(sid).parked  # the concurrent get unparked the stored record
    if reader == "video_latents":
        assert torch.equal(got, bespoke.video_latents(sid))
    else:
        assert tree_equal(got, managed.session_values(sid))


def test_a_bad_model_section_names_the_deploy_file(model: Model, tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("model:\n  preset: tiny\n  no_such_field: 1\n")
    config = OmniDiffusionConfig.from_yaml(path)
    with pytest.raises(
        KeyError, match=re.escape(f"Deploy config {str(path)!r}, `model` section: ")
    ):
        model.spec.pipeline(config, environ={ENV_ENABLE: "0"})


def test_a_steps_output_is_a_pytree_on_both_paths(model: Model) -> None:
    # Equal outputs are `tree_equal`, `tree_map` reaches their tensors, and the reset reason
    # is static data (outputs that differ only in it are not equal).
    bespoke, managed = _pair(model)
    (step_input,) = model.inputs(1, seed=3)
    a = bespoke.forward(step_input, "s")
    b = managed.forward(step_input, "s")
    assert type(a) is type(b)
    assert tree_equal(a, b)
    tensors = [v for v in model.outputs(a).values() if isinstance(v, torch.Tensor)]
    assert len(tree_leaves(a)) == len(tensors)
    assert all(any(leaf is t for t in tensors) for leaf in tree_leaves(a)), (
        "a leaf that is not one of the output's tensors"
    )
    doubled = tree_map(lambda t: t * 2, a)
    assert type(doubled) is type(a)
    assert doubled.reset == a.reset
    assert all(
        torch.equal(x, y * 2) for x, y in zip(tree_leaves(doubled), tree_leaves(a), strict=True)
    )
    assert not tree_equal(a, attrs.evolve(a, reset=None if a.reset else "session"))


# -- a footprint per session ---------------------------------------------------------------------


def test_the_managed_path_returns_a_sessions_footprint(model: Model) -> None:
    bespoke, managed = pipes = _pair(model)
    _both(model, pipes, model.inputs(1, seed=0)[0], "a")
    stats = managed.session_stats("a")
    assert stats == managed.manager.session_stats("a")
    assert stats["resident"]
    assert stats["nbytes"]
    msg = (
        "`session_stats('a')` reads the session-state manager's ledger; this pipeline runs the "
        "bespoke path, which keeps none. Enable the manager (OMNI_DIFFUSION_SESSION_STATE_"
        "MANAGER=1), or use `session_values` and `nbytes_by_device` for a session's bytes."
    )
    with pytest.raises(RuntimeError, match=re.escape(msg)):
        bespoke.session_stats("a")
    with pytest.raises(SessionStateLostError, match="No stats for session 'z'"):
        managed.session_stats("z")
