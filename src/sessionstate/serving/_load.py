"""What a load test offers a server, checked before anything runs: arrivals, lengths, shapes.

Upstream's vocabulary (vllm-omni PR #6444, RFC #6227): session *arrival rate* is the one
open-loop axis; a session's chunks are ordered and each depends on the last, so how many
sessions are active is measured, never set. Arrivals are Poisson at ``rate`` sessions per
second and lengths geometric with mean ``mean_chunks`` (at least one chunk), drawn from one
`random.Random(seed)`: the same load, chunk for chunk, for every policy and every run.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

import attrs

__all__ = ["Arrival", "DeployShape", "Load", "arrivals", "check_positive"]

GIB = 1024**3


def check_positive(value: object, name: str, *, fix: str) -> float:
    """``value`` as a float, if it is a positive finite number; else a `ValueError` with ``fix``.

    >>> check_positive(0.75, "chunk_period_s", fix="give the seconds one chunk plays")
    0.75
    >>> check_positive(float("nan"), "rate", fix="give sessions per second, such as 0.5")
    Traceback (most recent call last):
    ...
    ValueError: `rate` must be a positive finite number, got nan (float); give sessions per \
second, such as 0.5.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and math.isfinite(float(value)) and float(value) > 0:  # type: ignore[arg-type]
        return float(value)  # type: ignore[arg-type]
    msg = (
        f"`{name}` must be a positive finite number, got {value!r} ({type(value).__name__}); {fix}."
    )
    raise ValueError(msg)


@attrs.frozen
class Load:
    """An open-loop load: Poisson session arrivals for ``duration_s`` seconds.

    Args:
        rate: Session arrivals per second (Poisson).
        mean_chunks: The mean session length in chunks (geometric, at least 1).
        duration_s: Arrivals stop after this many seconds; admitted sessions run to their end.
        seed: Seeds the arrivals and the lengths.

    Raises:
        ValueError: for a rate, length or duration that is zero, negative, infinite or NaN,
            or a mean length below one chunk.

    >>> Load(rate=0.5, mean_chunks=40, duration_s=600).rate
    0.5
    """

    rate: float
    mean_chunks: float
    duration_s: float
    seed: int = 0

    def __attrs_post_init__(self) -> None:
        check_positive(self.rate, "rate", fix="give session arrivals per second, such as 0.5")
        check_positive(
            self.mean_chunks,
            "mean_chunks",
            fix="give the mean session length in chunks, such as 40",
        )
        if self.mean_chunks < 1:
            msg = (
                f"`mean_chunks` must be at least 1 (a session has at least one chunk), got "
                f"{self.mean_chunks!r}; give the mean session length in chunks, such as 40."
            )
            raise ValueError(msg)
        check_positive(
            self.duration_s, "duration_s", fix="give the seconds arrivals last, such as 600"
        )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            msg = f"`seed` must be an int, got {self.seed!r} ({type(self.seed).__name__})."
            raise TypeError(msg)


@attrs.frozen
class Arrival:
    """One session of a load: its id, its arrival time (seconds) and its length (chunks)."""

    session_id: str
    time: float
    chunks: int


def arrivals(load: Load) -> list[Arrival]:
    """The sessions ``load`` offers, in arrival order; the same list for the same load.

    >>> [(a.session_id, a.chunks) for a in arrivals(Load(rate=1, mean_chunks=3, duration_s=3))]
    [('s0', 4), ('s1', 1)]
    """
    rng = random.Random(load.seed)
    p = 1.0 / load.mean_chunks
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(load.rate)
        if t >= load.duration_s:
            return out
        u = rng.random()
        chunks = 1 if p >= 1 else 1 + int(math.log1p(-u) / math.log1p(-p))
        out.append(Arrival(f"s{len(out)}", t, chunks))


