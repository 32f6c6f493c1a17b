"""``sessionstate plan``: sessions per device and host, from one session's sizes (meta device).

The plan is arithmetic over a `sessionstate sizes` table (one session of the managed path,
run on ``meta``: nothing is allocated) and, for a model whose KV lives in an engine's block
pool, the pool's geometry. Per session it splits the device bytes into

- **KV** (the ``engine`` rows: the blocks the session's handle holds between steps),
- **parkable** state objects (the ``object`` rows on the model's device),
- **unparkable** state objects (``object`` rows the table marks ``"parkable": false``: the
  16-byte `RandomKey`), which a budgeted manager never parks,
- **attributes** (the ``attrs`` rows), which stay on the device when a session is parked,

and sets apart the values a model keeps on the host anyway (its generated latents), which
hold host memory whether the session is resident or parked.

Assumption: parking moves a session's KV (the tokens its blocks hold) and its parkable
objects to the host; its attributes and unparkable objects stay on the device. So a parked
session still holds them on the device, and every parked session held lowers the resident
count a little.
`capacity_plan` fills the host with parked sessions and then keeps resident as many sessions
as the device holds beside their remainders (`sessions_resident_without_parking` is the
figure with nothing parked).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sessionstate.cli._common import (
    fmt_at_least,
    fmt_bytes,
    negative_size,
    positive_int,
    stdout_console,
)
from sessionstate.models._registry import DEFAULT_MODEL, MODELS, get_model

__all__ = [
    "ASSUMPTION",
    "HOST_VALUES",
    "add_parsers",
    "capacity_plan",
    "check_kv_floor",
    "check_reserved",
    "fmt_plan_bytes",
    "fmt_seconds",
    "kv_geometry",
    "parse_bandwidth",
    "plan_for",
    "plan_notes",
    "plan_rows",
]

HOST_VALUES: dict[str, tuple[str, ...]] = {
    "dreamzero": ("video_latents_across_time",),
    "cosmos3": ("video_latents",),
}
"""Per model, the values its pipeline keeps on ``host_device`` (not the model's device).

A size table runs both on ``meta``, so it cannot tell them apart; ``tests/cli/test_cli_plan.py``
checks this list against a pipeline whose host device differs from its device.
"""

ASSUMPTION = (
    "Parking moves a session's KV (the tokens its blocks hold) and its parkable state objects "
    "to the host; its attributes and unparkable objects (its random key) stay on the device, "
    "so every parked session still holds them there."
)

_KV_MODULES = {"dreamzero": "sessionstate.models.dreamzero.kv"}
_CONFIGS = {"dreamzero": "sessionstate.models.dreamzero.config:DreamZeroConfig"}

GIB = 1024**3


# -- parsing ---------------------------------------------------------------------------------


def _byte_count(option: str, *, allow_zero: bool) -> Any:
    def parse(text: str) -> int:
        from sessionstate._manager import parse_nbytes

        negative = negative_size(text, example="141GiB")
        if negative is not None:
            raise argparse.ArgumentTypeError(negative)
        try:
            value = parse_nbytes(text, name=option)
        except ValueError:
            msg = f"expected a byte count such as 141GiB, 80GB or 1099511627776, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if value == 0 and not allow_zero:
            msg = f"expected a positive byte count such as 141GiB, got {text!r}"
            raise argparse.ArgumentTypeError(msg)
        return value

    return parse


def parse_bandwidth(text: str) -> float:
    """Bytes per second from text such as ``"50GB/s"`` or ``"25GiB/s"`` (units as budgets).

    Raises:
        ValueError: for anything else, naming the value and the accepted form.

    >>> parse_bandwidth("50GB/s"), parse_bandwidth("1 KiB/s")
    (50000000000.0, 1024.0)
    """
    from sessionstate._manager import parse_nbytes

    raw = text.strip()
    per_second = raw.lower().endswith("/s")
    value = 0
    if per_second:
        try:
            value = parse_nbytes(raw[:-2], name="--bandwidth")
        except ValueError:
            value = 0
    if not per_second or value <= 0:
        msg = (
            f"`--bandwidth` must be a positive byte count per second such as 50GB/s or "
            f"25GiB/s, got {text!r}."
        )
        raise ValueError(msg)
    return float(value)


def _bandwidth(text: str) -> float:
    try:
        return parse_bandwidth(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).rstrip(".")) from None


# -- the plan ----------------------------------------------------------------------------------


def kv_geometry(model: str, preset: str) -> dict[str, int] | None:
    """The KV pool's block geometry of ``model`` at ``preset``, or None without a block pool.

    ``block_nbytes`` is one block; ``handle_blocks`` the most a session's handle holds at once
    (its window, a partial block and one step's new blocks).

    >>> kv_geometry("dreamzero", "tiny")
    {'block_nbytes': 2048, 'handle_blocks': 4}
    >>> kv_geometry("cosmos3", "tiny") is None
    True
    """
    if model not in _KV_MODULES:
        return None
    import importlib

    from sessionstate.models._registry import Lazy

    kv = importlib.import_module(_KV_MODULES[model])
    cfg = Lazy(_CONFIGS[model] + ".preset")(preset)
    return {"block_nbytes": kv.block_nbytes(cfg), "handle_blocks": kv.handle_blocks(cfg)}


def _fits(r: int, p_of: Any, d: int, a: int, avail: int) -> bool:
    return bool(r * d + p_of(r) * a <= avail)


def capacity_plan(
    table: Mapping[str, Any],
    *,
    model: str,
    kv: Mapping[str, int] | None,
    device_nbytes: int,
    host_nbytes: int,
    bandwidth: float,
    reserved_nbytes: int = 0,
    resident: int | None = None,
) -> dict[str, Any]:
    """Sessions resident and parked for a `sessionstate sizes` ``table`` (pure arithmetic).

    Args:
        table: One session's sizes (``sessionstate sizes --json``); the managed path counts.
        model: The ``--model`` name (which values live on the host: `HOST_VALUES`).
        kv: The engine's block geometry (`kv_geometry`), or None if the model has no pool.
        device_nbytes: The device's bytes.
        host_nbytes: The host bytes given to parked sessions (and the host-kept values).
        bandwidth: Host-device copy bandwidth, bytes per second.
        reserved_nbytes: What the model itself holds on the device (weights, workspace).
        resident: Sessions to keep resident; parked sessions then fill what is left. By
            default the host is filled with parked sessions first, and as many sessions stay
            resident as the device holds beside the attributes the parked ones keep there.

    Raises:
        ValueError: if the device (less ``reserved_nbytes``) cannot hold one session, or the
            host cannot hold the values one session keeps there; the message gives the bytes
            needed.

    >>> t = {"preset": "x", "steps": 1, "session_nbytes": {"managed": 14}, "values": {
    ...     "kv": {"bucket": "engine", "managed_nbytes": 8},
    ...     "obj": {"bucket": "object", "managed_nbytes": 4},
    ...     "a": {"bucket": "attrs", "managed_nbytes": 2}}}
    >>> p = capacity_plan(t, model="m", kv=None, device_nbytes=100, host_nbytes=36, bandwidth=6)
    >>> p["sessions_resident_without_parking"], p["sessions_resident"], p["sessions_parked"]
    (7, 6, 3)
    >>> p["swap_in_s"]
    2.0
    """
    resident_requested = resident
    host_names = set(HOST_VALUES.get(model, ()))
    kv_b = parkable = kept = attrs_b = host_kept = 0
    for name, row in table["values"].items():
        n = int(row["managed_nbytes"])
        if name in host_names:
            host_kept += n
        elif row["bucket"] == "engine":
            kv_b += n
        elif row["bucket"] == "object" and row.get("parkable", True):
            parkable += n
        elif row["bucket"] == "object":
            kept += n  # an object parking leaves on the device (a `RandomKey`)
        else:
            attrs_b += n
    counted = kv_b + parkable + kept + attrs_b + host_kept
    shared = counted - int(table["session_nbytes"]["managed"])
    d = kv_b + parkable + kept + attrs_b  # one resident session, on the device
    moved = kv_b + parkable  # what parking copies to the host
    a = kept + attrs_b  # what a parked session keeps on the device
    q = moved + host_kept  # one parked session, on the host
    h = host_kept  # one resident session, on the host
    title = get_model(model).title if model in MODELS else model
    who = f"one {title} session at preset {table['preset']}"

    headroom = 0
    pool: dict[str, Any] | None = None
    if kv is not None:
        block, most = int(kv["block_nbytes"]), int(kv["handle_blocks"])
        held = math.ceil(kv_b / block) if block else 0
        headroom = max(0, most * block - kv_b)
        pool = {"block_nbytes": block, "handle_blocks": most, "blocks_held": held}
    need = d + headroom
    avail = device_nbytes - reserved_nbytes - headroom
    if avail < d:
        msg = (
            f"{_device_less_reserved(device_nbytes, reserved_nbytes)}, but {who} needs "
            f"{fmt_bytes(need)} on the device ({fmt_bytes(kv_b)} of KV, "
            f"{fmt_bytes(parkable + kept + attrs_b)} of model state"
            + (f", {fmt_bytes(headroom)} for one step's new KV blocks" if headroom else "")
            + f"); pass --device-bytes of at least {fmt_at_least(need + reserved_nbytes)}."
        )
        raise ValueError(msg)
    r0 = avail // d
    if h:
        if host_nbytes < h:
            msg = (
                f"`--host-bytes {fmt_bytes(host_nbytes)}` is less than the {fmt_bytes(h)} {who} "
                f"keeps on the host ({', '.join(sorted(host_names & set(table['values'])))}); "
                f"pass --host-bytes of at least {fmt_at_least(h)}."
            )
            raise ValueError(msg)
        r0 = min(r0, host_nbytes // h)

    def parked_for(r: int) -> int:
        return max(0, (host_nbytes - r * h) // q) if moved else 0

    def device_room(r: int) -> int:
        """Parked sessions whose attributes fit on the device beside ``r`` resident ones."""
        return (avail - r * d) // a if a else parked_for(r)

    if resident is not None:
        if resident > r0:
            msg = (
                f"`--resident {resident}` is more than the {r0} sessions the device holds "
                f"resident ({fmt_bytes(d)} each, {fmt_bytes(avail)} available); pass "
                f"--resident {r0} or less."
            )
            raise ValueError(msg)
        parked = min(parked_for(resident), device_room(resident))
        limited_by = "host" if parked == parked_for(resident) else "device"
    else:
        # The largest resident count that fits beside the parked sessions the host then
        # holds. `r * d + parked_for(r) * a` never decreases with r (d >= a, and one more
        # resident session takes at most one parked one's host bytes): a bisection finds it.
        lo, hi = 0, r0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fits(mid, parked_for, d, a, avail):
                lo = mid
            else:
                hi = mid - 1
        resident = max(lo, 1)  # the parked sessions' attributes alone would fill the device
        parked = min(parked_for(resident), device_room(resident))
        limited_by = "host" if parked == parked_for(resident) else "device"
    out: dict[str, Any] = {
        "model": model,
        "preset": table["preset"],
        "steps": table["steps"],
        "assumption": ASSUMPTION,
        "device_nbytes": device_nbytes,
        "host_nbytes": host_nbytes,
        "bandwidth_bytes_per_s": bandwidth,
        "reserved_nbytes": reserved_nbytes,
        "session": {
            "device_nbytes": d,
            "kv_nbytes": kv_b,
            "parkable_nbytes": parkable,
            "unparkable_nbytes": kept,
            "attrs_nbytes": attrs_b,
            "host_kept_nbytes": host_kept,
            "parked_host_nbytes": q,
            "parked_device_nbytes": a,
            "swap_nbytes": moved,
            "shared_nbytes": shared,
        },
        "step_headroom_nbytes": headroom,
        "available_nbytes": avail,
        "sessions_resident_without_parking": r0,
        "sessions_resident": resident,
        "sessions_parked": parked,
        "sessions_total": resident + parked,
        "parked_limited_by": limited_by,
        "resident_requested": resident_requested,
        "parked_per_resident_session": (d // a) if a else None,
        "device_used_nbytes": reserved_nbytes + headroom + resident * d + parked * a,
        "host_used_nbytes": resident * h + parked * q,
        "swap_in_s": moved / bandwidth,
        "swap_out_s": moved / bandwidth,
    }
    if pool is not None:
        pool["blocks"] = resident * held + headroom // block
        pool["pool_nbytes"] = pool["blocks"] * pool["block_nbytes"]
        pool["resident_sessions_by_handle_blocks"] = pool["blocks"] // pool["handle_blocks"]
        out["kv_pool"] = pool
    return out


def _device_less_reserved(device_nbytes: int, reserved_nbytes: int) -> str:
    return (
        f"`--device-bytes {fmt_bytes(device_nbytes)}` less `--reserved-bytes "
        f"{fmt_bytes(reserved_nbytes)}` leaves {fmt_bytes(device_nbytes - reserved_nbytes)}"
    )


def check_reserved(device_nbytes: int, reserved_nbytes: int) -> None:
    """Raises `ValueError` if ``reserved_nbytes`` leaves the device nothing for sessions.

    >>> check_reserved(80 * 2**30, 90 * 2**30)
    Traceback (most recent call last):
    ...
    ValueError: `--reserved-bytes 90.00 GiB` leaves nothing of `--device-bytes 80.00 GiB` for \
sessions; pass --reserved-bytes below 80.00 GiB, or the device's memory as --device-bytes.
    """
    if reserved_nbytes >= device_nbytes:
        msg = (
            f"`--reserved-bytes {fmt_bytes(reserved_nbytes)}` leaves nothing of "
            f"`--device-bytes {fmt_bytes(device_nbytes)}` for sessions; pass --reserved-bytes "
            f"below {fmt_bytes(device_nbytes)}, or the device's memory as --device-bytes."
        )
        raise ValueError(msg)


def check_kv_floor(model: str, preset: str, *, device_nbytes: int, reserved_nbytes: int) -> None:
    """Raises `ValueError` if the device cannot hold one session's KV blocks during a step.

    The blocks are a floor of what `capacity_plan` finds a session needs, known without
    sizing one: `plan` says so before it spends the time.

    >>> check_kv_floor("dreamzero", "tiny", device_nbytes=2**30, reserved_nbytes=0)
    >>> check_kv_floor("dreamzero", "tiny", device_nbytes=1000, reserved_nbytes=0)
    Traceback (most recent call last):
    ...
    ValueError: `--device-bytes 1000 B` less `--reserved-bytes 0 B` leaves 1000 B, but one \
DreamZero session at preset tiny needs at least 8.00 KiB on the device for its KV alone (4 \
blocks of 2.00 KiB: its window and one step's new blocks); pass --device-bytes of at least \
8.00KiB.
    """
    kv = kv_geometry(model, preset)
    if kv is None:
        return
    floor = kv["block_nbytes"] * kv["handle_blocks"]
    if device_nbytes - reserved_nbytes < floor:
        msg = (
            f"{_device_less_reserved(device_nbytes, reserved_nbytes)}, but one "
            f"{get_model(model).title} session at preset {preset} needs at least "
            f"{fmt_bytes(floor)} on the device for its KV alone ({kv['handle_blocks']} blocks "
            f"of {fmt_bytes(kv['block_nbytes'])}: its window and one step's new blocks); pass "
            f"--device-bytes of at least {fmt_at_least(floor + reserved_nbytes)}."
        )
        raise ValueError(msg)


def plan_for(
    model: str,
    preset: str,
    steps: int | None,
    *,
    sizes: Mapping[str, Any] | None = None,
    **figures: Any,
) -> dict[str, Any]:
    """`capacity_plan` of ``model`` at ``preset``: its size table run on meta, or ``sizes``.

    >>> plan_for("dreamzero", "tiny", 3, device_nbytes=2**20, host_nbytes=2**20,
    ...          bandwidth=1e9)["sessions_resident"] > 0
    True
    """
    spec = get_model(model)
    if sizes is None:
        from sessionstate.cli._sizes import _sized

        steps = spec.size_steps if steps is None else steps
        sizes = _sized(preset, steps, spec.name, spec.title, full=False)
    return capacity_plan(sizes, model=model, kv=kv_geometry(model, preset), **figures)


def _load_sizes(path: str, model: str, preset: str) -> dict[str, Any]:
    try:
        table: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        msg = (
            f"`--sizes-json {path}` cannot be read as JSON ({exc}); write it with "
            "`sessionstate sizes --json > FILE`."
        )
        raise ValueError(msg) from None
    if not isinstance(table, dict) or not {"values", "session_nbytes", "preset"} <= set(table):
        msg = f"`--sizes-json {path}` is not `sessionstate sizes --json` output."
        raise ValueError(msg)
    found = (table.get("model", DEFAULT_MODEL), table["preset"])
    if found != (model, preset):
        msg = (
            f"`--sizes-json {path}` sizes {found[0]} at preset {found[1]}, but the plan is for "
            f"{model} at preset {preset}; pass `--model {found[0]} --preset {found[1]}`."
        )
        raise ValueError(msg)
    return table


# -- output ----------------------------------------------------------------------------------


fmt_plan_bytes = fmt_bytes
"""The plan's byte format: the command's one (``docs/gen_sizes.py`` renders the plans with it)."""


def fmt_seconds(seconds: float) -> str:
    """Seconds for the plan's table.

    >>> fmt_seconds(0.1354), fmt_seconds(2.5), fmt_seconds(0.0000123)
    ('135.4 ms', '2.50 s', '12.3 us')
    """
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} us"


def _fmt_bandwidth(per_s: float) -> str:
    """A bandwidth in decimal GB/s, as hardware is quoted.

    >>> _fmt_bandwidth(50e9), _fmt_bandwidth(25 * 2**30)
    ('50 GB/s', '26.8 GB/s')
    """
    return f"{per_s / 1e9:.3g} GB/s"


def plan_rows(plan: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The plan as ``(quantity, device, host)`` rows: what the table and the docs show."""
    s = plan["session"]
    rows = [
        ("KV window (engine) per session", fmt_bytes(s["kv_nbytes"]), ""),
        ("parkable state objects per session", fmt_bytes(s["parkable_nbytes"]), ""),
        ("unparkable state objects per session", fmt_bytes(s["unparkable_nbytes"]), ""),
        ("attributes per session (stay when parked)", fmt_bytes(s["attrs_nbytes"]), ""),
        ("kept on the host per session", "", fmt_bytes(s["host_kept_nbytes"])),
        (
            "one resident session",
            fmt_bytes(s["device_nbytes"]),
            fmt_bytes(s["host_kept_nbytes"]),
        ),
        (
            "one parked session",
            fmt_bytes(s["parked_device_nbytes"]),
            fmt_bytes(s["parked_host_nbytes"]),
        ),
    ]
    if plan["step_headroom_nbytes"]:
        rows.append(
            ("one step's new KV blocks (once)", fmt_bytes(plan["step_headroom_nbytes"]), "")
        )
    rows += [
        ("reserved for the model (--reserved-bytes)", fmt_bytes(plan["reserved_nbytes"]), ""),
        (
            "available for sessions",
            fmt_bytes(plan["available_nbytes"]),
            fmt_bytes(plan["host_nbytes"]),
        ),
        ("sessions resident, nothing parked", str(plan["sessions_resident_without_parking"]), ""),
        ("sessions resident", str(plan["sessions_resident"]), ""),
        ("sessions parked", "", str(plan["sessions_parked"])),
        ("sessions in all", str(plan["sessions_total"]), ""),
        (
            "used",
            fmt_bytes(plan["device_used_nbytes"]),
            fmt_bytes(plan["host_used_nbytes"]),
        ),
        (
            f"swap one session in / out at {_fmt_bandwidth(plan['bandwidth_bytes_per_s'])}",
            f"{fmt_seconds(plan['swap_in_s'])} / {fmt_seconds(plan['swap_out_s'])}",
            fmt_bytes(s["swap_nbytes"]),
        ),
    ]
    return rows


def plan_notes(plan: Mapping[str, Any]) -> list[str]:
    """The lines printed under the plan's table."""
    s = plan["session"]
    notes = [
        f"Assumption: {plan['assumption']}",
        f"Each parked session keeps {fmt_bytes(s['parked_device_nbytes'])} of attributes "
        f"and unparkable objects on the device: {plan['sessions_parked']} parked sessions take "
        f"{fmt_bytes(plan['sessions_parked'] * s['parked_device_nbytes'])} there, "
        + (
            f"which leaves room for all {plan['sessions_resident']} resident sessions"
            if plan["sessions_resident"] == plan["sessions_resident_without_parking"]
            else f"so {plan['sessions_resident']} sessions stay resident instead of "
            f"{plan['sessions_resident_without_parking']}"
        )
        + f"; the {plan['parked_limited_by']} limits the parked sessions."
        + (
            f" One resident session's device bytes hold {plan['parked_per_resident_session']} "
            "parked sessions' attributes (--resident N trades them)."
            if plan["parked_per_resident_session"]
            else ""
        ),
    ]
    if plan["reserved_nbytes"] == 0:
        notes.append(
            "Nothing is reserved for the model itself: `sizes` does not know its weights (the "
            "reference networks are stand-ins), activations or workspace; pass "
            "--reserved-bytes with what your model holds on the device."
        )
    if plan["step_headroom_nbytes"]:
        pool = plan["kv_pool"]
        notes.append(
            f"KV: a session holds {pool['blocks_held']} blocks of "
            f"{fmt_bytes(pool['block_nbytes'])} between steps and up to "
            f"{pool['handle_blocks']} during one; the step's extra blocks are counted once, "
            f"for the session stepping. A pool of {pool['blocks']} blocks "
            f"({fmt_bytes(pool['pool_nbytes'])}) holds these "
            f"sessions; its stats() count {pool['handle_blocks']} blocks for every session "
            f"({pool['resident_sessions_by_handle_blocks']} at that size)."
        )
    if s["shared_nbytes"] > 0:
        notes.append(
            f"Values share {fmt_bytes(s['shared_nbytes'])} of storage; each value counts "
            "it here, so the figures are conservative."
        )
    return notes


def _cmd_plan(args: argparse.Namespace) -> int:
    spec = get_model(args.model)
    check_reserved(args.device_bytes, args.reserved_bytes)
    sizes = None
    if args.sizes_json is not None:
        if args.steps is not None:
            msg = "`--steps` and `--sizes-json` exclude each other: the file has its steps."
            raise ValueError(msg)
        sizes = _load_sizes(args.sizes_json, spec.name, args.preset)
    else:  # sizing takes a while: first what needs none (the plan gives exact figures)
        check_kv_floor(
            spec.name,
            args.preset,
            device_nbytes=args.device_bytes,
            reserved_nbytes=args.reserved_bytes,
        )
    plan = plan_for(
        spec.name,
        args.preset,
        args.steps,
        sizes=sizes,
        device_nbytes=args.device_bytes,
        host_nbytes=args.host_bytes,
        bandwidth=args.bandwidth,
        reserved_nbytes=args.reserved_bytes,
        resident=args.resident,
    )
    if args.json:
        print(json.dumps(plan, indent=2))
        return 0
    from rich.table import Table

    console = stdout_console()
    out = Table(
        "", "device", "host",
        title=f"Capacity plan: {spec.title}, preset {args.preset}, after {plan['steps']} steps "
        f"(meta); {fmt_bytes(args.device_bytes)} device, "
        f"{fmt_bytes(args.host_bytes)} host",
    )  # fmt: skip
    for row in plan_rows(plan):
        bold = row[0].startswith("sessions")
        out.add_row(*(f"[bold]{c}" if bold and c else c for c in row))
    console.print(out)
    for line in plan_notes(plan):
        console.print(line)
    return 0


def add_parsers(sub: Any) -> None:
    """Adds ``plan`` to the subcommands ``sub``."""
    plan = sub.add_parser(
        "plan",
        help="sessions resident and parked per device and host, from one session's sizes",
        description="Size one session on the meta device (nothing is allocated, as `sessionstate "
        "sizes`) and plan a deployment: the bytes a session holds on the device (its KV "
        "window and its model state, split into what parking moves and what stays), the "
        "sessions the device holds resident, the sessions the host holds parked, and the time "
        "to swap one in and out at --bandwidth. Assumes parking moves KV and parkable state "
        "objects to the host and leaves attributes on the device.",
    )
    plan.add_argument(
        "--model", choices=sorted(MODELS), default=DEFAULT_MODEL, help="model (default dreamzero)"
    )
    plan.add_argument("--preset", choices=["tiny", "deploy"], default="deploy", help="model preset")
    plan.add_argument(
        "--device-bytes",
        type=_byte_count("--device-bytes", allow_zero=False),
        required=True,
        help="the device's memory, e.g. 141GiB or 80GiB",
    )
    plan.add_argument(
        "--host-bytes",
        type=_byte_count("--host-bytes", allow_zero=True),
        required=True,
        help="host memory for sessions, e.g. 1TiB: parked sessions, and the values every "
        "session keeps on the host (its generated latents)",
    )
    plan.add_argument(
        "--bandwidth",
        type=_bandwidth,
        default="50GB/s",
        help="host-device copy bandwidth, e.g. 50GB/s or 25GiB/s",
    )
    plan.add_argument(
        "--reserved-bytes",
        type=_byte_count("--reserved-bytes", allow_zero=True),
        default=0,
        help="device bytes the model itself holds (weights, activations, workspace), which "
        "`sizes` does not know",
    )
    plan.add_argument(
        "--resident",
        type=positive_int,
        default=None,
        help="sessions to keep resident; parked sessions fill what is left (default: fill the "
        "host with parked sessions, then keep resident what the device holds beside them)",
    )
    plan.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="steps to size the session after (default: "
        + ", ".join(f"{spec.size_steps} for {name}" for name, spec in MODELS.items())
        + ")",
    )
    plan.add_argument(
        "--sizes-json",
        metavar="FILE",
        help="plan from a saved `sessionstate sizes --json` instead of sizing a session",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_cmd_plan)
