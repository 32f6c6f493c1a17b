"""The manager makes a step's room: a tiny model with a pool and one object, and no room code.

`SessionStateManager(pools=...)` and `step`: before the session is read, the least recently
used other sessions' KV is parked while the pool lacks the blocks a step can take; the step
runs in the pool's transaction and is published only if it succeeds.
"""

from __future__ import annotations

import pytest
import torch

from sessionstate import (
    EnginePool,
    KVCache,
    KVPool,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
)

WINDOW = 4


def _tiny_model(pool: KVPool) -> tuple[object, object]:
    """The whole model: a record of one `KVCache`, and a step that appends and reads."""

    def new() -> SessionState:
        return SessionState(objects={"kv": KVCache().allocate()})

    def step(state: SessionState, x: float) -> tuple[SessionState, torch.Tensor]:
        kv = state.object("kv", KVCache).append(pool, torch.full((2,), x), window=WINDOW)
        return state.with_object("kv", kv), kv.read()  # type: ignore[return-value]

    return new, step


def _windowed(tokens: list[float]) -> list[float]:
    # `KVPool.append(window=...)` keeps whole blocks of 2: drop leading ones past the window.
    while len(tokens) - 2 >= WINDOW:
        tokens = tokens[2:]
    return tokens


def test_a_tiny_model_runs_under_pool_pressure_with_no_room_code() -> None:
    pool = KVPool(7, block_tokens=2, token_shape=(), step_tokens=2, window_tokens=WINDOW)
    assert isinstance(pool, EnginePool)
    m = SessionStateManager(pools=(pool,))
    new, step = _tiny_model(pool)
    want: dict[str, list[float]] = {}
    for t in range(6):
        for sid in "abcd":
            x = float(10 * t + ord(sid))
            got = m.step(sid, lambda s, x=x: step(s, x), new=new)  # type: ignore[misc, operator]
            want[sid] = _windowed([*want.get(sid, []), x, x])
            assert got.tolist() == want[sid], (t, sid)
    stats = m.stats()
    assert stats["kv_parks"] > 0  # four sessions, room for two
    assert stats["kv_unparks"] > 0
    assert stats["evictions"] == 0
    for sid in "abcd":
        read = m.peek(sid, on_host=True)
        assert read is not None
        assert read.object("kv", KVCache).read().tolist() == want[sid]  # type: ignore[union-attr]
    del read  # a resident session's own record: it holds its blocks
    m.clear()
    assert pool.free_blocks == pool.num_blocks


def test_a_failed_step_leaves_the_record_and_the_pool_as_they_were() -> None:
    pool = KVPool(8, block_tokens=2, token_shape=(), step_tokens=2, window_tokens=WINDOW)
    m = SessionStateManager(pools=(pool,))
    new, step = _tiny_model(pool)
    m.step("a", lambda s: step(s, 1.0), new=new)  # type: ignore[operator]
    stored, free = m.peek("a"), pool.free_blocks

    def failing(state: SessionState) -> tuple[SessionState, None]:
        step(state, 2.0)  # type: ignore[operator]  # takes a block, then the step fails
        raise RuntimeError("the network failed")

    with pytest.raises(RuntimeError, match="the network failed"):
        m.step("a", failing, new=new)  # type: ignore[arg-type]
    assert m.peek("a") is stored
    assert pool.free_blocks == free


def test_begin_says_whether_a_step_starts_or_continues_a_session() -> None:
    pool = KVPool(8, block_tokens=2, token_shape=(), step_tokens=2, window_tokens=WINDOW)
    m = SessionStateManager(pools=(pool,))
    new, step = _tiny_model(pool)
    msg = "Cannot continue session 'a': the manager does not hold it"
    with pytest.raises(SessionStateLostError, match=msg):
        m.step("a", lambda s: step(s, 1.0), new=new, begin=False)  # type: ignore[operator]
    assert "a" not in m
    m.step("a", lambda s: step(s, 1.0), new=new)  # type: ignore[operator]
    again = m.step("a", lambda s: step(s, 2.0), new=new, begin=False)  # type: ignore[operator]
    assert again.tolist() == [1.0, 1.0, 2.0, 2.0]
    fresh = m.step("a", lambda s: step(s, 3.0), new=new, begin=True)  # type: ignore[operator]
    assert fresh.tolist() == [3.0, 3.0]
    lost = m.step  # a model words its own message
    with pytest.raises(SessionStateLostError, match=r"^Model session 'b' is gone$"):
        lost(
            "b",
            lambda s: (s, None),
            new=new,
            begin=False,
            lost=lambda sid: f"Model session {sid!r} is gone",
        )  # type: ignore[arg-type]


def test_the_room_maker_passes_by_sessions_whose_kv_is_parked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Forty sessions, a pool with room for about three: each step parks the K/V of the least
    # recently used session that holds some. A session whose K/V is parked is asked once
    # what it could free, not at every step (the scan would cost every session held).
    import sessionstate._manager._room as room_module

    pool = KVPool(8, block_tokens=2, token_shape=(), step_tokens=2, window_tokens=WINDOW)
    m = SessionStateManager(pools=(pool,))
    new, step = _tiny_model(pool)
    asked: list[str] = []
    objects_to_park = room_module.objects_to_park

    def counted(*args: object) -> list[str]:
        asked.append("")
        return objects_to_park(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(room_module, "objects_to_park", counted)
    ids = [f"s{i}" for i in range(40)]
    want: dict[str, list[float]] = {}
    steps = 0
    for t in range(3):
        for sid in ids:
            x = float(100 * t + int(sid[1:]))
            got = m.step(sid, lambda s, x=x: step(s, x), new=new)  # type: ignore[misc, operator]
            want[sid] = _windowed([*want.get(sid, []), x, x])
            assert got.tolist() == want[sid], (t, sid)
            steps += 1
    assert m.stats()["evictions"] == 0
    assert m.stats()["kv_parks"] >= steps - 4
    assert len(asked) <= 3 * steps, len(asked)
