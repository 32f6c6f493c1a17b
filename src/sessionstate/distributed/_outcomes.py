"""What the router and its workers report besides replies: their errors and migration records."""

from __future__ import annotations

from collections.abc import Hashable

import attrs

__all__ = [
    "MigrationError",
    "MigrationRecord",
    "SessionRestoredError",
    "StaleEpochError",
    "WorkerTimeoutError",
]


class MigrationError(RuntimeError):
    """A migration failed; the message says where the session is now.

    Almost always the source still owns the session with its record intact. When the
    source itself was lost, the message says so, and whether the session was restored
    from its snapshot or lost with the worker.
    """


class StaleEpochError(RuntimeError):
    """A worker refused a session operation sent with an epoch that is not the session's.

    Every session carries an epoch that changes when it begins, migrates or is restored; a
    worker applies an operation only when it carries the epoch the worker holds the session
    at, so a late message for an earlier owner or an earlier life is never applied.
    ``held`` is None when the worker holds the session at no epoch it may act on.
    """

    def __init__(
        self, msg: str, *, session_id: Hashable, worker: str, sent: int, held: int | None
    ) -> None:
        super().__init__(msg)
        self.session_id = session_id
        self.worker = worker
        self.sent = sent
        self.held = held

    def __reduce__(self) -> tuple[object, ...]:
        # Ray ships a worker's exception to the driver by pickling it.
        return (_stale, (str(self), self.session_id, self.worker, self.sent, self.held))


def _stale(
    msg: str, session_id: Hashable, worker: str, sent: int, held: int | None
) -> StaleEpochError:
    return StaleEpochError(msg, session_id=session_id, worker=worker, sent=sent, held=held)


class WorkerTimeoutError(TimeoutError):
    """A worker did not answer within the router's ``timeout``; the call may still run there.

    The router keeps its bookkeeping exact: a timed-out step is counted if, and only if, it
    completes, which the next call for the session (or `Router.steps`) waits for first.
    """

    def __init__(
        self, msg: str, *, session_id: Hashable, worker: str, operation: str, timeout: float
    ) -> None:
        super().__init__(msg)
        self.session_id = session_id
        self.worker = worker
        self.operation = operation
        self.timeout = timeout


class SessionRestoredError(RuntimeError):
    """The session's worker was lost; the session was restored elsewhere from its snapshot.

    The call that raised did not run. ``steps_lost`` calls after the snapshot must be sent
    again (zero when the session snapshots every step); ``steps_kept`` is where it resumes.
    """

    def __init__(
        self, msg: str, *, session_id: Hashable, worker: str, restored_on: str, steps_lost: int,
        steps_kept: int,
    ) -> None:  # fmt: skip
        super().__init__(msg)
        self.session_id = session_id
        self.worker = worker
        self.restored_on = restored_on
        self.steps_lost = steps_lost
        self.steps_kept = steps_kept


@attrs.frozen
class MigrationRecord:
    """One completed migration: which session moved where, how many bytes, how long it took."""

    session_id: Hashable
    source: str
    destination: str
    nbytes: int
    seconds: float
