"""Examples for `sessionstate._objects`: the `StateObject` contract and `LatentBuffer`."""

from __future__ import annotations

import gc
import re
import weakref
from typing import Any

import attrs
import pytest
import torch

import sessionstate as ss
from sessionstate import LatentBuffer, NotAllocatedError, StateObject


def _chunk(value: float, frames: int = 1) -> torch.Tensor:
    """A fresh (1, frames, 4) float32 chunk: its own 16 * frames byte storage."""
    return torch.full((1, frames, 4), float(value))


def _snapshot(buf: LatentBuffer) -> tuple[torch.Tensor, ...]:
    return tuple(c.clone() for c in buf.chunks)


# --- the contract ---------------------------------------------------------------------------


def test_state_object_is_abstract() -> None:
    with pytest.raises(TypeError):
        StateObject()  # type: ignore[abstract]
    assert isinstance(LatentBuffer(), StateObject)


def test_a_custom_state_object_record() -> None:
    @ss.record
    class Counter(StateObject):
        total: Any = ss.field(default=None)
        on: bool = ss.static_field(default=False)

        @property
        def is_allocated(self) -> bool:
            return self.on

        def allocate(self, **sizing: Any) -> Counter:
            return Counter(torch.zeros(()), on=True)

        def commit(self, payload: Any, /) -> Counter:
            return Counter(self.total + payload, on=True)

        def view(self) -> Any:
            return self.total

        def reset(self) -> Counter:
            return self.allocate()

        def evict(self) -> Counter:
            return Counter()

    c = Counter().allocate().commit(torch.tensor(2.0))
    assert c.view().item() == 2.0
    assert c.nbytes_by_device() == {"cpu": 4}
    assert c.evict().nbytes_by_device() == {}
    state = ss.SessionState(objects={"c": c})
    assert state.nbytes_by_device() == {"cpu": 4}


# --- allocation -----------------------------------------------------------------------------


def test_a_new_buffer_is_not_allocated() -> None:
    buf = LatentBuffer(name="frames")
    assert not buf.is_allocated
    assert len(buf) == 0
    assert buf.nbytes_by_device() == {}


@pytest.mark.parametrize(
    "use",
    [
        pytest.param(lambda b: b.commit(_chunk(0)), id="commit"),
        pytest.param(lambda b: b.view(), id="view"),
        pytest.param(lambda b: b.view(last=1), id="view-last"),
        pytest.param(lambda b: b.concat(), id="concat"),
        pytest.param(lambda b: b.reset(), id="reset"),
    ],
)
def test_use_before_allocate_names_the_buffer_and_the_fix(use: Any) -> None:
    buf = LatentBuffer(name="video_latents", dim=1)
    with pytest.raises(NotAllocatedError) as info:
        use(buf)
    assert isinstance(info.value, RuntimeError)
    text = str(info.value)
    assert "`video_latents`" in text
    assert "not allocated" in text
    assert "`.allocate(maxlen=...)`" in text


def test_allocate_returns_a_new_buffer() -> None:
    buf = LatentBuffer(name="r", dim=1)
    ring = buf.allocate(maxlen=3)
    assert not buf.is_allocated
    assert buf.maxlen is None
    assert ring.is_allocated
    assert (ring.name, ring.dim, ring.maxlen) == ("r", 1, 3)
    assert ring.allocate().maxlen is None


def test_allocate_empties_a_buffer() -> None:
    buf = LatentBuffer(dim=1).allocate().commit(_chunk(1))
    again = buf.allocate(maxlen=2)
    assert len(again) == 0
    assert len(buf) == 1


@pytest.mark.parametrize("maxlen", [0, -1, -100, True, False, 1.0, 2.5, "2", [2]], ids=repr)
def test_invalid_maxlen_raises_value_error(maxlen: object) -> None:
    with pytest.raises(ValueError, match=re.escape("`maxlen` must be a positive int or None")):
        LatentBuffer().allocate(maxlen=maxlen)  # type: ignore[arg-type]


@pytest.mark.parametrize("maxlen", [1, 2, 64, 10**9])
def test_positive_maxlen_is_accepted(maxlen: int) -> None:
    assert LatentBuffer().allocate(maxlen=maxlen).maxlen == maxlen


