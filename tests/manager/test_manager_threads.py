"""The manager under threads: rounds of concurrent creation, checked against an exact model.

In each round, eight threads released together by a barrier ask for the same new session with
`get_or_create`. The factory releases the interpreter lock while it builds the record (as one
that allocates device memory or reads a file does), so the other threads run while it is
inside the manager. The manager's lock makes the outcome exact: one factory call per round,
every thread gets that record, one miss and seven hits, and the cap evicts the oldest round.
The model predicts every counter, the residents and their order; the final byte count is
compared with an independent recount. Without the lock, several factories run per round and
the threads get different records.
"""

from __future__ import annotations

import threading
import time

import torch

from sessionstate import SessionState, SessionStateManager
from sessionstate.testing import recount_nbytes_by_device

CAP = 2
THREADS = 8
ROUNDS = 24


def test_concurrent_get_or_create_agrees_with_an_exact_model() -> None:
    manager = SessionStateManager(CAP)
    shared = torch.zeros(4 * ROUNDS)
    made: dict[int, list[SessionState]] = {r: [] for r in range(ROUNDS)}
    got: dict[int, list[SessionState]] = {r: [] for r in range(ROUNDS)}
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def factory(r: int) -> SessionState:
        time.sleep(0)  # releases the interpreter lock, as real work inside a factory does
        state = SessionState(attrs={"x": shared[4 * r :], "own": torch.full((r + 1,), r)})
        made[r].append(state)
        return state

    def worker() -> None:
        try:
            for r in range(ROUNDS):
                barrier.wait()
                got[r].append(manager.get_or_create(f"s{r}", lambda r=r: factory(r)))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)  # a hang guard only
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []

    # Each round: one factory call, and every thread got the record it made.
    assert [len(made[r]) for r in range(ROUNDS)] == [1] * ROUNDS
    for r in range(ROUNDS):
        assert all(state is made[r][0] for state in got[r]), f"round {r}"

    # The residents are the last CAP rounds, oldest first, holding the records made then.
    assert manager.session_ids() == [f"s{r}" for r in range(ROUNDS - CAP, ROUNDS)]
    held = [manager.peek(f"s{r}") for r in range(ROUNDS - CAP, ROUNDS)]
    expected = [made[r][0] for r in range(ROUNDS - CAP, ROUNDS)]
    assert all(a is b for a, b in zip(held, expected, strict=True))
    recount = recount_nbytes_by_device(held)
    assert manager.stats() == {
        "sessions": CAP,
        "max_sessions": CAP,
        "hits": ROUNDS * (THREADS - 1),
        "misses": ROUNDS,
        "evictions": ROUNDS - CAP,
        "total_nbytes": sum(recount.values()),
        **{f"nbytes:{device}": n for device, n in recount.items()},
        "forks": 0,
        "shared_sessions": 0,  # counted once a family is made (views of `shared` by hand)
    }
