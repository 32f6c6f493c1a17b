"""Examples for `sessionstate._session`: `SessionState` and the `SessionAttr` descriptor."""

from __future__ import annotations

import re
from typing import Any

import attrs
import pytest
import torch
import torch.utils._pytree as torch_pytree

import sessionstate as ss
from sessionstate import LatentBuffer, SessionAttr, SessionState
from sessionstate._frozen import FrozenDict


class Counted(SessionState):
    steps = SessionAttr(0, coerce=int, doc="Completed steps.")
    language = SessionAttr(None, doc="The prompt text.")
    embeds = SessionAttr(None, doc="Encoded prompt.")


class MoreCounted(Counted):
    window = SessionAttr(4, coerce=int, doc="Local attention window.")
    language = SessionAttr("en", doc="Overrides the parent default.")


def _ring(name: str = "frames", maxlen: int | None = 2) -> LatentBuffer:
    return LatentBuffer(name=name, dim=0).allocate(maxlen=maxlen)


def _state() -> SessionState:
    ring = _ring().commit(torch.zeros(2, 4))
    return SessionState(objects={"frames": ring}, attrs={"step": 1, "emb": torch.ones(3)})


# --- buckets --------------------------------------------------------------------------------


def test_a_generic_session_holds_two_buckets() -> None:
    state = _state()
    assert list(state.objects) == ["frames"]
    assert isinstance(state.object("frames"), LatentBuffer)
    assert state.attrs["step"] == 1
    assert state.get_attr("step") == 1
    assert SessionState().objects == {}
    assert SessionState().attrs == {}


def test_buckets_are_read_only() -> None:
    state = _state()
    with pytest.raises(TypeError):
        state.objects["x"] = _ring()  # type: ignore[index]
    with pytest.raises(TypeError):
        state.attrs["x"] = 1  # type: ignore[index]
    with pytest.raises(ss.ImmutableRecordError):
        state.objects = {}  # type: ignore[misc]
    assert list(state.objects) == ["frames"]
    assert "x" not in state.attrs


def test_the_constructor_copies_its_mappings() -> None:
    objects: dict[str, Any] = {"frames": _ring()}
    attrs: dict[str, Any] = {"step": 1}
    state = SessionState(objects=objects, attrs=attrs)
    objects["other"] = _ring()
    attrs["step"] = 2
    assert list(state.objects) == ["frames"]
    assert state.attrs["step"] == 1


def test_object_lookup_of_a_missing_name() -> None:
    with pytest.raises(KeyError, match=re.escape("has no state object `nope`")):
        _state().object("nope")


def test_with_object_requires_a_state_object() -> None:
    with pytest.raises(TypeError, match="must be a StateObject"):
        SessionState().with_object("x", torch.zeros(1))  # type: ignore[arg-type]


# --- pure transitions -----------------------------------------------------------------------


def test_with_object_is_pure() -> None:
    state = _state()
    before = ss.tree_flatten(state)
    new = state.with_object("latents", _ring("latents", None))
    assert sorted(new.objects) == ["frames", "latents"]
    assert list(state.objects) == ["frames"]
    assert new.object("frames") is state.object("frames")
    assert new.attrs["emb"] is state.attrs["emb"]
    assert ss.tree_equal(state, ss.tree_unflatten(before[1], before[0]))


def test_with_object_replaces() -> None:
    state = _state()
    replaced = state.with_object("frames", _ring(maxlen=5))
    assert replaced.object("frames").maxlen == 5
    assert state.object("frames").maxlen == 2


def test_update_object_is_pure() -> None:
    state = _state()
    chunk = torch.ones(1, 4)
    new = state.update_object("frames", lambda b: b.commit(chunk))
    assert len(new.object("frames")) == 2
    assert new.object("frames").view()[-1] is chunk
    assert len(state.object("frames")) == 1
    with pytest.raises(KeyError):
        state.update_object("missing", lambda b: b)


def test_with_attrs_is_pure() -> None:
    state = _state()
    new = state.with_attrs(step=2, extra="x")
    assert (new.attrs["step"], new.attrs["extra"]) == (2, "x")
    assert state.attrs["step"] == 1
    assert "extra" not in state.attrs
    assert new.object("frames") is state.object("frames")


def test_clear_attrs_is_pure() -> None:
    state = _state()
    cleared = state.clear_attrs("emb", "never-set")
    assert dict(cleared.attrs) == {"step": 1}
    assert set(state.attrs) == {"step", "emb"}