# --- commit: ring and accumulate -------------------------------------------------------------


def test_ring_drops_the_oldest_chunk() -> None:
    committed = [_chunk(i) for i in range(5)]
    ring = LatentBuffer(name="r", dim=1).allocate(maxlen=3)
    lengths = []
    for chunk in committed:
        ring = ring.commit(chunk)
        lengths.append(len(ring))
    assert lengths == [1, 2, 3, 3, 3]
    assert [c is k for c, k in zip(ring.view(), committed[2:], strict=True)] == [True] * 3


def test_ring_of_one_keeps_the_newest() -> None:
    ring = LatentBuffer(dim=1).allocate(maxlen=1)
    a, b = _chunk(1), _chunk(2)
    ring = ring.commit(a).commit(b)
    assert ring.view() == (b,)


def test_unbounded_buffer_accumulates() -> None:
    committed = [_chunk(i, frames=i + 1) for i in range(6)]
    buf = LatentBuffer(dim=1).allocate()
    for chunk in committed:
        buf = buf.commit(chunk)
    assert len(buf) == 6
    assert all(c is k for c, k in zip(buf.view(), committed, strict=True))


def test_chunks_may_differ_along_the_time_dim() -> None:
    buf = LatentBuffer(dim=1).allocate().commit(_chunk(0, frames=1)).commit(_chunk(1, frames=3))
    assert buf.concat().shape == (1, 4, 4)


# --- view -----------------------------------------------------------------------------------


def _ring_of(maxlen: int | None, count: int) -> tuple[LatentBuffer, list[torch.Tensor]]:
    committed = [_chunk(i) for i in range(count)]
    buf = LatentBuffer(name="vae_encoder_out", dim=1).allocate(maxlen=maxlen)
    for chunk in committed:
        buf = buf.commit(chunk)
    return buf, committed


def test_view_returns_oldest_to_newest() -> None:
    buf, committed = _ring_of(None, 3)
    assert buf.view() == tuple(committed)
    assert isinstance(buf.view(), tuple)


def test_view_last_returns_the_newest() -> None:
    buf, committed = _ring_of(4, 6)
    assert buf.view(last=1) == (committed[5],)
    assert buf.view(last=3) == tuple(committed[3:])
    assert buf.view(last=4) == tuple(committed[2:])
    assert buf.view(last=0) == ()


def test_view_last_larger_than_len_returns_everything_held() -> None:
    ring, committed = _ring_of(5, 2)
    assert ring.view(last=5) == tuple(committed)
    unbounded, committed = _ring_of(None, 2)
    assert unbounded.view(last=100) == tuple(committed)


def test_view_last_larger_than_maxlen_raises() -> None:
    ring, _ = _ring_of(2, 5)
    with pytest.raises(ValueError, match=re.escape("retains at most 2")):
        ring.view(last=3)
    # Even while the ring holds fewer chunks than it could.
    small, _ = _ring_of(2, 1)
    with pytest.raises(ValueError, match=re.escape("Requested 3 chunks")):
        small.view(last=3)


@pytest.mark.parametrize("last", [-1, True, 1.5, "1"], ids=repr)
def test_view_last_must_be_a_non_negative_int(last: object) -> None:
    buf, _ = _ring_of(None, 2)
    with pytest.raises(ValueError, match=re.escape("`last` must be a non-negative int or None")):
        buf.view(last=last)  # type: ignore[arg-type]


def test_view_of_an_empty_allocated_buffer() -> None:
    buf = LatentBuffer().allocate(maxlen=2)
    assert buf.view() == ()
    assert buf.view(last=2) == ()


# --- concat ---------------------------------------------------------------------------------


def test_concat_joins_along_dim() -> None:
    buf, committed = _ring_of(3, 4)
    assert torch.equal(buf.concat(), torch.cat(committed[1:], dim=1))
    assert torch.equal(buf.concat(last=2), torch.cat(committed[2:], dim=1))
    assert buf.concat().shape == (1, 3, 4)


def test_concat_along_dim_zero() -> None:
    buf = LatentBuffer(dim=0).allocate().commit(torch.ones(2, 3)).commit(torch.zeros(1, 3))
    assert torch.equal(buf.concat(), torch.tensor([[1.0] * 3, [1.0] * 3, [0.0] * 3]))


