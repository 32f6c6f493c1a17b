"""Thread safety: one managed DreamZero pipeline serving sessions from several threads.

Four worker threads each run whole DreamZero steps for their own two sessions through ONE
managed pipeline (the manager's immutability guard on), while a stats thread polls
``manager.stats()``, a reader thread inspects every published record, and a scratch thread
creates and drops a scratch session over and over. Nothing raises, no record is ever seen
half-built, every session's outputs and final record are bit-identical to a serial run of
the same per-session inputs, and the final ``stats()`` equals a recount.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest

from sessionstate import SessionState, tree_equal
from sessionstate.models.dreamzero import (
    FRAMES_PER_CHUNK,
    DreamZeroConfig,
    DreamZeroOutput,
    DreamZeroPipeline,
    DreamZeroSession,
    Observation,
)
from sessionstate.models.dreamzero.episode import scripted_episode
from sessionstate.testing import recount_nbytes_by_device
from tests.support import same_output, torch_threads

CFG = DreamZeroConfig.preset("tiny")
ENV = {
    "OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1",
    "OMNI_DIFFUSION_SESSION_STATE_MANAGER_CHECK_IMMUTABLE": "1",
}
WORKERS = 4
SESSIONS_PER_WORKER = 2
STEPS = 5
"""Steps per session: a window start, three in-window steps and a window rollover that also
encodes a 4-frame body chunk."""


def _inputs() -> dict[str, list[Observation]]:
    n = WORKERS * SESSIONS_PER_WORKER
    out: dict[str, list[Observation]] = {f"session-{i}": [] for i in range(n)}
    for sid, obs in scripted_episode(CFG, steps=STEPS, sessions=n, seed=7):
        out[sid].append(obs)
    return out


INPUTS = _inputs()
OWNED = {
    w: [f"session-{w * SESSIONS_PER_WORKER + j}" for j in range(SESSIONS_PER_WORKER)]
    for w in range(WORKERS)
}


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def _check_whole(state: SessionState) -> None:
    """A published DreamZero record is never half-built: its counters and buffers agree."""
    assert isinstance(state, DreamZeroSession)
    n = state.call_count
    assert n >= 1
    assert state.current_start_frame == 1 + CFG.num_frame_per_block * n
    assert len(state.stitched_buffer) == min(n, FRAMES_PER_CHUNK)
    assert state.vae_stream_initialized
    assert state.prompt_embeds is not None
    assert state.clip_feas is not None
    assert state.ys is not None
    assert len(state.video_latents_across_time) >= 1


def _recount(pipe: DreamZeroPipeline) -> dict[str, int]:
    assert pipe.manager is not None
    records = [pipe.manager.peek(sid) for sid in pipe.manager.session_ids()]
    totals = recount_nbytes_by_device(records)
    return {
        "sessions": len(records),
        "total_nbytes": sum(totals.values()),
        **{f"nbytes:{d}": n for d, n in sorted(totals.items())},
    }


@pytest.fixture(scope="module")
def serial() -> tuple[dict[str, list[DreamZeroOutput]], dict[str, SessionState]]:
    pipe = DreamZeroPipeline(CFG, environ=ENV)
    assert pipe.manager is not None
    outputs = {sid: [pipe.forward(obs, sid) for obs in seq] for sid, seq in INPUTS.items()}
    records = {}
    for sid in INPUTS:
        state = pipe.manager.get(sid)
        assert state is not None
        records[sid] = state
    return outputs, records


def test_threads_through_one_managed_pipeline_match_a_serial_run(
    serial: tuple[dict[str, list[DreamZeroOutput]], dict[str, SessionState]],
) -> None:
    expected_outputs, expected_records = serial
    pipe = DreamZeroPipeline(CFG, environ=ENV)
    manager = pipe.manager
    assert manager is not None

    outputs: dict[str, list[DreamZeroOutput]] = {sid: [] for sid in INPUTS}
    errors: list[BaseException] = []
    done = threading.Event()
    start = threading.Barrier(WORKERS + 3)
    counts = {"stats": 0, "reads": 0, "scratch": 0}

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                start.wait()
                fn()
            except BaseException as exc:  # reported in the main thread
                errors.append(exc)
                done.set()

        return run

    def worker(w: int) -> Callable[[], None]:
        def run() -> None:
            for i in range(STEPS):
                for sid in OWNED[w]:  # interleave the worker's own sessions
                    outputs[sid].append(pipe.forward(INPUTS[sid][i], sid))

        return run

    def until_done(body: Callable[[], None], pause: float) -> Callable[[], None]:
        # Runs `body` until the workers are done, and once more after that, so every side
        # thread has run at least once and the reader has seen every session's final record.
        def run() -> None:
            while True:
                finished = done.is_set()
                body()
                if finished:
                    return
                done.wait(pause)  # poll without starving the workers of the interpreter lock

        return run

    def poll_stats() -> None:
        stats = manager.stats()
        assert stats["sessions"] <= len(INPUTS) + 1
        devices = sum(v for k, v in stats.items() if k.startswith("nbytes:"))
        assert stats["total_nbytes"] == devices
        assert stats["evictions"] == 0
        counts["stats"] += 1

    def read_records() -> None:
        for sid in manager.session_ids():
            state = manager.peek(sid)  # touches neither LRU order nor counters
            if state is not None and sid != "scratch":
                _check_whole(state)
                counts["reads"] += 1

    def scratch() -> None:
        state = manager.get_or_create("scratch", pipe.new_session)
        manager.put("scratch", state.with_attrs(call_count=1))
        assert manager.drop("scratch")
        counts["scratch"] += 1

    workers = [threading.Thread(target=guarded(worker(w))) for w in range(WORKERS)]
    others = [
        threading.Thread(target=guarded(until_done(fn, pause)))
        for fn, pause in ((poll_stats, 0.002), (read_records, 0.002), (scratch, 0.001))
    ]
    for thread in workers + others:
        thread.start()
    for thread in workers:
        thread.join()
    done.set()
    for thread in others:
        thread.join()
    if errors:
        raise errors[0]
    assert counts["stats"] > 0
    assert counts["scratch"] > 0
    assert counts["reads"] >= len(INPUTS)

    # The final stats equal a recount, and the counters add up.
    stats = manager.stats()
    recount = _recount(pipe)
    assert {k: v for k, v in stats.items() if k in recount} == recount
    engine = {k for k in stats if k.startswith("engine_nbytes:")}  # part of the device totals
    assert set(stats) - set(recount) - engine == {
        "max_sessions",
        "hits",
        "misses",
        "evictions",
        "forks",
        "shared_sessions",
    }
    assert stats["sessions"] == len(INPUTS)
    assert stats["evictions"] == 0
    assert stats["hits"] == len(INPUTS) * (STEPS - 1)  # one `get` per forward...
    assert stats["misses"] == len(INPUTS) + counts["scratch"]  # ...a miss on each first step
    assert "scratch" not in manager

    # Per-session outputs and final records: bit-identical to the serial run.
    for sid in INPUTS:
        assert len(outputs[sid]) == STEPS
        for got, want in zip(outputs[sid], expected_outputs[sid], strict=True):
            assert same_output(got, want)
        final = manager.require(sid)
        _check_whole(final)
        assert tree_equal(final, expected_records[sid])