def test_get_attr_lookup_order() -> None:
    state = Counted().with_attrs(steps=3)
    assert state.get_attr("steps") == 3
    assert state.get_attr("steps", 99) == 3
    assert state.get_attr("language") is None
    assert state.get_attr("undeclared", 7) == 7
    with pytest.raises(KeyError, match=re.escape("`undeclared` is not set")):
        state.get_attr("undeclared")
    assert SessionState(attrs={"n": None}).get_attr("n", 5) is None


def test_transitions_keep_the_subclass() -> None:
    state = Counted()
    assert type(state.with_attrs(steps=1)) is Counted
    assert type(state.clear_attrs("steps")) is Counted
    assert type(state.with_object("r", _ring())) is Counted
    assert type(state.with_object("r", _ring()).update_object("r", lambda b: b)) is Counted


# --- SessionAttr ----------------------------------------------------------------------------


def test_unset_attributes_read_as_defaults() -> None:
    state = Counted()
    assert state.steps == 0
    assert state.language is None
    assert dict(state.attrs) == {}


def test_attributes_are_coerced_on_write() -> None:
    state = Counted().with_attrs(steps="12")
    assert state.steps == 12
    assert isinstance(state.attrs["steps"], int)
    # None passes through coercion: it means "cleared to nothing", not "int(None)".
    assert Counted().with_attrs(steps=None).steps is None


def test_attributes_without_coercion_store_the_object() -> None:
    emb = torch.zeros(2)
    assert Counted().with_attrs(embeds=emb).embeds is emb


def test_clear_attrs_restores_the_default() -> None:
    assert Counted().with_attrs(steps=5).clear_attrs("steps").steps == 0


def test_session_attr_descriptor_metadata() -> None:
    descriptor = Counted.steps
    assert isinstance(descriptor, SessionAttr)
    assert descriptor.__doc__ == "Completed steps."
    assert descriptor.name == "steps"
    assert descriptor.default == 0
    assert repr(descriptor) == "SessionAttr(name='steps', default=0)"
    assert descriptor.convert("4") == 4
    assert descriptor.convert(None) is None
    assert SessionAttr(1).convert("raw") == "raw"


def test_declared_classes_refuse_undeclared_names() -> None:
    with pytest.raises(AttributeError, match=re.escape("declares no attribute `stpes`")):
        Counted().with_attrs(stpes=1)


def test_a_failed_with_attrs_changes_nothing() -> None:
    state = Counted().with_attrs(steps=1)
    with pytest.raises(ValueError, match="invalid literal"):
        state.with_attrs(steps="not a number")
    assert state.steps == 1


def test_generic_sessions_accept_any_name() -> None:
    assert SessionState().with_attrs(anything=1).attrs["anything"] == 1


def test_assigning_a_declared_attribute_raises_with_the_fix() -> None:
    state = Counted()
    with pytest.raises(ss.ImmutableRecordError, match=re.escape("state.with_attrs(steps=...)")):
        state.steps = 4  # type: ignore[misc]
    assert state.steps == 0


# --- subclasses -----------------------------------------------------------------------------


def test_subclasses_are_registered_pytree_nodes() -> None:
    emb = torch.ones(2)
    state = Counted(objects={"r": _ring().commit(torch.zeros(1, 4))}).with_attrs(embeds=emb)
    leaves = ss.tree_leaves(state)
    assert any(leaf is emb for leaf in leaves)
    assert len(leaves) == 2
    rebuilt = ss.tree_unflatten(ss.tree_flatten(state)[1], leaves)
    assert type(rebuilt) is Counted
    assert rebuilt.embeds is emb
    torch_leaves, spec = torch_pytree.tree_flatten(state)
    assert len(torch_leaves) == 2
    assert type(torch_pytree.tree_unflatten(torch_leaves, spec)) is Counted


def test_a_subclass_of_a_subclass_inherits_declarations() -> None:
    assert set(MoreCounted.__session_attrs__) == {"steps", "language", "embeds", "window"}
    state = MoreCounted().with_attrs(steps="2", window="8")
    assert (state.steps, state.window, state.language) == (2, 8, "en")
    assert Counted().language is None
    with pytest.raises(AttributeError):
        MoreCounted().with_attrs(nope=1)
    assert ss.tree_leaves(state) == [2, 8]


