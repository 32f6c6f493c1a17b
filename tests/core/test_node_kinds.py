"""Every container kind a record may hold is known alike to every reader of a record.

`sessionstate._frozen.CONTAINERS` is the one table of those kinds. For each, a record holding
one (around a tensor) must flatten the same under optree and torch pytree, count its bytes,
compare with `tree_equal`, round-trip a snapshot as the same kind, and count in a manager. A
kind added to the table without teaching a reader fails here. A container outside the table
(which optree would flatten) is refused by the snapshot encoder, naming what a snapshot holds.
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.utils._pytree as torch_pytree

from sessionstate import (
    SessionState,
    SessionStateManager,
    TensorCache,
    dumps_state,
    loads_state,
    nbytes_by_device,
    tree_equal,
)
from sessionstate._frozen import CONTAINERS, CONTAINERS_BY_TAG, ContainerKind, freeze
from sessionstate._tree import tree_leaves


def _holding(kind: ContainerKind, tensor: torch.Tensor) -> Any:
    children: Any = {"t": tensor, "n": 1} if kind.mapping else [tensor, 1]
    return kind.build(children)


@pytest.mark.parametrize("kind", CONTAINERS, ids=lambda k: k.tag)
class TestEveryContainerKind:
    def test_flattens_alike_under_optree_and_torch_pytree(self, kind: ContainerKind) -> None:
        tensor = torch.arange(4.0)
        cache = TensorCache().allocate().commit(_holding(kind, tensor))
        for leaves in (tree_leaves(cache), torch_pytree.tree_leaves(cache)):
            assert [x for x in leaves if isinstance(x, torch.Tensor)] == [tensor]

    def test_counts_its_bytes_in_a_record_and_a_manager(self, kind: ContainerKind) -> None:
        tensor = torch.arange(4.0)
        cache = TensorCache().allocate().commit(_holding(kind, tensor))
        assert nbytes_by_device(cache) == {"cpu": 16}
        manager = SessionStateManager()
        manager.put("s", SessionState(objects={"c": cache}))
        assert manager.stats()["nbytes:cpu"] == 16

    def test_compares_with_tree_equal(self, kind: ContainerKind) -> None:
        cache = TensorCache().allocate().commit(_holding(kind, torch.arange(4.0)))
        same = TensorCache().allocate().commit(_holding(kind, torch.arange(4.0)))
        other = TensorCache().allocate().commit(_holding(kind, torch.arange(4.0) + 1))
        assert tree_equal(cache, same)
        assert not tree_equal(cache, other)
        for different in CONTAINERS:
            if different.cls is not kind.cls and different.mapping == kind.mapping:
                moved = TensorCache().allocate().commit(_holding(different, torch.arange(4.0)))
                assert not tree_equal(cache, moved)

    def test_round_trips_a_snapshot_as_the_same_kind(self, kind: ContainerKind) -> None:
        cache = TensorCache().allocate().commit(_holding(kind, torch.arange(4.0)))
        back = loads_state(dumps_state(cache))
        assert type(back.view()) is kind.cls
        assert tree_equal(back, cache)

    def test_is_stored_under_its_tag_from_its_format_on(self, kind: ContainerKind) -> None:
        assert CONTAINERS_BY_TAG[kind.tag] is kind
        assert kind.since >= 1


def test_freeze_yields_only_listed_kinds() -> None:
    frozen = freeze({"a": [1, {"b": (2, [3])}]}, "value")
    seen = []

    def walk(value: object) -> None:
        if isinstance(value, (int, str)):
            return
        seen.append(type(value))
        children = value.values() if hasattr(value, "values") else value
        for child in children:  # type: ignore[attr-defined]
            walk(child)

    walk(frozen)
    assert seen
    assert {kind for kind in seen} <= {kind.cls for kind in CONTAINERS}


@pytest.mark.parametrize(
    "value",
    [collections.OrderedDict(t=torch.zeros(1)), collections.deque([torch.zeros(1)])],
    ids=["OrderedDict", "deque"],
)
def test_a_container_outside_the_table_is_refused_by_the_snapshot(value: object) -> None:
    cache = TensorCache().allocate().commit(value)
    assert nbytes_by_device(cache) == {"cpu": 4}  # optree flattens it: it is counted
    with pytest.raises(TypeError, match="a tuple, list or dict, or a registered record"):
        dumps_state(cache)
