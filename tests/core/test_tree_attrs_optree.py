"""Where `_tree` leans on attrs and optree: the frozen `__setattr__`, the error, the marker."""

from __future__ import annotations

import pickle
import re

import attrs
import pytest

from sessionstate import ImmutableRecordError, field, record, register_record, tree_leaves
from sessionstate._tree import is_record


@record
class _Base:
    a: object = field()


@record
class _Child(_Base):
    b: object = field()


def test_a_record_names_the_fix_on_assignment() -> None:
    msg = (
        "`_Base` is immutable; `obj.a = ...` cannot assign. "
        "Use `obj = attrs.evolve(obj, a=...)`, which returns a new record."
    )
    with pytest.raises(ImmutableRecordError, match=re.escape(msg)):
        _Base(1).a = 2  # type: ignore[misc]


def test_a_class_with_its_own_setattr_keeps_it() -> None:
    @attrs.define(eq=False)
    class Mutable:
        a: object

    register_record(Mutable)
    m = Mutable(1)
    m.a = 2
    assert tree_leaves(m) == [2]


def test_the_error_is_attrs_frozen_error_with_our_message() -> None:
    exc = ImmutableRecordError("no")
    assert isinstance(exc, attrs.exceptions.FrozenInstanceError)
    assert (str(exc), exc.msg, exc.args) == ("no", "no", ("no",))
    again = pickle.loads(pickle.dumps(exc))
    assert (type(again), str(again)) == (ImmutableRecordError, "no")


def test_a_subclass_of_a_record_is_a_record_of_its_own() -> None:
    assert is_record(_Base)
    assert is_record(_Child)
    assert tree_leaves(_Child(1, 2)) == [1, 2]
