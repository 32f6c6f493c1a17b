"""The real-time clock: a reference model's pipeline stepped for real, parking for real.

The loop is `serve_loop`, the same as the simulated clock's; only the backend differs. Each
step runs the model (the tiny DreamZero preset on the CPU), the manager parks and unparks real
tensors, and a prefetch restores on the manager's worker thread while the step runs. Time is
*measured*: the loop's clock advances by each step's wall time (prefetch issued, forward
run, waits for restores included), and jumps over idle gaps (nothing runs in them; sleeping
through them would change no figure). Decisions therefore depend on the machine's speed;
outputs never do (each session's inputs are fixed by its id and chunk index).

Policies as on the simulated clock: ``fixed`` and ``cap`` refuse beyond their count (the loop's
``limit``), ``lru`` parks under a byte budget, ``schedule`` adds the server's schedule: with
`SessionStateManager.expect` where the manager has it, else ``prefetch(next, make_room=True)``
(room made least recently used first), issued before the step so the restore overlaps it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from sessionstate.serving._load import Arrival, Load, arrivals
from sessionstate.serving._server import serve_loop
from sessionstate.serving._sim import POLICIES, Policy

__all__ = ["RealTimeServer", "dreamzero_inputs", "serve_realtime"]


class RealTimeServer:
    """A backend stepping ``pipe`` (a managed reference pipeline) on ``inputs`` for real.

    Args:
        pipe: A managed pipeline (`DreamZeroPipeline` with the manager on).
        inputs: Per session id, its inputs in chunk order.
        policy: As `SimulatedServer`'s.
    """

    def __init__(self, pipe: Any, inputs: Mapping[str, Sequence[Any]], policy: Policy) -> None:
        self.pipe = pipe
        self.inputs = inputs
        self.policy = policy
        self.outputs: dict[str, list[Any]] = {}
        manager = pipe.manager
        self.schedule_api: str | None = None
        if policy == "schedule":
            self.schedule_api = (
                "expect" if hasattr(manager, "expect") else "prefetch(make_room=True)"
            )

    def admit(self, session_id: str, now: float, /) -> None:
        """Nothing to do: a session starts at its first step."""

    def step(
        self, session_ids: Sequence[str], now: float, schedule: Sequence[str], /
    ) -> tuple[float, float]:
        """Run one chunk of each session; the clock advances by the measured time."""
        start = time.perf_counter()
        manager = self.pipe.manager
        if self.policy == "schedule" and manager is not None:
            upcoming = [s for s in schedule if s not in session_ids]
            expect = getattr(manager, "expect", None)
            if expect is not None:
                expect([*session_ids, *upcoming], prefetch=False)
            if upcoming:
                self.pipe.prefetch(upcoming[0], make_room=True)
        for sid in session_ids:
            done = self.outputs.setdefault(sid, [])
            done.append(self.pipe.forward(self.inputs[sid][len(done)], sid))
        return now, now + (time.perf_counter() - start)

    def finish(self, session_id: str, now: float, /) -> None:
        """Drop the session."""
        self.pipe.drop_session(session_id)

    def counters(self) -> dict[str, float]:
        """The manager's parks, unparks, prefetches and prefetch hits."""
        stats = self.pipe.stats()
        keys = ("parks", "unparks", "prefetches", "prefetch_hits", "evictions")
        return {k: float(stats.get(k, 0)) for k in keys}


def dreamzero_inputs(cfg: Any, ids: Sequence[str], chunks: int, seed: int) -> dict[str, list[Any]]:
    """Per session id, ``chunks`` scripted DreamZero observations (the same for every policy).

    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> obs = dreamzero_inputs(DreamZeroConfig.preset("tiny"), ["s0", "s1"], 2, seed=0)
    >>> sorted(obs), len(obs["s1"])
    (['s0', 's1'], 2)
    """
    from sessionstate.models.dreamzero.episode import scripted_episode

    out: dict[str, list[Any]] = {sid: [] for sid in ids}
    episode = scripted_episode(cfg, steps=chunks, sessions=len(ids), seed=seed)
    for name, obs in episode:
        out[ids[int(name.rsplit("-", 1)[1])]].append(obs)
    return out


def serve_realtime(
    load: Load | Sequence[Arrival],
    policy: Policy,
    *,
    chunk_period_s: float,
    ttfc_s: float,
    max_bytes: int | None = None,
    capacity: int = 4,
    cap: int = 4,
) -> tuple[dict[str, Any], RealTimeServer]:
    """Serve ``load`` with tiny DreamZero sessions on this CPU; the figures and the server.

    The server's ``outputs`` hold every session's outputs in chunk order, its ``pipe`` the
    pipeline.

    Args:
        load: The arrivals: a `Load`, or the sessions themselves.
        policy: ``"fixed"`` (refuse beyond ``capacity``), ``"cap"`` (beyond ``cap``),
            ``"lru"`` or ``"schedule"`` (under ``max_bytes`` on the cpu, parked to the host).
        chunk_period_s: Seconds one chunk plays.
        ttfc_s: The first chunk's deadline after arrival.
        max_bytes: The byte budget of ``lru`` and ``schedule``.
        capacity: The fixed capacity of ``fixed``.
        cap: The session cap of ``cap``.

    >>> figures, server = serve_realtime([Arrival("a", 0.0, 1)], "fixed", chunk_period_s=60.0,
    ...                                  ttfc_s=60.0)
    >>> figures["metrics"]["chunks"], len(server.outputs["a"]), figures["clock"]
    (1, 1, 'real time (measured)')
    """
    from sessionstate import OmniDiffusionConfig
    from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline

    if policy not in POLICIES:
        msg = f"`policy` must be one of {sorted(POLICIES)}, got {policy!r}."
        raise ValueError(msg)
    if policy in ("lru", "schedule") and max_bytes is None:
        msg = f"Policy {policy!r} parks under a byte budget; pass `max_bytes`."
        raise ValueError(msg)
    sessions = arrivals(load) if isinstance(load, Load) else list(load)
    seed = load.seed if isinstance(load, Load) else 0
    cfg = DreamZeroConfig.preset("tiny")
    longest = max((a.chunks for a in sessions), default=1)
    inputs = dreamzero_inputs(cfg, [a.session_id for a in sessions], longest, seed)
    budgeted = policy in ("lru", "schedule")
    config = OmniDiffusionConfig(
        enable_session_state_manager=True,
        model={"preset": "tiny"},
        session_state_max_bytes=max_bytes if budgeted else None,
        session_state_park_tier="host",
    )
    with warnings.catch_warnings():  # a host tier under a cpu budget warns
        warnings.simplefilter("ignore")
        pipe = DreamZeroPipeline(config, environ={})
    server = RealTimeServer(pipe, inputs, policy)
    limit = {"fixed": capacity, "cap": cap}.get(policy)
    run = serve_loop(server, sessions, chunk_period_s=chunk_period_s, ttfc_s=ttfc_s, limit=limit)
    figures = {
        "clock": "real time (measured)",
        "model": "dreamzero tiny, cpu",
        "policy": policy,
        "policy_label": POLICIES[policy],
        "schedule_api": server.schedule_api,
        "max_bytes": max_bytes if budgeted else None,
        "load": (
            {"rate": load.rate, "mean_chunks": load.mean_chunks, "seed": load.seed}
            if isinstance(load, Load)
            else {"sessions": len(sessions)}
        ),
        "metrics": run.metrics(),
    }
    return figures, server
