"""Reliability: the immutability guard, admission and `require`, and bad input everywhere.

Three groups, each a guarantee listed on the docs' Guarantees page:

- The opt-in immutability guard (``check_immutable=True`` or
  ``OMNI_DIFFUSION_SESSION_STATE_MANAGER_CHECK_IMMUTABLE=1``) catches an in-place write into
  any tensor a stored record reaches, on the next access of that session, and names the key
  path; it raises no false positive over a long DreamZero run; it is off by default.
- Admission: ``on_full="refuse"`` refuses a new session at the cap and keeps serving the
  residents; `require` never creates a session; begin/close cycles leak nothing; the default
  stays ``"evict"``, which drops the table entry only.
- Bad input (a chunk of the wrong layout, a bad session id, a bad deploy YAML, garbage in the
  environment, a malformed observation) gives one clear error, or a warning for the
  environment, and nothing stored changes. Every message is pinned in full.

"""

from __future__ import annotations

import functools
import gc
import logging
import re
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
import yaml

from sessionstate import (
    ENV_CHECK_IMMUTABLE,
    ENV_ENABLE,
    ENV_MAX_SESSIONS,
    ImmutabilityViolationError,
    LatentBuffer,
    MissingKeyError,
    OmniDiffusionConfig,
    SessionAdmissionError,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
    resolve_session_state_config,
    tree_equal,
)
from sessionstate.models.dreamzero import (
    CAMERAS,
    DreamZeroConfig,
    DreamZeroPipeline,
    DreamZeroSession,
    Observation,
)
from sessionstate.models.dreamzero.episode import scripted_episode
from tests.support import clone_tree, same_output, torch_threads

CFG = DreamZeroConfig.preset("tiny")
MANAGED = {ENV_ENABLE: "1"}


def _exact(message: str) -> str:
    return re.escape(message)


def episode(steps: int, sessions: int = 1, seed: int = 5) -> list[tuple[str, Observation]]:
    return list(scripted_episode(CFG, steps=steps, sessions=sessions, seed=seed))


def stored(manager: SessionStateManager | None, sid: str) -> SessionState:
    # Read the stored record without touching LRU order, the counters or the guard (`peek`
    # checks the guard), straight from the manager's table.
    assert manager is not None
    state = manager._table.records.get(sid)
    assert state is not None
    return state


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


# =============================================================================================
# 2. The immutability guard
# =============================================================================================


def _violation(sid: str, key: str, old: int = 0, new: int = 1) -> str:
    return (
        f"Session {sid!r}: the tensor at `{key}` was modified in place after the record was "
        f"stored (version {old} -> {new}). Records are immutable: build new tensors "
        f"(`t = t + x`, not `t += x` or `t.copy_(...)`), then `drop({sid!r})` this corrupted "
        "session."
    )


@attrs.frozen
class Guarded:
    manager: SessionStateManager
    state: SessionState
    first: torch.Tensor
    second: torch.Tensor
    attr: torch.Tensor
    feat: tuple[torch.Tensor | None, ...]


def _guarded() -> Guarded:
    manager = SessionStateManager(4, check_immutable=True)
    first, second = torch.zeros(1, 3), torch.zeros(2, 3)
    ring = LatentBuffer(name="ring", dim=0).allocate(maxlen=2).commit(first).commit(second)
    attr = torch.zeros(4)
    feat = (None, torch.zeros(2, 2), torch.zeros(2, 2))  # a feat-map-like tuple
    state = SessionState(objects={"ring": ring}, attrs={"x": attr, "feat": feat, "n": 3})
    manager.put("s", state)
    manager.put("other", SessionState(attrs={"y": torch.zeros(2)}))
    return Guarded(manager, state, first, second, attr, feat)


WRITES: list[Any] = [
    pytest.param(lambda g: g.second.add_(1), "objects['ring'].chunks[1]", id="original-add_"),
    pytest.param(lambda g: g.second[1].fill_(7.0), "objects['ring'].chunks[1]", id="view-fill_"),
    pytest.param(
        lambda g: g.first.view(-1).copy_(torch.ones(3)), "objects['ring'].chunks[0]", id="copy_"
    ),
    pytest.param(
        lambda g: g.manager.require("s").object("ring").view()[1].add_(1),
        "objects['ring'].chunks[1]",
        id="add_-into-a-chunk-read-back",
    ),
    pytest.param(lambda g: g.attr.mul_(2), "attrs['x']", id="attr-tensor"),
    pytest.param(lambda g: g.attr.detach().sub_(1), "attrs['x']", id="detached-alias"),
    pytest.param(lambda g: g.feat[2].zero_(), "attrs['feat'][2]", id="feat-map-tuple-entry"),
]

