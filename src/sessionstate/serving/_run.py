"""One simulated load under one policy, and the sweep over arrival rates the headline reads.

A rate is *sustained* when the run meets at least 99% of its chunk deadlines and refuses at
most 1% of the sessions offered: a server that refuses most sessions meets its few deadlines
trivially, so refusals count against it as misses do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sessionstate.serving._admission import DeadlineAdmission
from sessionstate.serving._load import Arrival, DeployShape, Load, arrivals, check_positive
from sessionstate.serving._server import serve_loop
from sessionstate.serving._sim import Policy, SimulatedServer, describe

__all__ = ["SUSTAINED", "is_sustained", "simulate", "sustained_sessions", "sweep"]

SUSTAINED = {"attainment": 0.99, "refused_fraction": 0.01}
"""What a sustained rate meets: at least this attainment, at most this fraction refused."""


def simulate(
    shape: DeployShape,
    load: Load,
    policy: Policy,
    *,
    cap: int = 4,
    admission: bool = False,
    batch: int = 1,
    headroom: float = 0.9,
) -> dict[str, Any]:
    """Serve ``load`` on ``shape`` under ``policy`` on the simulated clock; JSON-ready figures.

    Args:
        shape: The deployment.
        load: The arrivals (the same for every policy).
        policy: ``"fixed"`` (a), ``"cap"`` (b), ``"lru"`` (c) or ``"schedule"`` (d).
        cap: The session cap of ``"cap"``.
        admission: Admit by deadline (`DeadlineAdmission` planned from the shape).
        batch: The most sessions stepped at once.
        headroom: The fraction of a period admission by deadline fills.

    >>> from sessionstate.serving import LINGBOT
    >>> out = simulate(LINGBOT, Load(rate=0.05, mean_chunks=20, duration_s=200), "schedule")
    >>> out["metrics"]["attainment"], out["policy_label"]
    (1.0, '(d) parking + prefetch, schedule known')
    """
    server = SimulatedServer(shape, policy, cap=cap)
    planned = (
        DeadlineAdmission.planned(shape, prefetch=policy == "schedule", headroom=headroom)
        if admission
        else None
    )
    run = serve_loop(
        server,
        arrivals(load),
        chunk_period_s=shape.chunk_period_s,
        ttfc_s=shape.ttfc_s,
        batch=batch,
        limit=shape.resident_capacity if policy == "fixed" else None,
        admission=planned,
    )
    return {
        "shape": shape.name,
        **describe(server),
        "admission": "deadline" if admission else None,
        "admission_limit": None if planned is None else planned.limit,
        "batch": batch,
        "load": {
            "rate": load.rate,
            "mean_chunks": load.mean_chunks,
            "duration_s": load.duration_s,
            "seed": load.seed,
        },
        "metrics": run.metrics(),
    }


def is_sustained(metrics: dict[str, Any]) -> bool:
    """Whether a run's metrics meet `SUSTAINED`.

    >>> is_sustained({"attainment": 0.995, "refused_fraction": 0.0})
    True
    """
    return bool(
        metrics["attainment"] >= SUSTAINED["attainment"]
        and metrics["refused_fraction"] <= SUSTAINED["refused_fraction"]
    )


def sweep(
    shape: DeployShape,
    rates: Sequence[float],
    *,
    mean_chunks: float,
    duration_s: float,
    seed: int = 0,
    policies: Sequence[Policy] = ("fixed", "cap", "lru", "schedule"),
    admission: bool = False,
    cap: int = 4,
) -> dict[str, Any]:
    """Every policy at every rate on the same arrivals; per policy the highest rate sustained.

    >>> from sessionstate.serving import LINGBOT
    >>> out = sweep(LINGBOT, [0.02], mean_chunks=10, duration_s=100, policies=["cap"])
    >>> out["best"]["cap"]["rate"]
    0.02
    """
    for r in rates:
        check_positive(r, "rates", fix="give positive arrival rates, such as 0.05")
    runs: dict[str, list[dict[str, Any]]] = {}
    best: dict[str, dict[str, Any] | None] = {}
    for policy in policies:
        runs[policy] = []
        best[policy] = None
        for rate in sorted(rates):
            load = Load(rate=rate, mean_chunks=mean_chunks, duration_s=duration_s, seed=seed)
            out = simulate(shape, load, policy, cap=cap, admission=admission)
            runs[policy].append(out)
            m = out["metrics"]
            if is_sustained(m) and (best[policy] is None or rate > best[policy]["rate"]):  # type: ignore[index]
                best[policy] = {
                    "rate": rate,
                    "active_mean": m["active_mean"],
                    "active_max": m["active_max"],
                    "attainment": m["attainment"],
                }
    return {"shape": shape.name, "figures": dict(shape.figures), "runs": runs, "best": best}


def sustained_sessions(
    shape: DeployShape, policy: Policy = "schedule", *, chunks: int = 60, most: int = 64
) -> int:
    """The most sessions held at once that ``shape`` keeps at 99% of their deadlines.

    Measured, not planned: ``n`` sessions of ``chunks`` chunks arrive spread over one chunk
    period, with no admission control, for ``n = 1, 2, ...`` until a run misses more than 1%
    of its chunks (at most ``most``). What `DeadlineAdmission` plans is checked against this.

    >>> from sessionstate.serving import LINGBOT
    >>> sustained_sessions(LINGBOT, "schedule", chunks=20)
    4
    """
    if policy not in ("lru", "schedule"):
        msg = (
            f"`sustained_sessions` measures a parking policy ('lru' or 'schedule'), got "
            f"{policy!r}: without a budget nothing stops sessions beyond the device's memory."
        )
        raise ValueError(msg)
    found = 0
    for n in range(1, most + 1):
        gap = shape.chunk_period_s / n
        sessions = [Arrival(f"s{i}", i * gap, chunks) for i in range(n)]
        run = serve_loop(
            SimulatedServer(shape, policy),
            sessions,
            chunk_period_s=shape.chunk_period_s,
            ttfc_s=shape.ttfc_s,
        )
        if run.metrics()["attainment"] < SUSTAINED["attainment"]:
            break
        found = n
    return found
