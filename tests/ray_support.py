"""What the Ray test modules share: a toy pipeline and the calls that wait on workers.

Imported as `tests.ray_support`; workers receive this module's classes by value, as they do
the test modules' own.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import ray
import torch

from sessionstate import SessionState, SessionStateManager
from sessionstate.distributed import Router

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT_S = 60


class CounterPipeline:
    """A session holds a call count and a payload tensor whose size the first call sets."""

    def __init__(self) -> None:
        self.manager = SessionStateManager()

    def forward(self, inputs: int, session_id: str) -> int:
        state = self.manager.get(session_id)
        if state is None:
            state = SessionState(attrs={"count": 0, "payload": torch.zeros(inputs)})
        count = state.attrs["count"] + 1
        self.manager.put(session_id, state.with_attrs(count=count))
        return int(count)


def get(ref: Any) -> Any:
    """``ray.get`` with the tests' timeout."""
    return ray.get(ref, timeout=TIMEOUT_S)


def kill(router: Router, worker: str) -> None:
    """Kill ``worker`` and wait until the kill has landed (a call queued before it may run)."""
    handle = router.handle(worker)
    ray.kill(handle)
    for _ in range(200):
        try:
            ray.get(handle.stats.remote(), timeout=TIMEOUT_S)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    msg = f"{worker!r} still answers after `ray.kill`."
    raise AssertionError(msg)


def other(router: Router, session_id: str) -> str:
    """A worker that does not own ``session_id``."""
    return next(w for w in router.workers if w != router.owner(session_id))
