"""Runtime capacity, the eviction warning, `on_full` resolution and `LatentBuffer.extend`.

The manager's cap can go up at runtime and never down; the first eviction is logged once per
manager and every eviction is counted; ``on_full`` comes from the deploy config and its
environment override with the same precedence as the flag; `extend` equals a fold of
`commit` and builds one tuple.
"""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sessionstate import (
    ENV_ON_FULL,
    LatentBuffer,
    NotAllocatedError,
    OmniDiffusionConfig,
    SessionAdmissionError,
    SessionState,
    SessionStateManager,
    resolve_session_state_config,
    tree_equal,
)


def _exact(message: str) -> str:
    return re.escape(message)


def _evicted_warning(sid: str, cap: int) -> str:
    return (
        f"Session {sid!r} was evicted by the session cap (max_sessions={cap}) although nobody "
        "ended it; its state is lost. End finished sessions explicitly with "
        "`drop(session_id)` (`drop_session(session_id)` on a model pipeline), or raise the "
        "cap. Warned once per manager; `stats()['evictions']` counts every eviction."
    )


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "sessionstate"]


# -- raise_max_sessions ---------------------------------------------------------------------------


def test_raise_max_sessions_goes_up_only() -> None:
    manager = SessionStateManager(2)
    assert manager.raise_max_sessions(5) is True
    assert manager.max_sessions == 5
    assert manager.stats()["max_sessions"] == 5
    for n in (5, 4, 1):
        assert manager.raise_max_sessions(n) is False
        assert manager.max_sessions == 5


def test_a_raised_cap_admits_more_sessions_without_eviction() -> None:
    manager = SessionStateManager(1, on_full="refuse")
    manager.put("a", SessionState())
    with pytest.raises(SessionAdmissionError):
        manager.put("b", SessionState())
    assert manager.raise_max_sessions(3)
    for sid in ("b", "c"):
        manager.put(sid, SessionState())
    assert manager.session_ids() == ["a", "b", "c"]
    assert manager.stats()["evictions"] == 0


def test_raise_max_sessions_from_many_threads_ends_at_the_largest() -> None:
    manager = SessionStateManager(1)
    results: list[bool] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        went_up = manager.raise_max_sessions(n)
        with lock:
            results.append(went_up)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(2, 34)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert manager.max_sessions == 33
    assert len(results) == 32
    assert any(results)


@pytest.mark.parametrize(
    ("n", "error", "msg"),
    [
        (
            0,
            ValueError,
            "`max_sessions` must be a positive int, got 0 (int); pass a cap above the current "
            "one (the cap never goes down at runtime).",
        ),
        (
            -3,
            ValueError,
            "`max_sessions` must be a positive int, got -3 (int); pass a cap above the current "
            "one (the cap never goes down at runtime).",
        ),
        (
            2.5,
            TypeError,
            "`max_sessions` must be a positive int, got 2.5 (float); pass the new cap as an int.",
        ),
        (
            True,
            TypeError,
            "`max_sessions` must be a positive int, got True (bool); pass the new cap as an int.",
        ),
    ],
)
def test_raise_max_sessions_rejects_a_bad_cap(n: Any, error: type[Exception], msg: str) -> None:
    manager = SessionStateManager(2)
    with pytest.raises(error, match=_exact(msg)):
        manager.raise_max_sessions(n)
    assert manager.max_sessions == 2


# -- the eviction warning -------------------------------------------------------------------------


