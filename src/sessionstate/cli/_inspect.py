"""``sessionstate inspect FILE``: a snapshot described from its header alone."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sessionstate.cli._common import fmt_bytes, stdout_console


def _cmd_inspect(args: argparse.Namespace) -> int:
    from sessionstate._storage import inspect_snapshot

    report = inspect_snapshot(args.file)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    # Everything shown comes from the file: plain text, never rich markup (a value named
    # "[/bold]" must print as such, not be interpreted).
    def row(table: Table, *cells: str) -> None:
        table.add_row(*(Text(cell) for cell in cells))

    console = stdout_console()
    about = Table("field", "value", title=escape(f"Snapshot {report['file']}"))
    row(about, "root", report["root"])
    row(about, "format_version", str(report["format_version"]))
    row(about, "library_version", str(report["library_version"]))
    row(about, "torch_version", str(report["torch_version"]))
    row(about, "file size", fmt_bytes(report["file_nbytes"]))
    row(about, "storages", str(len(report["storages"])))
    row(
        about,
        "tensors",
        f"{report['tensors']} references to {report['views']} views of "
        f"{len(report['storages'])} storages",
    )
    for device, nbytes in sorted(report["nbytes"].items()):
        row(about, f"nbytes:{device}", fmt_bytes(nbytes))
    for key, value in report["metadata"].items():
        row(about, f"metadata:{key}", value)
    console.print(about)
    family = any(value["bucket"] == "session" for value in report["values"])
    values = Table(
        "session" if family else "value",
        "bucket",
        "structure",
        "tensors",
        "bytes",
        title="Sessions" if family else "Values",
        caption="tensors: references (a tensor shared by two values counts for each, K/V "
        "included); bytes: each storage once, counted for the first value that reaches it",
    )
    for value in report["values"]:
        held = ", ".join(f"{fmt_bytes(n)} ({d})" for d, n in sorted(value["nbytes"].items()))
        row(
            values,
            value["name"],
            value["bucket"],
            value["structure"],
            str(value["tensors"]),
            held or "-",
        )
    console.print(values)
    return 0


def add_parsers(sub: Any) -> None:
    """Adds ``inspect`` to the subcommands ``sub``."""
    inspect = sub.add_parser(
        "inspect",
        help="describe a session snapshot file: structure, bytes per value, metadata",
        description="Print the structure, the bytes each value holds and the metadata of a "
        "snapshot written by sessionstate.save_state, read from its header alone.",
    )
    inspect.add_argument("file", help="the snapshot (.safetensors) file")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=_cmd_inspect)
