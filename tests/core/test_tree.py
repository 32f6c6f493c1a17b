"""Examples for `sessionstate._tree`: records, the namespace, torch pytree, `tree_equal`."""

from __future__ import annotations

import math
import re

import attrs
import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import sessionstate as ss
from sessionstate import LatentBuffer, SessionState, record, static_field


@record
class Pair:
    a: torch.Tensor
    b: object
    tag: str = static_field(default="pair")


@record()
class Called:
    """Declared with ``@record()`` (the called form)."""

    x: object


def _ring() -> LatentBuffer:
    ring = LatentBuffer(name="frames", dim=0).allocate(maxlen=2)
    return ring.commit(torch.arange(6.0).reshape(2, 3)).commit(torch.ones(1, 3))


def _session() -> SessionState:
    return SessionState(objects={"ring": _ring()}, attrs={"step": 3, "emb": torch.zeros(2, 2)})


# --- flatten / unflatten -------------------------------------------------------------------


def test_record_flattens_in_the_library_namespace_only() -> None:
    p = Pair(torch.zeros(2), torch.ones(3))
    leaves = optree.tree_leaves(p, namespace=ss.NAMESPACE)
    assert len(leaves) == 2
    assert leaves[0] is p.a
    assert leaves[1] is p.b
    # Outside the namespace optree does not know the class: the record is a leaf.
    assert optree.tree_leaves(p) == [p]


def test_record_helpers_round_trip() -> None:
    p = Pair(torch.zeros(2), (1, torch.ones(1)), tag="t")
    leaves, spec = ss.tree_flatten(p)
    assert [type(x) for x in leaves] == [torch.Tensor, int, torch.Tensor]
    rebuilt = ss.tree_unflatten(spec, leaves)
    assert type(rebuilt) is Pair
    assert rebuilt is not p
    assert rebuilt.a is p.a
    assert rebuilt.b[1] is p.b[1]
    assert rebuilt.tag == "t"
    assert ss.tree_equal(rebuilt, p)


def test_called_record_form_registers_too() -> None:
    assert ss.tree_leaves(Called(x=[1, 2])) == [1, 2]
    assert torch_pytree.tree_leaves(Called(x=[1, 2])) == [1, 2]


def test_torch_pytree_flattens_records() -> None:
    p = Pair(torch.zeros(2), torch.ones(3), tag="q")
    leaves = torch_pytree.tree_leaves(p)
    assert len(leaves) == 2
    assert leaves[0] is p.a
    assert leaves[1] is p.b


def test_torch_pytree_round_trip_keeps_static_fields() -> None:
    p = Pair(torch.zeros(2), torch.ones(3), tag="q")
    leaves, spec = torch_pytree.tree_flatten(p)
    rebuilt = torch_pytree.tree_unflatten(leaves, spec)
    assert type(rebuilt) is Pair
    assert rebuilt.tag == "q"
    assert rebuilt.a is p.a
    assert rebuilt.b is p.b


def test_torch_pytree_round_trip_of_a_session() -> None:
    state = _session()
    leaves, spec = torch_pytree.tree_flatten(state)
    assert len(leaves) == len(ss.tree_leaves(state))
    rebuilt = torch_pytree.tree_unflatten(leaves, spec)
    assert type(rebuilt) is SessionState
    assert ss.tree_equal(rebuilt, state)
    ring = rebuilt.object("ring")
    assert isinstance(ring, LatentBuffer)
    assert (ring.name, ring.dim, ring.maxlen, ring.is_allocated) == ("frames", 0, 2, True)


def test_torch_pytree_keys_name_the_fields() -> None:
    pairs, _ = torch_pytree.tree_flatten_with_path(_ring())
    paths = [torch_pytree.keystr(path) for path, _ in pairs]
    assert paths == [".chunks[0]", ".chunks[1]"]


def test_static_fields_are_not_leaves() -> None:
    buf = _ring()
    assert all(isinstance(leaf, torch.Tensor) for leaf in ss.tree_leaves(buf))
    assert all(isinstance(leaf, torch.Tensor) for leaf in torch_pytree.tree_leaves(buf))


