"""LatentBuffer against a deque model: rings of several sizes, unbounded, and re-allocation."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from sessionstate import LatentBuffer
from sessionstate.testing import chunks, ring_contract_machine


def _buffer() -> LatentBuffer:
    return LatentBuffer(name="latents", dim=0)


TestRingOf1 = ring_contract_machine(_buffer, maxlen=1, name="RingOf1").TestCase
TestRingOf2 = ring_contract_machine(_buffer, maxlen=2, name="RingOf2").TestCase
TestRingOf3 = ring_contract_machine(_buffer, maxlen=3, name="RingOf3").TestCase
TestUnbounded = ring_contract_machine(_buffer, maxlen=None, name="Unbounded").TestCase

# Re-allocating with a different size (or unbounded) mid-run must start a fresh buffer.
TestReallocated = ring_contract_machine(
    _buffer, maxlen=st.one_of(st.none(), st.integers(1, 5)), name="Reallocated"
).TestCase

# Meta chunks: no values, so the machine's checks rest on structure and byte counts.
TestMetaRing = ring_contract_machine(
    _buffer,
    chunk_strategy=chunks(device="meta", dtype=torch.bfloat16, feature_shape=(2, 3)),
    name="MetaRing",
).TestCase

# A time dimension other than 0, with non-contiguous and over-allocated chunks.
TestTimeDim2 = ring_contract_machine(
    lambda: LatentBuffer(name="frames", dim=2),
    chunk_strategy=chunks(dim=2, feature_shape=(1, 3), dtype=torch.float16),
    name="TimeDim2",
).TestCase
