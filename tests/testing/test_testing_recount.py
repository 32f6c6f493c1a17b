"""`recount_nbytes_by_device`: the independent count the contract machines check bytes against."""

from __future__ import annotations

import re

import pytest
import torch

from sessionstate import LatentBuffer, SessionState, nbytes_by_device
from sessionstate.testing import recount_nbytes_by_device


def test_a_view_counts_the_allocation_it_keeps_alive_once() -> None:
    base = torch.zeros(16)  # 64 bytes
    tree = {"slice": base[10:], "again": base.view(4, 4).t(), "empty": base[:0], "n": 3}
    assert recount_nbytes_by_device(tree) == {"cpu": 64}


def test_overlapping_storages_count_their_union() -> None:
    base = torch.zeros(8, dtype=torch.float64)  # 64 bytes
    head = torch.empty(0, dtype=torch.float64).set_(base.untyped_storage()[0:16])
    tail = torch.empty(0, dtype=torch.float64).set_(base.untyped_storage()[48:64])
    assert recount_nbytes_by_device([head, tail]) == {"cpu": 32}
    assert recount_nbytes_by_device([head, base, tail]) == {"cpu": 64}


def test_meta_storages_count_once_each() -> None:
    a, b = torch.empty(4, device="meta"), torch.empty(2, device="meta")
    assert recount_nbytes_by_device([a, a[1:], b]) == {"meta": 24}


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
def test_sparse_tensors_count_their_components() -> None:
    sparse = torch.eye(3).to_sparse()
    expected = sum(t.untyped_storage().nbytes() for t in (sparse._indices(), sparse._values()))
    assert recount_nbytes_by_device({"s": sparse}) == {"cpu": expected}
    csr = torch.eye(3).to_sparse_csr()
    assert recount_nbytes_by_device(csr) == nbytes_by_device(csr)


def test_agrees_with_the_library_on_a_session() -> None:
    shared = torch.zeros(32)
    ring = LatentBuffer(dim=0).allocate(maxlen=2).commit(shared[:4].view(1, 4))
    state = SessionState(
        objects={"ring": ring.commit(torch.ones(1, 4))},
        attrs={"alias": shared[8:], "meta": torch.empty(5, device="meta")},
    )
    assert recount_nbytes_by_device(state) == {"cpu": 128 + 16, "meta": 20}
    assert recount_nbytes_by_device(state) == nbytes_by_device(state)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_a_nested_tensor_is_refused() -> None:
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    msg = (
        "`recount_nbytes_by_device` recounts plain dense and sparse tensors, got a nested tensor "
        "(layout=torch.strided); check such leaves with `nbytes_by_device` against a count you "
        "know."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        recount_nbytes_by_device({"n": nested})
