"""The driver-side router: strict session affinity, live migration, rebalancing, worker loss."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from contextlib import suppress
from typing import Any

import attrs

from sessionstate._checks import describe, is_int
from sessionstate._errors import SessionStateLostError
from sessionstate.distributed._outcomes import (
    MigrationError,
    MigrationRecord,
    SessionRestoredError,
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
    steps: int = 0
    snapshot_every: int | None = None
    snapshot: Any = None  # ObjectRef of the latest snapshot's bytes, never fetched here
    snapshot_steps: int = 0
    lock: threading.Lock = attrs.field(factory=threading.Lock)


class Router:
    """Routes every call for a session to the one worker that owns it, and moves sessions.

    **Affinity.** A session is owned by exactly one worker; every call for it goes there,
    and there is no fallback. **Placement.** A new session goes to the live worker with the
    fewest resident bytes as last reported (each step's reply carries its worker's total),
    ties to the worker owning fewer sessions, then to the lower index.
    **Migration** (`migrate`): the source exports the record's bytes into Ray's object store,
    the destination imports them from there and acknowledges with their digest, then the
    source drops the session and ownership switches. A failure at any point before the
    switch leaves the source the owner with its record intact; calls for the session wait
    until the migration ends. **Worker loss**: calls for a lost worker's sessions raise
    `SessionStateLostError`, unless the session snapshots periodically
    (`set_snapshot_every`): then it is restored on another worker and the next call raises
    `SessionRestoredError` saying how many steps were lost.

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
        self._reported: dict[str, int] = dict.fromkeys(self._handles, 0)
        self._dead: set[str] = set()
        self._lost: dict[Hashable, str] = {}
        self._notices: dict[Hashable, SessionRestoredError] = {}
        self.migrations: list[MigrationRecord] = []
        # Surface a failing factory here, not at the first step.
        for name, handle in self._handles.items():
            self._get(handle.stats.remote(), name)

    # -- queries ---------------------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        """Names of the live workers, in index order."""
        return [name for name in self._handles if name not in self._dead]

    def handle(self, worker: str) -> Any:
        """The Ray actor handle of ``worker`` (to inspect it, or to `ray.kill` it in a drill)."""
        return self._handles[self._check_worker(worker)]

    def owners(self) -> dict[Hashable, str]:
        """Session id -> owning worker, for every live session, in order of first call."""
        with self._lock:
            return {sid: s.owner for sid, s in self._sessions.items()}

    def owner(self, session_id: Hashable) -> str:
        """The worker that owns ``session_id``.

        Raises:
            SessionStateLostError: if the router knows no live session by that id.
        """
        with self._lock:
            return self._require(session_id).owner

    def stats(self) -> dict[str, WorkerStats]:
        """Every live worker's `WorkerStats`, by worker name."""
        out: dict[str, WorkerStats] = {}
        for name in self.workers:
            try:
                stats = self._get(self._handles[name].stats.remote(), name)
            except _actor_error():
                self._worker_lost(name)
                continue
            out[name] = stats
            with self._lock:
                self._reported[name] = stats.total_nbytes
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
        """
        with self._lock:
            session = self._session_for_call(session_id)
        with session.lock:
            with self._lock:
                notice = self._notices.pop(session_id, None)
                if notice is not None:
                    raise notice
                self._require(session_id)
                worker = session.owner
                every = session.snapshot_every
                snapshot = every is not None and (session.steps + 1) % every == 0
                create = session.steps == 0
            handle = self._handles[worker]
            try:
                if snapshot:
                    reply_ref, snap_ref = handle.step_and_snapshot.options(num_returns=2).remote(
                        session_id, inputs, create=create
                    )
                else:
                    reply_ref, snap_ref = (
                        handle.step.remote(session_id, inputs, create=create),
                        None,
                    )
                reply: StepReply = self._get(reply_ref, worker)
            except _actor_error():
                self._worker_lost(worker)
                with self._lock:
                    notice = self._notices.pop(session_id, None)
                    if notice is not None:
                        raise notice from None
                    self._require(session_id)
                raise
            with self._lock:
                session.steps += 1
                if snap_ref is not None:
                    session.snapshot, session.snapshot_steps = snap_ref, session.steps
                self._reported[worker] = reply.resident_nbytes
            return reply.output

    def drop(self, session_id: Hashable) -> bool:
        """End ``session_id`` on its worker (or forget a lost one); returns whether it was known."""
        with self._lock:
            session = self._sessions.get(session_id)
            lost = self._lost.pop(session_id, None) is not None
            self._notices.pop(session_id, None)
        if session is None:
            return lost
        with session.lock:
            if session.owner not in self._dead:
                with suppress(*_actor_error()):
                    self._get(
                        self._handles[session.owner].drop_session.remote(session_id), session.owner
                    )
            with self._lock:
                self._sessions.pop(session_id, None)
        return True

    def migrate(self, session_id: Hashable, destination: str) -> MigrationRecord:
        """Move ``session_id`` to ``destination``: export, import and acknowledge, drop, switch.

        The record's bytes go from the source to the destination through Ray's object
        store; this process only handles their reference and digest.

        Raises:
            MigrationError: if any stage fails; the source still owns the session then.
            ValueError: if ``destination`` is not a live worker or already owns the session.
        """
        self._check_worker(destination)
        with self._lock:
            session = self._require(session_id)
        with session.lock:
            with self._lock:
                self._require(session_id)
                source = session.owner
            if destination == source:
                msg = (
                    f"Session {session_id!r} is already on {destination!r}; pick another "
                    f"destination among {self.workers}."
                )
                raise ValueError(msg)
            start = time.perf_counter()
            src, dst = self._handles[source], self._handles[destination]
            stage = "export"
            try:
                data_ref, digest_ref = src.export_session.options(num_returns=2).remote(session_id)
                expected = self._get(digest_ref, source)  # the export is done; bytes stay put
                stage = "import"
                ack: ImportAck = self._get(
                    dst.import_session.remote(session_id, data_ref), destination
                )
                stage = "acknowledge"
                if ack.digest != expected:
                    msg = f"digest {ack.digest[:12]} imported, {expected[:12]} exported"
                    raise RuntimeError(msg)
                stage = "drop at the source"
                self._get(src.drop_session.remote(session_id), source)
            except Exception as exc:
                self._abort(session_id, source, destination, stage, exc)
            with self._lock:
                session.owner = destination
                self._reported[source] = max(0, self._reported[source] - ack.nbytes)
                record = MigrationRecord(
                    session_id, source, destination, ack.nbytes, time.perf_counter() - start
                )
                self.migrations.append(record)
            return record

    def rebalance(self, *, tolerance: float = 0.1) -> list[MigrationRecord]:
        """Migrate sessions until resident bytes per worker are within ``tolerance``.

        Repeatedly moves, from the heaviest worker to the lightest, the session whose move
        leaves the two closest, while a move narrows their gap. On return the spread
        (heaviest minus lightest worker's resident bytes) is at most ``tolerance`` times the
        mean, or no single session can narrow it: then it is at most the smallest session on
        the heaviest worker.

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
            candidates = {
                sid: n for sid, n in stats[heavy].nbytes_by_session.items() if 0 < n < gap
            }
            if not candidates:
                break
            sid = min(candidates, key=lambda s: (abs(gap - 2 * candidates[s]), repr(s)))
            done.append(self.migrate(sid, light))
        return done

    def shutdown(self) -> None:
        """Kill every worker actor; the router cannot be used afterwards."""
        import ray

        for name, handle in self._handles.items():
            if name not in self._dead:
                ray.kill(handle)
            self._dead.add(name)

    # -- internals -----------------------------------------------------------------------------

    def _get(self, ref: Any, worker: str) -> Any:
        import ray

        return ray.get(ref, timeout=self.timeout)

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
            session = _Session(self._place())
            self._sessions[session_id] = session
        if session is None:
            self._require(session_id)
        assert session is not None
        return session

    def _require(self, session_id: Hashable) -> _Session:
        session = self._sessions.get(session_id)
        if session is not None:
            return session
        worker = self._lost.get(session_id)
        if worker is not None:
            msg = (
                f"Session {session_id!r} was lost with worker {worker!r} (the worker died and "
                "the session had no snapshot); its state is gone. Call `drop` on the router "
                "to start it again, or set `set_snapshot_every` to survive a worker loss."
            )
        else:
            msg = (
                f"Session {session_id!r} is not known to this router; start it with `step`. "
                f"Known sessions: {sorted(self._sessions, key=repr)}."
            )
        raise SessionStateLostError(msg)

    def _place(self) -> str:
        live = self.workers
        if not live:
            msg = "Every worker of this router is lost; start a new `Router`."
            raise RuntimeError(msg)
        owned = {name: 0 for name in live}
        for s in self._sessions.values():
            if s.owner in owned:
                owned[s.owner] += 1
        return min(live, key=lambda n: (self._reported[n], owned[n], live.index(n)))

    def _abort(
        self, session_id: Hashable, source: str, destination: str, stage: str, exc: Exception
    ) -> None:
        # Undo a completed import, so the destination holds no second copy.
        with suppress(Exception):
            self._get(self._handles[destination].drop_session.remote(session_id), destination)
        if isinstance(exc, _actor_error()):
            for worker in (source, destination):
                if not self._alive(worker):
                    self._worker_lost(worker)
        cause = getattr(exc, "cause", None) or exc  # the worker's own error, not Ray's wrapper
        msg = (
            f"Migrating session {session_id!r} from {source!r} to {destination!r} failed at "
            f"the {stage} stage ({type(cause).__name__}: {cause}); the session stays on {source!r} "
            "with its record intact. Retry, or pick another destination."
        )
        raise MigrationError(msg) from exc

    def _alive(self, worker: str) -> bool:
        try:
            self._get(self._handles[worker].stats.remote(), worker)
        except _actor_error():
            return False
        return True

    def _worker_lost(self, worker: str) -> None:
        with self._lock:
            if worker in self._dead:
                return
            self._dead.add(worker)
            self._reported.pop(worker, None)
            orphans = [sid for sid, s in self._sessions.items() if s.owner == worker]
            for sid in orphans:
                session = self._sessions[sid]
                if session.snapshot_every is None or (session.snapshot is None and session.steps):
                    del self._sessions[sid]
                    self._lost[sid] = worker
                    continue
                self._restore(sid, session, worker)

    def _restore(self, session_id: Hashable, session: _Session, worker: str) -> None:
        target = self._place()
        lost = session.steps - session.snapshot_steps
        if session.snapshot is not None:
            try:
                self._get(
                    self._handles[target].import_session.remote(session_id, session.snapshot),
                    target,
                )
            except Exception:
                del self._sessions[session_id]
                self._lost[session_id] = worker
                return
        session.owner, session.steps = target, session.snapshot_steps
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


def _actor_error() -> tuple[type[Exception], ...]:
    import ray.exceptions

    return (ray.exceptions.RayActorError,)
