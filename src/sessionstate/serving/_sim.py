"""The simulated clock: deploy-sized sessions, the real manager deciding, two copy lanes.

**The real manager decides.** Every decision of a policy with a manager (the session cap, the
byte budget, what to park for room, which prefetch to start or drop, whom to refuse) is taken
by a real `SessionStateManager` over real records. What it cannot do is move deploy-sized
bytes: parking copies real storages, and meta tensors (how size tables are computed) hold no
data to copy (`park_tree` refuses them). So each simulated session's record is a *scale
model*: one CPU ``uint8`` tensor per declared value, one byte per MiB of the deploy size (each
value rounded up to whole MiB, at most 1 MiB per value, stated in the output as ``scale``).
The manager's budget is the device's bytes less the model's, at the same scale, and its host
pool the host's. Decisions depend only on byte counts, so they are those of the deploy sizes.

**Copies are modelled from the manager's events.** Each park, unpark and prefetch the manager
reports (`SessionEvent`, with its bytes) becomes a copy of ``bytes * scale`` at the shape's
bandwidth on one of two lanes, device-to-host (parks) and host-to-device (unparks and
prefetches), each one copy at a time:

- a park starts when its lane is free, and not before the session's running step ends (its
  record is being read);
- an unpark or a prefetch starts when its lane is free and the parks the same call made for
  its room are done (the room is free only then), and not before the session's own park ends;
- a step starts when the compute lane is free and every session of it is resident: a
  prefetched session when its prefetch lands (a *prefetch hit*, counted by the manager's
  ``prefetch_hits``), another parked one when its foreground unpark does.

So a prefetch overlaps the running step as it would on a GPU with a side stream. Step times
come from the shape (per batch size). Nothing here sleeps: time is a number.

**Policies.** ``fixed`` (a): no manager, a fixed capacity (the sessions the device holds
resident), beyond it refused. ``cap`` (b): a manager refusing at a session cap (upstream
Phase 1, default 4), no budget. ``lru`` (c): a byte budget with parking, least recently used
first, no prefetch. ``schedule`` (d): the same budget, and the server tells the manager what
runs next, and the next session is prefetched. With `SessionStateManager.expect` where the
manager has it: ``expect(schedule, prefetch=False)`` (Belady room-making), then
``prefetch(next, make_room=True)``: prefetching further ahead parks, in a round robin,
sessions the optimal order keeps (every session was swapped at every step when we tried).
Until it lands, the server does what ``expect`` promises
through public calls: it parks the resident session used furthest in the schedule
(`SessionStateManager.park_until` keeping every other session) until the next session fits,
then `SessionStateManager.prefetch` (``make_room=False``: the room is made); a foreground
unpark gets its room the same way. ``schedule_api`` in the output says which ran.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch

from sessionstate._errors import SessionAdmissionError
from sessionstate._manager import SessionStateManager
from sessionstate._manager._events import SessionEvent
from sessionstate._session import SessionState
from sessionstate.serving._load import DeployShape
from sessionstate.serving._server import SessionFailedError

__all__ = ["POLICIES", "SCALE", "Policy", "SimulatedServer"]

Policy = Literal["fixed", "cap", "lru", "schedule"]
POLICIES: dict[str, str] = {
    "fixed": "(a) no manager, fixed capacity",
    "cap": "(b) refuse at a session cap",
    "lru": "(c) byte budget, parking LRU",
    "schedule": "(d) parking + prefetch, schedule known",
}
"""The policies, by name, with their label in the issue."""

SCALE = 2**20
"""Deploy bytes per byte of a simulated record (one byte per MiB)."""


def _units(nbytes: int) -> int:
    return max(1, math.ceil(nbytes / SCALE))


class SimulatedServer:
    """A server on the simulated clock under one policy (see the module's text).

    Args:
        shape: The deployment.
        policy: ``"fixed"``, ``"cap"``, ``"lru"`` or ``"schedule"``.
        cap: The session cap of ``"cap"`` (upstream's default 4).

    >>> from sessionstate.serving import LINGBOT
    >>> server = SimulatedServer(LINGBOT, "schedule")
    >>> server.admit("a", 0.0); start, end = server.step(["a"], 0.0, [])
    >>> start, round(end, 3)
    (0.0, 0.1)
    """

    def __init__(self, shape: DeployShape, policy: Policy, *, cap: int = 4) -> None:
        if policy not in POLICIES:
            msg = f"`policy` must be one of {sorted(POLICIES)}, got {policy!r}."
            raise ValueError(msg)
        if policy == "cap" and cap > shape.resident_capacity:
            msg = (
                f"A session cap of {cap} does not fit shape {shape.name!r}: its device holds "
                f"{shape.resident_capacity} sessions beside the model, and a cap without a "
                f"budget parks nothing; give a cap of {shape.resident_capacity} or less."
            )
            raise ValueError(msg)
        self.shape = shape
        self.policy = policy
        self._units = {name: _units(n) for name, n in shape.objects.items()}
        self._attr_units = _units(shape.attrs_nbytes) if shape.attrs_nbytes else 0
        self._swap_units = sum(self._units.values())
        self._session_units = self._swap_units + self._attr_units
        self._events: list[SessionEvent] = []
        self.manager: SessionStateManager[SessionState] | None = None
        self.schedule_api: str | None = None
        if policy == "cap":
            self.manager = SessionStateManager(
                max_sessions=cap, on_full="refuse", on_event=self._events.append
            )
        elif policy in ("lru", "schedule"):
            with warnings.catch_warnings():  # a host tier under a cpu budget: the scale model
                warnings.simplefilter("ignore")
                self.manager = SessionStateManager(
                    max_sessions=10**9,
                    on_full="refuse",
                    max_bytes={"cpu": (shape.device_nbytes - shape.reserved_nbytes) // SCALE},
                    host_pool_bytes=max(1, shape.host_nbytes // SCALE),
                    host_pool_full="refuse",
                    keep_parked_copies=False,  # a step changes the record: every park copies
                    on_event=self._events.append,
                )
            if policy == "schedule":
                self.schedule_api = (
                    "expect"
                    if hasattr(self.manager, "expect")
                    else "park_until(furthest next use) + prefetch, in the harness"
                )
        self._d2h_free = 0.0
        self._h2d_free = 0.0
        self._busy_until: dict[str, float] = {}
        self._park_end: dict[str, float] = {}
        self._ready: dict[str, float] = {}
        self._prefetch_ready: dict[str, float] = {}
        self._count = {
            "parks": 0.0,
            "unparks": 0.0,
            "prefetches": 0.0,
            "prefetch_hits": 0.0,
            "bytes_moved": 0.0,
            "copy_seconds": 0.0,
            "compute_seconds": 0.0,
            "stall_seconds": 0.0,
        }

    def _record(self) -> SessionState:
        from sessionstate import StateObject, TensorCache

        objects: dict[str, StateObject] = {
            name: TensorCache().allocate().commit(torch.zeros(n, dtype=torch.uint8))
            for name, n in self._units.items()
        }
        attrs = {"kept": torch.zeros(self._attr_units, dtype=torch.uint8)}
        return SessionState(objects=objects, attrs=attrs if self._attr_units else {})

    def admit(self, session_id: str, now: float, /) -> None:
        """Store the new session's record (the manager may park others for it, or refuse).

        Its first step waits for the parks that made its room.
        """
        if self.manager is None:
            return
        self._events.clear()
        try:
            self.manager.put(session_id, self._record())
        finally:
            room = self._copies(now, {})
        self._ready[session_id] = room  # its memory is free once the parks for it are done

    def step(
        self, session_ids: Sequence[str], now: float, schedule: Sequence[str], /
    ) -> tuple[float, float]:
        """Make the sessions resident (timed on the copy lanes), then step them."""
        manager = self.manager
        ready = now
        expect = getattr(manager, "expect", None) if self.policy == "schedule" else None
        if manager is not None:
            order = [*session_ids, *[s for s in schedule if s not in session_ids]]
            if expect is not None:  # this step's sessions first, then what runs after
                expect(order, prefetch=False)
            for sid in session_ids:
                self._events.clear()
                hits = manager.stats().get("prefetch_hits", 0)
                try:
                    if self.policy == "schedule" and expect is None:
                        self._furthest_room(sid, order, keep=set(session_ids))
                    manager.get(sid)
                except SessionAdmissionError as exc:
                    self._copies(now, {})
                    raise SessionFailedError(sid, str(exc)) from None
                hit = manager.stats().get("prefetch_hits", 0) > hits
                self._copies(now, {sid: hit})
                ready = max(ready, self._ready.pop(sid, now))
        start = ready
        end = start + self.shape.step_time(len(session_ids))
        self._count["compute_seconds"] += end - start
        self._count["stall_seconds"] += start - now
        for sid in session_ids:
            self._busy_until[sid] = end
        if manager is not None and self.policy == "schedule":
            self._events.clear()
            if expect is not None:
                expect(list(schedule), prefetch=False)
                if schedule:
                    manager.prefetch(schedule[0], make_room=True)
            else:
                self._prefetch_head(schedule)
            self._copies(now, {})
        return start, end

    def _prefetch_head(self, schedule: Sequence[str]) -> None:
        # Until `expect` lands: what it promises, through public calls, for the next session
        # only. If it is parked, park the resident session used furthest in the schedule
        # (Belady; `park_until` keeping every other session) until it fits, then `prefetch`
        # it (``make_room=False``: the room is made). Not further ahead: in a round robin,
        # parking now for a later session parks one the optimal order keeps (every session
        # was swapped at every step when we tried).
        if not schedule:
            return
        manager = self.manager
        assert manager is not None
        head = schedule[0]
        if not self._is_parked(head) or head in self._prefetch_ready:
            return
        if self._furthest_room(head, schedule, keep={head}):
            manager.prefetch(head)

    def _is_parked(self, sid: str) -> bool:
        manager = self.manager
        assert manager is not None
        record = manager.peek(sid)
        return record is not None and bool(record.parked)

    def _furthest_room(
        self,
        sid: str,
        schedule: Sequence[str],
        *,
        keep: set[str],
    ) -> bool:
        # Park resident sessions, the one used furthest in ``schedule`` first (never one in
        # ``keep``), until ``sid``'s parked bytes fit the
        # budget beside what is charged; whether they fit.
        manager = self.manager
        assert manager is not None
        if not self._is_parked(sid):
            return True
        stats = manager.stats()
        need = self._session_units
        budget = stats["max_bytes:cpu"]
        pending = sum(1 for s in self._prefetch_ready if s != sid) * self._swap_units
        free = budget - stats.get("nbytes:cpu", 0) - pending
        if free >= need - self._attr_units:
            return True
        rank = {s: i for i, s in enumerate(schedule)}
        held = [str(s) for s in manager.session_ids()]
        victims = [
            s
            for s in held
            if s not in keep
            and s != sid
            and s not in self._prefetch_ready
            and not self._is_parked(s)
        ]
        victims.sort(key=lambda s: -rank.get(s, len(schedule)))
        for victim in victims:
            others = [s for s in held if s != victim]
            calls = iter([False])  # asked before the first park only: one session parked
            manager.park_until(
                functools.partial(next, calls, True), frees=_any_storage, keep=others
            )
            free += self._swap_units
            if free >= need - self._attr_units:
                return True
        return False

    def finish(self, session_id: str, now: float, /) -> None:
        """Drop the session."""
        if self.manager is not None:
            self.manager.drop(session_id)
        for table in (self._busy_until, self._park_end, self._ready, self._prefetch_ready):
            table.pop(session_id, None)

    def counters(self) -> dict[str, float]:
        """Parks, unparks, prefetches, prefetch hits, bytes moved; copy, compute, stall seconds."""
        return dict(self._count)

    def _copy(self, lane: Literal["d2h", "h2d"], earliest: float, units: int) -> float:
        nbytes = units * SCALE
        seconds = nbytes / self.shape.bandwidth
        free = self._d2h_free if lane == "d2h" else self._h2d_free
        begin = max(free, earliest)
        end = begin + seconds
        if lane == "d2h":
            self._d2h_free = end
        else:
            self._h2d_free = end
        self._count["bytes_moved"] += nbytes
        self._count["copy_seconds"] += seconds
        return end

    def _copies(self, now: float, hits: dict[str, bool]) -> float:
        # The events of one manager call, as copies on the two lanes (see the module's text);
        # returns when the room its parks made is free.
        room = now
        for event in self._events:
            sid = str(event.session_id)
            if event.kind == "park":
                earliest = max(now, self._busy_until.get(sid, 0.0))
                end = self._copy("d2h", earliest, event.nbytes)
                self._park_end[sid] = end
                room = max(room, end)
                self._count["parks"] += 1
            elif event.kind == "prefetch":
                earliest = max(room, self._park_end.get(sid, 0.0))
                self._prefetch_ready[sid] = self._copy("h2d", earliest, event.nbytes)
                self._count["prefetches"] += 1
            elif event.kind == "unpark":
                self._count["unparks"] += 1
                landed = self._prefetch_ready.pop(sid, None)
                if hits.get(sid) and landed is not None:
                    self._count["prefetch_hits"] += 1
                    self._ready[sid] = landed
                else:
                    earliest = max(room, self._park_end.get(sid, 0.0))
                    self._ready[sid] = self._copy("h2d", earliest, event.nbytes)
        self._events.clear()
        return room


def _any_storage(entry: object) -> bool:
    return True


def describe(server: SimulatedServer) -> dict[str, Any]:
    """The simulated server's settings, for the output."""
    return {
        "policy": server.policy,
        "policy_label": POLICIES[server.policy],
        "schedule_api": server.schedule_api,
        "scale_bytes_per_unit": SCALE,
    }
