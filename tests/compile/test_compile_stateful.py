"""Donation against an eager model: no record a donating compiled step ever produced changes.

The machine steps one current record through a donating `sessionstate.compile` and an eager
twin through the plain step, and takes records, objects and chunk tuples out of the current
one at random (each with a copy of its bits). After every rule the current record equals the
eager twin bit for bit, and everything taken still equals its copy: a donating step wrote
only into what nothing else held. What it could donate is donated (`donated` counts it).
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import sessionstate as ss
from tests.compile.test_compile import rich_session, rich_step

FAST = ss.compile(rich_step, backend="aot_eager", donate=True, max_structures=64)


def _copy(tree: Any) -> Any:
    return ss.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


class DonationMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.current = rich_session()
        self.twin = rich_session()
        self.taken: list[tuple[Any, Any]] = []

    @rule(value=st.integers(-4, 4))
    def step(self, value: int) -> None:
        x = torch.full((1, 4), float(value))
        settled = len(self.current.object("latents", ss.LatentBuffer)) == 2 and not self.taken
        before = FAST.donated
        self.current, out = FAST(self.current, x.clone())
        if settled:  # nothing else holds it: every leaf is donated
            assert FAST.donated == before + 1
        self.twin, expected = rich_step(self.twin, x.clone())
        assert torch.equal(out, expected)

    @rule()
    def take_the_record(self) -> None:
        self.taken.append((self.current, _copy(self.current)))

    @rule(name=st.sampled_from(["latents", "feat"]))
    def take_an_object(self, name: str) -> None:
        obj = self.current.object(name)
        self.taken.append((obj, _copy(obj)))

    @rule()
    def take_the_chunks(self) -> None:
        chunks = self.current.object("latents", ss.LatentBuffer).view()
        self.taken.append((chunks, _copy(chunks)))

    @rule()
    def let_go(self) -> None:
        self.taken.clear()

    @invariant()
    def current_equals_eager(self) -> None:
        assert ss.tree_equal(self.current, self.twin)

    @invariant()
    def nothing_taken_changed(self) -> None:
        for kept, bits in self.taken:
            assert ss.tree_equal(kept, bits)


DonationMachine.TestCase.settings = settings(
    DonationMachine.TestCase.settings, max_examples=8, stateful_step_count=15, deadline=None
)
TestDonation = DonationMachine.TestCase