# --- static fields survive tree_map ---------------------------------------------------------


def test_tree_map_to_meta_keeps_latent_buffer_configuration() -> None:
    buf = _ring()
    moved = ss.tree_map(lambda t: t.to("meta"), buf)
    assert type(moved) is LatentBuffer
    assert (moved.name, moved.dim, moved.maxlen, moved.is_allocated) == ("frames", 0, 2, True)
    assert [c.device.type for c in moved.chunks] == ["meta", "meta"]
    assert [c.shape for c in moved.chunks] == [c.shape for c in buf.chunks]
    # The source is untouched.
    assert [c.device.type for c in buf.chunks] == ["cpu", "cpu"]


def test_torch_tree_map_to_meta_keeps_latent_buffer_configuration() -> None:
    moved = torch_pytree.tree_map(lambda t: t.to("meta"), _ring())
    assert (moved.name, moved.dim, moved.maxlen, moved.is_allocated) == ("frames", 0, 2, True)
    assert all(c.is_meta for c in moved.chunks)


def test_tree_map_to_meta_keeps_session_configuration() -> None:
    moved = ss.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, _session())
    ring = moved.object("ring")
    assert (ring.name, ring.dim, ring.maxlen) == ("frames", 0, 2)
    assert moved.attrs["step"] == 3
    assert moved.attrs["emb"].is_meta


def test_static_field_differences_change_the_treespec() -> None:
    x = torch.zeros(1)
    assert ss.tree_flatten(Pair(x, x, tag="a"))[1] != ss.tree_flatten(Pair(x, x, tag="b"))[1]


# --- registration ---------------------------------------------------------------------------


def test_register_record_is_idempotent() -> None:
    assert ss.register_record(Pair) is Pair
    assert ss.register_record(Pair) is Pair
    assert ss.register_record(LatentBuffer) is LatentBuffer
    assert ss.tree_leaves(Pair(1, 2)) == [1, 2]
    assert torch_pytree.tree_leaves(Pair(1, 2)) == [1, 2]


def test_record_on_a_registered_class_returns_it_unchanged() -> None:
    assert record(Pair) is Pair
    assert record(LatentBuffer) is LatentBuffer
    assert ss.tree_leaves(Pair(1, 2)) == [1, 2]


def test_register_record_on_a_plain_attrs_class() -> None:
    @attrs.frozen(eq=False)
    class Plain:
        x: object
        size: int = attrs.field(default=1, metadata={"pytree_node": False})

    registered = ss.register_record(Plain)
    assert registered is Plain
    assert Plain in torch_pytree.SUPPORTED_NODES
    assert ss.tree_leaves(Plain([5, 6], size=9)) == [5, 6]
    assert ss.tree_map(lambda v: v + 1, Plain([5], size=9)).size == 9
    with pytest.raises(ss.ImmutableRecordError):
        Plain(1).x = 2  # type: ignore[misc]


def test_records_are_attrs_classes_without_value_equality() -> None:
    assert attrs.has(Pair)
    x = torch.zeros(1)
    # eq=False: identity, never a tensor `==`.
    assert Pair(x, x) != Pair(x, x)


# --- torch.compile / torch.export see through records ---------------------------------------


class _Concat(torch.nn.Module):
    def forward(self, buf: LatentBuffer) -> torch.Tensor:
        return torch.cat(buf.chunks, dim=buf.dim) * 2


def test_torch_export_sees_through_a_record() -> None:
    buf = _ring()
    exported = torch.export.export(_Concat(), (buf,))
    assert "LatentBuffer" in str(exported.call_spec.in_spec)
    other = ss.tree_map(lambda t: t + 1, buf)
    assert torch.equal(exported.module()(other), _Concat()(other))


def test_torch_compile_sees_through_a_record() -> None:
    compiled = torch.compile(_Concat().forward, backend="eager", fullgraph=True)
    buf = _ring()
    assert torch.equal(compiled(buf), torch.cat(buf.chunks, dim=0) * 2)