@attrs.frozen
class DeployShape:
    """A deployment as the simulated clock sees it: what a session holds, the device, the clocks.

    Args:
        name: The shape's name (``lingbot``, ``sana-wm``, ``dreamzero``).
        objects: Per session, the bytes of each value parking moves (KV, decode state).
        attrs_nbytes: Per session, device bytes that stay when it is parked.
        reserved_nbytes: What the model holds on the device (weights, workspace).
        device_nbytes: The device's memory.
        host_nbytes: Host memory for parked sessions.
        bandwidth: Host-device copy bandwidth, bytes per second, each way.
        step_s: Seconds of one step of a batch of 1, 2, ... sessions (the last entry's
            per-session time extends it to larger batches).
        chunk_period_s: Seconds one chunk plays: chunk k is due k periods after the first.
        ttfc_s: The first chunk is due this long after the session arrives.
        figures: Every figure that is assumed rather than measured, with its source.

    Raises:
        ValueError: for a size, bandwidth, step time or deadline that is zero, negative or
            NaN; a device that cannot hold one session beside the model; or a step longer
            than the chunk period or the TTFC budget (no session could meet its deadlines).

    >>> shape = DeployShape("toy", {"kv": 2 * GIB}, reserved_nbytes=GIB, device_nbytes=8 * GIB,
    ...     host_nbytes=64 * GIB, bandwidth=50e9, step_s=(0.1,), chunk_period_s=0.5, ttfc_s=1.0)
    >>> shape.resident_capacity, round(shape.swap_s, 4)
    (3, 0.0429)
    """

    name: str
    objects: Mapping[str, int]
    reserved_nbytes: int
    device_nbytes: int
    host_nbytes: int
    bandwidth: float
    step_s: tuple[float, ...]
    chunk_period_s: float
    ttfc_s: float
    attrs_nbytes: int = 0
    figures: Mapping[str, str] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        for key, n in self.objects.items():
            check_positive(n, f"objects[{key!r}]", fix="give each value's bytes per session")
        check_positive(
            self.bandwidth, "bandwidth", fix="give bytes per second each way, such as 50e9"
        )
        check_positive(self.chunk_period_s, "chunk_period_s", fix="give the seconds a chunk plays")
        check_positive(self.ttfc_s, "ttfc_s", fix="give the seconds the first chunk may take")
        check_positive(self.device_nbytes, "device_nbytes", fix="give the device's bytes")
        if not self.step_s:
            msg = "`step_s` is empty; give the seconds of one step of one session, such as (0.15,)."
            raise ValueError(msg)
        for b, s in enumerate(self.step_s, 1):
            check_positive(s, f"step_s[{b - 1}]", fix=f"give the seconds of a step of {b}")
        if self.reserved_nbytes < 0 or self.host_nbytes < 0 or self.attrs_nbytes < 0:
            msg = (
                f"`reserved_nbytes`, `host_nbytes` and `attrs_nbytes` must not be negative, got "
                f"{self.reserved_nbytes}, {self.host_nbytes} and {self.attrs_nbytes}."
            )
            raise ValueError(msg)
        if self.resident_capacity < 1:
            msg = (
                f"Shape {self.name!r}: the device's {self.device_nbytes} bytes less the "
                f"{self.reserved_nbytes} the model holds cannot hold one session of "
                f"{self.session_nbytes} bytes; give a larger device or a smaller session."
            )
            raise ValueError(msg)
        step = self.step_s[0]
        for what, budget in (("chunk_period_s", self.chunk_period_s), ("ttfc_s", self.ttfc_s)):
            if step > budget:
                msg = (
                    f"Shape {self.name!r}: one session's step takes {step} s, longer than "
                    f"`{what}` {budget} s, so no session can meet its deadlines; give a shorter "
                    f"step or a longer `{what}`."
                )
                raise ValueError(msg)

    @property
    def session_nbytes(self) -> int:
        """The device bytes of one resident session."""
        return sum(self.objects.values()) + self.attrs_nbytes

    @property
    def swap_nbytes(self) -> int:
        """The bytes parking one session moves (each way)."""
        return sum(self.objects.values())

    @property
    def swap_s(self) -> float:
        """Seconds to copy one session one way at ``bandwidth``."""
        return self.swap_nbytes / self.bandwidth

    @property
    def resident_capacity(self) -> int:
        """Sessions the device holds resident beside the model."""
        return (self.device_nbytes - self.reserved_nbytes) // max(1, self.session_nbytes)

    def step_time(self, batch: int) -> float:
        """Seconds of one step of ``batch`` sessions (extended at the last per-session time).

        >>> s = DeployShape("t", {"kv": 1}, reserved_nbytes=0, device_nbytes=9, host_nbytes=0,
        ...     bandwidth=1.0, step_s=(0.1, 0.15), chunk_period_s=1, ttfc_s=1)
        >>> s.step_time(1), s.step_time(2), round(s.step_time(4), 3)
        (0.1, 0.15, 0.3)
        """
        n = len(self.step_s)
        if batch <= n:
            return self.step_s[batch - 1]
        return self.step_s[-1] * batch / n
