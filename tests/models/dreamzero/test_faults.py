"""Failure atomicity: a DreamZero step that raises loses nothing on the managed path.

Faults are injected by wrapping one callable so that its k-th call raises `InjectedFaultError`:
the observation transform (`stitch_views`), the Wan VAE encode (`nets.encode_chunk`, also
called inside `encode_image`), the denoiser (`nets.diffuse`), a `LatentBuffer.commit`, and
`DreamZeroSession.with_values` (the step's two transitions: before the denoiser runs, and
with what it produced).

On the managed path the stored record of the faulted session is the very same object as
before the step and bit-identical to a clone taken before it; other sessions are untouched;
a brand-new session whose first step fails leaves nothing behind; and once the fault is
gone, retrying the observation and continuing gives exactly the outputs of an unfaulted
pipeline fed the same observations.

The bespoke path (``OMNI_DIFFUSION_SESSION_STATE_MANAGER=0``) is run against the same faults
to document what it loses: its per-session state is mutated in place while the step runs, so
a step that fails half-way leaves the session half-updated, and the continued outputs differ
from the unfaulted run. That is the reason to use the manager-backed path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest

import sessionstate.models.dreamzero._bespoke as bespoke_module
import sessionstate.models.dreamzero._managed as managed_module
import sessionstate.models.dreamzero.state as state_module
from sessionstate import LatentBuffer, SessionState, tree_equal
from sessionstate.models.dreamzero import (
    DreamZeroConfig,
    DreamZeroOutput,
    DreamZeroPipeline,
    DreamZeroSession,
    DreamZeroState,
    Observation,
    stitch_views,
)
from sessionstate.models.dreamzero.episode import scripted_episode
from tests.support import clone_tree, same_output, torch_threads

CFG = DreamZeroConfig.preset("tiny")
MANAGED = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
BESPOKE = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "0"}
STEPS = 7
"""Steps per session: a window start, four in-window steps (the fifth encodes a 4-frame body
chunk), a window rollover (``local_attn_size=9`` is reached after five steps) and one more."""
S0, S1 = "session-0", "session-1"
BESPOKE_STEP = 4
"""The bespoke runs fail in the fifth step: a window reset that also encodes a body chunk."""
BESPOKE_TAIL = 8
"""The bespoke runs continue until a stale pending frame reaches the next body chunk."""


def _observations() -> dict[str, list[Observation]]:
    obs: dict[str, list[Observation]] = {S0: [], S1: []}
    episode = scripted_episode(CFG, steps=BESPOKE_TAIL, sessions=2, seed=11, prompt_change_every=99)
    for sid, o in episode:
        obs[sid].append(o)
    return obs


OBS = _observations()


class InjectedFaultError(RuntimeError):
    """The exception the tests inject."""


class Fault:
    """Wraps callables so that the k-th call (counted over all wrapped ones) raises."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.calls = 0
        self.fired = False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.calls == self.k:
                self.fired = True
                msg = f"injected fault on call {self.k} of {getattr(fn, '__qualname__', fn)}"
                raise InjectedFaultError(msg)
            return fn(*args, **kwargs)

        return wrapper


def inject(mp: pytest.MonkeyPatch, pipe: DreamZeroPipeline, target: str, k: int) -> Fault:
    """Make the k-th call of ``target`` raise (until ``mp.undo()``)."""
    fault = Fault(k)
    if target == "stitch_views":
        module = managed_module if pipe.managed else bespoke_module
        mp.setattr(f"{module.__name__}.stitch_views", fault.wrap(stitch_views))
    elif target in ("encode_chunk", "diffuse"):
        mp.setattr(pipe.nets, target, fault.wrap(getattr(pipe.nets, target)))
    elif target == "commit":
        mp.setattr(LatentBuffer, "commit", fault.wrap(LatentBuffer.commit))
    elif target == "with_values":
        mp.setattr(DreamZeroSession, "with_values", fault.wrap(DreamZeroSession.with_values))
    elif target == "append_vae_encoder_chunk":  # the bespoke path's commit of an encoder chunk
        mp.setattr(
            DreamZeroState,
            "append_vae_encoder_chunk",
            fault.wrap(DreamZeroState.append_vae_encoder_chunk),
        )
    elif target == "frames_for_model":  # bespoke: between `call_count += 1` and the rest
        mp.setattr(state_module, "frames_for_model", fault.wrap(state_module.frames_for_model))
    else:  # pragma: no cover - a typo in a parametrization
        raise AssertionError(target)
    return fault


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@attrs.frozen
class Reference:
    """An unfaulted managed run: ``records[sid][i]`` is the record after ``i`` steps."""

    records: dict[str, list[SessionState | None]]
    outputs: dict[str, list[DreamZeroOutput]]
    clones: dict[str, list[Any]]


