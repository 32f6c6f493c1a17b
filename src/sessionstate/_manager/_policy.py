"""The byte budget: per device, whether the table fits, and what to park or evict to make it fit.

`BudgetPolicy` decides and changes nothing: it reads the ledger and a session's values and
returns device lists, object names and refusals. The manager's make-room loop acts on them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Literal, cast

import torch

from sessionstate._checks import describe, is_int
from sessionstate._errors import BudgetTextError, SessionAdmissionError
from sessionstate._manager._ledger import SessionLedger, Values, entries_of
from sessionstate._protocols import StorageEntry
from sessionstate._session import ValueKey
from sessionstate._stateobject import StateObject

__all__ = [
    "BudgetPolicy",
    "BudgetTextError",
    "OnFull",
    "check_max_bytes",
    "is_budget_device",
    "objects_to_park",
    "parse_budget_text",
    "parse_nbytes",
    "zero_budget",
]

OnFull = Literal["evict", "refuse"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_nbytes(value: object, /, *, name: str = "max_bytes") -> int:
    """A byte count from a non-negative int or a string such as ``"24GiB"`` or ``"1.5 GB"``.

    Raises:
        ValueError: for anything else, naming ``name``, the value and the accepted forms.

    >>> parse_nbytes("24GiB"), parse_nbytes("1.5 kb"), parse_nbytes(512)
    (25769803776, 1500, 512)
    """
    number: float | None = None
    if is_int(value):
        number = value
    elif isinstance(value, str):
        text = value.strip().lower().replace("_", "")
        digits = text.rstrip("kmgtib").strip()
        unit = text[len(text.rstrip("kmgtib")) :].strip()
        try:
            number = float(digits) * _UNITS[unit] if unit in _UNITS else None
        except ValueError:
            number = None
    if number is None or number < 0 or number != number or number == float("inf"):
        msg = (
            f"`{name}` must be a byte count: a non-negative int or a string like '24GiB', "
            f"'512MiB' or '1.5GB'; got {describe(value)}."
        )
        raise ValueError(msg)
    return int(number)


def check_max_bytes(max_bytes: object) -> dict[str, int] | None:
    """``max_bytes`` as ``{device string: bytes}``, or None; the manager's argument checked.

    The manager takes the forms a model's config and its environment variable take: a mapping
    from device string to byte count (``{"cuda:0": "24GiB"}``), or the same as text
    (``"cuda:0=24GiB,cpu=8GiB"``, each device once). A bare count (``"24GiB"``, ``24 * 2**30``)
    is refused: a config applies it to its model's device, which a manager does not know, so
    the message asks for the device.

    Raises:
        TypeError: if it is neither a mapping nor a str nor an int.
        ValueError: for a bare count, a key that is not a device string with its index, a
            device named twice, or a value that is not a byte count.

    >>> check_max_bytes({"cuda:0": "1KiB", "cpu": 8})
    {'cuda:0': 1024, 'cpu': 8}
    >>> check_max_bytes("cuda:0=1KiB, cpu=8")
    {'cuda:0': 1024, 'cpu': 8}
    """
    if max_bytes is None:
        return None
    if is_int(max_bytes) or (isinstance(max_bytes, str) and "=" not in max_bytes):
        count = max_bytes.strip() if isinstance(max_bytes, str) else max_bytes
        msg = (
            f"`max_bytes` {max_bytes!r} ({type(max_bytes).__name__}) is one byte count with no "
            "device, and a manager cannot know which device it should budget (a model's config "
            "applies a bare count to the model's device). Name the device: "
            f"`max_bytes={{'cuda:0': {count!r}}}` or `max_bytes='cuda:0={count}'`."
        )
        raise ValueError(msg)
    if isinstance(max_bytes, str):
        # Text naming a device reads as pairs, never as one count.
        return cast("dict[str, int]", parse_budget_text(max_bytes))
    if not isinstance(max_bytes, Mapping):
        msg = (
            f"`max_bytes` must map device strings to byte budgets, got {max_bytes!r} "
            f"({type(max_bytes).__name__}); e.g. `max_bytes={{'cuda:0': 24 * 2**30}}` or "
            "`max_bytes='cuda:0=24GiB'`."
        )
        raise TypeError(msg)
    out: dict[str, int] = {}
    for key, value in max_bytes.items():
        out[_device_key(key)] = parse_nbytes(value, name=f"max_bytes[{key!r}]")
    return out


def parse_budget_text(text: str, /, *, positive: bool = False) -> int | dict[str, int]:
    """The budget ``text`` writes: one byte count, or ``device=count`` pairs.

    The one reading of a budget written as text, for the manager's ``max_bytes``, the deploy
    config's field and its environment variable. Pairs are separated by commas and name each
    device once, as tensors report it (``"cuda:0=24GiB,cpu=8GiB"``). With ``positive`` a count
    of 0 is refused: a config's budget of 0 bytes would refuse every session.

    Raises:
        BudgetTextError: naming the part that breaks a rule, the first in the text.

    >>> parse_budget_text("24GiB"), parse_budget_text("cuda:0=1KiB, cpu=2")
    (25769803776, {'cuda:0': 1024, 'cpu': 2})
    """
    if "=" not in text:
        return _count(text, text, positive)
    out: dict[str, int] = {}
    for part in text.split(","):
        key, _, count = part.partition("=")
        device = key.strip()
        try:
            _device_key(device)
        except ValueError as error:
            raise BudgetTextError(str(error), rule="device", part=device) from None
        if device in out:
            msg = (
                f"`max_bytes` {text!r} names device {device!r} twice; name each device once, "
                "e.g. 'cuda:0=24GiB,cpu=8GiB'."
            )
            raise BudgetTextError(msg, rule="twice", part=device)
        out[device] = _count(count, f"max_bytes[{device!r}]", positive)
    return out


def _count(text: str, name: str, positive: bool) -> int:
    try:
        n = parse_nbytes(text.strip(), name=name)
    except ValueError as error:
        raise BudgetTextError(str(error), rule="count", part=text.strip()) from None
    if positive and n == 0:
        raise BudgetTextError(zero_budget(text.strip()), rule="zero", part=text.strip())
    return n


def zero_budget(raw: object) -> str:
    """Why a budget of 0 bytes (written ``raw``) is refused where a budget is configured."""
    return (
        f"{raw!r} reads as 0 bytes, a budget that refuses every session; give a positive "
        "budget such as '24GiB', or none for no budget"
    )


def is_budget_device(device: object) -> bool:
    """Whether ``device`` names a device the way its tensors report it (so a budget applies).

    >>> is_budget_device("cuda:0"), is_budget_device("cpu"), is_budget_device("cuda")
    (True, True, False)
    """
    if not isinstance(device, str):
        return False
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return False
    return str(parsed) == device and (parsed.index is None) == (parsed.type in ("cpu", "meta"))


def _device_key(key: object) -> str:
    # The device as its tensors report it ('cuda:0', 'cpu'): a budget keyed 'cpu:0' or
    # 'cuda' would never apply, since the ledger keys bytes by what tensors report.
    text = str(key) if isinstance(key, torch.device) else key
    if not is_budget_device(text):
        msg = (
            f"`max_bytes` key {key!r} ({type(key).__name__}) is not a device string with "
            "its index; name each budgeted device as tensors report it, e.g. 'cuda:0' or "
            "'cpu'."
        )
        raise ValueError(msg)
    return str(text)


def objects_to_park(
    values: Values,
    objects: Mapping[str, StateObject],
    frees: Callable[[StorageEntry], bool],
    /,
) -> list[str]:
    """The objects of one session to park (in table order) to free the storages ``frees`` picks.

    The parkable objects holding bytes in such a storage, except any that shares a storage
    with a value that stays resident: an attribute, an object that is not parked, or (in
    turn) an object left out for sharing with one. Parking such an object would free nothing
    of that storage, and unparking it would split the alias into two copies; objects that
    share storages only among themselves are parked together, into one handle, and come back
    sharing them. A `KVHandle`'s blocks (`EngineBlock` entries) count: its class implements
    the offload protocol, so parking moves them to the tier and they return to their pool.

    Sharing is seen within the session only: an object sharing a storage with another
    session's value is parked (leaving it resident instead would leave a session forked from
    another with nothing parkable, and the budget evicting one of the two). The manager's
    parking keeps what forks share: the same object parked by a sibling is not copied again,
    and one a sibling unparked comes back as that object.

    >>> import torch
    >>> from sessionstate import SessionState, TensorCache
    >>> from sessionstate._manager._ledger import SessionLedger
    >>> state = SessionState(objects={"c": TensorCache().allocate().commit(torch.zeros(2))})
    >>> values = SessionLedger().values_for("a", state)
    >>> objects_to_park(values, state.objects, lambda entry: entry[0] == "cpu")
    ['c']
    """
    candidates = {
        name
        for name, obj in objects.items()
        if obj.parkable and any(entry[3] and frees(entry) for entry in values[("o", name)].entries)
    }
    if not candidates:
        return []
    # Who holds each storage; then what stays resident, closed over shared storages: a
    # candidate sharing a storage with a value that stays, stays too, and so on. Each
    # storage is followed once, so this costs the session's entries, however many leaves
    # share a storage.
    holders: dict[Hashable, set[ValueKey]] = {}
    for key, item in values.items():
        for entry in item.entries:
            holders.setdefault(entry[1], set()).add(key)
    staying = [key for key in values if not (key[0] == "o" and key[1] in candidates)]
    reached = set(staying)
    followed: set[Hashable] = set()
    while staying:
        for entry in values[staying.pop()].entries:
            identity = entry[1]
            if identity in followed:
                continue
            followed.add(identity)
            for key in holders[identity]:
                if key not in reached:
                    reached.add(key)
                    staying.append(key)
    return [name for name in objects if name in candidates and ("o", name) not in reached]


class BudgetPolicy:
    """A byte budget per device, and the decisions that keep the table within it.

    Every method reads and returns; none changes the ledger, the table or a record.

    >>> policy = BudgetPolicy({"cpu": 64})
    >>> policy.over(SessionLedger(), {"cpu": 65})
    ['cpu']
    """

    def __init__(self, max_bytes: Mapping[str, int], /) -> None:
        self.max_bytes = dict(max_bytes)

    def refusal(
        self, session_id: Hashable, ledger: SessionLedger, /
    ) -> SessionAdmissionError | None:
        """The error for a session whose stored record alone exceeds a device's whole budget.

        Reads the ledger's per-session totals (moved by the put that stored the record, at the
        cost of what changed), so the check costs one lookup per budgeted device, not a walk
        of the record; ``ledger`` must be built with ``per_session=True``.
        """
        for device, budget in self.max_bytes.items():
            alone = ledger.session_total(session_id, device)
            if alone > budget:
                msg = (
                    f"Cannot store session {session_id!r}: its record holds "
                    f"{alone} bytes on {device}, more than the whole budget of "
                    f"{budget} bytes there (`max_bytes`). Raise the budget for {device}, or "
                    "keep less of the session on that device."
                )
                return SessionAdmissionError(msg)
        return None

    def over(self, ledger: SessionLedger, extra: Mapping[str, int], /) -> list[str]:
        """The budgeted devices the ledger's totals plus ``extra`` would exceed."""
        return [
            device
            for device, budget in self.max_bytes.items()
            if ledger.total(device) + extra.get(device, 0) > budget
        ]

    def parkable(
        self, values: Values, objects: Mapping[str, StateObject], devices: Sequence[str], /
    ) -> list[str]:
        """The objects to park (in table order) to free bytes on ``devices``.

        See `objects_to_park`: the parkable objects holding bytes there (a `KVHandle`'s
        blocks included: parking moves them), except any sharing a storage with a value that
        stays resident.
        """
        return objects_to_park(values, objects, lambda entry: entry[0] in devices)

    def holds_on(self, values: Values, devices: Sequence[str], /) -> bool:
        """Whether ``values`` hold any bytes on ``devices`` (evicting them would free some)."""
        return any(entry[0] in devices and entry[3] for entry in entries_of(values))

    def shortfall(
        self,
        session_id: Hashable,
        ledger: SessionLedger,
        extra: Mapping[str, int],
        devices: Sequence[str],
        on_full: OnFull,
        /,
    ) -> SessionAdmissionError:
        """The refusal when parking (and evicting, if ``on_full="evict"``) left ``devices`` over."""
        device = devices[0]
        wanted = ledger.total(device) + extra.get(device, 0)
        after = "parking and evicting" if on_full == "evict" else "parking"
        msg = (
            f"Cannot make room for session {session_id!r}: {device} would hold {wanted} bytes, "
            f"over its budget of {self.max_bytes[device]} bytes, even after {after} the "
            f"other sessions' parkable objects (`on_full={on_full!r}`). Drop finished "
            f"sessions, raise `max_bytes` for {device}, or keep large values in parkable "
            "state objects rather than attributes."
        )
        return SessionAdmissionError(msg)
