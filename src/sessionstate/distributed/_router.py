"""One idea, the driver's map of which worker owns each session, and moving that ownership.

Strict session affinity (every call for a session goes to its owner), live migration,
rebalancing and worker loss all read and change the one map, under one lock.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NoReturn

import attrs

from sessionstate._checks import describe, is_int
from sessionstate._errors import SessionStateLostError
from sessionstate.distributed._outcomes import (
    MigrationError,
    MigrationRecord,
    SessionRestoredError,
    WorkerTimeoutError,
)
from sessionstate.distributed._worker import (
    ImportAck,
    SessionPipeline,
    SessionWorker,
    StepReply,
    WorkerStats,
)

__all__ = ["MigrationError", "MigrationRecord", "Router", "SessionRestoredError"]


@attrs.define
class _Session:
    owner: str
    epoch: int
    steps: int = 0  # steps its record holds: counted when a step's reply arrives
    snapshot_every: int | None = None
    snapshot: Any = None  # ObjectRef of the latest snapshot's bytes, never fetched here
    snapshot_steps: int = 0
    pending: Any = None  # (reply ref, snapshot ref, worker) of a step that timed out
    lock: threading.Lock = attrs.field(factory=threading.Lock)


class Router:
    """Routes every call for a session to the one worker that owns it, and moves sessions.

    **Affinity.** A session is owned by exactly one worker; every call for it goes there,
    and there is no fallback. **Placement.** A new session goes to the live worker with the
    fewest resident bytes as last reported (each step's reply carries its worker's total,
    from the ledger its budget checks), ties to the worker owning fewer sessions, then to the
    lower index; a worker that reported no room (at its session cap, or at its byte budget on
    a device) is passed over while another has room.
    **Fencing.** Every session has an epoch (`epoch`) that changes when it begins, migrates
    or is restored; every operation sent to a worker carries it, and a worker refuses one
    whose epoch is not the session's current one there, so a late message for an earlier
    owner or an earlier life of the session is never applied.
    **Migration** (`migrate`): the source exports the record's bytes into Ray's object store
    and keeps the record (refusing steps at the old epoch), the destination imports them at a
    new epoch and acknowledges with their digest; once the digest matches, ownership
    switches, and then the source drops its copy. A failure before the switch (a timeout
    included) drops the destination's copy and leaves the source the owner with its record
    intact; calls for the session wait until the migration ends. **Timeouts**: a call that
    takes longer than ``timeout`` raises `WorkerTimeoutError`; a step is counted when it
    completes, so `steps` and `SessionRestoredError.steps_kept` stay exact.
    **Worker loss**: calls for a lost worker's sessions raise
    `SessionStateLostError`, unless the session snapshots periodically
    (`set_snapshot_every`): then it is restored on another worker and the next call raises
    `SessionRestoredError` saying how many steps were lost. Losing the last live worker
    loses every session, each with its own `SessionStateLostError`.

    Ray must be initialised first (`init_local_ray`, or ``ray.init(address=...)``).

    Args:
        factory: Builds each worker's pipeline, in the worker's process (it is pickled).
        workers: Number of worker actors.
        worker_class: The worker implementation (a `SessionWorker` subclass).
        num_threads: Torch threads per worker process.
        timeout: Seconds every remote call may take before `ray.get` gives up.
        actor_options: Extra Ray actor options (resources, placement, runtime env).

    >>> from sessionstate.distributed import DreamZeroFactory, Router, init_local_ray
    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> from sessionstate.models.dreamzero.episode import scripted_episode
    >>> _ = init_local_ray()
    >>> router = Router(DreamZeroFactory(preset="tiny"), workers=2)
    >>> cfg = DreamZeroConfig.preset("tiny")
    >>> for sid, obs in scripted_episode(cfg, steps=1, sessions=2, seed=0):
    ...     out = router.step(sid, obs)
    >>> router.owners()
    {'session-1': 'worker-0', 'session-0': 'worker-1'}
    >>> router.migrate("session-0", "worker-0").destination
    'worker-0'
    >>> sorted(router.stats()["worker-0"].nbytes_by_session)
    ['session-0', 'session-1']
    >>> [m.session_id for m in router.rebalance(tolerance=0.0)]
    ['session-0']
    >>> router.shutdown()
    >>> import ray; ray.shutdown()
    """

    def __init__(
        self,
        factory: Callable[[], SessionPipeline],
        *,
        workers: int = 2,
        worker_class: type[SessionWorker] = SessionWorker,
        num_threads: int | None = 1,
        timeout: float = 120.0,
        actor_options: dict[str, Any] | None = None,
    ) -> None:
        import ray

        if not is_int(workers) or workers <= 0:
            msg = f"`workers` must be a positive int, got {describe(workers)}."
            raise ValueError(msg)
        if not ray.is_initialized():
            msg = (
                "Ray is not initialised; call `sessionstate.distributed.init_local_ray()` for "
                "a local cluster, or `ray.init(address=...)` to join one, before `Router`."
            )
            raise RuntimeError(msg)
        self.timeout = timeout
        options = {"num_cpus": 0, "max_restarts": 0, **(actor_options or {})}
        actor = ray.remote(worker_class).options(**options)
        self._handles: dict[str, Any] = {}
        for i in range(workers):
            name = f"worker-{i}"
            self._handles[name] = actor.remote(name, factory, num_threads=num_threads)
        self._lock = threading.RLock()
        self._sessions: dict[Hashable, _Session] = {}
        self._epoch_counter = itertools.count(1)  # one sequence for all: an epoch is never reused
        self._reported: dict[str, int] = dict.fromkeys(self._handles, 0)
        self._room: dict[str, bool] = dict.fromkeys(self._handles, True)
        self._dead: set[str] = set()
        self._lost: dict[Hashable, str] = {}  # session -> the message saying how it was lost
        # Sessions forked from one another and not parted since: each member maps to its
        # family's one set (what they share lives on one worker; `rebalance` moves it whole).
        self._families: dict[Hashable, set[Hashable]] = {}
        self._notices: dict[Hashable, SessionRestoredError] = {}
        self.migrations: list[MigrationRecord] = []
        # Surface a failing factory here, not at the first step.
        for name, handle in self._handles.items():
            try:
                self._get(handle.stats.remote(), name, "stats")
            except _WorkerLostError as lost:
                raise lost.error from None

    # -- queries ---------------------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        """Names of the live workers, in index order."""
        return [name for name in self._handles if name not in self._dead]

    def handle(self, worker: str) -> Any:
        """The Ray actor handle of ``worker`` (to inspect it, or to `ray.kill` it in a drill)."""
        return self._handles[self._check_worker(worker)]

    def owners(self) -> dict[Hashable, str]:
        """Session id -> owning worker, for every live session on a live worker.

        In order of first call. A session whose worker was lost is not listed (it was lost,
        or restored elsewhere and listed there).
        """
        with self._lock:
            return {sid: s.owner for sid, s in self._sessions.items() if s.owner not in self._dead}

    def owner(self, session_id: Hashable) -> str:
        """The worker that owns ``session_id``.

        Raises:
            SessionStateLostError: if the router knows no live session by that id.
        """
        with self._lock:
            return self._require(session_id).owner

    def epoch(self, session_id: Hashable) -> int:
        """The epoch of ``session_id``: it changes when the session begins, migrates or is restored.

        Every operation the router sends a worker carries it, and a worker refuses one whose
        epoch is not the one it holds the session at (`StaleEpochError`).

        Raises:
            SessionStateLostError: if the router knows no live session by that id.
        """
        with self._lock:
            return self._require(session_id).epoch

    def steps(self, session_id: Hashable) -> int:
        """How many steps of ``session_id`` its record holds, as the router counted them.

        A step that timed out is counted once it completes; this waits for it first (up to
        the router's ``timeout``), so the count is exact.

        Raises:
            SessionStateLostError: if the router knows no live session by that id.
            WorkerTimeoutError: if a step that timed out is still running.
            SessionRestoredError: if the session's worker was lost while that step ran.
        """
        with self._lock:
            session = self._require(session_id)
        with session.lock:
            self._settle(session_id, session)
            with self._lock:
                return self._require(session_id).steps

    def stats(self) -> dict[str, WorkerStats]:
        """Every live worker's `WorkerStats`, by worker name."""
        out: dict[str, WorkerStats] = {}
        for name in self.workers:
            try:
                stats = self._get(self._handles[name].stats.remote(), name, "stats")
            except _WorkerLostError as lost:
                self._worker_lost(lost.worker)
                continue
            out[name] = stats
            with self._lock:
                self._reported[name] = stats.total_nbytes
                self._room[name] = stats.room
        return out

    # -- calls ---------------------------------------------------------------------------------

    def set_snapshot_every(self, session_id: Hashable, every: int | None) -> None:
        """Snapshot ``session_id`` after every ``every``-th step (None: never).

        A snapshot is the session's bytes, left in Ray's object store; if the session's
        worker is lost, the session is restored on another worker from the latest one.
        Setting it before the session's first step places the session as usual.
        """
        if every is not None and (not is_int(every) or every <= 0):
            msg = (
                f"`every` must be a positive int or None, got {describe(every)} "
                f"for session {session_id!r}."
            )
            raise ValueError(msg)
        with self._lock:
            self._session_for_call(session_id).snapshot_every = every

    def step(self, session_id: Hashable, inputs: Any) -> Any:
        """Run one step of ``session_id`` on the worker that owns it; returns the output.

        A new session is placed first (see the class docstring). Calls for one session run
        one at a time, in the order they take its lock; calls for different sessions run
        concurrently.

        Raises:
            SessionStateLostError: if the session's worker was lost and it had no snapshot
                (or its worker no longer holds it). Drop it with `drop` to start it again.
            SessionRestoredError: once, after the session was restored from a snapshot.
            WorkerTimeoutError: if the worker did not answer within ``timeout``. The step
                may still complete there; it is counted if it does, and the next call for
                the session waits for it first. Do not resend it before `steps` says it
                was not applied.
        """
        with self._lock:
            session = self._session_for_call(session_id)
        with session.lock:
            self._settle(session_id, session)
            with self._lock:
                notice = self._notices.pop(session_id, None)
                if notice is not None:
                    raise notice
                self._require(session_id)
                worker, epoch = session.owner, session.epoch
                every = session.snapshot_every
                snapshot = every is not None and (session.steps + 1) % every == 0
                create = session.steps == 0
            handle = self._handles[worker]
            if snapshot:
                reply_ref, snap_ref = handle.step_and_snapshot.options(num_returns=2).remote(
                    session_id, inputs, epoch=epoch, create=create
                )
            else:
                reply_ref = handle.step.remote(session_id, inputs, epoch=epoch, create=create)
                snap_ref = None
            try:
                reply: StepReply = self._get(reply_ref, worker, "step", session_id)
            except WorkerTimeoutError:
                with self._lock:
                    session.pending = (reply_ref, snap_ref, worker)
                raise
            except _WorkerLostError as lost:
                self._worker_lost(lost.worker)
                raise self._loss_error(session_id) from None
            self._count(session, worker, reply, snap_ref)
            return reply.output

    def drop(self, session_id: Hashable) -> bool:
        """End ``session_id`` on its worker (or forget a lost one); returns whether it was known.

        The drop goes to the owner at the session's epoch; a drop that times out still runs
        there, after any call for the session in flight.
        """
        with self._lock:
            session = self._sessions.get(session_id)
            lost = self._lost.pop(session_id, None) is not None
            self._notices.pop(session_id, None)
        if session is None:
            return lost
        with session.lock:
            with self._lock:
                # Forgotten first, so a worker loss found by the drop cannot restore it.
                self._sessions.pop(session_id, None)
                self._part(session_id)
                owner, epoch = session.owner, session.epoch
            if owner not in self._dead:
                try:
                    if self._get(
                        self._handles[owner].drop_session.remote(session_id, epoch=epoch),
                        owner,
                        "drop_session",
                        session_id,
                    ):
                        self._room[owner] = True  # one session fewer: it has room again
                except WorkerTimeoutError:
                    pass  # queued on the owner behind the session's calls; it runs in order
                except _WorkerLostError as lost:
                    self._worker_lost(lost.worker)
        return True

    def migrate(self, session_id: Hashable, destination: str) -> MigrationRecord:
        """Move ``session_id`` to ``destination``: export, import, acknowledge, switch, release.

        The record goes from the source to the destination through Ray's object store as a
        snapshot in parts (its storages as NumPy arrays, passed out of band: one copy in,
        read-only views out, one checked copy into the destination's tensors); this process
        only handles their reference and the digest of the header. The source keeps the
        record, and refuses steps for it, until the destination's acknowledgement matches
        the exported digest; then the owner and the epoch switch, and the source drops its
        copy (a drop that times out still runs there, and its copy is fenced meanwhile).

        Raises:
            MigrationError: if the export, the import or the acknowledgement fails; the
                message says where the session is (almost always: still on the source, with
                its record intact, and the destination holds no copy).
            ValueError: if ``destination`` is not a live worker or already owns the session.
            WorkerTimeoutError: if a step of the session that timed out is still running.
        """
        self._check_worker(destination)
        with self._lock:
            session = self._require(session_id)
        with session.lock:
            self._settle(session_id, session)
            with self._lock:
                self._require(session_id)
                source, epoch = session.owner, session.epoch
                if destination == source:
                    msg = (
                        f"Session {session_id!r} is already on {destination!r}; pick another "
                        f"destination among {self.workers}."
                    )
                    raise ValueError(msg)
                new_epoch = next(self._epoch_counter)
            start = time.perf_counter()
            src, dst = self._handles[source], self._handles[destination]
            stage = "export"
            try:
                data_ref, digest_ref = src.export_session.options(num_returns=2).remote(
                    session_id, epoch=epoch
                )
                expected = self._get(digest_ref, source, "export_session", session_id)
                stage = "import"
                ack: ImportAck = self._get(
                    dst.import_session.remote(session_id, data_ref, epoch=new_epoch),
                    destination,
                    "import_session",
                    session_id,
                )
                stage = "acknowledge"
                _check_ack(ack, expected, source, destination)
            except Exception as exc:
                self._abort([session_id], source, destination, stage, exc, [epoch], [new_epoch])
            # The acknowledgement is terminal: the destination holds the record at the new
            # epoch. Switch first; only then may the source let its copy go.
            with self._lock:
                session.owner, session.epoch = destination, new_epoch
                self._part(session_id)  # what it shared stays behind
                self._reported[source] = max(0, self._reported.get(source, 0) - ack.nbytes)
                record = MigrationRecord(
                    session_id, source, destination, ack.nbytes, time.perf_counter() - start
                )
                self.migrations.append(record)
            try:
                self._get(
                    src.drop_session.remote(session_id, epoch=epoch),
                    source,
                    "drop_session",
                    session_id,
                )
            except WorkerTimeoutError:
                pass  # it runs there in order; the copy is handed off and fenced until then
            except _WorkerLostError as lost:
                self._worker_lost(lost.worker)
            return record

    def fork(self, source_id: Hashable, /, *branch_ids: Hashable) -> None:
        """Branch ``source_id`` into new sessions ``branch_ids`` on the worker that owns it.

        The worker forks the session (its pipeline's ``fork``, else its manager's): the
        branches share the source's storages there, and each is a session of its own from
        then on, owned by the same worker at an epoch of its own, its steps counted from the
        source's. A branch takes the source's `set_snapshot_every` setting, and its first
        snapshot is its own (until then, losing the worker loses the branch). Move a family
        together with `migrate_many`, so that what it shares is sent once.

        Raises:
            SessionStateLostError: if the router knows no live session ``source_id``.
            ValueError: if no branch is named, or a branch id is known already or repeated.
            WorkerTimeoutError: if the worker did not answer; no branch is registered (drops
                for them are queued behind the fork, which may still run there).
        """
        if not branch_ids:
            msg = f"`fork({source_id!r})` names no branch; pass the new ids: `fork(source, 'b1')`."
            raise ValueError(msg)
        with self._lock:
            source = self._require(source_id)
        with source.lock:
            self._settle(source_id, source)
            with self._lock:
                self._require(source_id)
                known = [b for b in branch_ids if b in self._sessions or b in self._lost]
                if known or len(set(branch_ids)) != len(branch_ids):
                    msg = (
                        f"Cannot fork session {source_id!r} into {list(branch_ids)!r}: "
                        f"{known or 'an id named twice'} already known to this router. Name "
                        "new ids (`drop` a session to reuse its id)."
                    )
                    raise ValueError(msg)
                owner, epoch = source.owner, source.epoch
                branches = {
                    b: _Session(
                        owner,
                        next(self._epoch_counter),
                        steps=source.steps,
                        snapshot_every=source.snapshot_every,
                    )
                    for b in branch_ids
                }
                # Registered now and locked (fresh locks: never contended) until the fork
                # answers: a call for a branch meanwhile waits for it.
                for branch in branches.values():
                    branch.lock.acquire()
                self._sessions.update(branches)
            try:
                self._get(
                    self._handles[owner].fork_session.remote(
                        source_id,
                        list(branch_ids),
                        epoch=epoch,
                        epochs=[branch.epoch for branch in branches.values()],
                    ),
                    owner,
                    "fork_session",
                    source_id,
                )
                with self._lock:
                    members = self._families.get(source_id) or {source_id}
                    members.update(branch_ids)
                    for sid in members:
                        self._families[sid] = members
            except BaseException as exc:
                with self._lock:
                    for b in branches:
                        self._sessions.pop(b, None)
                if isinstance(exc, _WorkerLostError):
                    self._worker_lost(exc.worker)
                    raise self._loss_error(source_id) from None
                if isinstance(exc, WorkerTimeoutError):
                    # Queued behind the fork, which may still run there: no copy is left.
                    for b, branch in branches.items():
                        self._handles[owner].drop_session.remote(b, epoch=branch.epoch)
                raise
            finally:
                for branch in branches.values():
                    branch.lock.release()

    def migrate_many(self, session_ids: Sequence[Hashable], destination: str) -> MigrationRecord:
        """Move a family of sessions (a source and its forks) to ``destination`` together.

        As `migrate`, for all of them at once, in one payload: the owner exports the records
        as one snapshot in parts (a storage they share is one part, so the family costs about
        one session plus what each branch holds alone), the destination imports them
        together (`SessionStateManager.put_many`: all or none) with the sharing restored, each
        at a new epoch, and acknowledges the payload's digest; then every owner and epoch
        switches, and the source drops its copies. A failure at any stage undoes the import
        and leaves every session on the source with its record intact, as `migrate` does.

        Returns:
            One `MigrationRecord` for the family: its ``session_id`` is the tuple of ids, its
            ``nbytes`` the payload's.

        Raises:
            MigrationError: as `migrate`; the message says where the sessions are.
            ValueError: if ``destination`` is not a live worker or already owns them, the
                sessions are not all on one worker, or no id is given, or one twice.
            SessionStateLostError: if the router knows no live session by one of the ids.
            WorkerTimeoutError: if a step of one of them that timed out is still running.
        """
        ids = list(session_ids)
        if not ids or len(set(ids)) != len(ids):
            msg = f"`migrate_many` needs distinct session ids, got {ids!r}; name each session once."
            raise ValueError(msg)
        self._check_worker(destination)
        with self._lock:
            family = {sid: self._require(sid) for sid in ids}
            order = {sid: i for i, sid in enumerate(self._sessions)}
        with contextlib.ExitStack() as stack:
            # One lock order for every caller (the table's), so two families never deadlock.
            for sid in sorted(ids, key=order.__getitem__):
                stack.enter_context(family[sid].lock)
            for sid in ids:
                self._settle(sid, family[sid])
            with self._lock:
                for sid in ids:
                    self._require(sid)
                owners = {sid: s.owner for sid, s in family.items()}
                source = owners[ids[0]]
                if set(owners.values()) != {source}:
                    msg = (
                        f"Cannot migrate {ids!r} together: they are on several workers "
                        f"({owners!r}). Migrate a family from the one worker that holds it."
                    )
                    raise ValueError(msg)
                if destination == source:
                    msg = (
                        f"Sessions {ids!r} are already on {destination!r}; pick another "
                        f"destination among {self.workers}."
                    )
                    raise ValueError(msg)
                epochs = [family[sid].epoch for sid in ids]
                new_epochs = [next(self._epoch_counter) for _ in ids]
            start = time.perf_counter()
            src, dst = self._handles[source], self._handles[destination]
            what = tuple(ids)
            stage = "export"
            try:
                data_ref, digest_ref = src.export_family.options(num_returns=2).remote(
                    ids, epochs=epochs
                )
                expected = self._get(digest_ref, source, "export_family", what)
                stage = "import"
                ack: ImportAck = self._get(
                    dst.import_family.remote(ids, data_ref, epochs=new_epochs),
                    destination,
                    "import_family",
                    what,
                )
                stage = "acknowledge"
                _check_ack(ack, expected, source, destination)
            except Exception as exc:
                self._abort(ids, source, destination, stage, exc, epochs, new_epochs)
            with self._lock:
                for sid, new_epoch in zip(ids, new_epochs, strict=True):
                    family[sid].owner, family[sid].epoch = destination, new_epoch
                self._part(*ids)  # a family moved whole stays one; a part of one, its own
                self._reported[source] = max(0, self._reported.get(source, 0) - ack.nbytes)
                record = MigrationRecord(
                    what, source, destination, ack.nbytes, time.perf_counter() - start
                )
                self.migrations.append(record)
            for sid, epoch in zip(ids, epochs, strict=True):
                try:
                    self._get(
                        src.drop_session.remote(sid, epoch=epoch), source, "drop_session", sid
                    )
                except WorkerTimeoutError:
                    pass  # it runs there in order; the copy is handed off and fenced until then
                except _WorkerLostError as lost:
                    self._worker_lost(lost.worker)
                    break
            return record

    def rebalance(self, *, tolerance: float = 0.1) -> list[MigrationRecord]:
        """Migrate sessions until resident bytes per worker are within ``tolerance``.

        Repeatedly moves, from the heaviest worker to the lightest, the session whose move
        leaves the two closest, while a move narrows their gap. A family of forks
        (`families`) moves whole, with `migrate_many`, weighed by what it holds there (each
        member's own bytes and their shared history once): never one member apart from what
        it shares. On return the spread (heaviest minus lightest worker's resident bytes) is
        at most ``tolerance`` times the mean, or no session or family can narrow it: then it
        is at most the smallest of them on the heaviest worker.

        Returns:
            The migrations made, in order.
        """
        if not tolerance >= 0.0:
            msg = f"`tolerance` must be a non-negative fraction of the mean, got {tolerance!r}."
            raise ValueError(msg)
        done: list[MigrationRecord] = []
        for _ in range(1 + 2 * len(self.owners()) * len(self._handles)):
            stats = self.stats()
            if len(stats) < 2:
                break
            totals = {name: s.total_nbytes for name, s in stats.items()}
            heavy = max(totals, key=lambda n: (totals[n], n))
            light = min(totals, key=lambda n: (totals[n], n))
            gap = totals[heavy] - totals[light]
            if gap <= tolerance * sum(totals.values()) / len(totals):
                break
            units = self._units(heavy, stats[heavy].nbytes_by_session)
            candidates = {unit: n for unit, n in units.items() if 0 < n < gap}
            if not candidates:
                break
            unit = min(candidates, key=lambda u: (abs(gap - 2 * candidates[u]), repr(u)))
            if len(unit) == 1:
                done.append(self.migrate(unit[0], light))
            else:
                done.append(self.migrate_many(list(unit), light))
        return done

    def _units(
        self, worker: str, nbytes_by_session: dict[Hashable, int]
    ) -> dict[tuple[Hashable, ...], int]:
        # What `rebalance` may move from `worker`: each family whole, each other session on
        # its own, with the bytes moving it frees there. A family's: what each member holds
        # alone, and the largest part a member shares (their common history) once.
        with self._lock:
            families = {
                id(f): f
                for sid in nbytes_by_session
                if (f := self._families.get(sid))
                and all(m in self._sessions and self._sessions[m].owner == worker for m in f)
            }
        units: dict[tuple[Hashable, ...], int] = {}
        grouped = {sid for f in families.values() for sid in f}
        for sid, n in nbytes_by_session.items():
            if sid not in grouped:
                units[(sid,)] = n
        handle = self._handles[worker]
        for family in families.values():
            members = tuple(sorted(family, key=repr))
            stats = [
                self._get(handle.session_stats.remote(sid), worker, "session_stats", sid)
                for sid in members
            ]
            alone = [sum(s["nbytes"].values()) - sum(s["nbytes_shared"].values()) for s in stats]
            shared = max(sum(s["nbytes_shared"].values()) for s in stats)
            units[members] = sum(alone) + shared
        return units

    def shutdown(self) -> None:
        """Kill every worker actor; the router cannot be used afterwards."""
        import ray

        for name, handle in self._handles.items():
            if name not in self._dead:
                ray.kill(handle)
            self._dead.add(name)

    # -- internals -----------------------------------------------------------------------------

    def _get(
        self, ref: Any, worker: str, operation: str, session_id: Hashable | None = None
    ) -> Any:
        import ray.exceptions

        try:
            return ray.get(ref, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            what = f"`{operation}`" + ("" if session_id is None else f" for {session_id!r}")
            msg = (
                f"Worker {worker!r} did not answer {what} within {self.timeout:g} s (the "
                "router's `timeout`); the call may still be running there. A step is counted "
                "only if it completes: the next call for the session waits for it first, and "
                "`Router.steps` reports the steps applied. Raise `timeout` if calls take "
                "this long."
            )
            raise WorkerTimeoutError(
                msg,
                session_id=session_id,
                worker=worker,
                operation=operation,
                timeout=self.timeout,
            ) from None
        except ray.exceptions.RayActorError as exc:
            raise _WorkerLostError(worker, exc) from exc

    def _settle(self, session_id: Hashable, session: _Session) -> None:
        """Wait for a step of the session that timed out, and count it if it completed."""
        if session.pending is None:
            return
        reply_ref, snap_ref, worker = session.pending
        try:
            reply = self._get(reply_ref, worker, "step", session_id)
        except _WorkerLostError as lost:
            session.pending = None
            self._worker_lost(lost.worker)
            raise self._loss_error(session_id) from None
        except WorkerTimeoutError:
            raise
        except Exception:  # the step failed on the worker: it stored nothing, so count nothing
            session.pending = None
            return
        session.pending = None
        self._count(session, worker, reply, snap_ref)

    def _count(self, session: _Session, worker: str, reply: StepReply, snap_ref: Any) -> None:
        with self._lock:
            session.steps += 1
            if snap_ref is not None:
                session.snapshot, session.snapshot_steps = snap_ref, session.steps
            self._reported[worker] = reply.resident_nbytes
            self._room[worker] = reply.room

    def _check_worker(self, worker: str) -> str:
        if worker not in self._handles or worker in self._dead:
            msg = (
                f"{describe(worker)} is not a live worker of this router; "
                f"the live workers are {self.workers}."
            )
            raise ValueError(msg)
        return worker

    def _session_for_call(self, session_id: Hashable) -> _Session:
        session = self._sessions.get(session_id)
        if session is None and session_id not in self._lost:
            session = _Session(self._place(), next(self._epoch_counter))
            self._sessions[session_id] = session
        if session is None:
            raise self._loss_error(session_id)
        return session

    def _require(self, session_id: Hashable) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise self._loss_error(session_id)
        return session

    def _loss_error(self, session_id: Hashable) -> Exception:
        """Why ``session_id`` cannot be called: its restore notice, or how it was lost."""
        with self._lock:
            notice = self._notices.pop(session_id, None)
            if notice is not None:
                return notice
            lost = self._lost.get(session_id)
            if lost is not None:
                return SessionStateLostError(lost)
            msg = (
                f"Session {session_id!r} is not known to this router; start it with `step`. "
                f"Known sessions: {sorted(self._sessions, key=repr)}."
            )
            return SessionStateLostError(msg)

    def _place(self) -> str:
        live = self.workers
        if not live:
            msg = "Every worker of this router is lost; start a new `Router`."
            raise RuntimeError(msg)
        owned = {name: 0 for name in live}
        for s in self._sessions.values():
            if s.owner in owned:
                owned[s.owner] += 1
        roomy = [name for name in live if self._room.get(name, True)] or live
        return min(roomy, key=lambda n: (self._reported.get(n, 0), owned[n], live.index(n)))

    def _abort(
        self,
        family: list[Hashable],
        source: str,
        destination: str,
        stage: str,
        exc: Exception,
        epochs: list[int],
        new_epochs: list[int],
    ) -> NoReturn:
        # A failed migration of `family` (one session, or a family moved together): undo the
        # import, end the hand-off, settle lost workers, and say where the sessions are.
        with self._lock:
            sessions = [self._sessions.get(sid) for sid in family]
            plain = all(s is None or s.snapshot_every is None for s in sessions)
        dead: set[str] = {exc.worker} if isinstance(exc, _WorkerLostError) else set()
        for session_id, epoch, new_epoch in zip(family, epochs, new_epochs, strict=True):
            if stage != "export" and destination not in dead:
                # Undo an import that completed (or will: the drop runs after it, in order).
                try:
                    self._get(
                        self._handles[destination].drop_session.remote(session_id, epoch=new_epoch),
                        destination,
                        "drop_session",
                        session_id,
                    )
                except _WorkerLostError:
                    dead.add(destination)
                except Exception:
                    pass  # a copy left behind is fenced: no call the router sends can reach it
            if source not in dead:
                # End the hand-off; the source is then known alive (or merely slow: the
                # reclaim runs there before any later call for the session).
                try:
                    self._get(
                        self._handles[source].reclaim_session.remote(session_id, epoch=epoch),
                        source,
                        "reclaim_session",
                        session_id,
                    )
                except _WorkerLostError:
                    dead.add(source)
                except WorkerTimeoutError:
                    pass
        for worker in sorted(dead):
            self._worker_lost(worker)
        if isinstance(exc, _WorkerLostError):
            cause: BaseException | None = exc.error
            what = f"worker {exc.worker!r} died"
        elif isinstance(exc, (WorkerTimeoutError, _DigestMismatchError)):
            cause = None
            what = (
                str(exc)
                if isinstance(exc, _DigestMismatchError)
                else f"{exc.worker!r} did not answer `{exc.operation}` within {exc.timeout:g} s"
            )
        else:
            cause = getattr(exc, "cause", None) or exc  # the worker's own error, not Ray's wrapper
            what = f"{type(cause).__name__}: {cause}"
        if len(family) == 1:
            subject = f"session {family[0]!r}"
            outcome = self._outcome(family[0], source, source in dead, plain)
        else:
            subject = f"the family {family!r}"
            outcome = self._family_outcome(family, source, source in dead)
        msg = (
            f"Migrating {subject} from {source!r} to {destination!r} failed at the {stage} "
            f"stage ({what}); {outcome}"
        )
        raise MigrationError(msg) from cause if cause is not None else exc

    def _outcome(self, session_id: Hashable, source: str, lost: bool, plain: bool) -> str:
        # Where a session is after its failed migration.
        if not lost:
            return (
                f"the session stays on {source!r} with its record intact. Retry, or pick "
                "another destination."
            )
        with self._lock:
            notice = self._notices.get(session_id)
        if notice is not None:
            return (
                f"{source!r} was lost, and the session was restored on "
                f"{notice.restored_on!r} from its snapshot after step {notice.steps_kept}; "
                "the next call for it raises `SessionRestoredError`."
            )
        return (
            f"{source!r} was lost, and the session with it; the next call for it "
            "raises `SessionStateLostError`, saying why. Call `drop` on the router to "
            "start it again"
            + (", or set `set_snapshot_every` to survive a worker loss." if plain else ".")
        )

    def _family_outcome(self, family: list[Hashable], source: str, lost: bool) -> str:
        # Where a family's sessions are after their failed migration.
        if not lost:
            return (
                f"the sessions stay on {source!r} with their records intact. Retry, or pick "
                "another destination."
            )
        with self._lock:
            restored = [sid for sid in family if sid in self._notices]
        gone = [sid for sid in family if sid not in restored]
        parts = []
        if restored:
            parts.append(
                f"{restored!r} were restored from their snapshots (the next call for each "
                "raises `SessionRestoredError`)"
            )
        if gone:
            parts.append(
                f"{gone!r} were lost with it (the next call for each raises "
                "`SessionStateLostError`; call `drop` on the router to start them again)"
            )
        return f"{source!r} was lost: " + "; ".join(parts) + "."

    def _worker_lost(self, worker: str) -> None:
        with self._lock:
            if worker in self._dead:
                return
            self._dead.add(worker)
            self._reported.pop(worker, None)
            orphans = [sid for sid, s in self._sessions.items() if s.owner == worker]
            for sid in orphans:
                session = self._sessions[sid]
                session.pending = None  # its outcome died with the worker; the snapshot is exact
                if session.snapshot_every is None or (session.snapshot is None and session.steps):
                    self._lose(
                        sid,
                        f"Session {sid!r} was lost with worker {worker!r} (the worker died and "
                        "the session had no snapshot); its state is gone. Call `drop` on the "
                        "router to start it again, or set `set_snapshot_every` to survive a "
                        "worker loss.",
                    )
                    continue
                self._restore(sid, session, worker)
                # Restored alone, from its own snapshot: it shares nothing with its family.
                self._part(sid)

    def _lose(self, session_id: Hashable, msg: str) -> None:
        del self._sessions[session_id]
        self._lost[session_id] = msg
        self._part(session_id)

    def _part(self, *session_ids: Hashable) -> None:
        # The sessions leave their families (under the lock); the moved ones of one family,
        # if several, stay a family of their own.
        moved = set(session_ids)
        for family in {id(f): f for sid in moved if (f := self._families.get(sid))}.values():
            leaving = family & moved
            family -= leaving
            for rest in (family, leaving):
                for sid in rest:
                    if len(rest) > 1 and rest is leaving:
                        self._families[sid] = leaving
                    elif len(rest) <= 1:
                        self._families.pop(sid, None)

    def families(self) -> list[set[Hashable]]:
        """The families of sessions: each a set of sessions forked from one another (by
        `fork`) and neither dropped, lost, restored nor moved apart since; each lives on one
        worker. A member restored after its worker was lost leaves its family: it comes back
        from its own snapshot, sharing nothing.

        `rebalance` moves a family whole; `migrate` of one member parts it from the others.
        """
        with self._lock:
            return [set(f) for f in {id(f): f for f in self._families.values()}.values()]

    def _restore(self, session_id: Hashable, session: _Session, worker: str) -> None:
        while self.workers:
            target = self._place()
            epoch = next(self._epoch_counter)
            if session.snapshot is not None:
                try:
                    self._get(
                        self._handles[target].import_session.remote(
                            session_id, session.snapshot, epoch=epoch
                        ),
                        target,
                        "import_session",
                        session_id,
                    )
                except _WorkerLostError as died:
                    self._worker_lost(died.worker)
                    continue
                except WorkerTimeoutError:
                    pass  # the import runs there before any later call for the session
                except Exception as exc:
                    cause = getattr(exc, "cause", None) or exc
                    self._lose(
                        session_id,
                        f"Session {session_id!r} was lost with worker {worker!r} (the worker "
                        f"died, and restoring its snapshot on {target!r} failed: "
                        f"{type(cause).__name__}: {cause}); its state is gone. Call `drop` on "
                        "the router to start it again.",
                    )
                    return
            break
        else:
            self._lose(
                session_id,
                f"Session {session_id!r} was lost with worker {worker!r} (the worker died, and "
                "no live worker was left to restore its snapshot on); its state is gone. "
                "Every worker of this router is lost: start a new `Router`.",
            )
            return
        lost = session.steps - session.snapshot_steps
        session.owner, session.epoch, session.steps = target, epoch, session.snapshot_steps
        msg = (
            f"Session {session_id!r} was lost with worker {worker!r} and restored on "
            f"{target!r} from its snapshot after step {session.snapshot_steps}; {lost} steps "
            f"were lost. This call did not run: resend the inputs from step "
            f"{session.snapshot_steps + 1} on."
        )
        self._notices[session_id] = SessionRestoredError(
            msg,
            session_id=session_id,
            worker=worker,
            restored_on=target,
            steps_lost=lost,
            steps_kept=session.snapshot_steps,
        )


def _check_ack(ack: ImportAck, expected: str, source: str, destination: str) -> None:
    # The migration's terminal check: the destination stored the bytes the source exported.
    if ack.digest != expected:
        msg = (
            f"{destination!r} acknowledged digest {ack.digest[:12]}, "
            f"{source!r} exported {expected[:12]}"
        )
        raise _DigestMismatchError(msg)


class _WorkerLostError(Exception):
    """A worker died during a call (internal: the router settles its sessions, then reports)."""

    def __init__(self, worker: str, error: BaseException) -> None:
        super().__init__(worker)
        self.worker = worker
        self.error = error


class _DigestMismatchError(Exception):
    """A destination acknowledged other bytes than the source exported (internal)."""
