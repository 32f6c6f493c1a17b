"""Examples for `sessionstate._accounting`: bytes per storage, deduplicated, per device."""

from __future__ import annotations

import itertools
import re
import warnings
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

import sessionstate as ss
from sessionstate import LatentBuffer, SessionState, nbytes_by_device, nbytes_by_key
from sessionstate._accounting import ByteCounter


@ss.record
class Holder:
    value: object


def _base() -> torch.Tensor:
    return torch.arange(64, dtype=torch.float32)  # 64 float32 = 256 bytes


# --- one storage, counted in full, once ------------------------------------------------------


def test_a_dense_tensor_counts_its_storage() -> None:
    assert nbytes_by_device(_base()) == {"cpu": 256}
    assert nbytes_by_device(torch.zeros(3, 5, dtype=torch.bfloat16)) == {"cpu": 30}
    assert nbytes_by_device(torch.zeros(2, dtype=torch.complex128)) == {"cpu": 32}


VIEWS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "slice": lambda x: x[1:3],
    "step-slice": lambda x: x[::7],
    "empty-slice": lambda x: x[5:5],
    "element": lambda x: x[3],
    "detach": lambda x: x.detach(),
    "view(-1)": lambda x: x.view(-1),
    "view(8,8)": lambda x: x.view(8, 8),
    "transpose": lambda x: x.view(8, 8).t(),
    "permute": lambda x: x.view(2, 4, 8).permute(2, 0, 1),
    "mT": lambda x: x.view(4, 16).mT,
    "expand": lambda x: x[:1].expand(1000),
    "expand2d": lambda x: x.view(1, 64).expand(5, 64),
    "unsqueeze": lambda x: x.unsqueeze(0),
    "as_strided": lambda x: x.as_strided((2, 2), (1, 1), 10),
    "unfold": lambda x: x.unfold(0, 4, 4),
    "narrow": lambda x: x.narrow(0, 60, 4),
    "row-slice": lambda x: x.view(8, 8)[2:],
    "complex-view": lambda x: torch.view_as_complex(x.view(32, 2)),
    "dtype-view": lambda x: x.view(torch.uint8),
}


@pytest.mark.parametrize("make_view", VIEWS.values(), ids=VIEWS.keys())
def test_a_view_counts_the_whole_storage(make_view: Callable[[torch.Tensor], torch.Tensor]) -> None:
    base = _base()
    view = make_view(base)
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert nbytes_by_device(view) == {"cpu": 256}
    assert nbytes_by_device([view, base]) == {"cpu": 256}
    assert nbytes_by_device([base, view, make_view(base)]) == {"cpu": 256}


def test_all_views_together_count_once() -> None:
    base = _base()
    assert nbytes_by_device([make(base) for make in VIEWS.values()]) == {"cpu": 256}


def test_a_clone_is_a_second_storage() -> None:
    base = _base()
    assert nbytes_by_device([base, base.clone()]) == {"cpu": 512}
    assert nbytes_by_device([base, base[:2].clone()]) == {"cpu": 264}
    assert nbytes_by_device([base, base.contiguous()]) == {"cpu": 256}  # contiguous: a no-op


def test_a_narrow_slice_keeps_its_allocation_alive() -> None:
    kept = _base()[:1]
    assert kept.numel() * kept.element_size() == 4
    assert nbytes_by_device(kept) == {"cpu": 256}


def test_aliases_across_containers_count_once() -> None:
    base = _base()
    ring = LatentBuffer(dim=0).allocate().commit(base.view(8, 8))
    tree = {
        "list": [base, base[1:]],
        "tuple": (base.view(-1),),
        "dict": {"deep": {"deeper": base.detach()}},
        "record": Holder(value=base[::2]),
        "buffer": ring,
        "session": SessionState(objects={"r": ring}, attrs={"a": base[3:]}),
    }
    assert nbytes_by_device(tree) == {"cpu": 256}


def test_distinct_storages_add_up() -> None:
    tree = {"a": torch.zeros(4), "b": [torch.zeros(2, dtype=torch.float64)], "c": torch.zeros(0)}
    assert nbytes_by_device(tree) == {"cpu": 16 + 16}


# --- meta device -----------------------------------------------------------------------------


def test_meta_storages_are_told_apart() -> None:
    a = torch.empty(64, device="meta")
    b = torch.empty(64, device="meta")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    assert nbytes_by_device(a) == {"meta": 256}
    assert nbytes_by_device([a, b]) == {"meta": 512}
    assert nbytes_by_device([a, a[1:], a.view(8, 8).t()]) == {"meta": 256}
    assert nbytes_by_device([a, a[1:], b.view(8, 8)]) == {"meta": 512}


