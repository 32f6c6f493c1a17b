"""The manager: a thin table of the latest record per session, built from parts.

- `SessionStateManager` (``_table``): the table, its lock and counters, cap admission and the
  loop that makes room under a byte budget.
- `SessionLedger` (``_ledger``): what the stored records hold, per device, kept up to date by
  the values that changed.
- `BudgetPolicy` (``_policy``): the byte budget's decisions (what to park, what to evict,
  when to refuse); it changes nothing.
- `Parking` (``_parking``): the tier, the spool directory, the handles it made, their counts.
- `ImmutabilityGuard` (``_guard``): stored tensors' version counters, checked on access.
- ``_schedule``: under a schedule of next use (`SessionStateManager.expect`), whom to park
  first (`park_order`, Belady's) and whom to prefetch (`prefetch_plan`), as pure functions.
"""

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
from sessionstate._manager._table import DEFAULT_MAX_SESSIONS, SessionStateManager, SessionT

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
