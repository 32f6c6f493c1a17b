"""The worker: one pipeline, one `SessionStateManager`, sessions stepped, exported, imported."""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import attrs
import torch

from sessionstate._config import ENV_ENABLE, OmniDiffusionConfig
from sessionstate._errors import SessionStateLostError
from sessionstate._manager import SessionStateManager
from sessionstate.distributed._transport import decode_record, digest, encode_record

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
    """What a worker returns for one step: the output and its own resident bytes after it."""

    output: Any
    worker: str
    resident_nbytes: int


@attrs.frozen
class ImportAck:
    """A destination's acknowledgement: the session is stored, and these bytes produced it."""

    session_id: str
    worker: str
    digest: str
    nbytes: int


@attrs.frozen
class WorkerStats:
    """A worker's resident sessions and bytes, and how many calls it served.

    ``not_held`` counts continuation calls for a session the worker did not hold (each one
    raised `SessionStateLostError`); a router with strict affinity never causes one.
    """

    worker: str
    nbytes_by_session: dict[Hashable, int]
    total_nbytes: int
    steps: int
    not_held: int


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
    >>> reply = src.step(sid, obs, create=True)
    >>> data, sha = src.export_session(sid)
    >>> dst.import_session(sid, data).digest == sha, src.drop_session(sid)
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
        self._steps = 0
        self._not_held = 0

    def step(self, session_id: str, inputs: Any, *, create: bool) -> StepReply:
        """Run one step of ``session_id``; ``create`` says whether it may start the session.

        Raises:
            SessionStateLostError: if ``create`` is False and this worker does not hold the
                session (a continuation is never silently restarted from scratch).

        >>> w = SessionWorker("w0", DreamZeroFactory(preset="tiny"))
        >>> w.step("s", None, create=False)
        Traceback (most recent call last):
        ...
        sessionstate._errors.SessionStateLostError: Worker 'w0' does not hold session 's'...
        """
        if not create and session_id not in self.manager:
            self._not_held += 1
            msg = (
                f"Worker {self.name!r} does not hold session {session_id!r} (evicted by its "
                "session cap, or routed here by mistake); its state is lost on this worker. "
                "Drop the session at the router and start it again."
            )
            raise SessionStateLostError(msg)
        output = self.pipeline.forward(inputs, session_id)
        self._steps += 1
        return StepReply(output, self.name, self.manager.stats()["total_nbytes"])

    def step_and_snapshot(
        self, session_id: str, inputs: Any, *, create: bool
    ) -> tuple[StepReply, bytes]:
        """`step`, then the session's bytes after it (for restoring it elsewhere).

        >>> w = SessionWorker("w0", DreamZeroFactory(preset="tiny"))
        >>> w.step_and_snapshot("s", None, create=False)
        Traceback (most recent call last):
        ...
        sessionstate._errors.SessionStateLostError: Worker 'w0' does not hold session 's'...
        """
        reply = self.step(session_id, inputs, create=create)
        return reply, encode_record(self.manager.require(session_id))

    def export_session(self, session_id: str) -> tuple[bytes, str]:
        """The bytes of the session's latest record and their digest; the record stays here.

        Raises:
            SessionStateLostError: if this worker does not hold the session.

        >>> SessionWorker("w0", DreamZeroFactory()).export_session("s")
        Traceback (most recent call last):
        ...
        sessionstate._errors.SessionStateLostError: Worker 'w0' cannot export session 's'...
        """
        state = self.manager.peek(session_id)
        if state is None:
            msg = (
                f"Worker {self.name!r} cannot export session {session_id!r}: it does not hold "
                "it. Ask the router which worker owns the session."
            )
            raise SessionStateLostError(msg)
        # A record with parked objects travels resident: the bytes of its tier stay here.
        data = encode_record(state.unpark())
        return data, digest(data)

    def import_session(self, session_id: str, data: bytes) -> ImportAck:
        """Store the record in ``data`` as ``session_id``; the acknowledgement carries its digest.

        Raises:
            ValueError: if this worker already holds the session (an import never overwrites).

        >>> from sessionstate import SessionState
        >>> from sessionstate.distributed import encode_record
        >>> w = SessionWorker("w0", DreamZeroFactory())
        >>> w.import_session("s", encode_record(SessionState())).worker
        'w0'
        """
        if session_id in self.manager:
            msg = (
                f"Worker {self.name!r} already holds session {session_id!r}; an import never "
                "overwrites a live record. Drop it there first, or migrate to another worker."
            )
            raise ValueError(msg)
        self.manager.put(session_id, decode_record(data))
        return ImportAck(session_id, self.name, digest(data), len(data))

    def drop_session(self, session_id: str) -> bool:
        """Forget the session; returns whether it was held.

        >>> SessionWorker("w0", DreamZeroFactory()).drop_session("s")
        False
        """
        return self.manager.drop(session_id)

    def stats(self) -> WorkerStats:
        """Resident bytes per session and in total, calls served, continuations not held.

        >>> SessionWorker("w0", DreamZeroFactory()).stats().total_nbytes
        0
        """
        by_session = {
            sid: sum(nbytes.values()) for sid, nbytes in self.manager.nbytes_by_session().items()
        }
        return WorkerStats(
            self.name,
            by_session,
            self.manager.stats()["total_nbytes"],
            self._steps,
            self._not_held,
        )
