"""``sessionstate demo``: several sessions of a model through the manager, and what they hold."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from sessionstate._env import ENV_ENABLE, ENV_MAX_SESSIONS
from sessionstate.cli._common import (
    add_budget_arguments,
    check_device,
    fmt_bytes,
    load_model_config,
    positive_int,
    stdout_console,
    with_budget,
)
from sessionstate.cli._sizes import step_bar
from sessionstate.models._registry import DEFAULT_MODEL, MODELS, get_model


def _cmd_demo(args: argparse.Namespace) -> int:
    from rich.table import Table

    check_device(args.device)
    spec = get_model(args.model)
    deploy, cfg = load_model_config(None, args.preset, spec.name)
    deploy = with_budget(deploy, args)
    environ = dict(os.environ, **{ENV_ENABLE: "1"})
    if args.max_sessions is not None:
        environ[ENV_MAX_SESSIONS] = str(args.max_sessions)
    pipe = spec.pipeline(deploy, environ=environ, device=args.device)
    assert pipe.manager is not None
    buckets = spec.buckets()
    console = stdout_console()
    episode = spec.episode(cfg, steps=args.steps, sessions=args.sessions, seed=args.seed)
    total = args.steps * args.sessions
    with step_bar(f"{spec.title} sessions", total) as update:
        for i, (sid, obs) in enumerate(episode):
            pipe.forward(obs, sid)
            update(i + 1, total)

    stats = pipe.manager.stats()
    sizes = pipe.manager.nbytes_by_session()
    largest = max(sizes, key=lambda sid: sum(sizes[sid].values()))
    state = pipe.manager.peek(largest)
    assert state is not None
    # The bucket each value belongs in, as `sessionstate sizes` and the Models page say.
    values = {
        name: {"bucket": buckets.get(name, "object" if name in state.objects else "attrs"),
               "nbytes": sum(by_device.values())}
        for name, by_device in state.nbytes_by_value().items()
    }  # fmt: skip
    if args.save is not None:
        pipe.manager.snapshot(largest, args.save)
    if args.json:
        print(json.dumps({"model": spec.name, "stats": stats, "largest_session": str(largest),
                          "values": values, "saved": args.save}, indent=2))  # fmt: skip
        return 0
    table = Table("stat", "value", title="SessionStateManager.stats()")
    for key, value in stats.items():
        byte_key = "nbytes" in key or key.startswith("max_bytes")
        table.add_row(key, fmt_bytes(value) if byte_key else str(value))
    console.print(table)
    breakdown = Table("value", "bucket", "bytes", title=f"Largest session: {largest}")
    for name, row in values.items():
        breakdown.add_row(name, str(row["bucket"]), fmt_bytes(int(row["nbytes"]), zero="-"))
    console.print(breakdown)
    if args.save is not None:
        console.print(
            f"saved session {largest!r} to {args.save}; look inside with "
            f"`sessionstate inspect {args.save}`"
        )
    return 0


def add_parsers(sub: Any) -> None:
    """Adds ``demo`` to the subcommands ``sub``."""
    demo = sub.add_parser(
        "demo",
        help="run several sessions of a model through the manager and show what they hold",
        description="Run a multi-session workload of a reference model (DreamZero by default) "
        "on the manager-backed path, then print stats() and the per-value bytes of the largest "
        "session.",
    )
    demo.add_argument(
        "--model", choices=sorted(MODELS), default=DEFAULT_MODEL, help="model (default dreamzero)"
    )
    demo.add_argument("--preset", choices=["tiny", "deploy"], default="tiny", help="model preset")
    demo.add_argument("--sessions", type=positive_int, default=4, help="interleaved sessions")
    demo.add_argument("--steps", type=positive_int, default=16, help="steps per session")
    demo.add_argument(
        "--max-sessions",
        type=positive_int,
        help="the manager's session cap (default: the deploy config's)",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the scripted observations")
    add_budget_arguments(demo)
    demo.add_argument(
        "--save",
        metavar="PATH",
        help="also snapshot the largest session to PATH (a safetensors file for "
        "`sessionstate inspect`)",
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=_cmd_demo)