@pytest.fixture(scope="module")
def reference() -> Reference:
    pipe = DreamZeroPipeline(CFG, environ=MANAGED)
    assert pipe.manager is not None
    records: dict[str, list[SessionState | None]] = {S0: [None], S1: [None]}
    outputs: dict[str, list[DreamZeroOutput]] = {S0: [], S1: []}
    for i in range(STEPS):
        for sid in (S0, S1):
            outputs[sid].append(pipe.forward(OBS[sid][i], sid))
            records[sid].append(pipe.manager.get(sid))
    clones = {sid: [clone_tree(r) for r in records[sid]] for sid in records}
    return Reference(records=records, outputs=outputs, clones=clones)


def managed(**env: str) -> DreamZeroPipeline:
    pipe = DreamZeroPipeline(CFG, environ={**MANAGED, **env})
    assert pipe.manager is not None
    return pipe


def record(pipe: DreamZeroPipeline, sid: str) -> SessionState:
    assert pipe.manager is not None
    state = pipe.manager.get(sid)
    assert state is not None
    return state


def check_reference_intact(reference: Reference) -> None:
    # The faulted pipelines resume from the reference's records: nothing may write into them.
    for sid, recs in reference.records.items():
        for rec, clone in zip(recs, reference.clones[sid], strict=True):
            assert tree_equal(rec, clone)


# --- managed path: a failed step leaves the stored record exactly as it was ------------------

MANAGED_CASES = [
    # (target, step index of session-0 that fails, k-th call raises). Steps 1-3 are inside
    # the window; step 4 reaches the window end, so it resets the window, re-encodes the
    # conditioning (`encode_image`: 3 encodes) and encodes the 4-frame body chunk (4th encode).
    pytest.param("stitch_views", 2, 1, id="transform"),
    pytest.param("encode_chunk", 4, 2, id="vae-encode-in-encode_image"),
    pytest.param("encode_chunk", 4, 4, id="vae-encode-body-chunk"),
    pytest.param("diffuse", 1, 1, id="denoiser-in-window"),
    pytest.param("diffuse", 4, 1, id="denoiser-after-window-reset"),
    pytest.param("commit", 4, 1, id="commit-stitched-frame"),
    pytest.param("commit", 4, 2, id="commit-encoder-chunk"),
    pytest.param("commit", 4, 3, id="commit-video-latents-last-update"),
    pytest.param("with_values", 2, 1, id="after-the-kv-append-before-the-denoiser"),
    pytest.param("with_values", 4, 1, id="after-the-window-reset-before-the-denoiser"),
    pytest.param("with_values", 4, 2, id="after-the-denoiser-last-update"),
]


@pytest.mark.parametrize(("target", "j", "k"), MANAGED_CASES)
def test_managed_failed_step_keeps_the_record_and_continues_exactly(
    monkeypatch: pytest.MonkeyPatch, reference: Reference, target: str, j: int, k: int
) -> None:
    pipe = managed()
    assert pipe.manager is not None
    # Resume both sessions where the unfaulted run was (records are immutable: sharing is safe).
    before0, before1 = reference.records[S0][j], reference.records[S1][3]
    assert isinstance(before0, SessionState)
    assert isinstance(before1, SessionState)
    pipe.manager.put(S0, before0)
    pipe.manager.put(S1, before1)
    stats_before = pipe.manager.stats()

    fault = inject(monkeypatch, pipe, target, k)
    with pytest.raises(InjectedFaultError):
        pipe.forward(OBS[S0][j], S0)
    assert fault.fired
    monkeypatch.undo()

    # Nothing was published: the same record objects, bit-identical to before the step, and
    # the LRU order as it was (a step makes its session the most recent when it publishes).
    assert pipe.session_ids() == [S0, S1]
    assert record(pipe, S0) is before0
    assert record(pipe, S1) is before1
    assert tree_equal(before0, reference.clones[S0][j])
    assert tree_equal(before1, reference.clones[S1][3])
    after = pipe.manager.stats()
    assert after["sessions"] == 2
    assert after["evictions"] == 0
    assert after["total_nbytes"] == stats_before["total_nbytes"]

    # Retry the same observation and go on: exactly the unfaulted outputs and records.
    for i in range(j, STEPS):
        assert same_output(pipe.forward(OBS[S0][i], S0), reference.outputs[S0][i])
        assert tree_equal(record(pipe, S0), reference.records[S0][i + 1])
    assert same_output(pipe.forward(OBS[S1][3], S1), reference.outputs[S1][3])
    check_reference_intact(reference)


