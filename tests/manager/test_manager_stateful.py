"""SessionStateManager against an OrderedDict LRU model, caps 1..4, evicting and refusing."""

from __future__ import annotations

import functools

from sessionstate import SessionStateManager
from sessionstate.testing import manager_contract_machine, session_states, tensor_pools

# Small records keep each run cheap; aliasing within a record stays common (one base
# allocation, several views of it).
_states = session_states(
    pools=tensor_pools(max_bases=1, max_derived=3, max_dims=2), max_objects=1, max_attrs=2
)

TestEvictCap1 = manager_contract_machine(max_sessions=1, states=_states, name="EvictCap1").TestCase
TestEvictCap2 = manager_contract_machine(max_sessions=2, states=_states, name="EvictCap2").TestCase
TestEvictCap3 = manager_contract_machine(max_sessions=3, states=_states, name="EvictCap3").TestCase
TestEvictCap4 = manager_contract_machine(max_sessions=4, states=_states, name="EvictCap4").TestCase

TestRefuseCap1 = manager_contract_machine(
    max_sessions=1, on_full="refuse", states=_states, name="RefuseCap1"
).TestCase
TestRefuseCap2 = manager_contract_machine(
    max_sessions=2, on_full="refuse", states=_states, name="RefuseCap2"
).TestCase
TestRefuseCap3 = manager_contract_machine(
    max_sessions=3, on_full="refuse", states=_states, name="RefuseCap3"
).TestCase
TestRefuseCap4 = manager_contract_machine(
    max_sessions=4, on_full="refuse", states=_states, name="RefuseCap4"
).TestCase

# The cap drawn per run, with the default (larger) records.
TestEvictDrawnCap = manager_contract_machine(name="EvictDrawnCap").TestCase
TestRefuseDrawnCap = manager_contract_machine(on_full="refuse", name="RefuseDrawnCap").TestCase

# The manager's own in-place-write check must stay silent when nothing writes in place.
TestEvictCheckingImmutability = manager_contract_machine(
    states=_states,
    manager_factory=functools.partial(SessionStateManager, check_immutable=True),
    name="EvictCheckingImmutability",
).TestCase