ACCESSES: list[Any] = [
    pytest.param(lambda m: m.get("s"), id="get"),
    pytest.param(lambda m: m.require("s"), id="require"),
    pytest.param(lambda m: m.get_or_create("s", SessionState), id="get_or_create"),
    pytest.param(lambda m: m.peek("s"), id="peek"),
]


@pytest.mark.parametrize(("write", "key"), WRITES)
@pytest.mark.parametrize("access", ACCESSES)
def test_guard_catches_an_in_place_write_on_the_next_access(
    write: Callable[[Guarded], object], key: str, access: Callable[[SessionStateManager], object]
) -> None:
    g = _guarded()
    write(g)
    with pytest.raises(ImmutabilityViolationError, match=_exact(_violation("s", key))):
        access(g.manager)
    # Nothing was replaced, and it keeps raising until the session is dropped (or replaced).
    assert stored(g.manager, "s") is g.state
    with pytest.raises(ImmutabilityViolationError, match=_exact(_violation("s", key))):
        g.manager.get("s")
    # Other sessions are served.
    assert g.manager.get("other") is not None
    assert g.manager.drop("s")
    fresh = SessionState()
    assert g.manager.get_or_create("s", lambda: fresh) is fresh


def test_guard_names_the_version_jump() -> None:
    g = _guarded()
    g.attr.add_(1)
    g.attr.add_(1)
    with pytest.raises(
        ImmutabilityViolationError, match=_exact(_violation("s", "attrs['x']", 0, 2))
    ):
        g.manager.get("s")


def test_guard_is_not_tripped_by_reads_or_new_records() -> None:
    g = _guarded()
    assert g.manager.get("s") is g.state
    _ = g.second + 1, torch.cat([g.first, g.second]), g.attr.clone().add_(1)  # no in-place write
    new = g.state.update_object("ring", lambda r: r.commit(torch.ones(1, 3)))
    g.manager.put("s", new)
    g.second.add_(1)  # `second` is still in the new ring, so this is caught...
    with pytest.raises(ImmutabilityViolationError):
        g.manager.get("s")
    g2 = _guarded()
    g2.manager.put("s", g2.state.update_object("ring", lambda r: r.reset()))
    g2.first.add_(1)  # ...but a tensor no stored record reaches any more is the caller's own
    assert g2.manager.get("s") is not None


def test_guard_warns_once_about_inference_mode_tensors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager = SessionStateManager(check_immutable=True)
    with torch.inference_mode():
        leaf = torch.zeros(3)
        other = torch.ones(2)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        manager.put("s", SessionState(attrs={"x": leaf}))
        manager.put("t", SessionState(attrs={"y": other}))
    messages = [r.getMessage() for r in caplog.records if r.name == "sessionstate"]
    assert messages == [
        "Session 's': the tensor at `attrs['x']` was made under torch.inference_mode() and "
        "keeps no version counter, so check_immutable cannot watch it (warned once per "
        "manager). Create session tensors under torch.no_grad() to have them checked."
    ]