def test_torch_compile_builds_the_chunks_of_a_buffer_of_blocks() -> None:
    # A buffer built by commits holds its chunks in blocks; `chunks` is built when first
    # read, and a compiled function reads it too (a full graph, no break).
    compiled = torch.compile(_Concat().forward, backend="eager", fullgraph=True)
    buf = LatentBuffer(name="frames", dim=0).allocate()
    for i in range(150):
        buf = buf.commit(torch.full((1, 3), float(i)))
    assert "chunks" not in vars(buf)
    assert torch.equal(compiled(buf), torch.cat(buf.chunks, dim=0) * 2)


# --- tree_equal ------------------------------------------------------------------------------


def test_tree_equal_same_values_in_distinct_tensors() -> None:
    a = torch.arange(6.0).reshape(2, 3)
    assert ss.tree_equal({"x": a, "n": 1}, {"x": a.clone(), "n": 1})


def test_tree_equal_ignores_strides() -> None:
    a = torch.arange(6.0).reshape(2, 3)
    transposed_copy = a.t().contiguous().t()
    assert transposed_copy.stride() != a.stride()
    assert ss.tree_equal(a, transposed_copy)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        pytest.param(torch.zeros(3), torch.zeros(3, dtype=torch.float64), id="dtype"),
        pytest.param(torch.zeros(3), torch.zeros(1, 3), id="shape"),
        pytest.param(torch.zeros(3), torch.zeros(3, device="meta"), id="device"),
        pytest.param(torch.zeros(3), torch.tensor([0.0, 0.0, 1.0]), id="value"),
        pytest.param(torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.int64), id="int"),
        pytest.param(torch.zeros(3), [0.0, 0.0, 0.0], id="tensor-vs-list"),
        pytest.param(torch.zeros(1), 0.0, id="tensor-vs-float"),
        pytest.param(
            torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, float("nan")]), id="nan-moved"
        ),
        pytest.param(torch.tensor([float("nan")]), torch.tensor([0.0]), id="nan-vs-number"),
        pytest.param(torch.empty(2, device="meta"), torch.empty(3, device="meta"), id="meta-shape"),
        pytest.param(
            torch.empty(2, device="meta"),
            torch.empty(2, device="meta", dtype=torch.float16),
            id="meta-dtype",
        ),
        pytest.param({"a": 1}, {"b": 1}, id="dict-keys"),
        pytest.param((1, 2), [1, 2], id="tuple-vs-list"),
        pytest.param((1, 2), (1, 2, 3), id="length"),
        pytest.param("a", "b", id="string"),
        pytest.param(None, 0, id="none-vs-zero"),
    ],
)
def test_tree_equal_detects_differences(left: object, right: object) -> None:
    assert not ss.tree_equal(left, right)
    assert not ss.tree_equal(right, left)


def test_tree_equal_nans_in_the_same_places_are_equal() -> None:
    x = torch.tensor([1.0, math.nan, 3.0, math.nan])
    assert ss.tree_equal(x, x.clone())
    z = torch.complex(torch.tensor([math.nan, 1.0]), torch.tensor([0.0, 2.0]))
    assert ss.tree_equal(z, z.clone())


def test_tree_equal_nan_comparison_still_checks_other_values() -> None:
    x = torch.tensor([1.0, math.nan])
    assert not ss.tree_equal(x, torch.tensor([2.0, math.nan]))


def test_tree_equal_meta_tensors_compare_by_dtype_and_shape() -> None:
    assert ss.tree_equal(torch.empty(2, 3, device="meta"), torch.empty(2, 3, device="meta"))


def test_tree_equal_compares_static_fields() -> None:
    x = torch.zeros(1)
    assert ss.tree_equal(Pair(x, 1, tag="a"), Pair(x.clone(), 1, tag="a"))
    assert not ss.tree_equal(Pair(x, 1, tag="a"), Pair(x, 1, tag="b"))
    ring = LatentBuffer(name="r", dim=0).allocate(maxlen=2)
    assert not ss.tree_equal(ring, LatentBuffer(name="r", dim=0).allocate(maxlen=3))
    assert not ss.tree_equal(ring, LatentBuffer(name="s", dim=0).allocate(maxlen=2))
    assert not ss.tree_equal(ring, ring.evict())