def test_a_locally_defined_subclass_is_registered() -> None:
    class Local(SessionState):
        value = SessionAttr(None)

    state = Local().with_attrs(value=torch.zeros(3))
    assert ss.nbytes_by_device(state) == {"cpu": 12}
    assert type(ss.tree_map(lambda t: t, state)) is Local


def test_sessions_of_different_classes_are_not_tree_equal() -> None:
    assert ss.tree_equal(Counted(), Counted())
    assert not ss.tree_equal(Counted(), MoreCounted())
    assert not ss.tree_equal(Counted(), SessionState())


# --- bytes ----------------------------------------------------------------------------------


def test_alias_between_buckets_counts_once() -> None:
    x = torch.zeros(80)  # 320 bytes
    ring = _ring(maxlen=None).commit(x.view(8, 10))
    state = SessionState(objects={"r": ring}, attrs={"alias": x[:8], "again": x})
    assert state.nbytes_by_device() == {"cpu": 320}
    grown = state.with_attrs(more=x.view(10, 8).t())
    assert grown.nbytes_by_device() == {"cpu": 320}


def test_both_buckets_are_counted() -> None:
    state = SessionState(
        objects={"r": _ring().commit(torch.zeros(2, 4))},
        attrs={"emb": torch.zeros(3, dtype=torch.float64), "m": torch.empty(4, device="meta")},
    )
    assert state.nbytes_by_device() == {"cpu": 32 + 24, "meta": 16}