def test_guard_is_off_by_default() -> None:
    manager = SessionStateManager()
    assert manager.check_immutable is False
    leaf = torch.zeros(3)
    state = SessionState(attrs={"x": leaf})
    manager.put("s", state)
    leaf.add_(1)  # a misuse the opt-in guard would catch; off, nothing is checked
    assert manager.get("s") is state
    pipe = DreamZeroPipeline(CFG, environ=MANAGED)
    assert pipe.manager is not None
    assert pipe.manager.check_immutable is False
    assert resolve_session_state_config(None, {}).check_immutable is False


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        (" On ", True),
        ("YES", True),
        ("0", False),
        ("off", False),
        ("", False),
        ("  ", False),
    ],
)
def test_guard_env_var_parsing(raw: str, expected: bool, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings = resolve_session_state_config(None, {ENV_CHECK_IMMUTABLE: raw})
    assert settings.check_immutable is expected
    assert caplog.records == []
    pipe = DreamZeroPipeline(CFG, environ={**MANAGED, ENV_CHECK_IMMUTABLE: raw})
    assert pipe.manager is not None
    assert pipe.manager.check_immutable is expected


def test_guard_env_var_garbage_warns_and_stays_off(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings = resolve_session_state_config(None, {ENV_CHECK_IMMUTABLE: "sure"})
    assert settings.check_immutable is False
    assert [r.getMessage() for r in caplog.records] == [
        "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER_CHECK_IMMUTABLE='sure': expected one of "
        "1/0/true/false/yes/no/on/off; the check stays off."
    ]


def test_guard_has_no_false_positive_over_a_40_step_dreamzero_run() -> None:
    """40 interleaved steps (prompt changes, window rollovers, body chunks), guard on.

    Every forward reads (`get`) and publishes (`put`) its session, so every stored tensor is
    verified on the next step. Afterwards one in-place write proves the guard was armed.
    """
    pipe = DreamZeroPipeline(CFG, environ={**MANAGED, ENV_CHECK_IMMUTABLE: "1"})
    assert pipe.manager is not None
    assert pipe.manager.check_immutable
    resets = set()
    steps = episode(steps=20, sessions=2, seed=3)
    assert len(steps) == 40
    for sid, obs in steps:
        resets.add(pipe.forward(obs, sid).reset)
    assert resets == {"session", "inference", None}  # every kind of step was exercised
    for sid in ("session-0", "session-1"):
        assert pipe.manager.require(sid) is not None

    record = stored(pipe.manager, "session-0")
    assert isinstance(record, DreamZeroSession)
    chunk = record.vae_encoder_out.view()[-1]
    version = chunk._version
    chunk.mul_(2)
    key = f"objects['vae_encoder_out'].chunks[{len(record.vae_encoder_out) - 1}]"
    msg = _violation("session-0", key, version, version + 1)
    with pytest.raises(ImmutabilityViolationError, match=_exact(msg)):
        pipe.forward(steps[-1][1], "session-0")
    assert stored(pipe.manager, "session-0") is record


# =============================================================================================
# 4. Admission and require
# =============================================================================================


def _refused(sid: str, cap: int) -> str:
    return (
        f"Cannot admit session {sid!r}: the manager holds {cap} sessions (its cap) and "
        "`on_full='refuse'`. Drop a finished session first, or raise `max_sessions`."
    )


def _lost(sid: str) -> str:
    return (
        f"Session {sid!r} is not held by this manager (never created, dropped, or evicted by the "
        "LRU cap); its state is lost. Start it again with `get_or_create`, or raise the cap."
    )


def test_default_on_full_is_evict() -> None:
    assert SessionStateManager().on_full == "evict"
    pipe = DreamZeroPipeline(CFG, environ=MANAGED)
    assert pipe.manager is not None
    assert pipe.manager.on_full == "evict"


def test_refuse_rejects_a_new_session_and_keeps_the_residents() -> None:
    manager = SessionStateManager(2, on_full="refuse", check_immutable=True)
    a = SessionState(attrs={"x": torch.arange(4.0)})
    b = SessionState(attrs={"x": torch.arange(8.0)})
    manager.put("a", a)
    manager.put("b", b)
    clones = clone_tree(a), clone_tree(b)
    calls: list[int] = []

    def factory() -> SessionState:
        calls.append(1)
        return SessionState()

    with pytest.raises(SessionAdmissionError, match=_exact(_refused("c", 2))):
        manager.get_or_create("c", factory)
    assert calls == []  # refused before paying for the factory
    with pytest.raises(SessionAdmissionError, match=_exact(_refused("c", 2))):
        manager.put("c", SessionState())
    assert "c" not in manager
    assert manager.session_ids() == ["a", "b"]
    assert manager.stats()["evictions"] == 0
    # Residents keep being served, untouched.
    assert manager.get("a") is a
    assert manager.require("b") is b
    assert tree_equal((a, b), clones)
    manager.put("a", a.with_attrs(x=torch.zeros(1)))
    # A drop makes room.
    assert manager.drop("b")
    c = manager.get_or_create("c", factory)
    assert calls == [1]
    assert manager.get("c") is c
    assert manager.session_ids() == ["a", "c"]


def test_refuse_through_the_dreamzero_pipeline() -> None:
    """At the cap a new session's step is refused; the residents continue exactly."""
    steps = episode(steps=2, sessions=3, seed=1)
    first = {sid: obs for sid, obs in steps[:3]}
    second = {sid: obs for sid, obs in steps[3:]}
    ref = DreamZeroPipeline(CFG, environ=MANAGED)
    pipe = DreamZeroPipeline(CFG, environ=MANAGED)
    pipe.manager = SessionStateManager(2, on_full="refuse")
    for sid in ("session-0", "session-1"):
        assert same_output(pipe.forward(first[sid], sid), ref.forward(first[sid], sid))
    residents = {sid: stored(pipe.manager, sid) for sid in ("session-0", "session-1")}
    clones = clone_tree(residents)

    with pytest.raises(SessionAdmissionError, match=_exact(_refused("session-2", 2))):
        pipe.forward(first["session-2"], "session-2")
    assert "session-2" not in pipe.manager
    assert {sid: stored(pipe.manager, sid) for sid in residents} == residents
    assert tree_equal(residents, clones)
    for sid in ("session-1", "session-0"):
        assert same_output(pipe.forward(second[sid], sid), ref.forward(second[sid], sid))
        assert tree_equal(stored(pipe.manager, sid), stored(ref.manager, sid))


def test_require_never_creates_a_session() -> None:
    manager = SessionStateManager(2)  # evict
    with pytest.raises(SessionStateLostError, match=_exact(_lost("unknown"))) as info:
        manager.require("unknown")
    assert isinstance(info.value, KeyError)
    assert str(info.value) == _lost("unknown")
    assert "unknown" not in manager
    assert len(manager) == 0

    manager.put("dropped", SessionState())
    manager.drop("dropped")
    with pytest.raises(SessionStateLostError, match=_exact(_lost("dropped"))):
        manager.require("dropped")

    manager.put("old", SessionState())
    manager.put("b", SessionState())
    manager.put("c", SessionState())  # evicts "old"
    assert manager.stats()["evictions"] == 1
    with pytest.raises(SessionStateLostError, match=_exact(_lost("old"))):
        manager.require("old")
    assert manager.session_ids() == ["b", "c"]


def test_require_through_the_dreamzero_pipeline_prevents_a_silent_restart() -> None:
    """LRU eviction drops the table entry only; `require` turns a silent restart into an error.

    With the cap at 1, a second session evicts the first. The caller that still holds the
    evicted record continues it exactly (`pipe.step`); `forward` instead silently restarts
    the session from scratch, which `require` exposes.
    """
    steps = episode(steps=2, sessions=2, seed=2)
    obs = {(sid, i // 2): o for i, (sid, o) in enumerate(steps)}
    ref = DreamZeroPipeline(CFG, environ=MANAGED)
    ref.forward(obs["session-0", 0], "session-0")
    expected = ref.forward(obs["session-0", 1], "session-0")

    pipe = DreamZeroPipeline(CFG, environ={**MANAGED, ENV_MAX_SESSIONS: "1"})
    assert pipe.manager is not None
    pipe.forward(obs["session-0", 0], "session-0")
    held = stored(pipe.manager, "session-0")
    assert isinstance(held, DreamZeroSession)
    clone = clone_tree(held)
    pipe.forward(obs["session-1", 0], "session-1")  # evicts session-0
    assert pipe.session_ids() == ["session-1"]
    assert pipe.manager.stats()["evictions"] == 1
    with pytest.raises(SessionStateLostError, match=_exact(_lost("session-0"))):
        pipe.manager.require("session-0")
    assert "session-0" not in pipe.manager

    # The evicted record is intact and continues exactly.
    assert tree_equal(held, clone)
    _, out = pipe.step(held, obs["session-0", 1])
    assert same_output(out, expected)
    # Whereas `forward` restarts it from scratch: a different output.
    restarted = pipe.forward(obs["session-0", 1], "session-0")
    assert restarted.reset == "session"
    assert not same_output(restarted, expected)


def _holding(leaf: torch.Tensor) -> SessionState:
    return SessionState(attrs={"x": leaf})


@pytest.mark.parametrize("on_full", ["evict", "refuse"])
def test_100_begin_close_cycles_leak_no_slots(on_full: Any) -> None:
    manager = SessionStateManager(2, on_full=on_full, check_immutable=True)
    manager.put("resident", SessionState(attrs={"x": torch.zeros(4)}))
    refs: list[weakref.ref[torch.Tensor]] = []
    for i in range(100):
        sid = f"s{i}"
        leaf = torch.zeros(16)
        refs.append(weakref.ref(leaf))
        state = manager.get_or_create(sid, functools.partial(_holding, leaf))
        manager.put(sid, state.with_attrs(y=torch.ones(2)))
        assert manager.require(sid) is not None
        assert manager.drop(sid)
        del leaf, state
    assert manager.session_ids() == ["resident"]
    stats = manager.stats()
    assert (stats["sessions"], stats["evictions"], stats["total_nbytes"]) == (1, 0, 16)
    gc.collect()
    assert all(ref() is None for ref in refs)  # nothing (not even the guard) keeps them alive
    manager.put("new", SessionState())  # the slot is free
    assert len(manager) == 2


# =============================================================================================
# 5. Bad input: one clear error, nothing stored changes
# =============================================================================================


def _layout(got: str) -> str:
    return (
        "LatentBuffer `frames` holds chunks of dtype torch.float32 on cpu with shape (T, 2, 3); "
        f"got {got}. Convert the chunk (`.to(dtype=..., device=...)`) or `reset()` the buffer to "
        "change its layout."
    )


BAD_CHUNKS: list[Any] = [
    pytest.param(
        torch.zeros(1, 2, 3, dtype=torch.float64),
        ValueError,
        _layout("dtype torch.float64 on cpu with shape (1, 2, 3)"),
        id="dtype",
    ),
    pytest.param(
        torch.zeros(1, 2, 4),
        ValueError,
        _layout("dtype torch.float32 on cpu with shape (1, 2, 4)"),
        id="shape-outside-the-time-dim",
    ),
    pytest.param(
        torch.zeros(1, 6),
        ValueError,
        _layout("dtype torch.float32 on cpu with shape (1, 6)"),
        id="rank",
    ),
    pytest.param(
        torch.zeros(1, 2, 3, device="meta"),
        ValueError,
        _layout("dtype torch.float32 on meta with shape (1, 2, 3)"),
        id="device",
    ),
    pytest.param(
        [[0.0] * 3] * 2,
        TypeError,
        "LatentBuffer `frames` holds tensors, got list; commit a torch.Tensor.",
        id="list",
    ),
    pytest.param(
        np.zeros((1, 2, 3), dtype=np.float32),
        TypeError,
        "LatentBuffer `frames` holds tensors, got ndarray; commit a torch.Tensor.",
        id="numpy",
    ),
    pytest.param(
        torch.tensor(1.0),
        ValueError,
        "LatentBuffer `frames` concatenates along dim 0, so a chunk needs at least 1 dims; "
        "got shape (). Commit chunks with the time axis at `dim`, "
        "or build the buffer with a matching `dim=`.",
        id="scalar",
    ),
]


@pytest.mark.parametrize(("chunk", "error", "msg"), BAD_CHUNKS)
def test_bad_commit_changes_nothing(chunk: Any, error: type[Exception], msg: str) -> None:
    # The manager is full, so a new session would evict "s"; the bad commit runs inside the
    # manager, in the factory of `get_or_create`, and must cost nothing.
    manager = SessionStateManager(1, check_immutable=True)
    ring = LatentBuffer(name="frames", dim=0).allocate(maxlen=4).commit(torch.zeros(1, 2, 3))
    state = SessionState(objects={"frames": ring})
    manager.put("s", state)
    clone = clone_tree(state)
    before = manager.stats()

    def fork() -> SessionState:
        return state.update_object("frames", lambda b: b.commit(chunk))

    with pytest.raises(error, match=_exact(msg)):
        manager.get_or_create("t", fork)
    assert manager.session_ids() == ["s"]
    assert manager.peek("s") is state
    assert tree_equal(state, clone)
    assert len(ring) == 1
    assert manager.stats() == {**before, "misses": before["misses"] + 1}


def test_bad_commit_into_a_dreamzero_record_names_the_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No window resets, so the only VAE encodes after the first step are the stream's body
    # chunks, the first of them committed on step 5.
    cfg = DreamZeroConfig.preset("tiny", local_attn_size=-1)
    pipe = DreamZeroPipeline(cfg, environ={**MANAGED, ENV_CHECK_IMMUTABLE: "1"})
    (sid, first), *rest = scripted_episode(cfg, steps=5, sessions=1, seed=5)
    pipe.forward(first, sid)
    good = stored(pipe.manager, sid).vae_encoder_out.view()[-1]
    msg = (
        "LatentBuffer `vae_encoder_out` holds chunks of dtype torch.float32 on cpu with shape "
        f"(1, {good.shape[1]}, T, {good.shape[3]}, {good.shape[4]}); got dtype torch.bfloat16 on "
        f"cpu with shape {tuple(good.shape)}. Convert the chunk (`.to(dtype=..., device=...)`) "
        "or `reset()` the buffer to change its layout."
    )
    # From now on the VAE encoder returns bfloat16: the pipeline's next body chunk is
    # committed into the float32 ring inside `forward`, which must then change nothing.
    encode_chunk = pipe.nets.encode_chunk

    def encode_to_bfloat16(chunk: torch.Tensor, feat_map: Any) -> tuple[torch.Tensor, Any]:
        out, feat_map = encode_chunk(chunk, feat_map)
        return out.bfloat16(), feat_map

    monkeypatch.setattr(pipe.nets, "encode_chunk", encode_to_bfloat16)
    with pytest.raises(ValueError, match=_exact(msg)):  # noqa: PT012 (steps until the commit)
        for _, obs in rest:
            record = stored(pipe.manager, sid)
            clone = clone_tree(record)
            pipe.forward(obs, sid)
    assert isinstance(record, DreamZeroSession)
    assert stored(pipe.manager, sid) is record
    assert tree_equal(record, clone)
    assert pipe.session_ids() == [sid]


def _bad_id(value: object) -> str:
    return (
        "`session_id` must be hashable (any value a dict accepts as a key: a str, an int, a "
        f"tuple, ...), got {value!r} ({type(value).__name__}); pass an immutable id such as a "
        "str or a tuple."
    )


MANAGER_METHODS: list[Any] = [
    pytest.param(lambda m, sid: m.get(sid), id="get"),
    pytest.param(lambda m, sid: m.peek(sid), id="peek"),
    pytest.param(lambda m, sid: m.require(sid), id="require"),
    pytest.param(lambda m, sid: m.get_or_create(sid, SessionState), id="get_or_create"),
    pytest.param(lambda m, sid: m.put(sid, SessionState()), id="put"),
    pytest.param(lambda m, sid: m.drop(sid), id="drop"),
]


@pytest.mark.parametrize("method", MANAGER_METHODS)
@pytest.mark.parametrize(
    ("session_id", "error"),
    [([], TypeError), ({"s": 1}, TypeError), ({"s"}, TypeError), (("s", []), TypeError)],
)
def test_bad_session_id_on_every_manager_method(
    method: Callable[[SessionStateManager, object], object],
    session_id: object,
    error: type[Exception],
) -> None:
    manager = SessionStateManager(1, on_full="refuse", check_immutable=True)
    state = SessionState(attrs={"x": torch.zeros(2)})
    manager.put("s", state)
    before = manager.stats()
    with pytest.raises(error, match=_exact(_bad_id(session_id))):
        method(manager, session_id)
    assert manager.stats() == before  # no hit, miss or eviction counted
    assert manager.session_ids() == ["s"]
    assert stored(manager, "s") is state


def test_bad_session_id_through_the_dreamzero_pipeline() -> None:
    pipe = DreamZeroPipeline(CFG, environ=MANAGED)
    assert pipe.manager is not None
    before = pipe.manager.stats()
    (_, obs), *_ = episode(steps=1)
    bad_ids: tuple[tuple[object, type[Exception]], ...] = (([7], TypeError), ({}, TypeError))
    for bad, error in bad_ids:
        with pytest.raises(error, match=_exact(_bad_id(bad))):
            pipe.forward(obs, bad)  # type: ignore[arg-type]
        with pytest.raises(error, match=_exact(_bad_id(bad))):
            pipe.drop_session(bad)  # type: ignore[arg-type]
    assert pipe.manager.stats() == before


# --- deploy YAML ---------------------------------------------------------------------------


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_yaml_unknown_key(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "enable_session_state_manger: true\n")
    msg = (
        f"Deploy config {str(path)!r}: Unknown deploy config key 'enable_session_state_manger' "
        "(value True); known keys: ['enable_session_state_manager', 'model', "
        "'session_state_host_pool_bytes', 'session_state_host_pool_full', "
        "'session_state_keep_parked_copies', 'session_state_kv_pool_bytes', "
        "'session_state_max_bytes', 'session_state_on_full', "
        "'session_state_park_tier', 'session_state_spool_dir']."
    )
    with pytest.raises(MissingKeyError, match=_exact(msg)) as info:
        OmniDiffusionConfig.from_yaml(path)
    assert str(info.value) == msg


@pytest.mark.parametrize(
    ("text", "msg"),
    [
        (
            "enable_session_state_manager: maybe\n",
            "`enable_session_state_manager` must be a bool (true or false), got 'maybe' (str).",
        ),
        (
            "enable_session_state_manager: 1\n",
            "`enable_session_state_manager` must be a bool (true or false), got 1 (int).",
        ),
        ("model: tiny\n", "`model` must be a mapping of model settings, got 'tiny' (str)."),
        ("- 1\n- 2\n", "A deploy config must be a mapping of keys to values, got list."),
    ],
)
def test_yaml_wrong_type(tmp_path: Path, text: str, msg: str) -> None:
    path = _yaml(tmp_path, text)
    full = f"Deploy config {str(path)!r}: {msg}"
    with pytest.raises(TypeError, match=_exact(full)) as info:
        OmniDiffusionConfig.from_yaml(path)
    assert str(info.value) == full


def test_yaml_invalid(tmp_path: Path) -> None:
    text = "enable_session_state_manager: [true\nmodel: {preset: tiny}\n"
    path = _yaml(tmp_path, text)
    with pytest.raises(yaml.YAMLError) as parsed:
        yaml.safe_load(text)
    msg = f"Deploy config {str(path)!r} is not valid YAML: {parsed.value}"
    with pytest.raises(ValueError, match=_exact(msg)) as info:
        OmniDiffusionConfig.from_yaml(path)
    assert str(info.value) == msg


def _known_model_keys() -> str:
    known = sorted(a.name for a in attrs.fields(DreamZeroConfig) if a.name != "name")
    return str(["preset", *known])


@pytest.mark.parametrize(
    ("model", "error", "msg"),
    [
        pytest.param(
            "{preset: tiny, camera_hieght: 40}",
            MissingKeyError,
            "Unknown DreamZero model setting 'camera_hieght' (value 40); did you mean "
            "'camera_height'? Known: " + _known_model_keys() + ".",
            id="unknown-key",
        ),
        pytest.param(
            "{preset: huge}",
            MissingKeyError,
            "Unknown DreamZero preset 'huge'; choose one of ['deploy', 'tiny'].",
            id="unknown-preset",
        ),
        pytest.param(
            "{preset: tiny, camera_height: '40'}",
            ValueError,
            "`camera_height` must be a positive int, got '40' (str).",
            id="wrong-type",
        ),
        pytest.param(
            "{preset: tiny, num_frame_per_block: 0}",
            ValueError,
            "`num_frame_per_block` must be a positive int, got 0 (int).",
            id="non-positive",
        ),
        pytest.param(
            "{preset: tiny, crop_scale: a}",
            ValueError,
            "`crop_scale` must be a number in (0, 1], got 'a'.",
            id="crop-scale-type",
        ),
        pytest.param(
            "{preset: tiny, crop_scale: 3.0}",
            ValueError,
            "`crop_scale` must be a number in (0, 1], got 3.0.",
            id="crop-scale-range",
        ),
        pytest.param(
            "{preset: tiny, dtype: float64}",
            ValueError,
            "`dtype` must be one of ['bfloat16', 'float16', 'float32'], got 'float64'.",
            id="dtype",
        ),
    ],
)
def test_yaml_bad_model_section(
    tmp_path: Path, model: str, error: type[Exception], msg: str
) -> None:
    path = _yaml(tmp_path, f"enable_session_state_manager: true\nmodel: {model}\n")
    config = OmniDiffusionConfig.from_yaml(path)
    full = f"Deploy config {str(path)!r}, `model` section: {msg}"
    with pytest.raises(error, match=_exact(full)) as info:
        DreamZeroPipeline(config, environ={})
    assert str(info.value) == full


@pytest.mark.parametrize(
    ("key", "value", "error", "msg"),
    [
        (
            "local_attn_size",
            "nine",
            ValueError,
            "`local_attn_size` must be a positive int (latent frames per window) or -1 (no "
            "window resets), got 'nine' (str).",
        ),
        (
            "local_attn_size",
            "-5",
            ValueError,
            "`local_attn_size` must be a positive int (latent frames per window) or -1 (no "
            "window resets), got -5 (int).",
        ),
        ("seed", "x", TypeError, "`seed` must be an int, got 'x' (str)."),
    ],
)
def test_yaml_model_setting_of_the_wrong_type_is_named(
    tmp_path: Path, key: str, value: str, error: type[Exception], msg: str
) -> None:
    path = _yaml(tmp_path, f"model: {{preset: tiny, {key}: {value}}}\n")
    config = OmniDiffusionConfig.from_yaml(path)
    with pytest.raises(error, match=re.escape(msg)):
        DreamZeroPipeline(config, environ=MANAGED)


# --- environment ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "warning"),
    [
        (
            {ENV_ENABLE: "maybe"},
            "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER='maybe': expected one of "
            "1/0/true/false/yes/no/on/off; using the config value "
            "enable_session_state_manager=True.",
        ),
        (
            {ENV_MAX_SESSIONS: "lots"},
            "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS='lots': expected a "
            "positive int; using the default cap 64.",
        ),
        (
            {ENV_MAX_SESSIONS: "-3"},
            "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS='-3': expected a "
            "positive int; using the default cap 64.",
        ),
        (
            {ENV_MAX_SESSIONS: "0"},
            "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS='0': expected a "
            "positive int; using the default cap 64.",
        ),
        (
            {ENV_CHECK_IMMUTABLE: "\x00"},
            "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER_CHECK_IMMUTABLE='\\x00': expected one "
            "of 1/0/true/false/yes/no/on/off; the check stays off.",
        ),
    ],
)
def test_env_garbage_warns_and_falls_back(
    env: dict[str, str], warning: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = OmniDiffusionConfig(enable_session_state_manager=True, model={"preset": "tiny"})
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        pipe = DreamZeroPipeline(config, environ=env)
    assert [r.getMessage() for r in caplog.records] == [warning]
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert pipe.manager is not None
    assert (pipe.manager.max_sessions, pipe.manager.check_immutable) == (64, False)


# --- observations --------------------------------------------------------------------------


def _image(shape: tuple[int, ...] = (40, 72, 3), dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def _obs(**images: Any) -> Observation:
    base: dict[str, Any] = {cam: _image() for cam in CAMERAS}
    base.update(images)
    return Observation(
        images={k: v for k, v in base.items() if v is not None},
        prompt="pick",
        state=torch.zeros(8),
    )


_CAMS = "['exterior_image_1_left', 'exterior_image_2_left', 'wrist_image_left']"
BAD_OBSERVATIONS: list[Any] = [
    pytest.param(
        _obs(wrist_image_left=None),
        ValueError,
        f"An observation needs exactly the cameras {_CAMS}; got "
        "['exterior_image_1_left', 'exterior_image_2_left'].",
        id="two-cameras",
    ),
    pytest.param(
        _obs(wrist_image_right=_image()),
        ValueError,
        f"An observation needs exactly the cameras {_CAMS}; got ['exterior_image_1_left', "
        "'exterior_image_2_left', 'wrist_image_left', 'wrist_image_right'].",
        id="four-cameras",
    ),
    pytest.param(
        _obs(wrist_image_left=_image((41, 72, 3))),
        ValueError,
        "Camera `wrist_image_left` has shape (41, 72, 3), but the `tiny` geometry expects "
        "(40, 72, 3); resize it or use a config with matching camera sizes.",
        id="size",
    ),
    pytest.param(
        _obs(exterior_image_2_left=_image((40, 72, 4))),
        ValueError,
        "Camera `exterior_image_2_left` has shape (40, 72, 4), but the `tiny` geometry expects "
        "(40, 72, 3); resize it or use a config with matching camera sizes.",
        id="channels",
    ),
    pytest.param(
        _obs(exterior_image_1_left=_image(dtype=torch.float32)),
        TypeError,
        "Camera `exterior_image_1_left` must be a uint8 tensor (H, W, 3), got dtype "
        "torch.float32; pass 0..255 pixel values as `torch.uint8`.",
        id="dtype",
    ),
    pytest.param(
        _obs(wrist_image_left=np.zeros((40, 72, 3), dtype=np.uint8)),
        TypeError,
        "Camera `wrist_image_left` must be a uint8 torch.Tensor (H, W, 3), got numpy.ndarray; "
        "convert it with `torch.as_tensor(image)`.",
        id="numpy-image",
    ),
    pytest.param(
        attrs.evolve(_obs(), prompt=None),  # type: ignore[arg-type]
        TypeError,
        "Observation `prompt` must be a str, got NoneType.",
        id="prompt-None",
    ),
    pytest.param(
        attrs.evolve(_obs(), prompt=b"pick"),  # type: ignore[arg-type]
        TypeError,
        "Observation `prompt` must be a str, got bytes.",
        id="prompt-bytes",
    ),
    pytest.param(
        attrs.evolve(_obs(), state=torch.zeros(7)),
        ValueError,
        "Observation `state` must be a tensor of shape (8,) (7 joints + gripper), got "
        "torch.Size([7]).",
        id="joint-state",
    ),
    pytest.param(
        {"images": {}, "prompt": "pick"},
        TypeError,
        "Expected an Observation, got dict.",
        id="not-an-observation",
    ),
]


@pytest.fixture(scope="module")
def one_step_pipeline() -> DreamZeroPipeline:
    pipe = DreamZeroPipeline(CFG, environ={**MANAGED, ENV_CHECK_IMMUTABLE: "1"})
    (sid, obs), *_ = episode(steps=1)
    pipe.forward(obs, sid)
    return pipe


@pytest.mark.parametrize(("obs", "error", "msg"), BAD_OBSERVATIONS)
def test_bad_observation_through_forward_changes_nothing(
    one_step_pipeline: DreamZeroPipeline, obs: Any, error: type[Exception], msg: str
) -> None:
    pipe = one_step_pipeline
    assert pipe.manager is not None
    record = stored(pipe.manager, "session-0")
    clone = clone_tree(record)
    for sid in ("session-0", "fresh"):
        with pytest.raises(error, match=_exact(msg)) as info:
            pipe.forward(obs, sid)
        assert str(info.value) == msg
    assert pipe.session_ids() == ["session-0"]
    assert stored(pipe.manager, "session-0") is record
    assert tree_equal(record, clone)


def test_images_that_are_not_a_mapping_are_named(one_step_pipeline: DreamZeroPipeline) -> None:
    obs = attrs.evolve(_obs(), images=[_image()] * 3)  # type: ignore[arg-type]
    msg = (
        "Observation `images` must be a mapping of camera name to image, got list; pass a dict "
        "with the keys ['exterior_image_1_left', 'exterior_image_2_left', 'wrist_image_left']."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        one_step_pipeline.forward(obs, "fresh")
