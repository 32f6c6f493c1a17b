"""The manager: a thin table of the latest record per session, its jobs in rooms of their own.

`SessionStateManager` (``_face``) is the public face: every method keeps its docstring and
delegates to the room that does the job, over one `Table`:

- ``_table``: the records, LRU order, the cap (admit, evict, refuse), the lock and counters, and
  the parts below as plain attributes.
- ``_room``: making room, the byte budget's and the engine pools' one parking loop.
- ``_access``: get and put, single and batched, and the read-only `peek`.
- ``_family``: forks, and family snapshots (`snapshot_many`, `peek_many`, `restore_many`).
- ``_stepping``: `step` and `step_many`, the pools' transactions, the read check.
- ``_observe``: `stats`, `session_stats`, `metrics_snapshot`, events.
- ``_prefetch``: background unparks and their room, and `expect`'s schedule of next use.
- ``_decide``: the decisions as pure functions of plain data, tested without a manager.
- ``_schedule``: under a schedule of next use (`SessionStateManager.expect`), whom to park
  first (`park_order`, Belady's) and whom to prefetch (`prefetch_plan`), as pure functions.

The parts: `SessionLedger` (``_ledger``: what the stored records hold, per device, kept up to
date by the values that changed), `BudgetPolicy` (``_policy``: the byte budget's decisions; it
changes nothing), `Parking` (``_parking``: the tier, the spool directory, the handles it made,
their counts), `ImmutabilityGuard` (``_guard``: stored tensors' version counters) and the
`Reporter` (``_events``: what the manager reports as it works, `SessionEvent` and timings).
"""

from sessionstate._manager._face import SessionStateManager
from sessionstate._manager._guard import ImmutabilityGuard
from sessionstate._manager._ledger import Ledger, SessionLedger
from sessionstate._manager._parking import Parking
from sessionstate._manager._policy import (
    BudgetPolicy,
    BudgetTextError,
    OnFull,
    check_max_bytes,
    is_budget_device,
    parse_budget_text,
    parse_nbytes,
    zero_budget,
)
from sessionstate._manager._table import DEFAULT_MAX_SESSIONS, SessionT

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "BudgetPolicy",
    "BudgetTextError",
    "ImmutabilityGuard",
    "Ledger",
    "OnFull",
    "Parking",
    "SessionLedger",
    "SessionStateManager",
    "SessionT",
    "check_max_bytes",
    "is_budget_device",
    "parse_budget_text",
    "parse_nbytes",
    "zero_budget",
]