def test_devices_are_kept_apart() -> None:
    tree = [torch.zeros(8), torch.empty(4, device="meta", dtype=torch.float16)]
    assert nbytes_by_device(tree) == {"cpu": 32, "meta": 8}


def test_moving_to_meta_keeps_the_count() -> None:
    base = _base()
    tree = {"a": base, "b": base[2:], "c": torch.zeros(3, dtype=torch.int16)}
    on_meta = ss.tree_map(lambda t: t.to("meta"), tree)
    assert nbytes_by_device(tree) == {"cpu": 262}
    # `.to("meta")` makes one storage per tensor: the alias does not survive the move.
    assert nbytes_by_device(on_meta) == {"meta": 256 + 248 + 6}


# --- zero-size, non-tensor leaves, numpy ---------------------------------------------------


def test_zero_size_tensors_count_zero_bytes() -> None:
    assert sum(nbytes_by_device(torch.zeros(0)).values()) == 0
    assert sum(nbytes_by_device([torch.zeros(0, 5), torch.zeros(3, 0)]).values()) == 0
    assert nbytes_by_device([torch.zeros(0), torch.zeros(2)]) == {"cpu": 8}


def test_zero_size_tensor_device_is_absent() -> None:
    assert nbytes_by_device(torch.zeros(0)) == {}


def test_non_tensor_leaves_count_zero() -> None:
    tree = {"i": 7, "f": 2.5, "s": "text", "n": None, "b": True, "c": 1j, "bytes": b"xyz"}
    assert nbytes_by_device(tree) == {}
    assert nbytes_by_device([]) == {}
    assert nbytes_by_device({}) == {}


def test_numpy_arrays_count_on_the_host() -> None:
    a = np.zeros(10, dtype=np.float64)  # 80 bytes
    assert nbytes_by_device(a) == {"cpu": 80}
    assert nbytes_by_device([a, a[2:5], a.reshape(2, 5).T, a[::3]]) == {"cpu": 80}
    assert nbytes_by_device(a[2:5]) == {"cpu": 80}
    assert nbytes_by_device([a, np.zeros(10, dtype=np.float64)]) == {"cpu": 160}
    assert nbytes_by_device([a, torch.zeros(2)]) == {"cpu": 88}


def test_numpy_views_of_views_count_the_base_once() -> None:
    a = np.arange(12, dtype=np.int32)  # 48 bytes
    vv = a.reshape(3, 4)[1:][:, 2:]
    assert nbytes_by_device([vv, a[5:]]) == {"cpu": 48}


def test_numpy_view_of_a_tensor_counts_once() -> None:
    t = torch.zeros(4)
    assert nbytes_by_device([t, t.numpy()]) == {"cpu": 16}


def test_tensor_from_numpy_counts_once() -> None:
    a = np.zeros(4, dtype=np.float32)
    assert nbytes_by_device([a, torch.from_numpy(a)]) == {"cpu": 16}


# --- sparse, nested, subclasses -------------------------------------------------------------


@pytest.fixture(autouse=True)
def _quiet_beta_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
        warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
        warnings.filterwarnings("ignore", message=".*nested tensors.*")
        yield


def test_sparse_coo_counts_indices_and_values() -> None:
    indices = torch.tensor([[0, 1, 2], [0, 1, 2]])  # 6 int64 = 48 bytes
    values = torch.ones(3)  # 12 bytes
    coo = torch.sparse_coo_tensor(indices, values, (3, 3))
    assert nbytes_by_device(coo) == {"cpu": 60}
    assert nbytes_by_device([coo, coo]) == {"cpu": 60}


def test_sparse_csr_counts_its_three_parts() -> None:
    crow = torch.tensor([0, 1, 2, 3])  # 32 bytes
    col = torch.tensor([0, 1, 2])  # 24 bytes
    values = torch.ones(3)  # 12 bytes
    csr = torch.sparse_csr_tensor(crow, col, values, (3, 3))
    assert nbytes_by_device(csr) == {"cpu": 68}
    assert nbytes_by_device([csr, csr.values()]) == {"cpu": 68}


def test_sparse_csc_counts_its_three_parts() -> None:
    ccol = torch.tensor([0, 1, 2, 3])
    row = torch.tensor([0, 1, 2])
    values = torch.ones(3, dtype=torch.float64)
    csc = torch.sparse_csc_tensor(ccol, row, values, (3, 3))
    assert nbytes_by_device(csc) == {"cpu": 32 + 24 + 24}


