"""`nbytes_by_device` counts plain dense tensors inline: it must agree with the general path.

The inline count (the common leaf, without `storage_entries`' generators) and the general
path (`count_entries` of `storage_entries`) take the same trees, drawn from shared pools so
views, aliases and meta storages are common, and must agree with each other and with an
independent recount; trees mixing the inline leaves with every other kind (sparse, numpy,
storages over one allocation) too.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given

from sessionstate import SessionState, nbytes_by_device
from sessionstate._accounting import count_entries, storage_entries
from sessionstate.testing import recount_nbytes_by_device, session_states


@given(state=session_states())
def test_the_inline_count_equals_the_general_path_and_a_recount(state: SessionState) -> None:
    inline = nbytes_by_device(state)
    assert inline == count_entries(storage_entries(state))
    assert inline == recount_nbytes_by_device(state)


def test_inline_and_general_leaves_over_one_allocation_count_their_union() -> None:
    arr = np.zeros(16)  # 128 bytes
    head = torch.from_numpy(arr[:8])  # a plain tensor: counted inline, bytes 0..64
    tail = torch.from_numpy(arr[4:])  # another storage over bytes 32..128
    sparse = torch.sparse_coo_tensor(
        torch.zeros(1, 2, dtype=torch.int64), torch.ones(2), check_invariants=True
    )
    meta = torch.zeros(4, device="meta")
    leaves = [head, tail, arr, sparse, meta, meta[1:], 3, None]
    expected = {"cpu": 128 + 16 + 8, "meta": 16}
    for order in itertools.permutations(leaves[:5]):
        assert nbytes_by_device([*order, *leaves[5:]]) == expected
    assert count_entries(storage_entries(leaves)) == expected
