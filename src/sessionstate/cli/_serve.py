"""``sessionstate serve-bench``: sessions kept at their chunk deadlines, per policy and rate.

A thin shell over `sessionstate.serving`: the simulated clock over a deploy shape (the real
manager deciding, copies on two lanes at a stated bandwidth), or the real-time clock over the
tiny DreamZero model on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from sessionstate.cli._common import positive_int, stdout_console

SHAPES = ("lingbot", "sana-wm", "dreamzero")
POLICY_HELP = {
    "fixed": "(a) no manager, fixed capacity",
    "cap": "(b) refuse at a session cap",
    "lru": "(c) byte budget, parking LRU",
    "schedule": "(d) parking + prefetch, schedule known",
}
"""`sessionstate.serving.POLICIES`, written out: building the parser imports no torch (a test
checks the two agree)."""


def positive_float(text: str) -> float:
    """A positive finite number from the command line (argparse's type).

    >>> positive_float("0.5")
    0.5
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        msg = f"expected a positive finite number such as 0.5, got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return value


def _bandwidth(text: str) -> float:
    from sessionstate.cli._plan import parse_bandwidth

    try:
        return parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None


def shape_for(args: argparse.Namespace) -> Any:
    """The deploy shape the arguments name, with their overrides."""
    import attrs

    from sessionstate import serving

    if args.shape == "lingbot":
        shape = serving.LINGBOT
    elif args.shape == "sana-wm":
        shape = serving.SANA_WM
    else:
        from sessionstate.cli._plan import plan_for

        plan = plan_for(
            "dreamzero",
            "deploy",
            None,
            device_nbytes=serving.H200_NBYTES,
            host_nbytes=1024 * 2**30,
            bandwidth=args.bandwidth or 50e9,
        )
        shape = serving.dreamzero_shape(plan)
    changes: dict[str, Any] = {}
    if args.step is not None:
        changes["step_s"] = (args.step,)
    if args.bandwidth is not None:
        changes["bandwidth"] = args.bandwidth
    if args.chunk_period is not None:
        changes["chunk_period_s"] = args.chunk_period
    if args.ttfc is not None:
        changes["ttfc_s"] = args.ttfc
    return attrs.evolve(shape, **changes) if changes else shape


def _cmd_serve(args: argparse.Namespace) -> int:
    from sessionstate import serving

    policies = args.policy or list(serving.POLICIES)
    loads = [
        serving.Load(rate=r, mean_chunks=args.mean_chunks, duration_s=args.duration, seed=args.seed)
        for r in args.rate
    ]  # every load checked before anything runs
    runs: list[dict[str, Any]] = []
    if args.clock == "realtime":
        from sessionstate.serving._realtime import serve_realtime

        period = args.chunk_period or 1.0
        for policy in policies:
            for load in loads:
                figures, _ = serve_realtime(
                    load,
                    policy,
                    chunk_period_s=period,
                    ttfc_s=args.ttfc or 2 * period,
                    max_bytes=args.max_bytes,
                    cap=args.cap,
                    capacity=args.cap,
                )
                runs.append(figures)
        out: dict[str, Any] = {"clock": "realtime", "runs": runs}
    else:
        shape = shape_for(args)
        for policy in policies:
            for load in loads:
                runs.append(
                    serving.simulate(
                        shape, load, policy, cap=args.cap, admission=args.admission,
                        batch=args.batch,
                    )
                )  # fmt: skip
        out = {
            "clock": "simulated",
            "shape": shape.name,
            "figures": dict(shape.figures),
            "runs": runs,
        }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print_runs(out)
    return 0


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _print_runs(out: dict[str, Any]) -> None:
    from rich.table import Table

    console = stdout_console()
    title = f"serve-bench, {out['clock']} clock" + (
        f", shape {out['shape']}" if "shape" in out else ""
    )
    table = Table(
        "policy", "rate /s", "attainment", "chunk p99 s", "TTFC p99 s", "active mean",
        "active max", "refused", "parks /s", "prefetch hits /s", title=title,
    )  # fmt: skip
    for run in out["runs"]:
        m = run["metrics"]
        table.add_row(
            f"{run['policy_label'][:3]} {run['policy']}"
            + (" + admission" if run.get("admission") else ""),
            _fmt(run["load"].get("rate")),
            _fmt(m["attainment"], 4),
            _fmt(m["chunk_latency_p99_s"]),
            _fmt(m["ttfc_p99_s"]),
            _fmt(m["active_mean"], 2),
            str(m["active_max"]),
            f"{m['refused_sessions']}/{m['offered_sessions']}",
            _fmt(m.get("parks_per_s"), 2),
            _fmt(m.get("prefetch_hits_per_s"), 2),
        )
    console.print(table)
    apis = {run.get("schedule_api") for run in out["runs"]} - {None}
    for api in sorted(apis):
        console.print(f"(d) ran with the schedule through: {api}")
    for name, text in out.get("figures", {}).items():
        console.print(f"[dim]{name}: {text}[/]")


def add_parsers(sub: Any) -> None:
    """Adds ``serve-bench`` to the subcommands ``sub``."""
    POLICIES = POLICY_HELP  # noqa: N806 - the table, under the name it has in the library
    p = sub.add_parser(
        "serve-bench",
        help="sessions kept at their chunk deadlines under Poisson arrivals, per policy",
        description="Offer open-loop Poisson session arrivals (geometric lengths) to a server "
        "and measure what upstream measures: chunk-deadline attainment, TTFC and chunk "
        "latency p50/p99, RTF, active sessions, refusals, parks, unparks and prefetch hits "
        "per second. The simulated clock runs a deploy shape with the real manager deciding "
        "and copies at --bandwidth; the realtime clock runs the tiny DreamZero model here. "
        "Policies: " + "; ".join(f"{k} = {v}" for k, v in POLICIES.items()) + ".",
    )
    p.add_argument("--clock", choices=["simulated", "realtime"], default="simulated")
    p.add_argument("--shape", choices=SHAPES, default="lingbot", help="deploy shape (simulated)")
    p.add_argument(
        "--policy", choices=sorted(POLICIES), action="append", help="policy (repeat; default all)"
    )
    p.add_argument(
        "--rate", type=positive_float, action="append", required=True,
        help="session arrivals per second (repeat for several)",
    )  # fmt: skip
    p.add_argument("--mean-chunks", type=positive_float, default=40.0, help="mean session chunks")
    p.add_argument("--duration", type=positive_float, default=600.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0, help="seed of arrivals and lengths")
    p.add_argument(
        "--cap",
        type=positive_int,
        default=4,
        help="session cap of (b), capacity of (a) in real time",
    )
    p.add_argument("--admission", action="store_true", help="admit by deadline (simulated)")
    p.add_argument("--batch", type=positive_int, default=1, help="most sessions per step")
    p.add_argument("--step", type=positive_float, default=None, help="seconds per step (override)")
    p.add_argument("--bandwidth", type=_bandwidth, default=None, help="copy bandwidth, e.g. 50GB/s")
    p.add_argument(
        "--chunk-period", type=positive_float, default=None, help="seconds a chunk plays"
    )
    p.add_argument("--ttfc", type=positive_float, default=None, help="first chunk's deadline, s")
    p.add_argument(
        "--max-bytes", type=positive_int, default=1_000_000,
        help="byte budget of (c) and (d) in real time (cpu)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_serve)