def test_jagged_nested_tensor_counts_values_and_offsets() -> None:
    nested = torch.nested.nested_tensor([torch.zeros(2, 4), torch.zeros(3, 4)], layout=torch.jagged)
    # values: 5 x 4 float32 = 80 bytes; offsets: 3 int64 = 24 bytes.
    assert nbytes_by_device(nested) == {"cpu": 104}
    assert nbytes_by_device([nested, nested.values()]) == {"cpu": 104}


def test_strided_nested_tensor_is_rejected() -> None:
    nested = torch.nested.nested_tensor([torch.zeros(2, 4), torch.zeros(3, 4)])
    with pytest.raises(ss.UnsupportedTensorError, match="strided nested tensor") as info:
        nbytes_by_device({"x": nested})
    assert isinstance(info.value, TypeError)


def test_opaque_tensor_is_rejected() -> None:
    opaque = torch.zeros(3).to_mkldnn()
    with pytest.raises(ss.UnsupportedTensorError, match=re.escape("torch._mkldnn")):
        nbytes_by_device([opaque])


def test_parameters_count_like_tensors() -> None:
    p = torch.nn.Parameter(torch.zeros(8))
    assert nbytes_by_device([p, p.data, p.detach()[2:]]) == {"cpu": 32}


# --- nbytes_by_key and ByteCounter ----------------------------------------------------------


def test_nbytes_by_key_attributes_each_storage_to_its_first_leaf() -> None:
    base = _base()
    tree = {"a": base[4:], "b": base, "c": torch.zeros(2), "d": "text"}
    assert nbytes_by_key(tree) == {
        "['a']": {"cpu": 256},
        "['b']": {},
        "['c']": {"cpu": 8},
        "['d']": {},
    }


def _sum(per_key: dict[str, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for by_device in per_key.values():
        for device, nbytes in by_device.items():
            out[device] = out.get(device, 0) + nbytes
    return out


def test_nbytes_by_key_sums_to_nbytes_by_device() -> None:
    base = _base()
    meta = torch.empty(5, 5, device="meta")
    ring = LatentBuffer(name="r", dim=0).allocate(maxlen=2)
    ring = ring.commit(base.view(8, 8)).commit(torch.ones(2, 8))
    tree = [
        SessionState(objects={"ring": ring}, attrs={"alias": base[3:], "m": meta, "n": 3}),
        {"again": meta.t(), "np": np.ones(3)},
        (base, torch.zeros(1, dtype=torch.int8)),
    ]
    per_key = nbytes_by_key(tree)
    assert _sum(per_key) == nbytes_by_device(tree)
    assert nbytes_by_device(tree) == {"cpu": 256 + 64 + 24 + 1, "meta": 100}
    assert list(per_key) == ss.tree_flatten_with_keys(tree)[0]


def test_byte_counter_dedups_across_calls() -> None:
    base = _base()
    counter = ByteCounter()
    assert counter.add(base[:2]) == {"cpu": 256}
    assert counter.add(base.view(8, 8)) == {}
    assert counter.add(torch.zeros(1)) == {"cpu": 4}
    assert counter.add("leaf") == {}
    assert counter.totals == {"cpu": 260}


def test_byte_counter_keeps_storages_alive() -> None:
    counter = ByteCounter()
    for _ in range(50):
        # Each temporary dies after `add`; a reused address must not be mistaken for it.
        counter.add(torch.zeros(16))
    assert counter.totals == {"cpu": 50 * 64}


def test_state_objects_report_their_own_bytes() -> None:
    ring = (
        LatentBuffer(dim=0).allocate(maxlen=2).commit(torch.zeros(3, 4)).commit(torch.zeros(1, 4))
    )
    assert ring.nbytes_by_device() == nbytes_by_device(ring) == {"cpu": 48 + 16}


def test_overlapping_storages_over_one_allocation_count_their_union_in_any_order() -> None:
    arr = np.zeros(10)  # 80 bytes
    head = torch.from_numpy(arr[:5])  # bytes 0..40 of the same memory
    middle = torch.from_numpy(arr[3:8])  # bytes 24..64
    rewrapped = torch.empty(0, dtype=torch.float64).set_(head.untyped_storage()[0:16])
    leaves = [head, middle, rewrapped, arr]
    for order in itertools.permutations(leaves):
        assert nbytes_by_device(list(order)) == {"cpu": 80}
    assert nbytes_by_device([head, middle]) == {"cpu": 64}
    assert nbytes_by_device([middle, rewrapped]) == {"cpu": 56}