NEW_SESSION_CASES = [
    pytest.param("stitch_views", 1, id="transform"),
    pytest.param("encode_chunk", 2, id="vae-encode-in-encode_image"),
    pytest.param("encode_chunk", 4, id="vae-encode-stream-seed"),
    pytest.param("diffuse", 1, id="denoiser"),
    pytest.param("commit", 2, id="commit-encoder-seed"),
    pytest.param("commit", 3, id="commit-video-latents"),
    pytest.param("with_values", 1, id="after-the-stream-seed-before-the-denoiser"),
    pytest.param("with_values", 2, id="last-update"),
]


@pytest.mark.parametrize(("target", "k"), NEW_SESSION_CASES)
def test_managed_new_session_whose_first_step_fails_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch, reference: Reference, target: str, k: int
) -> None:
    # At the cap: a stored-then-failed new session would evict a resident. Nothing may change.
    pipe = managed(OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS="2")
    assert pipe.manager is not None
    resident_a, resident_b = reference.records[S0][2], reference.records[S1][2]
    assert isinstance(resident_a, SessionState)
    assert isinstance(resident_b, SessionState)
    pipe.manager.put("resident-a", resident_a)
    pipe.manager.put("resident-b", resident_b)

    fault = inject(monkeypatch, pipe, target, k)
    with pytest.raises(InjectedFaultError):
        pipe.forward(OBS[S0][0], "fresh")
    assert fault.fired
    monkeypatch.undo()

    assert "fresh" not in pipe.manager
    assert pipe.session_ids() == ["resident-a", "resident-b"]
    assert pipe.manager.stats()["evictions"] == 0
    assert record(pipe, "resident-a") is resident_a
    assert record(pipe, "resident-b") is resident_b
    assert tree_equal(resident_a, reference.clones[S0][2])
    assert tree_equal(resident_b, reference.clones[S1][2])

    # Once the fault is gone the new session starts exactly as an unfaulted one does.
    assert same_output(pipe.forward(OBS[S0][0], "fresh"), reference.outputs[S0][0])
    assert tree_equal(record(pipe, "fresh"), reference.records[S0][1])


def test_managed_interleaved_run_with_faults_matches_an_unfaulted_run(
    monkeypatch: pytest.MonkeyPatch, reference: Reference
) -> None:
    """A whole interleaved run from scratch, faulted at several points, retried each time."""
    pipe = managed()
    plan = {
        (0, S0): ("encode_chunk", 4),
        (0, S1): ("commit", 1),
        (1, S1): ("diffuse", 1),
        (2, S0): ("with_values", 1),
        (4, S1): ("commit", 2),
        (4, S0): ("encode_chunk", 3),
        (6, S1): ("stitch_views", 1),
    }
    for i in range(STEPS):
        for sid in (S0, S1):
            if (i, sid) in plan:
                before = pipe.manager.get(sid) if pipe.manager is not None else None
                clone = clone_tree(before)
                fault = inject(monkeypatch, pipe, *plan[i, sid])
                with pytest.raises(InjectedFaultError):
                    pipe.forward(OBS[sid][i], sid)
                assert fault.fired
                monkeypatch.undo()
                assert pipe.manager is not None
                if before is None:
                    assert sid not in pipe.manager
                else:
                    assert pipe.manager.get(sid) is before
                    assert tree_equal(before, clone)
            assert same_output(pipe.forward(OBS[sid][i], sid), reference.outputs[sid][i])
    for sid in (S0, S1):
        assert tree_equal(record(pipe, sid), reference.records[sid][STEPS])


# --- bespoke path: the same faults leave a half-updated session -------------------------------