def test_concat_is_a_new_tensor() -> None:
    only = _chunk(7)
    buf = LatentBuffer(dim=1).allocate().commit(only)
    out = buf.concat()
    out.add_(1)
    assert torch.equal(buf.view()[0], _chunk(7))
    assert only.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()


def test_concat_of_an_empty_buffer_raises() -> None:
    with pytest.raises(ValueError, match="is empty"):
        LatentBuffer(name="e").allocate().concat()
    buf, _ = _ring_of(None, 2)
    with pytest.raises(ValueError, match="`last=0` selects no chunks"):
        buf.concat(last=0)


def test_concat_checks_last_like_view() -> None:
    ring, _ = _ring_of(2, 2)
    with pytest.raises(ValueError, match="retains at most 2"):
        ring.concat(last=3)


# --- reset / evict --------------------------------------------------------------------------


def test_reset_empties_and_keeps_configuration() -> None:
    ring, _ = _ring_of(3, 5)
    before = _snapshot(ring)
    empty = ring.reset()
    assert len(empty) == 0
    assert (empty.name, empty.dim, empty.maxlen, empty.is_allocated) == (
        "vae_encoder_out",
        1,
        3,
        True,
    )
    assert empty.nbytes_by_device() == {}
    assert ss.tree_equal(ring.chunks, before)
    refilled = empty.commit(_chunk(9))
    assert len(refilled) == 1
    assert refilled.maxlen == 3


def test_evict_releases_storage_and_requires_allocate() -> None:
    ring, _ = _ring_of(3, 3)
    evicted = ring.evict()
    assert not evicted.is_allocated
    assert len(evicted) == 0
    assert evicted.nbytes_by_device() == {}
    assert evicted.name == "vae_encoder_out"
    assert len(ring) == 3
    with pytest.raises(NotAllocatedError):
        evicted.commit(_chunk(0))
    with pytest.raises(NotAllocatedError):
        evicted.view()
    revived = evicted.allocate(maxlen=2).commit(_chunk(1))
    assert len(revived) == 1


def test_evict_drops_the_reference_to_the_chunks() -> None:
    chunk = _chunk(1)
    alive = weakref.ref(chunk)
    buf = LatentBuffer(dim=1).allocate().commit(chunk)
    del chunk
    evicted = buf.evict()
    del buf
    gc.collect()
    assert alive() is None
    assert evicted.chunks == ()


def test_evict_of_a_never_allocated_buffer() -> None:
    assert not LatentBuffer().evict().is_allocated


# --- structural sharing and immutability ----------------------------------------------------


def test_commit_shares_the_chunks_it_keeps() -> None:
    buf, _ = _ring_of(None, 3)
    new = buf.commit(_chunk(3))
    assert all(a is b for a, b in zip(buf.chunks, new.chunks[:3], strict=True))
    ring, _ = _ring_of(3, 3)
    shifted = ring.commit(_chunk(3))
    assert all(a is b for a, b in zip(ring.chunks[1:], shifted.chunks[:2], strict=True))


def test_commit_does_not_copy_the_payload() -> None:
    chunk = _chunk(1)
    buf = LatentBuffer(dim=1).allocate().commit(chunk)
    assert buf.chunks[0] is chunk


def test_old_versions_are_unchanged() -> None:
    versions = [LatentBuffer(name="v", dim=1).allocate(maxlen=3)]
    snapshots = [_snapshot(versions[0])]
    for i in range(8):
        versions.append(versions[-1].commit(_chunk(i, frames=1 + i % 2)))
        snapshots.append(_snapshot(versions[-1]))
        versions.append(versions[-1].reset() if i == 5 else versions[-1])
        snapshots.append(_snapshot(versions[-1]))
    for version, snapshot in zip(versions, snapshots, strict=True):
        assert ss.tree_equal(version.chunks, snapshot)
        assert version.maxlen == 3


def test_a_buffer_is_a_frozen_record() -> None:
    buf = LatentBuffer().allocate()
    with pytest.raises(ss.ImmutableRecordError):
        buf.chunks = (torch.zeros(1, 1, 1),)  # type: ignore[misc]
    assert attrs.has(LatentBuffer)


