"""Model-based contract machines a downstream model runs against its own state objects.

- `RingContractMachine` is the `LatentBuffer` contract: it drives an object with
  ``allocate(maxlen=...)``, ``commit``, ``view()``, ``view(last=n)``, ``reset()`` and
  ``evict()`` next to a ``collections.deque(maxlen=k)``. It fits `LatentBuffer` and records
  that behave like it (a ring of chunks); other `StateObject` kinds need their own machine.
- `ManagerContractMachine` runs a `SessionStateManager` (or a wrapper with its interface)
  next to an ``OrderedDict`` LRU, over any `SessionState` records.

Both keep every record they produced and check after every step that none of them changed.
`ring_contract_machine` and `manager_contract_machine` configure them in one line; assign the
result's ``.TestCase`` in a test module.

>>> from sessionstate import LatentBuffer
>>> TestLatentRing = ring_contract_machine(lambda: LatentBuffer(dim=0), maxlen=2).TestCase
"""

from __future__ import annotations

from sessionstate.testing._manager_contract import ManagerContractMachine, manager_contract_machine
from sessionstate.testing._ring import RingContractMachine, ring_contract_machine

__all__ = [
    "ManagerContractMachine",
    "RingContractMachine",
    "manager_contract_machine",
    "ring_contract_machine",
]
