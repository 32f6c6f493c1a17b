"""The manager's byte ledger: resident bytes per device, kept up to date incrementally.

Every stored value (a state object or an attribute of a session) adds one reference to each
storage it reaches; replacing, dropping or parking the value removes them. A storage counts
while it has a reference, once, however many values reach it, so the totals are what
`nbytes_by_device` of all stored records together would say (each storage once; storages over
overlapping memory as the union of their address ranges), at the cost of the values that
changed rather than a walk of every session.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterable

from sessionstate._accounting import EngineBlock, StorageEntry
from sessionstate._checks import describe, is_int

__all__ = ["Ledger", "parse_nbytes"]

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


class _Ranges:
    """A multiset of address ranges on one device and the size of their union."""

    def __init__(self) -> None:
        self._spans: list[tuple[int, int]] = []  # distinct ranges, sorted
        self._counts: dict[tuple[int, int], int] = {}
        self._longest = 0
        self.total = 0

    def add(self, start: int, end: int) -> None:
        span = (start, end)
        count = self._counts.get(span, 0)
        self._counts[span] = count + 1
        if count:
            return
        self.total += (end - start) - self._covered(start, end)
        bisect.insort(self._spans, span)
        self._longest = max(self._longest, end - start)

    def remove(self, start: int, end: int) -> None:
        span = (start, end)
        count = self._counts[span] - 1
        if count:
            self._counts[span] = count
            return
        del self._counts[span]
        del self._spans[bisect.bisect_left(self._spans, span)]
        self.total -= (end - start) - self._covered(start, end)

    def _covered(self, start: int, end: int) -> int:
        """Bytes of ``[start, end)`` that the held ranges cover."""
        spans = self._spans
        # A range overlapping [start, end) starts after `start - longest` and before `end`.
        lo = bisect.bisect_left(spans, (start - self._longest, start - self._longest))
        hi = bisect.bisect_left(spans, (end, end))
        covered, reach = 0, start
        for s, e in sorted(spans[lo:hi]):
            if e <= reach:
                continue
            s = max(s, reach)
            e = min(e, end)
            if e > s:
                covered += e - s
                reach = e
        return covered


class Ledger:
    """Resident bytes per device from per-storage reference counts.

    >>> import torch
    >>> from sessionstate._accounting import storage_entries
    >>> x = torch.zeros(8)
    >>> ledger = Ledger()
    >>> ledger.add(storage_entries(x)); ledger.add(storage_entries(x[2:]))
    >>> ledger.totals()
    {'cpu': 32}
    >>> ledger.remove(storage_entries(x)); ledger.totals()
    {'cpu': 32}
    >>> ledger.remove(storage_entries(x[2:])); ledger.totals()
    {}
    """

    def __init__(self) -> None:
        self._refs: dict[Hashable, list[object]] = {}  # identity -> [count, entry]
        self._engine: dict[str, int] = {}  # bytes of engine-owned blocks, per device
        self._ranges: dict[str, _Ranges] = {}
        self._unmapped: dict[str, int] = {}  # bytes of storages without memory (meta)

    def add(self, entries: Iterable[StorageEntry], /) -> None:
        """Add one reference to each entry's storage."""
        refs = self._refs
        for entry in entries:
            identity = entry[1]
            ref = refs.get(identity)
            if ref is not None:
                ref[0] = int(ref[0]) + 1  # type: ignore[call-overload]
                continue
            refs[identity] = [1, entry]
            self._count(entry, +1)

    def remove(self, entries: Iterable[StorageEntry], /) -> None:
        """Remove one reference from each entry's storage (added before)."""
        refs = self._refs
        for entry in entries:
            identity = entry[1]
            ref = refs[identity]
            count = int(ref[0]) - 1  # type: ignore[call-overload]
            if count:
                ref[0] = count
                continue
            del refs[identity]
            self._count(entry, -1)

    def _count(self, entry: StorageEntry, sign: int) -> None:
        device, identity, pointer, nbytes, _ = entry
        if nbytes == 0:
            return
        if isinstance(identity, EngineBlock):
            self._engine[device] = self._engine.get(device, 0) + sign * nbytes
        if not pointer:
            self._unmapped[device] = self._unmapped.get(device, 0) + sign * nbytes
            return
        ranges = self._ranges.get(device)
        if ranges is None:
            ranges = self._ranges[device] = _Ranges()
        if sign > 0:
            ranges.add(pointer, pointer + nbytes)
        else:
            ranges.remove(pointer, pointer + nbytes)

    def total(self, device: str, /) -> int:
        """Resident bytes on ``device``."""
        ranges = self._ranges.get(device)
        return (ranges.total if ranges is not None else 0) + self._unmapped.get(device, 0)

    def engine_totals(self) -> dict[str, int]:
        """Bytes of engine-owned blocks per device (each block once), for devices holding any."""
        return {d: n for d, n in sorted(self._engine.items()) if n}

    def totals(self) -> dict[str, int]:
        """Resident bytes per device, for devices holding any."""
        devices = {*self._ranges, *self._unmapped}
        out = {d: self.total(d) for d in devices}
        return {d: n for d, n in sorted(out.items()) if n}