def test_tree_equal_compares_record_types() -> None:
    x = torch.zeros(1)
    assert not ss.tree_equal(Pair(x, 1), Called(x=[x, 1]))
    assert not ss.tree_equal(Pair(x, 1), (x, 1))


def test_tree_equal_survives_a_leaf_whose_eq_raises() -> None:
    class Awkward:
        def __eq__(self, other: object) -> bool:
            raise RuntimeError("no")

        __hash__ = object.__hash__

    a = Awkward()
    assert ss.tree_equal([a], [a])
    assert not ss.tree_equal([a], [Awkward()])


def test_tree_equal_of_sessions() -> None:
    assert ss.tree_equal(_session(), _session())
    changed = _session().update_object("ring", lambda b: b.commit(torch.zeros(1, 3)))
    assert not ss.tree_equal(_session(), changed)


def test_tree_equal_numpy_arrays() -> None:
    import numpy as np

    assert ss.tree_equal({"a": np.zeros(3)}, {"a": np.zeros(3)})


# --- immutability ---------------------------------------------------------------------------


def test_assignment_to_a_record_field_raises_with_the_fix() -> None:
    p = Pair(torch.zeros(1), 1)
    msg = (
        "`Pair` is immutable; `obj.b = ...` cannot assign. "
        "Use `obj = attrs.evolve(obj, b=...)`, which returns a new record."
    )
    with pytest.raises(ss.ImmutableRecordError, match=re.escape(msg)) as info:
        p.b = 2  # type: ignore[misc]
    assert isinstance(info.value, AttributeError)
    assert isinstance(info.value, attrs.exceptions.FrozenInstanceError)
    assert p.b == 1


def test_assignment_to_a_latent_buffer_field_raises() -> None:
    buf = _ring()
    with pytest.raises(ss.ImmutableRecordError, match=re.escape("`LatentBuffer` is immutable")):
        buf.maxlen = 5  # type: ignore[misc]
    assert buf.maxlen == 2


def test_the_suggested_fix_works() -> None:
    p = Pair(torch.zeros(1), 1)
    q = attrs.evolve(p, b=2)
    assert (p.b, q.b) == (1, 2)
    assert q.a is p.a


# --- key paths ------------------------------------------------------------------------------


def test_tree_flatten_with_keys_for_a_session() -> None:
    state = _session()
    keys, leaves, spec = ss.tree_flatten_with_keys(state)
    assert keys == [
        "objects['ring'].chunks[0]",
        "objects['ring'].chunks[1]",
        "attrs['emb']",
        "attrs['step']",
    ]
    assert leaves[0] is state.object("ring").chunks[0]
    assert leaves[3] == 3
    assert spec == ss.tree_flatten(state)[1]


def test_tree_flatten_with_keys_root_and_positions() -> None:
    assert ss.tree_flatten_with_keys(torch.zeros(1))[0] == ["<root>"]
    assert ss.tree_flatten_with_keys([1, (2, {"k": 3})])[0] == ["[0]", "[1][0]", "[1][1]['k']"]
    assert ss.tree_flatten_with_keys({5: "v"})[0] == ["[5]"]


def test_tree_equal_sparse_and_nested_tensors() -> None:
    dense = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    assert ss.tree_equal(dense.to_sparse(), dense.to_sparse())
    assert not ss.tree_equal(dense.to_sparse(), (dense * 2).to_sparse())
    assert not ss.tree_equal(dense.to_sparse(), dense)
    parts = [torch.zeros(2, 3), torch.ones(4, 3)]
    nested = torch.nested.nested_tensor(parts, layout=torch.jagged)
    assert ss.tree_equal(nested, torch.nested.nested_tensor(parts, layout=torch.jagged))
    other = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(4, 3)], layout=torch.jagged)
    assert not ss.tree_equal(nested, other)
