"""Hypothesis strategies and contract state machines for code built on sessionstate.

Two kinds of tools, both public so a downstream model can test its own state the way this
library tests itself:

- `sessionstate.testing.strategies`: strategies with knobs. Every argument forces an option
  (``devices=("meta",)``) or, left at its default, randomises it. `tensors` draws one tensor;
  `tensor_pools` draws a few base allocations and derives views, aliases and clones from
  them, recording which allocation each tensor lives in; `chunks` draws tensors that one
  `LatentBuffer` accepts; and `session_states` draws `SessionState` records whose buckets
  alias each other.
- `sessionstate.testing.machines`: model-based state machines. `RingContractMachine` is the
  `LatentBuffer` contract, run against a ``collections.deque``; `ManagerContractMachine`
  runs a `SessionStateManager` against an ``OrderedDict`` LRU. Both keep every record they
  produced and check after every step that none of them changed. `ring_contract_machine`
  and `manager_contract_machine` configure them in one line; assign the result's
  ``.TestCase`` in a test module.
- `sessionstate.testing.recount`: an independent byte count, `recount_nbytes_by_device`, to
  check `nbytes_by_device` and `SessionStateManager.stats` against; and `EagerLedger`, the
  eager reference the manager's lazy ledger is tested against.

Every public name is re-exported here. hypothesis is an optional dependency: install
``sessionstate[testing]``.

>>> from sessionstate import LatentBuffer
>>> from sessionstate.testing import ring_contract_machine
>>> TestLatentRing = ring_contract_machine(lambda: LatentBuffer(dim=0), maxlen=2).TestCase
"""

from __future__ import annotations

from sessionstate.testing.machines import (
    ManagerContractMachine,
    RingContractMachine,
    manager_contract_machine,
    ring_contract_machine,
)
from sessionstate.testing.recount import EagerLedger, recount_nbytes_by_device
from sessionstate.testing.strategies import (
    CHUNK_DERIVATIONS,
    DEFAULT_DEVICES,
    DEFAULT_DTYPES,
    POOL_DERIVATIONS,
    PoolTensor,
    TensorPool,
    chunks,
    session_states,
    tensor_pools,
    tensors,
)

__all__ = [
    "CHUNK_DERIVATIONS",
    "DEFAULT_DEVICES",
    "DEFAULT_DTYPES",
    "POOL_DERIVATIONS",
    "EagerLedger",
    "ManagerContractMachine",
    "PoolTensor",
    "RingContractMachine",
    "TensorPool",
    "chunks",
    "manager_contract_machine",
    "recount_nbytes_by_device",
    "ring_contract_machine",
    "session_states",
    "tensor_pools",
    "tensors",
]
