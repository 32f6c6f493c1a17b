"""``sessionstate sizes``: the bytes each session value holds on both paths (meta device)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sessionstate.cli._common import fmt_bytes, positive_int
from sessionstate.models._registry import DEFAULT_MODEL, MODELS, get_model


def size_table(preset: str, steps: int, *, model: str = DEFAULT_MODEL) -> dict[str, Any]:
    """Per-value bytes of one session of ``model`` on both paths after ``steps`` steps (meta).

    >>> table = size_table("tiny", 2)
    >>> table["values"]["vae_encoder_out"]["bucket"]
    'object'
    >>> size_table("tiny", 2, model="cosmos3")["values"]["text_kv"]["bucket"]
    'object'
    """
    return get_model(model).size_table(preset, steps)


def _sized(preset: str, steps: int, model: str, title: str) -> dict[str, Any]:
    """`size_table` under a spinner with the elapsed time on stderr (it runs minutes)."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        progress.add_task(
            f"one {title} session, preset {preset}: {steps} steps on each path (meta)", total=None
        )
        return size_table(preset, steps, model=model)


def _cmd_sizes(args: argparse.Namespace) -> int:
    from sessionstate import DEFAULT_MAX_SESSIONS

    spec = get_model(args.model)
    steps = spec.size_steps if args.steps is None else args.steps
    if args.json:
        print(json.dumps(size_table(args.preset, steps, model=spec.name), indent=2))
        return 0
    table = _sized(args.preset, steps, spec.name, spec.title)
    from rich.console import Console
    from rich.table import Table

    console = Console()
    out = Table(
        "value", "bucket", "managed", "bespoke",
        title=f"One {spec.title} session, preset {args.preset}, after {steps} steps (meta)",
    )  # fmt: skip
    for name, row in table["values"].items():
        out.add_row(
            name,
            row["bucket"],
            fmt_bytes(row["managed_nbytes"]),
            fmt_bytes(row["bespoke_nbytes"]),
        )
    totals = table["session_nbytes"]
    out.add_row("[bold]session", "", fmt_bytes(totals["managed"]), fmt_bytes(totals["bespoke"]))
    many = table["sessions_64_nbytes"]
    out.add_row(
        f"[bold]{DEFAULT_MAX_SESSIONS} sessions", "",
        f"{many['managed'] / 1024**3:.2f} GiB", f"{many['bespoke'] / 1024**3:.2f} GiB",
    )  # fmt: skip
    rows, lines = spec.size_footer(table)
    for row in rows:
        out.add_row(*row)
    console.print(out)
    for line in lines:
        console.print(line)
    return 0


def add_parsers(sub: Any) -> None:
    """Adds ``sizes`` to the subcommands ``sub``."""
    sizes = sub.add_parser(
        "sizes",
        help="bytes each DreamZero session value holds, per path (meta device)",
        description="Run one session on the meta device (nothing is allocated) and print the "
        "bytes each value holds on the managed and the bespoke path. The deploy preset runs "
        "minutes; a spinner on stderr shows it is still working.",
    )
    sizes.add_argument(
        "--model", choices=sorted(MODELS), default=DEFAULT_MODEL, help="model (default dreamzero)"
    )
    sizes.add_argument(
        "--preset", choices=["tiny", "deploy"], default="deploy", help="model preset"
    )
    sizes.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="steps to run (default: "
        + ", ".join(f"{spec.size_steps} for {name}" for name, spec in MODELS.items())
        + ")",
    )
    sizes.add_argument("--json", action="store_true", help="print one JSON object")
    sizes.set_defaults(func=_cmd_sizes)
