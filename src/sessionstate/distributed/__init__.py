"""Scale-out on Ray: session-affine workers, live migration, and recovery from worker loss.

A `Router` (in the driver) owns a set of `SessionWorker` actors, each with its own pipeline
and `SessionStateManager`. Every session lives on exactly one worker; `Router.migrate` moves
a live session's bytes between workers through Ray's object store (`Router.migrate_many` a
family of forks, each shared storage once); `Router.rebalance` evens out resident bytes.
Needs the optional extra, from your clone: ``pip install -e '.[ray]'``.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("ray") is None:  # pragma: no cover - the extra is installed in CI
    _msg = (
        "`sessionstate.distributed` needs Ray, which is not installed; install the `ray` extra "
        "from your clone with `pip install -e '.[ray]'` (no release is on PyPI yet)."
    )
    raise ImportError(_msg)

from sessionstate.distributed._episode import cluster_episode
from sessionstate.distributed._outcomes import StaleEpochError, WorkerTimeoutError
from sessionstate.distributed._ray import LOCAL_RAY_ENV, init_local_ray
from sessionstate.distributed._router import (
    MigrationError,
    MigrationRecord,
    Router,
    SessionRestoredError,
)
from sessionstate.distributed._transport import (
    decode_family,
    decode_record,
    digest,
    encode_family,
    encode_record,
)
from sessionstate.distributed._worker import (
    DreamZeroFactory,
    ImportAck,
    SessionPipeline,
    SessionWorker,
    StepReply,
    WorkerStats,
)

__all__ = [
    "LOCAL_RAY_ENV",
    "DreamZeroFactory",
    "ImportAck",
    "MigrationError",
    "MigrationRecord",
    "Router",
    "SessionPipeline",
    "SessionRestoredError",
    "SessionWorker",
    "StaleEpochError",
    "StepReply",
    "WorkerStats",
    "WorkerTimeoutError",
    "cluster_episode",
    "decode_family",
    "decode_record",
    "digest",
    "encode_family",
    "encode_record",
    "init_local_ray",
]
