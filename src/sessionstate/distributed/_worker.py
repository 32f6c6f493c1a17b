"""The worker: one pipeline, one `SessionStateManager`, sessions stepped, exported, imported."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import attrs
import torch

from sessionstate._config import ENV_ENABLE, OmniDiffusionConfig
from sessionstate._errors import SessionStateLostError
from sessionstate._manager import SessionStateManager
from sessionstate._manager._events import SessionEvent
from sessionstate._storage import SnapshotParts, recorded_devices
from sessionstate.distributed._outcomes import StaleEpochError
from sessionstate.distributed._transport import (
    decode_family,
    decode_record,
    digest,
    encode_family,
    encode_record,
)

__all__ = [
    "DreamZeroFactory",
    "ImportAck",
    "SessionPipeline",
    "SessionWorker",
    "StepReply",
    "WorkerStats",
]


class SessionPipeline(Protocol):
    """What a worker needs from a model pipeline.

    ``forward(inputs, session_id)`` runs one step of the session against the record held by
    ``manager`` and stores the new record there only when the step succeeds (the DreamZero
    pipeline's managed path does exactly this).
    """

    @property
    def manager(self) -> SessionStateManager[Any] | None: ...

    def forward(self, inputs: Any, session_id: str, /) -> Any: ...


@attrs.frozen
class StepReply:
    """What a worker returns for one step: the output, its resident bytes and room after it.

    ``room`` says whether the worker can take one more session: below its session cap and
    below the budget (``max_bytes``) on every budgeted device.
    """

    output: Any
    worker: str
    resident_nbytes: int
    room: bool = True


@attrs.frozen
class ImportAck:
    """A destination's acknowledgement: the session is stored, and these bytes produced it.

    For a family imported together, ``session_id`` is the tuple of its ids.
    """

    session_id: Hashable
    worker: str
    digest: str
    nbytes: int


@attrs.frozen
class WorkerStats:
    """A worker's resident sessions and bytes, and how many calls it served.

    ``not_held`` counts continuation calls for a session the worker did not hold (each one
    raised `SessionStateLostError`); a router with strict affinity never causes one. The byte
    figures come from the worker manager's ledger, the one its budget checks:
    ``total_nbytes`` and ``nbytes_by_device`` are resident bytes (engine bytes included, each
    block once), ``engine_nbytes`` the engine's share of them, ``parked_nbytes`` what its park
    tiers hold. ``room`` says whether it can take one more session (below ``max_sessions``
    and below ``max_bytes`` on every budgeted device).
    """

    worker: str
    nbytes_by_session: dict[Hashable, int]
    total_nbytes: int
    steps: int
    not_held: int
    nbytes_by_device: dict[str, int] = attrs.field(factory=dict)
    parked_nbytes: int = 0
    engine_nbytes: int = 0
    sessions: int = 0
    max_sessions: int = 0
    max_bytes: dict[str, int] | None = None
    room: bool = True


@attrs.frozen
class DreamZeroFactory:
    """Builds the DreamZero pipeline on its managed path, in the worker's process.

    Args:
        preset: A `DreamZeroConfig` preset name, used when ``config`` is None.
        config: A deploy config; its ``model`` section picks the DreamZero settings.

    >>> pipe = DreamZeroFactory(preset="tiny")()
    >>> pipe.managed
    True
    """

    preset: str = "tiny"
    config: OmniDiffusionConfig | None = None

    def __call__(self) -> Any:
        """A new pipeline; the session-state manager is always on (it is how sessions move)."""
        from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline

        environ = dict(os.environ, **{ENV_ENABLE: "1"})
        if self.config is not None:
            return DreamZeroPipeline(self.config, environ=environ)
        return DreamZeroPipeline(DreamZeroConfig.preset(self.preset), environ=environ)


class SessionWorker:
    """Steps the sessions it holds; exports and imports them as bytes for migration.

    Plain Python: `Router` runs it as a Ray actor (``ray.remote(SessionWorker)``), and it runs
    in-process as well, which is how the example below uses it.

    **Fencing.** The worker holds each session at an epoch, set when the session begins here
    (the first `step`, with ``create=True``) or is imported; every operation carries the
    epoch its sender believes current, and one that does not match is refused with
    `StaleEpochError` and changes nothing. An export hands the session off: the worker keeps
    the record (its lease) but refuses further steps at that epoch until the migration ends,
    with `drop_session` (it completed) or `reclaim_session` (it failed).

    Args:
        name: The worker's name in messages and statistics.
        factory: Builds the pipeline, in the worker's own process.
        num_threads: Torch intra-op threads of the worker's process (None leaves torch's
            default). Pin the same count as a reference run to compare bit for bit.

    Raises:
        TypeError: if the pipeline has no session-state manager.

    >>> src = SessionWorker("w0", DreamZeroFactory(preset="tiny"))
    >>> dst = SessionWorker("w1", DreamZeroFactory(preset="tiny"))
    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> from sessionstate.models.dreamzero.episode import scripted_episode
    >>> (sid, obs), = scripted_episode(DreamZeroConfig.preset("tiny"), steps=1, sessions=1, seed=0)
    >>> reply = src.step(sid, obs, epoch=1, create=True)
    >>> data, sha = src.export_session(sid, epoch=1)
    >>> dst.import_session(sid, data, epoch=2).digest == sha, src.drop_session(sid, epoch=1)
    (True, True)
    >>> dst.stats().nbytes_by_session.keys(), src.stats().total_nbytes
    (dict_keys(['session-0']), 0)
    """

    def __init__(
        self,
        name: str,
        factory: Callable[[], SessionPipeline],
        *,
        num_threads: int | None = None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.name = name
        self.pipeline = factory()
        manager = self.pipeline.manager
        if not isinstance(manager, SessionStateManager):
            msg = (
                f"Worker {name!r}: the pipeline built by {factory!r} has no session-state "
                f"manager (`manager` is {manager!r}, {type(manager).__name__}); a worker can "
                "only hold and move sessions kept by a `SessionStateManager`. Build the "
                f"pipeline with the manager enabled ({ENV_ENABLE}=1)."
            )
            raise TypeError(msg)
        self.manager: SessionStateManager = manager
        self._epochs: dict[Hashable, int] = {}
        self._handed_off: set[Hashable] = set()
        self._steps = 0
        self._not_held = 0

    def step(self, session_id: str, inputs: Any, *, epoch: int, create: bool) -> StepReply:
        """Run one step of ``session_id`` at ``epoch``; ``create`` says whether it may begin it.

        A session begun here is held at ``epoch`` from then on.

        Raises:
            SessionStateLostError: if ``create`` is False and this worker does not hold the
                session (a continuation is never silently restarted from scratch).
            StaleEpochError: if the worker holds the session at another epoch, or has handed
                it off to a migration; nothing runs.

        >>> w = SessionWorker("w0", DreamZeroFactory(preset="tiny"))
        >>> w.step("s", None, epoch=1, create=False)
        Traceback (most recent call last):
        ...
        sessionstate._errors.SessionStateLostError: Worker 'w0' does not hold session 's'...
        """
        begin = self._held(session_id) is None and session_id not in self.manager
        if begin and not create:
            self._not_held += 1
            msg = (
                f"Worker {self.name!r} does not hold session {session_id!r} (evicted by its "
                "session cap, or routed here by mistake); its state is lost on this worker. "
                "Drop the session at the router and start it again."
            )
            raise SessionStateLostError(msg)
        if not begin:
            self._fence(session_id, epoch, "step", steps=True)
        output = self.pipeline.forward(inputs, session_id)
        if begin and session_id in self.manager:
            self._epochs[session_id] = epoch
        self._steps += 1
        stats = self.manager.stats()
        return StepReply(output, self.name, stats["total_nbytes"], self._room(stats))

    def step_and_snapshot(
        self, session_id: str, inputs: Any, *, epoch: int, create: bool
    ) -> tuple[StepReply, SnapshotParts]:
        """`step`, then the session's snapshot after it, in parts (for restoring it elsewhere).

        >>> w = SessionWorker("w0", DreamZeroFactory(preset="tiny"))
        >>> w.step_and_snapshot("s", None, epoch=1, create=False)
        Traceback (most recent call last):
        ...
        sessionstate._errors.SessionStateLostError: Worker 'w0' does not hold session 's'...
        """
        reply = self.step(session_id, inputs, epoch=epoch, create=create)
        return reply, encode_record(self.manager.require(session_id))

    def export_session(self, session_id: str, *, epoch: int) -> tuple[SnapshotParts, str]:
        """The session's latest record as a snapshot in parts, and its digest; it stays here.

        The parts' storages are views of the record's memory: Ray copies them once into its
        object store when this call returns.

        The session is handed off: this worker keeps its record, and refuses steps at
        ``epoch``, until `drop_session` or `reclaim_session` ends the migration.

        Raises:
            SessionStateLostError: if this worker does not hold the session.
            StaleEpochError: if the worker holds the session at another epoch.

        >>> SessionWorker("w0", DreamZeroFactory()).export_session("s", epoch=1)
        Traceback (most recent call last):
        ...
        sessionstate._errors.SessionStateLostError: Worker 'w0' cannot export session 's'...
        """
        if session_id not in self.manager:
            msg = (
                f"Worker {self.name!r} cannot export session {session_id!r}: it does not hold "
                "it. Ask the router which worker owns the session."
            )
            raise SessionStateLostError(msg)
        self._fence(session_id, epoch, "export_session", steps=False)
        start = time.perf_counter()
        # A record with parked objects travels resident: the bytes of its tier stay here. They
        # are read into host memory (no device memory, no pool block taken), and the parts
        # record the devices they came from.
        with recorded_devices():
            state = self.manager.peek(session_id, on_host=True)
            if state is None:  # dropped meanwhile
                msg = (
                    f"Worker {self.name!r} cannot export session {session_id!r}: it was "
                    "dropped while the export began. Ask the router which worker owns it."
                )
                raise SessionStateLostError(msg)
            data = encode_record(state)
        self._handed_off.add(session_id)
        sha = digest(data)
        self._migrated(session_id, data, "out", start)
        return data, sha

    def reclaim_session(self, session_id: str, *, epoch: int) -> bool:
        """End a failed migration's hand-off: steps at ``epoch`` run here again.

        Returns whether the worker holds the session at ``epoch`` (False: nothing changed).

        >>> SessionWorker("w0", DreamZeroFactory()).reclaim_session("s", epoch=1)
        False
        """
        if self._held(session_id) != epoch:
            return False
        self._handed_off.discard(session_id)
        return True

    def import_session(self, session_id: str, data: SnapshotParts, *, epoch: int) -> ImportAck:
        """Store the record in ``data`` as ``session_id`` at ``epoch``; the ack carries its digest.

        ``data`` may be read-only views of Ray's object store: each storage is copied once
        into the record's own memory and checked against the header as it is copied.

        Raises:
            ValueError: if this worker already holds the session (an import never overwrites).
            SnapshotError: if ``data`` is not an intact snapshot of a `SessionState` (a
                storage that fails its checksum, parts that do not match the header).

        >>> from sessionstate import SessionState
        >>> from sessionstate.distributed import encode_record
        >>> w = SessionWorker("w0", DreamZeroFactory())
        >>> w.import_session("s", encode_record(SessionState()), epoch=1).worker
        'w0'
        """
        if session_id in self.manager:
            msg = (
                f"Worker {self.name!r} already holds session {session_id!r}; an import never "
                "overwrites a live record. Drop it there first, or migrate to another worker."
            )
            raise ValueError(msg)
        start = time.perf_counter()
        self.manager.put(session_id, decode_record(data))
        self._epochs[session_id] = epoch
        self._handed_off.discard(session_id)
        ack = ImportAck(session_id, self.name, digest(data), data.nbytes)
        self._migrated(session_id, data, "in", start)
        return ack

    def fork_session(
        self, source_id: str, branch_ids: Sequence[str], *, epoch: int, epochs: Sequence[int]
    ) -> None:
        """Fork ``source_id`` (held at ``epoch``) into ``branch_ids``, held at ``epochs``.

        The pipeline's ``fork`` where it has one (a reference model's: it forks what the
        model keeps beside the record too), else the manager's: the branches share the
        source's storages, nothing copied.

        Raises:
            StaleEpochError: if the source is held at another epoch, or handed off to a
                migration; nothing changes.
            ValueError: as `SessionStateManager.fork` (a branch held already).

        >>> from sessionstate.models.dreamzero import DreamZeroConfig
        >>> from sessionstate.models.dreamzero.episode import scripted_episode
        >>> w = SessionWorker("w0", DreamZeroFactory(preset="tiny"))
        >>> (sid, obs), = scripted_episode(DreamZeroConfig.preset("tiny"), steps=1, sessions=1, seed=0)
        >>> _ = w.step(sid, obs, epoch=1, create=True)
        >>> w.fork_session(sid, ["b"], epoch=1, epochs=[2]); w.epoch("b")
        2
        """  # noqa: E501 - a doctest line
        self._fence(source_id, epoch, "fork_session", steps=True)
        if len(epochs) != len(branch_ids):
            msg = (
                f"Worker {self.name!r}: `fork_session` got {len(branch_ids)} branches and "
                f"{len(epochs)} epochs; pass one epoch per branch."
            )
            raise ValueError(msg)
        # A model pipeline's fork does what the model needs beside the manager's.
        fork = getattr(self.pipeline, "fork", None) or self.manager.fork
        fork(source_id, *branch_ids)
        for branch_id, branch_epoch in zip(branch_ids, epochs, strict=True):
            self._epochs[branch_id] = branch_epoch

    def export_family(
        self, session_ids: Sequence[str], *, epochs: Sequence[int]
    ) -> tuple[SnapshotParts, str]:
        """The sessions' latest records as one snapshot in parts, and its digest; they stay here.

        As `export_session` for each (fenced at its epoch, handed off until `drop_session` or
        `reclaim_session` ends its migration), except that what the sessions share (a fork's
        history, parked bytes they hold together) is one part, sent once.

        Raises:
            SessionStateLostError: if this worker does not hold one of them (none is handed
                off).
            StaleEpochError: if one is held at another epoch (none is handed off).

        >>> SessionWorker("w0", DreamZeroFactory()).export_family(["s"], epochs=[1])
        Traceback (most recent call last):
        ...
        sessionstate._errors.SessionStateLostError: Worker 'w0' cannot export session 's'...
        """
        ids = list(session_ids)
        for session_id, epoch in zip(ids, epochs, strict=True):
            if session_id not in self.manager:
                msg = (
                    f"Worker {self.name!r} cannot export session {session_id!r}: it does not "
                    "hold it. Ask the router which worker owns the session."
                )
                raise SessionStateLostError(msg)
            self._fence(session_id, epoch, "export_family", steps=False)
        start = time.perf_counter()
        with recorded_devices():  # parked bytes travel resident, read where they lie
            data = encode_family(self.manager.peek_many(ids))
        self._handed_off.update(ids)
        sha = digest(data)
        self._migrated(tuple(ids), data, "out", start)
        return data, sha

    def import_family(
        self, session_ids: Sequence[str], data: SnapshotParts, *, epochs: Sequence[int]
    ) -> ImportAck:
        """Store the family in ``data`` as ``session_ids`` at ``epochs``, sharing what it shared.

        All or nothing: the records are stored together (`SessionStateManager.put_many`), and
        a refusal stores none. The ack's ``session_id`` is the tuple of ids.

        Raises:
            ValueError: if this worker holds one of them already, or the ids are not one per
                record.
            SnapshotError: if ``data`` is not an intact snapshot of a family of records.
            SessionAdmissionError: if the manager cannot hold the family; none is stored.

        >>> from sessionstate import SessionState
        >>> from sessionstate.distributed import encode_family
        >>> w = SessionWorker("w0", DreamZeroFactory())
        >>> family = encode_family([SessionState(), SessionState()])
        >>> w.import_family(["a", "b"], family, epochs=[1, 2]).session_id, w.epoch("b")
        (('a', 'b'), 2)
        """
        ids = list(session_ids)
        held = [sid for sid in ids if sid in self.manager]
        if held:
            msg = (
                f"Worker {self.name!r} already holds sessions {held!r}; an import never "
                "overwrites a live record. Drop them there first, or migrate to another worker."
            )
            raise ValueError(msg)
        start = time.perf_counter()
        records = decode_family(data)
        if len(records) != len(ids) or len(epochs) != len(ids):
            msg = (
                f"Worker {self.name!r}: the family holds {len(records)} records, and "
                f"{len(ids)} ids with {len(epochs)} epochs were given; pass one id and one "
                "epoch per record."
            )
            raise ValueError(msg)
        self.manager.put_many(list(zip(ids, records, strict=True)))
        for session_id, epoch in zip(ids, epochs, strict=True):
            self._epochs[session_id] = epoch
            self._handed_off.discard(session_id)
        ack = ImportAck(tuple(ids), self.name, digest(data), data.nbytes)
        self._migrated(tuple(ids), data, "in", start)
        return ack

    def drop_session(self, session_id: str, *, epoch: int) -> bool:
        """Forget the session held at ``epoch``; returns whether it was held.

        Raises:
            StaleEpochError: if the worker holds the session at another epoch; nothing is
                dropped.

        >>> SessionWorker("w0", DreamZeroFactory()).drop_session("s", epoch=1)
        False
        """
        if session_id not in self.manager:
            self._held(session_id)  # forgets its epoch
            return False
        self._fence(session_id, epoch, "drop_session", steps=False)
        self._epochs.pop(session_id, None)
        self._handed_off.discard(session_id)
        return self.manager.drop(session_id)

    def epoch(self, session_id: str) -> int | None:
        """The epoch this worker holds ``session_id`` at, or None if it does not hold it.

        >>> SessionWorker("w0", DreamZeroFactory()).epoch("s") is None
        True
        """
        return self._held(session_id)

    def session_stats(self, session_id: str) -> dict[str, Any]:
        """The footprint of a session held here: `SessionStateManager.session_stats`.

        ``nbytes_shared`` and ``shared_with`` say what it shares with the sessions of its
        family held here (after `Router.migrate_many`, the sharing it had on its source).

        >>> from sessionstate import SessionState
        >>> from sessionstate.distributed import encode_record
        >>> w = SessionWorker("w0", DreamZeroFactory())
        >>> _ = w.import_session("s", encode_record(SessionState()), epoch=1)
        >>> w.session_stats("s")["shared_with"]
        []
        """
        return self.manager.session_stats(session_id)

    def stats(self) -> WorkerStats:
        """Resident bytes per session and in total, calls served, continuations not held.

        >>> SessionWorker("w0", DreamZeroFactory()).stats().total_nbytes
        0
        """
        by_session = {
            sid: sum(nbytes.values()) for sid, nbytes in self.manager.nbytes_by_session().items()
        }
        stats = self.manager.stats()
        return WorkerStats(
            self.name,
            by_session,
            stats["total_nbytes"],
            self._steps,
            self._not_held,
            nbytes_by_device=_per_device(stats, "nbytes:"),
            parked_nbytes=sum(_per_device(stats, "nbytes_parked:").values()),
            engine_nbytes=sum(_per_device(stats, "engine_nbytes:").values()),
            sessions=stats["sessions"],
            max_sessions=stats["max_sessions"],
            max_bytes=self.manager.max_bytes,
            room=self._room(stats),
        )

    def _migrated(
        self, session_id: Hashable, data: SnapshotParts, direction: str, start: float
    ) -> None:
        # An export or import is a "migrate" event of the manager: its metrics count and time it.
        seconds = time.perf_counter() - start
        event = SessionEvent("migrate", session_id, data.nbytes, seconds, direction=direction)
        self.manager.report(event)

    def _room(self, stats: dict[str, int]) -> bool:
        budget = self.manager.max_bytes or {}
        return stats["sessions"] < stats["max_sessions"] and all(
            stats.get(f"nbytes:{device}", 0) < limit for device, limit in budget.items()
        )

    def _held(self, session_id: Hashable) -> int | None:
        if session_id not in self.manager:  # never held, dropped, or evicted by the cap
            self._epochs.pop(session_id, None)
            self._handed_off.discard(session_id)
            return None
        return self._epochs.get(session_id)

    def _fence(self, session_id: Hashable, epoch: int, operation: str, *, steps: bool) -> None:
        held = self._held(session_id)
        if held == epoch and not (steps and session_id in self._handed_off):
            return
        if held == epoch:
            why = (
                "it exported the session at that epoch to a migration and holds the record "
                "only until the migration ends"
            )
        elif held is None:
            why = "it holds the session at no epoch (it was stored here outside the router)"
        else:
            why = (
                f"it holds the session at epoch {held} (the session began, moved or was "
                "restored since the call was sent)"
            )
        msg = (
            f"Worker {self.name!r} refused `{operation}` for session {session_id!r} at epoch "
            f"{epoch}: {why}, so nothing was applied. Send calls through the router, which "
            "knows each session's owner and current epoch."
        )
        raise StaleEpochError(msg, session_id=session_id, worker=self.name, sent=epoch, held=held)


def _per_device(stats: dict[str, int], prefix: str) -> dict[str, int]:
    return {key[len(prefix) :]: value for key, value in stats.items() if key.startswith(prefix)}