def bespoke_run(pipe: DreamZeroPipeline, sid: str, start: int, stop: int) -> list[DreamZeroOutput]:
    return [pipe.forward(OBS[sid][i], sid) for i in range(start, stop)]


WINDOW_RESET = {
    "stitched_buffer",
    "call_count",
    "current_start_frame",
    "clip_feas",
    "ys",
    "kv_cache",
}
"""What the bespoke window reset (done in place at the start of the step) plus the frame push
change."""

BESPOKE_CASES = [
    # (target, k, the session values the failed step already changed)
    pytest.param("frames_for_model", 1, WINDOW_RESET, id="between-frame-push-and-the-rest"),
    pytest.param(
        "encode_chunk", 4, WINDOW_RESET | {"vae_pending_body_frames"}, id="vae-encode-body"
    ),
    pytest.param(
        "append_vae_encoder_chunk",
        1,
        WINDOW_RESET | {"vae_pending_body_frames", "vae_enc_feat_map"},
        id="commit-encoder-chunk",
    ),
    pytest.param(
        "diffuse",
        1,
        # The noise was drawn before the denoiser failed: the key advanced too.
        WINDOW_RESET
        | {"vae_pending_body_frames", "vae_enc_feat_map", "vae_encoder_out", "random_key"},
        id="denoiser",
    ),
]


@pytest.fixture(scope="module")
def bespoke_reference(reference: Reference) -> list[DreamZeroOutput]:
    pipe = DreamZeroPipeline(CFG, environ=BESPOKE)
    outputs = bespoke_run(pipe, S0, 0, BESPOKE_TAIL)
    # Without faults the two paths are bit-identical.
    for out, expected in zip(outputs, reference.outputs[S0], strict=False):
        assert same_output(out, expected)
    return outputs


@pytest.mark.parametrize(("target", "k", "changed"), BESPOKE_CASES)
def test_bespoke_failed_step_leaves_a_half_updated_session(
    monkeypatch: pytest.MonkeyPatch,
    bespoke_reference: list[DreamZeroOutput],
    target: str,
    k: int,
    changed: set[str],
) -> None:
    pipe = DreamZeroPipeline(CFG, environ=BESPOKE)
    assert not pipe.managed
    for i, out in enumerate(bespoke_run(pipe, S0, 0, BESPOKE_STEP)):
        assert same_output(out, bespoke_reference[i])
    before = clone_tree(pipe.session_values(S0))

    fault = inject(monkeypatch, pipe, target, k)
    with pytest.raises(InjectedFaultError):
        pipe.forward(OBS[S0][BESPOKE_STEP], S0)
    assert fault.fired
    monkeypatch.undo()

    # What it loses: the failed step already wrote into the session. The window was reset in
    # place (so the retry no longer reports the reset) and, depending on where it failed, the
    # VAE stream advanced without its output being kept.
    after = pipe.session_values(S0)
    assert {name for name in before if not tree_equal(before[name], after[name])} == changed
    assert (before["call_count"], after["call_count"]) == (4, 1)

    # Retrying and continuing does not give the unfaulted outputs.
    continued = bespoke_run(pipe, S0, BESPOKE_STEP, BESPOKE_TAIL)
    expected = bespoke_reference[BESPOKE_STEP:]
    assert not all(same_output(a, b) for a, b in zip(continued, expected, strict=True))
    assert continued[0].reset is None  # the unfaulted step reported "inference"
    assert expected[0].reset == "inference"


def test_bespoke_transform_fault_on_a_new_session_evicts_a_resident(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The bespoke path registers a new session before its step runs.

    A first step that fails in the observation transform leaves an empty session in the
    table and, at the cap, has already evicted the least recently used resident. The managed
    path (`test_managed_new_session_whose_first_step_fails_leaves_nothing`) stores nothing.
    """
    pipe = DreamZeroPipeline(CFG, environ=BESPOKE, max_bespoke_sessions=2)
    pipe.forward(OBS[S0][0], S0)
    pipe.forward(OBS[S1][0], S1)
    fault = inject(monkeypatch, pipe, "stitch_views", 1)
    with pytest.raises(InjectedFaultError):
        pipe.forward(OBS[S0][1], "fresh")
    assert fault.fired
    monkeypatch.undo()
    assert pipe.session_ids() == [S1, "fresh"]  # session-0 is gone
    assert pipe.session_values("fresh")["call_count"] == 0
