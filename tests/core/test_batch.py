"""Batches: `stack`, `vmap` and `unstack` of records.

A batch stepped by `vmap` gives, record by record, what the step gives each record on its
own (`torch.equal` here: the twenty-line model's kernels do not depend on the batch); what
the records share stays one tensor and is shared again after `unstack`; records that cannot
be stacked are refused naming the first difference.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sessionstate as ss
from tests.support import alias_graph


class Session(ss.SessionState):
    steps = ss.SessionAttr(0, coerce=int, doc="Completed steps.")


def new_session() -> Session:
    ring = ss.LatentBuffer(name="latents", dim=0).allocate(maxlen=3)
    return Session(objects={"latents": ring})


def step(state: Session, x: torch.Tensor) -> tuple[Session, torch.Tensor]:
    # The README's twenty-line model, with a linear map to give the kernels some work.
    state = state.update_object("latents", lambda ring: ring.commit(x))
    out = state.object("latents", ss.LatentBuffer).concat().mean(dim=0) @ WEIGHT
    return state.with_attrs(steps=state.steps + 1), out


WEIGHT = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))


def _forked(n: int) -> list[Session]:
    # A shared history of two chunks, then one chunk of each record's own.
    source = new_session()
    for t in range(2):
        source, _ = step(source, torch.full((1, 4), float(t)))
    return [step(source, torch.full((1, 4), 10.0 + i))[0] for i in range(n)]


def test_a_vmapped_batch_steps_as_each_record_on_its_own() -> None:
    records = _forked(4)
    batch = ss.stack(records)
    assert batch.size == 4
    assert batch.shared == 2  # the two history chunks every record holds
    xs = torch.randn(4, 1, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        batch, outs = ss.vmap(step)(batch, xs)
        expected = [step(r, xs[i]) for i, r in enumerate(records)]
        records = [state for state, _ in expected]
        for i, (_, out) in enumerate(expected):
            assert torch.equal(outs[i], out)
        xs = xs + 1.0
    back = ss.unstack(batch)
    for got, want in zip(back, records, strict=True):
        assert ss.tree_equal(got, want)
        assert got.steps == want.steps == 5


def test_what_the_records_share_stays_one_tensor_and_is_shared_again() -> None:
    records = _forked(3)
    history = records[0].object("latents", ss.LatentBuffer).view()[1]  # kept by the ring
    batch, _ = ss.vmap(step)(ss.stack(records), torch.zeros(3, 1, 4))
    back = ss.unstack(batch)
    # The oldest chunk was left as it was: one storage for all three, the records' own.
    firsts = [r.object("latents", ss.LatentBuffer).view()[0] for r in back]
    assert {t.untyped_storage().data_ptr() for t in firsts} == {
        history.untyped_storage().data_ptr()
    }
    total = ss.nbytes_by_device(back)["cpu"]
    alone = sum(ss.nbytes_by_device(r)["cpu"] for r in back)
    assert total < alone
    # Batched leaves are each record's own, not views into the stacked tensor.
    newest = [r.object("latents", ss.LatentBuffer).view()[-1] for r in back]
    assert len({t.untyped_storage().data_ptr() for t in newest}) == 3
    assert all(t.untyped_storage().nbytes() == 16 for t in newest)


def test_unstack_of_a_stack_is_the_records() -> None:
    records = _forked(3)
    for copy in (True, False):
        back = ss.unstack(ss.stack(records), copy=copy)
        assert all(ss.tree_equal(a, b) for a, b in zip(back, records, strict=True))


@pytest.mark.parametrize(
    ("other", "match"),
    [
        (lambda s: s.with_attrs(steps=9), r"attrs.*steps.*is 3 in record 0 but 9 in record 1"),
        (
            lambda s: s.update_object("latents", lambda r: r.reset().commit(torch.zeros(1, 4))),
            r"structures differ",
        ),
        (
            lambda s: Session(
                objects={"latents": ss.LatentBuffer(name="latents", dim=0).allocate(maxlen=5)}
            ),
            r"structures differ",
        ),
        (
            lambda s: s.update_object(
                "latents", lambda r: r.reset().commit(torch.zeros(1, 4, dtype=torch.float64))
            ),
            r"structures differ|float64",
        ),
    ],
)
def test_records_that_cannot_be_stacked_are_refused_naming_the_difference(
    other: Any, match: str
) -> None:
    record = _forked(1)[0]
    with pytest.raises(ValueError, match=match):
        ss.stack([record, other(record)])


def test_a_leaf_of_another_shape_is_named_with_its_path() -> None:
    a = ss.SessionState(attrs={"x": torch.zeros(2)})
    b = ss.SessionState(attrs={"x": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"x.*is \(2,\) torch.float32 on cpu in record 0 but "):
        ss.stack([a, b])
    with pytest.raises(ValueError, match="at least one record"):
        ss.stack([])


def test_vmap_of_the_twenty_line_step_over_sixteen_sessions_is_sixteen_steps() -> None:
    records = _forked(16)
    xs = torch.randn(16, 1, 4, generator=torch.Generator().manual_seed(2))
    batch, outs = ss.vmap(step)(ss.stack(records), xs)
    for record, x, out, got in zip(records, xs, outs, ss.unstack(batch), strict=True):
        want, expected = step(record, x)
        assert torch.equal(out, expected)
        assert ss.tree_equal(got, want)


@st.composite
def _family(draw: st.DrawFn) -> list[ss.SessionState]:
    # Records of one layout: per record a base tensor, a slice of it, the base again (an
    # alias), a tensor of its own, maybe a stride-0 view of the base; maybe one tensor every
    # record holds (a fork's history).
    n = draw(st.integers(1, 5))
    size = draw(st.integers(2, 6))
    start = draw(st.integers(0, size - 1))
    with_history, with_grid = draw(st.booleans()), draw(st.booleans())
    shared = torch.arange(3.0)
    records = []
    for r in range(n):
        base = torch.arange(float(size)) + 10 * r
        attrs: dict[str, Any] = {"base": base, "part": base[start:], "again": base}
        attrs["own"] = torch.full((2,), float(r))
        if with_history:
            attrs["history"] = shared
        if with_grid:
            attrs["grid"] = base.view(1, size).expand(2, size)
        records.append(ss.SessionState(attrs=attrs))
    return records


@settings(max_examples=60, deadline=None)
@given(_family())
def test_unstack_of_a_stack_keeps_every_leaf_and_the_sharing(records: list[Any]) -> None:
    batch = ss.stack(records)
    for copy in (True, False):
        back = ss.unstack(batch, copy=copy)
        for got, want in zip(back, records, strict=True):
            assert ss.tree_equal(got, want)
            if copy:
                assert alias_graph(got) == alias_graph(want)
        if copy:  # what every record held is one tensor, shared again; nothing else is
            first = records[0].attrs
            shared = [k for k in first if all(r.attrs[k] is first[k] for r in records)]
            for k in shared:
                assert all(b.attrs[k] is records[0].attrs[k] for b in back)
    # The batch holds what the records share once and each record's own storages once.
    own = ss.nbytes_by_device([r.attrs[k] for r in records for k in r.attrs])
    assert ss.nbytes_by_device(list(batch.leaves)) == own


# -- reliability round 5 (issue 50) -----------------------------------------------------------


def test_a_storage_every_record_reaches_through_its_own_equal_view_stays_shared() -> None:
    # Each record holds a tensor object of its own, the same view of one history: it stays
    # one tensor in the batch (no copy) and every record gets that storage back.
    history = torch.arange(12.0)
    records = [ss.SessionState(attrs={"h": history[2:10].view(2, 4)}) for _ in range(3)]
    assert records[0].attrs["h"] is not records[1].attrs["h"]
    batch = ss.stack(records)
    assert batch.shared == 1
    assert batch.dims == (None,)
    assert batch.leaves[0].untyped_storage().data_ptr() == history.untyped_storage().data_ptr()
    for copy in (True, False):
        back = ss.unstack(batch, copy=copy)
        for got, want in zip(back, records, strict=True):
            assert ss.tree_equal(got, want)
            leaf = got.attrs["h"]
            assert leaf.untyped_storage().data_ptr() == history.untyped_storage().data_ptr()
            assert (leaf.storage_offset(), leaf.stride()) == (2, (4, 1))
    # A view at another offset, or with other strides, in one record is stacked (a copy).
    for other in (history[:8].view(2, 4), history[2:10].view(4, 2).t()):
        mixed = [*records[:2], ss.SessionState(attrs={"h": other})]
        assert ss.stack(mixed).dims == (0,)
        back = ss.unstack(ss.stack(mixed))
        assert all(ss.tree_equal(a, b) for a, b in zip(back, mixed, strict=True))


def test_views_of_one_storage_are_grouped_only_when_offset_and_stride_agree() -> None:
    # Record 0 holds a matrix and its transpose; record 1 holds its own matrix twice. The
    # records do not lay their storage out alike: each comes back with its own values (read
    # through record 0's layout, record 1's `b` would be its transpose).
    m = torch.arange(4.0).view(2, 2)
    n = torch.arange(4.0, 8.0).view(2, 2)
    records = [ss.SessionState(attrs={"a": m, "b": m.t()}), ss.SessionState(attrs={"a": n, "b": n})]
    for copy in (True, False):
        back = ss.unstack(ss.stack(records), copy=copy)
        assert all(ss.tree_equal(got, want) for got, want in zip(back, records, strict=True))


def test_unstack_without_copies_gives_views_into_the_stacked_tensors() -> None:
    # `copy=False`: each record's batched leaves are views of the batch's stacked storage
    # (a base and its slice, stacked as their storage, too), not copies of it.
    records = []
    for i in range(3):
        base = torch.arange(6.0) + 10 * i
        records.append(
            ss.SessionState(
                attrs={"own": torch.full((2,), float(i)), "base": base, "part": base[2:]}
            )
        )
    batch = ss.stack(records)
    stacked = {
        path: leaf.untyped_storage().data_ptr()
        for path, leaf in zip(batch.paths, batch.leaves, strict=True)
    }
    for copy in (False, True):
        back = ss.unstack(batch, copy=copy)
        for got, want in zip(back, records, strict=True):
            assert ss.tree_equal(got, want)
            for key, path in (
                ("own", "attrs['own']"),
                ("base", "attrs['base']"),
                ("part", "attrs['part']"),
            ):
                views = got.attrs[key].untyped_storage().data_ptr() == stacked[path]
                assert views is not copy
