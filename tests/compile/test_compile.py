"""`sessionstate.compile`: whole steps under `torch.compile`, structures counted, donation.

Every compiled result is compared with the eager step's, bitwise (`tree_equal`, `torch.equal`),
under ``backend="aot_eager"``; addresses are compared by `data_ptr`.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

import sessionstate as ss
from sessionstate import GatheredKV, KVCache, KVPool, LatentBuffer, TensorCache


class Session(ss.SessionState):
    steps = ss.SessionAttr(0, coerce=int, doc="Completed steps.")


def readme_session() -> Session:
    ring = ss.LatentBuffer(name="latents", dim=0).allocate(maxlen=2)
    return Session(objects={"latents": ring})


def readme_step(state: Session, x: torch.Tensor) -> tuple[Session, torch.Tensor]:
    """The README's step, word for word."""
    state = state.update_object("latents", lambda ring: ring.commit(x))
    out = state.object("latents").concat().mean(dim=0)
    return state.with_attrs(steps=state.steps + 1), out


def rich_session() -> Session:
    ring = LatentBuffer(name="latents", dim=0).allocate(maxlen=2)
    cache = TensorCache(name="feat").allocate().commit((torch.zeros(3), torch.ones(2, 2)))
    return Session(objects={"latents": ring, "feat": cache})


def rich_step(state: Session, x: torch.Tensor) -> tuple[Session, torch.Tensor]:
    """A ring commit, a TensorCache commit through `with_object`, `with_attrs`."""
    state = state.update_object("latents", lambda r: r.commit(x))
    feat = state.object("feat", TensorCache).view()
    cache = state.object("feat", TensorCache).commit((feat[0] + x.sum(), feat[1] * 2))
    state = state.with_object("feat", cache)
    out = state.object("latents", LatentBuffer).concat().mean(dim=0)
    return state.with_attrs(steps=state.steps + 1), out


POOL = KVPool(8, block_tokens=1, token_shape=(2,))


def kv_session() -> Session:
    cache = KVCache(name="kv").allocate()
    gathered = GatheredKV(torch.zeros(2, 2), pool=POOL, gathered=2)
    return Session(objects={"kv": attrs.evolve(cache, handle=gathered)})


def kv_step(state: Session, x: torch.Tensor) -> tuple[Session, torch.Tensor]:
    """A K/V read and a windowed append through gathered K/V."""
    tokens = state.object("kv", KVCache).read()
    assert tokens is not None
    state = state.update_object("kv", lambda c: c.append(POOL, x, window=4))
    return state.with_attrs(steps=state.steps + 1), tokens.sum(0)


def _inputs(n: int, shape: tuple[int, ...] = (1, 4)) -> list[torch.Tensor]:
    return [torch.full(shape, float(i)) for i in range(n)]


def _same(a: Any, b: Any) -> bool:
    # A `GatheredKV` is a leaf compared by identity: compare what it holds.
    def open_kv(leaf: Any) -> Any:
        return (leaf.tokens, leaf.gathered, leaf.dropped) if isinstance(leaf, GatheredKV) else leaf

    return ss.tree_equal(ss.tree_map(open_kv, a), ss.tree_map(open_kv, b))


@pytest.mark.parametrize(
    ("make", "step", "shape"),
    [
        (readme_session, readme_step, (1, 4)),
        (rich_session, rich_step, (1, 4)),
        (kv_session, kv_step, (1, 2)),
    ],
    ids=["readme", "rich", "kv"],
)
def test_a_whole_step_compiles_bit_identical_to_eager(make: Any, step: Any, shape: Any) -> None:
    fast = ss.compile(step, backend="aot_eager")
    compiled, eager = make(), make()
    for x in _inputs(6, shape):
        compiled, out = fast(compiled, x.clone())
        eager, expected = step(eager, x.clone())
        assert torch.equal(out, expected)
        assert _same(compiled, eager)


@pytest.mark.parametrize(
    ("make", "step", "shape"),
    [(readme_session, readme_step, (1, 4)), (kv_session, kv_step, (1, 2))],
    ids=["readme", "kv"],
)
def test_a_whole_step_has_no_graph_break(make: Any, step: Any, shape: Any) -> None:
    state = make()
    for x in _inputs(3, shape):  # a ring full, a window reached
        state, _ = step(state, x)
    explained = torch._dynamo.explain(step)(state, torch.ones(shape))
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1


