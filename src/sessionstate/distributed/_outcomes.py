"""What the router reports besides replies: its two errors and the record of a migration."""

from __future__ import annotations

from collections.abc import Hashable

import attrs

__all__ = ["MigrationError", "MigrationRecord", "SessionRestoredError"]


class MigrationError(RuntimeError):
    """A migration failed; the source worker still owns the session, its record intact."""


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