def _total(per_value: dict[str, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for by_device in per_value.values():
        for device, nbytes in by_device.items():
            out[device] = out.get(device, 0) + nbytes
    return out


def test_nbytes_by_value_names_every_value() -> None:
    state = SessionState(
        objects={"r": _ring().commit(torch.zeros(2, 4)), "empty": _ring()},
        attrs={"emb": torch.zeros(3), "n": 3},
    )
    assert state.nbytes_by_value() == {
        "r": {"cpu": 32},
        "empty": {},
        "emb": {"cpu": 12},
        "n": {},
    }


def test_nbytes_by_value_sums_to_the_total() -> None:
    x = torch.zeros(80)
    state = SessionState(
        objects={"r": _ring(maxlen=None).commit(x.view(8, 10)).commit(torch.zeros(1, 10))},
        attrs={"alias": x[:8], "m": torch.empty(3, device="meta"), "own": torch.zeros(2)},
    )
    per_value = state.nbytes_by_value()
    assert _total(per_value) == state.nbytes_by_device() == {"cpu": 320 + 40 + 8, "meta": 12}
    assert set(per_value) == {"r", "alias", "m", "own"}


def test_nbytes_by_value_attributes_a_shared_storage_to_the_object() -> None:
    x = torch.zeros(80)
    state = SessionState(objects={"r": _ring(maxlen=None).commit(x)}, attrs={"alias": x[:8]})
    assert state.nbytes_by_value() == {"r": {"cpu": 320}, "alias": {}}


def test_nbytes_by_value_with_a_quoted_name() -> None:
    state = SessionState(attrs={"it's": torch.zeros(2)})
    assert state.nbytes_by_value() == {"it's": {"cpu": 8}}


# --- moving a session -----------------------------------------------------------------------


def test_moving_a_session_to_meta_keeps_its_configuration() -> None:
    ring = LatentBuffer(name="vae_encoder_out", dim=1).allocate(maxlen=2)
    ring = ring.commit(torch.zeros(1, 1, 4)).commit(torch.zeros(1, 1, 4))
    state = MoreCounted(objects={"vae": ring}).with_attrs(steps=3, embeds=torch.zeros(5))

    def to_meta(leaf: object) -> object:
        return leaf.to("meta") if isinstance(leaf, torch.Tensor) else leaf

    moved = ss.tree_map(to_meta, state)
    assert type(moved) is MoreCounted
    vae = moved.object("vae")
    assert isinstance(vae, LatentBuffer)
    assert (vae.name, vae.dim, vae.maxlen, vae.is_allocated) == ("vae_encoder_out", 1, 2, True)
    assert moved.steps == 3
    assert moved.window == 4
    assert moved.embeds.is_meta
    assert moved.nbytes_by_device() == {"meta": 16 + 16 + 20}
    assert state.nbytes_by_device() == {"cpu": 16 + 16 + 20}
    # The moved session still accepts commits of its own layout, on meta.
    moved = moved.update_object("vae", lambda b: b.commit(torch.empty(1, 1, 4, device="meta")))
    assert len(moved.object("vae")) == 2


def test_a_subclass_that_adds_fields_is_a_registered_record() -> None:
    @ss.record
    class WithField(SessionState):
        extra: torch.Tensor = ss.field(factory=lambda: torch.zeros(100))

    @attrs.frozen(eq=False)
    class WithAttrsField(SessionState):
        extra: torch.Tensor = attrs.field(factory=lambda: torch.zeros(50))

    for cls, nbytes in ((WithField, 400), (WithAttrsField, 200)):
        state = cls()
        assert [a.name for a in attrs.fields(cls)] == ["_objects", "_attrs", "extra"]
        assert ss.tree_leaves(state) == [state.extra]
        assert ss.nbytes_by_device(state) == {"cpu": nbytes}
        moved = state.with_attrs(step=1)
        assert type(moved) is cls
        assert moved.extra is state.extra
        manager = ss.SessionStateManager()
        manager.put("s", state)
        assert manager.stats()["total_nbytes"] == nbytes


# -- declared defaults are frozen, checked and counted like assigned values (issue 20, item 12) --


def test_a_list_default_is_frozen_so_no_record_can_change_another() -> None:
    class History(SessionState):
        hist = SessionAttr([], doc="Past actions.")
        cfg = SessionAttr({"ids": [1, 2]})

    first, second = History(), History()
    assert first.hist == ()
    with pytest.raises(AttributeError):
        first.hist.append(1)  # type: ignore[attr-defined]
    assert second.hist == () == History().hist
    assert first.cfg == FrozenDict({"ids": (1, 2)})
    with pytest.raises(TypeError):
        first.cfg["ids"] = ()  # type: ignore[index]
    assert History().with_attrs(hist=[]).hist == first.hist  # the same form as assigned


@pytest.mark.parametrize(
    ("default", "fix"),
    [
        ({1}, "a frozenset (`frozenset(value)`)"),
        (bytearray(b"ab"), "bytes (`bytes(value)`)"),
    ],
)
def test_a_mutable_default_with_no_frozen_form_is_refused_at_class_definition(
    default: object, fix: str
) -> None:
    msg = (
        f"Session attribute value `Bad.x` is a mutable {type(default).__name__}: {default!r}. "
        f"Session state is immutable all the way down; store {fix} instead."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):

        class Bad(SessionState):
            x = SessionAttr(default)

    with pytest.raises(TypeError):
        SessionState().with_attrs(x=default)  # the same refusal as an assigned value


def test_a_default_goes_through_its_coercion() -> None:
    class Coerced(SessionState):
        steps = SessionAttr("3", coerce=int)

    assert Coerced().steps == 3
    msg = (
        "Session attribute `steps` coerces its values with `int`, which refused 'many' (str): "
        "ValueError: invalid literal for int() with base 10: 'many'. Pass a value `int` accepts."
    )
    with pytest.raises(ValueError, match=re.escape(msg)):

        class Refused(SessionState):
            steps = SessionAttr("many", coerce=int)


def test_a_tensor_default_is_seen_by_accounting_leaves_and_moves() -> None:
    class WithTable(SessionState):
        table = SessionAttr(torch.ones(4), doc="A lookup table shared by new sessions.")

    state = WithTable()
    assert state.nbytes_by_device() == {"cpu": 16}
    assert any(leaf is WithTable.table.default for leaf in ss.tree_leaves(state))
    moved = ss.to_device(state, "meta")
    assert moved.table.device.type == "meta"
    assert state.table.device.type == "cpu"
    cleared = state.with_attrs(table=torch.zeros(2)).clear_attrs("table")
    assert cleared.nbytes_by_device() == {"cpu": 16}  # unset again: the default, still counted
    manager = ss.SessionStateManager[WithTable]()
    manager.put("a", state)
    manager.put("b", WithTable())
    assert manager.stats()["nbytes:cpu"] == 16  # one default, shared by both sessions


def test_object_typed_by_a_class_returns_it_or_names_both_types() -> None:
    from sessionstate import EncodeOnceKV

    state = SessionState(objects={"ring": LatentBuffer().allocate(maxlen=2)})
    ring = state.object("ring", LatentBuffer)
    assert ring is state.object("ring")
    msg = (
        "State object `ring` holds a LatentBuffer, but EncodeOnceKV was asked for; store one "
        "under `ring`, or ask for LatentBuffer."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        state.object("ring", EncodeOnceKV)
    with pytest.raises(KeyError, match=re.escape("Session has no state object `kv`")):
        state.object("kv", EncodeOnceKV)