def test_a_new_structure_compiles_once_and_a_counter_does_not_recompile() -> None:
    fast = ss.compile(readme_step, backend="aot_eager")
    state = readme_session()
    for x in _inputs(10):
        state, _ = fast(state, x)
    # The ring holds 0, 1, then 2 chunks: three structures; the int counter is not one.
    assert fast.structures == 3
    assert fast.compiles == 3
    assert state.steps == 10


def test_gathered_kv_is_one_structure_however_long_it_runs() -> None:
    fast = ss.compile(kv_step, backend="aot_eager")
    state = kv_session()
    for x in _inputs(12, (1, 2)):
        state, _ = fast(state, x)
    # An opaque leaf counts by its type: a new `GatheredKV` each step is not a new structure.
    # The two: `steps` unset (its default), then set.
    assert fast.structures == 2
    assert state.steps == 12


def test_the_structure_bound_raises_rather_than_falls_back() -> None:
    fast = ss.compile(readme_step, backend="aot_eager", max_structures=2)
    state = readme_session()
    state, _ = fast(state, torch.ones(1, 4))
    state, _ = fast(state, torch.ones(1, 4))
    with pytest.raises(ss.RecompileLimitError, match="max_structures=2"):
        fast(state, torch.ones(1, 4))


def _ptrs(state: Any) -> list[int]:
    return [t.data_ptr() for t in ss.tree_leaves(state) if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_donation_keeps_every_address_from_step_two_and_stays_bit_identical(backend: str) -> None:
    # Under "eager" the writes run in program order (no functionalization): a ring's chunk
    # moving down one place must be read before the chunk it moves into is written.
    fast = ss.compile(rich_step, backend=backend, donate=True)
    compiled, eager = rich_session(), rich_session()
    addresses = []
    for x in _inputs(100):
        compiled, out = fast(compiled, x.clone())
        eager, expected = rich_step(eager, x.clone())
        assert torch.equal(out, expected)
        assert _same(compiled, eager)
        addresses.append(_ptrs(compiled))
    assert all(a == addresses[1] for a in addresses[1:])
    assert fast.donated == 100
    assert fast.structures == 3


def swap_step(state: Session, x: torch.Tensor) -> tuple[Session, torch.Tensor]:
    """Two cache tensors trade places: each write's source is the other's target."""
    a, b = state.object("feat", TensorCache).view()
    state = state.update_object("feat", lambda c: c.commit((b, a)))
    return state, x


def swap_session() -> Session:
    pair = (torch.zeros(2), torch.ones(2))
    return Session(objects={"feat": TensorCache(name="feat").allocate().commit(pair)})


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_donated_leaves_that_trade_places_keep_their_values(backend: str) -> None:
    fast = ss.compile(swap_step, backend=backend, donate=True)
    compiled, eager = swap_session(), swap_session()
    for x in _inputs(4):
        compiled, _ = fast(compiled, x)
        eager, _ = swap_step(eager, x)
        assert _same(compiled, eager)
    assert fast.donated >= 3


def test_a_record_held_elsewhere_is_copied_never_written() -> None:
    fast = ss.compile(rich_step, backend="aot_eager", donate=True)
    state = rich_session()
    for x in _inputs(3):
        state, _ = fast(state, x.clone())
    kept = state
    snapshot = ss.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, kept)
    new, _ = fast(state, torch.full((1, 4), 9.0))
    assert fast.copied == 1
    assert _same(kept, snapshot)
    del new


def test_a_held_sub_object_or_tensor_turns_donation_off() -> None:
    fast = ss.compile(rich_step, backend="aot_eager", donate=True)
    state = rich_session()
    for x in _inputs(3):
        state, _ = fast(state, x.clone())
    ring = state.object("latents", LatentBuffer)
    chunks = ring.view()
    before = [c.clone() for c in chunks]
    del ring
    state, _ = fast(state, torch.full((1, 4), 9.0))
    assert all(torch.equal(a, b) for a, b in zip(chunks, before, strict=True))


def test_stepping_again_from_a_donated_record_raises() -> None:
    fast = ss.compile(readme_step, backend="aot_eager", donate=True)
    state = readme_session()
    for x in _inputs(3):
        state, _ = fast(state, x.clone())
    new, _ = fast(state, torch.ones(1, 4))  # `state` is consumed: donated
    assert fast.donated == 3  # the first, empty ring had no tensor to give
    with pytest.raises(ss.DonatedRecordError):
        fast(state, torch.ones(1, 4))
    del new