def test_eviction_warns_once_per_manager_and_counts_every_eviction(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager = SessionStateManager(2)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        for i in range(12):
            manager.put(f"s{i}", SessionState())
    records = _records(caplog)
    assert [r.getMessage() for r in records] == [_evicted_warning("s0", 2)]
    assert records[0].levelno == logging.WARNING
    assert manager.stats()["evictions"] == 10
    assert manager.session_ids() == ["s10", "s11"]

    other = SessionStateManager(1)  # a second manager warns once of its own
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        for sid in ("x", "y", "z"):
            other.get_or_create(sid, SessionState)
    assert [r.getMessage() for r in _records(caplog)] == [_evicted_warning("x", 1)]
    assert other.stats()["evictions"] == 2


def test_ending_sessions_explicitly_never_warns(caplog: pytest.LogCaptureFixture) -> None:
    manager = SessionStateManager(2)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        for i in range(10):
            manager.put(f"s{i}", SessionState())
            manager.drop(f"s{i}")
    assert _records(caplog) == []
    assert manager.stats()["evictions"] == 0


def test_a_refusing_manager_never_warns(caplog: pytest.LogCaptureFixture) -> None:
    manager = SessionStateManager(1, on_full="refuse")
    manager.put("a", SessionState())
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        for _ in range(3):
            with pytest.raises(SessionAdmissionError):
                manager.put("b", SessionState())
    assert _records(caplog) == []
    assert manager.stats()["evictions"] == 0


# -- on_full: deploy config and environment -------------------------------------------------------


def test_on_full_defaults_to_evict() -> None:
    assert OmniDiffusionConfig().session_state_on_full == "evict"
    assert resolve_session_state_config(None, {}).on_full == "evict"
    assert resolve_session_state_config(OmniDiffusionConfig(), {}).on_full == "evict"


@pytest.mark.parametrize(
    ("field", "raw", "expected"),
    [
        ("evict", None, "evict"),
        ("refuse", None, "refuse"),
        ("evict", "refuse", "refuse"),
        ("refuse", "evict", "evict"),
        ("evict", " REFUSE ", "refuse"),
        ("refuse", "", "refuse"),  # empty reads as unset
        ("refuse", "  ", "refuse"),
    ],
)
def test_env_overrides_the_config_field(field: Any, raw: str | None, expected: str) -> None:
    cfg = OmniDiffusionConfig(session_state_on_full=field)
    env = {} if raw is None else {ENV_ON_FULL: raw}
    assert resolve_session_state_config(cfg, env).on_full == expected


def test_env_garbage_warns_and_keeps_the_config_value(caplog: pytest.LogCaptureFixture) -> None:
    cfg = OmniDiffusionConfig(session_state_on_full="refuse")
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        settings = resolve_session_state_config(cfg, {ENV_ON_FULL: "drop-oldest"})
    assert settings.on_full == "refuse"
    msg = (
        "Ignoring OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL='drop-oldest': expected 'evict' "
        "or 'refuse'; using the config value session_state_on_full='refuse'."
    )
    assert [r.getMessage() for r in _records(caplog)] == [msg]


def test_on_full_from_a_deploy_yaml(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("enable_session_state_manager: true\nsession_state_on_full: refuse\n")
    cfg = OmniDiffusionConfig.from_yaml(path)
    assert resolve_session_state_config(cfg, {}).on_full == "refuse"
    assert resolve_session_state_config(cfg, {ENV_ON_FULL: "evict"}).on_full == "evict"


def test_bad_on_full_in_the_config_is_named(tmp_path: Path) -> None:
    msg = (
        "`session_state_on_full` must be 'evict' or 'refuse', got 'lru' (str): 'evict' drops "
        "the least recently used session at the cap, 'refuse' refuses the new one."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        OmniDiffusionConfig(session_state_on_full="lru")  # type: ignore[arg-type]
    path = tmp_path / "deploy.yaml"
    path.write_text("session_state_on_full: lru\n")
    with pytest.raises(ValueError, match=_exact(f"Deploy config {str(path)!r}: {msg}")):
        OmniDiffusionConfig.from_yaml(path)
    typed = msg.replace("got 'lru' (str)", "got 1 (int)")  # the same check: a TypeError
    with pytest.raises(TypeError, match=_exact(typed)):
        OmniDiffusionConfig.from_dict({"session_state_on_full": 1})


# -- LatentBuffer.extend --------------------------------------------------------------------------

_POOL = [torch.full((1, 2), float(i)) for i in range(6)] + [torch.zeros(3, 2)]


@given(
    maxlen=st.one_of(st.none(), st.integers(1, 4)),
    held=st.lists(st.sampled_from(_POOL), max_size=5),
    batches=st.lists(st.lists(st.sampled_from(_POOL), max_size=5), max_size=4),
)
def test_extend_equals_a_fold_of_commits(
    maxlen: int | None, held: list[torch.Tensor], batches: list[list[torch.Tensor]]
) -> None:
    start = LatentBuffer(name="buf", dim=0).allocate(maxlen=maxlen)
    for chunk in held:
        start = start.commit(chunk)
    buf = start
    for batch in batches:
        folded = buf
        for chunk in batch:
            folded = folded.commit(chunk)
        extended = buf.extend(batch)
        # The same tensors by reference, in the same order, and the same configuration.
        assert len(extended.chunks) == len(folded.chunks)
        assert all(a is b for a, b in zip(extended.chunks, folded.chunks, strict=True))
        assert (extended.name, extended.dim, extended.maxlen, extended.allocated) == (
            folded.name,
            folded.dim,
            folded.maxlen,
            folded.allocated,
        )
        assert tree_equal(extended, folded)
        buf = extended


def test_extend_builds_one_tuple() -> None:
    buf = LatentBuffer(dim=0).allocate().commit(torch.zeros(1))
    chunks = [torch.ones(1), torch.full((1,), 2.0), torch.full((1,), 3.0)]
    made = 0
    real = LatentBuffer._with_chunks

    def counting(self: LatentBuffer, new: tuple[torch.Tensor, ...], *rest: int) -> LatentBuffer:
        nonlocal made
        made += 1
        return real(self, new, *rest)

    LatentBuffer._with_chunks = counting  # type: ignore[method-assign]
    try:
        out = buf.extend(chunks)
    finally:
        LatentBuffer._with_chunks = real  # type: ignore[method-assign]
    assert made == 1
    assert out.chunks[1:] == tuple(chunks)
    assert len(buf) == 1


def test_extend_of_a_generator_and_of_nothing() -> None:
    buf = LatentBuffer(dim=0).allocate(maxlen=2).commit(torch.zeros(1))
    assert buf.extend(torch.full((1,), float(i)) for i in range(3)).concat().tolist() == [1, 2]
    same = buf.extend([])
    assert same.chunks == buf.chunks
    assert same.maxlen == 2


def test_a_failed_extend_builds_nothing_and_names_the_chunk() -> None:
    buf = LatentBuffer(name="latents", dim=2).allocate().commit(torch.zeros(1, 4, 1, 2))
    good = torch.ones(1, 4, 2, 2)
    bad = torch.ones(1, 3, 1, 2)
    msg = (
        "LatentBuffer `latents` holds chunks of dtype torch.float32 on cpu with shape "
        "(1, 4, T, 2); got dtype torch.float32 on cpu with shape (1, 3, 1, 2). Convert the chunk "
        "(`.to(dtype=..., device=...)`) or `reset()` the buffer to change its layout."
    )
    with pytest.raises(ValueError, match=_exact(msg)):
        buf.extend([good, bad])
    assert len(buf) == 1
    # Each chunk is checked against the one before it, not only against the held ones.
    empty = LatentBuffer(name="latents", dim=2).allocate()
    with pytest.raises(ValueError, match=_exact(msg)):
        empty.extend([good, bad])


@pytest.mark.parametrize(
    ("chunks", "msg"),
    [
        (
            torch.zeros(2, 3),
            "LatentBuffer `latents`: `extend` takes an iterable of tensors, got Tensor; use "
            "`commit(chunk)` for one chunk.",
        ),
        (
            3,
            "LatentBuffer `latents`: `extend` takes an iterable of tensors, got int; pass a list "
            "or tuple of tensors.",
        ),
        (
            [torch.zeros(1, 1, 1), "x"],
            "LatentBuffer `latents` holds tensors, got str; commit a torch.Tensor.",
        ),
    ],
)
def test_extend_rejects_what_is_not_chunks(chunks: Any, msg: str) -> None:
    buf = LatentBuffer(name="latents", dim=2).allocate()
    with pytest.raises(TypeError, match=_exact(msg)):
        buf.extend(chunks)
    assert len(buf) == 0


def test_extend_before_allocate() -> None:
    msg = (
        "Cannot extend LatentBuffer `latents`: it is not allocated; call "
        "`.allocate(maxlen=...)` first."
    )
    with pytest.raises(NotAllocatedError, match=_exact(msg)):
        LatentBuffer(name="latents").extend([torch.zeros(1, 1, 1)])
