"""``sessionstate cluster``: the DreamZero episode across local Ray workers, migrating."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sessionstate.cli._common import fmt_bytes, positive_int, stdout_console


def _cmd_cluster(args: argparse.Namespace) -> int:
    import ray

    from sessionstate.distributed import cluster_episode, init_local_ray

    started = bool(init_local_ray(num_cpus=args.num_cpus))
    try:
        report = cluster_episode(
            workers=args.workers,
            preset=args.preset,
            sessions=args.sessions,
            steps=args.steps,
            seed=args.seed,
            migrate_every=args.migrate_every,
        )
    finally:
        if started:
            ray.shutdown()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_cluster(report)
    return 0 if report["identical"] else 1


def _print_cluster(report: dict[str, Any]) -> None:
    from rich.table import Table

    console = stdout_console()
    verdict = "[bold green]IDENTICAL[/]" if report["identical"] else "[bold red]MISMATCH[/]"
    console.print(
        f"cluster vs one process {verdict}: {report['outputs_compared']} outputs compared with "
        f"torch.equal, {report['migrations']} migrations (median "
        f"{report['median_migration_ms']} ms), {report['sessions']} sessions x "
        f"{report['steps']} steps, preset {report['preset']}"
    )
    if report["first_mismatch"]:
        console.print(f"first mismatch: {report['first_mismatch']}")
    table = Table("worker", "sessions", "resident bytes", "steps served")
    for name, row in report["workers"].items():
        table.add_row(
            name, ", ".join(row["sessions"]) or "-", fmt_bytes(row["nbytes"]), str(row["steps"])
        )
    console.print(table)


def add_parsers(sub: Any) -> None:
    """Adds ``cluster`` to the subcommands ``sub``."""
    cluster = sub.add_parser(
        "cluster",
        help="run the DreamZero episode across local Ray workers, migrating sessions",
        description="Run one scripted episode through session-affine Ray workers, migrating "
        "the session just stepped after every --migrate-every calls, and compare every "
        "output with a single-process run (torch.equal). Exits 0 iff identical. Needs the "
        "ray extra; starts a local, offline Ray cluster unless one is running.",
    )
    cluster.add_argument("--workers", type=positive_int, default=2, help="worker actors")
    cluster.add_argument(
        "--preset", choices=["tiny", "deploy"], default="tiny", help="model preset"
    )
    cluster.add_argument("--sessions", type=positive_int, default=6, help="sessions")
    cluster.add_argument("--steps", type=positive_int, default=24, help="steps per session")
    cluster.add_argument("--seed", type=int, default=0, help="seed of the scripted observations")
    cluster.add_argument(
        "--migrate-every", type=positive_int, default=5, help="calls between migrations"
    )
    cluster.add_argument(
        "--num-cpus", type=positive_int, default=2, help="CPUs of the local Ray cluster"
    )
    cluster.add_argument("--json", action="store_true", help="print one JSON object")
    cluster.set_defaults(func=_cmd_cluster)
