"""``sessionstate sizes``: the bytes each session value holds on both paths (meta device)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from sessionstate.cli._common import fmt_bytes, positive_int, stdout_console
from sessionstate.models._registry import DEFAULT_MODEL, MODELS, get_model

__all__ = ["add_parsers", "progress_columns", "size_table", "step_bar"]


def size_table(
    preset: str, steps: int, *, model: str = DEFAULT_MODEL, full: bool = False
) -> dict[str, Any]:
    """Per-value bytes of one session of ``model`` on both paths after ``steps`` steps (meta).

    ``full=True`` runs every network call instead of replaying their layouts; the table is
    the same.

    >>> table = size_table("tiny", 2)
    >>> table["values"]["vae_encoder_out"]["bucket"]
    'object'
    >>> size_table("tiny", 2, model="cosmos3")["values"]["text_kv"]["bucket"]
    'object'
    """
    from sessionstate.models._sizes import size_run

    with size_run(full=True) if full else contextlib.nullcontext():
        return get_model(model).size_table(preset, steps)


def progress_columns() -> tuple[Any, ...]:
    """The columns of a long command's progress bar: what runs, the bar, steps done of all,
    the time spent and the time left.

    >>> [type(c).__name__ for c in progress_columns()]  # doctest: +NORMALIZE_WHITESPACE
    ['SpinnerColumn', 'TextColumn', 'BarColumn', 'MofNCompleteColumn', 'TimeElapsedColumn',
     'TimeRemainingColumn']
    """
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )


@contextlib.contextmanager
def step_bar(description: str, total: int) -> Iterator[Callable[[int, int], None]]:
    """A progress bar on stderr, gone when the block ends; yields ``update(done, total)``.

    ``update`` sets the steps done and the steps in all (the total may be revised), so it
    is a `StepReport` and fits `size_run` ``(report=...)`` as it is.

    >>> with step_bar("two steps", 2) as update:
    ...     update(1, 2)
    ...     update(2, 2)
    """
    from rich.console import Console
    from rich.progress import Progress

    with Progress(*progress_columns(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _sized(preset: str, steps: int, model: str, title: str, *, full: bool) -> dict[str, Any]:
    """`size_table` under a progress bar on stderr (steps of both paths, time left)."""
    from sessionstate.models._sizes import size_run

    what = f"one {title} session, preset {preset}, on each path (meta)"
    with step_bar(what, 2 * steps) as update, size_run(report=update, full=full):
        return get_model(model).size_table(preset, steps)


def _cmd_sizes(args: argparse.Namespace) -> int:
    from sessionstate import DEFAULT_MAX_SESSIONS

    spec = get_model(args.model)
    steps = spec.size_steps if args.steps is None else args.steps
    if args.branches is not None:
        return _branches(args, steps)
    table = _sized(args.preset, steps, spec.name, spec.title, full=args.full)
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    from rich.table import Table

    console = stdout_console()
    out = Table(
        "value", "bucket", "managed", "bespoke",
        title=f"One {spec.title} session, preset {args.preset}, after {steps} steps (meta)",
    )  # fmt: skip
    for name, row in table["values"].items():
        out.add_row(
            name,
            row["bucket"],
            fmt_bytes(row["managed_nbytes"], zero="-"),
            fmt_bytes(row["bespoke_nbytes"], zero="-"),
        )
    totals = table["session_nbytes"]
    out.add_row("[bold]session", "", fmt_bytes(totals["managed"]), fmt_bytes(totals["bespoke"]))
    many = table["sessions_64_nbytes"]
    out.add_row(
        f"[bold]{DEFAULT_MAX_SESSIONS} sessions", "",
        fmt_bytes(many["managed"]), fmt_bytes(many["bespoke"]),
    )  # fmt: skip
    rows, lines = spec.size_footer(table, fmt_bytes)
    for row in rows:
        out.add_row(*row)
    console.print(out)
    for line in lines:
        console.print(line)
    return 0


def _branches(args: argparse.Namespace, steps: int) -> int:
    # `--branches N`: what N forks of one session hold against N deep copies (meta).
    if args.model != "dreamzero":
        print(
            f"sessionstate sizes: error: `--branches` measures DreamZero's forks; got "
            f"--model {args.model}. Drop `--model`, or run `sessionstate rollout` for "
            "Cosmos3's bytes per plan step.",
            file=sys.stderr,
        )
        return 2
    from sessionstate.models.dreamzero.sizes import branch_table

    table = branch_table(
        args.preset, steps=steps, branches=args.branches, branch_steps=args.branch_steps
    )
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print(
        f"{table['branches']} branches of one DreamZero session (preset {args.preset}, "
        f"{steps} steps, then {table['branch_steps']} each), on meta:\n"
        f"  forks:       {fmt_bytes(table['forks_nbytes'])}\n"
        f"  deep copies: {fmt_bytes(table['deep_copies_nbytes'])}\n"
        f"  forks / deep copies: {table['forks_over_deep_copies']}"
    )
    return 0


def add_parsers(sub: Any) -> None:
    """Adds ``sizes`` to the subcommands ``sub``."""
    sizes = sub.add_parser(
        "sizes",
        help="bytes each session value of a model (DreamZero or Cosmos3) holds, per path "
        "(meta device)",
        description="Run one session on the meta device (nothing is allocated) and print the "
        "bytes each value holds on the managed and the bespoke path. Each network call runs "
        "once per distinct argument layout and is replayed after, which changes no byte "
        "(`--full` runs them all); a progress bar on stderr counts the steps.",
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
    sizes.add_argument(
        "--branches",
        type=positive_int,
        metavar="N",
        help="DreamZero: fork the session after --steps steps into N branches, step each "
        "--branch-steps more, and print what the forks hold against N deep copies",
    )
    sizes.add_argument(
        "--branch-steps", type=positive_int, default=4, help="steps of each branch (default 4)"
    )
    sizes.add_argument("--json", action="store_true", help="print one JSON object")
    sizes.add_argument(
        "--full",
        action="store_true",
        help="run every network call instead of replaying layouts: the same table, as a "
        "check (the deploy preset then takes minutes)",
    )
    sizes.set_defaults(func=_cmd_sizes)