def test_chunks_are_always_a_tuple() -> None:
    buf = LatentBuffer(chunks=[_chunk(0)], dim=1, allocated=True)
    assert isinstance(buf.chunks, tuple)


# --- chunk validation -----------------------------------------------------------------------


@pytest.mark.parametrize("payload", [[1.0, 2.0], 3.0, None, "x", (torch.zeros(1, 1, 1),)], ids=repr)
def test_commit_rejects_non_tensors(payload: object) -> None:
    with pytest.raises(TypeError, match="holds tensors"):
        LatentBuffer(name="b").allocate().commit(payload)  # type: ignore[arg-type]


def test_commit_rejects_a_chunk_without_the_time_dim() -> None:
    buf = LatentBuffer(name="b", dim=2).allocate()
    with pytest.raises(ValueError, match="needs at least 3 dims"):
        buf.commit(torch.zeros(4, 4))
    buf.commit(torch.zeros(4, 4, 1))


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(torch.zeros(1, 1, 4, dtype=torch.float64), id="dtype"),
        pytest.param(torch.zeros(1, 1, 4, device="meta"), id="device"),
        pytest.param(torch.zeros(1, 1, 5), id="trailing-dim"),
        pytest.param(torch.zeros(2, 1, 4), id="leading-dim"),
        pytest.param(torch.zeros(1, 1, 4, 1), id="extra-dim"),
        pytest.param(torch.zeros(1, 4), id="missing-dim"),
    ],
)
def test_commit_rejects_a_chunk_of_another_layout(bad: torch.Tensor) -> None:
    buf = LatentBuffer(name="b", dim=1).allocate().commit(_chunk(0))
    with pytest.raises(ValueError, match="LatentBuffer `b` holds chunks"):
        buf.commit(bad)
    assert len(buf) == 1


def test_reset_allows_a_new_layout() -> None:
    buf = LatentBuffer(dim=1).allocate().commit(_chunk(0))
    fresh = buf.reset().commit(torch.zeros(2, 3, 5, dtype=torch.float16))
    assert fresh.view()[0].dtype == torch.float16


def test_meta_chunks_are_accepted() -> None:
    ring = LatentBuffer(dim=1).allocate(maxlen=2)
    for _ in range(3):
        ring = ring.commit(torch.empty(1, 1, 4, device="meta"))
    assert ring.nbytes_by_device() == {"meta": 32}


# --- acceptance: bounded memory ------------------------------------------------------------


def test_ring_bytes_stay_constant_over_400_steps() -> None:
    ring = LatentBuffer(name="vae_encoder_out", dim=1).allocate(maxlen=2)
    chunk_bytes = 1 * 2 * 8 * 4  # (1, 2, 8) float32
    seen = []
    for step in range(400):
        ring = ring.commit(torch.full((1, 2, 8), float(step)))
        seen.append(ss.nbytes_by_device(ring))
    assert seen[0] == {"cpu": chunk_bytes}
    assert all(s == {"cpu": 2 * chunk_bytes} for s in seen[1:])
    assert len(ring) == 2
    assert torch.equal(ring.concat()[0, :, 0], torch.tensor([398.0, 398.0, 399.0, 399.0]))


def test_unbounded_buffer_grows_by_one_chunk_per_commit() -> None:
    buf = LatentBuffer(name="video_latents", dim=1).allocate()
    chunk_bytes = 1 * 2 * 8 * 4
    totals = []
    for step in range(400):
        buf = buf.commit(torch.full((1, 2, 8), float(step)))
        totals.append(ss.nbytes_by_device(buf)["cpu"])
    assert totals == [chunk_bytes * (i + 1) for i in range(400)]
    assert len(buf) == 400


def test_a_ring_of_views_of_one_storage_counts_it_once() -> None:
    frames = torch.zeros(1, 10, 4)  # 160 bytes
    ring = LatentBuffer(dim=1).allocate(maxlen=3)
    for i in range(10):
        ring = ring.commit(frames[:, i : i + 1])
    assert ring.nbytes_by_device() == {"cpu": 160}
