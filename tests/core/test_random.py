"""`RandomKey`: a session's random state, drawn from and split by pure transitions.

Examples, then properties against a model of the key (two Python ints, stream and counter):
every transition leaves the key it started from unchanged and drawing as before, a draw
advances the counter by one, splits are distinct from each other and from the parent's draws,
and a key continues bit for bit after a snapshot, a move and a fork of its session.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import sessionstate as ss
from sessionstate import NotAllocatedError, RandomKey

_SEEDS = st.integers(min_value=-(2**63), max_value=2**64 - 1)
_SHAPES = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3).map(tuple)


def _bits(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# --- examples -------------------------------------------------------------------------------


def test_a_key_is_a_state_object_with_one_int64_leaf() -> None:
    key = RandomKey.seeded(5)
    assert isinstance(key, ss.StateObject)
    assert not key.parkable
    (leaf,) = ss.tree_leaves(key)
    assert leaf.dtype == torch.int64
    assert leaf.tolist() == [5, 0]
    assert ss.nbytes_by_device(key) == {"cpu": 16}
    assert ss.nbytes_by_device(RandomKey()) == {}


def test_the_lifecycle() -> None:
    key = RandomKey(name="noise")
    assert not key.is_allocated
    key = key.allocate(seed=9)
    assert key.name == "noise"
    assert key.view().tolist() == [9, 0]
    _, drawn = key.normal((3,))
    assert drawn.counter == 1
    assert ss.tree_equal(drawn.reset(), key)  # counter rewound, stream kept
    assert not drawn.evict().is_allocated
    committed = key.commit(torch.tensor([1, 2]))
    assert committed.view().tolist() == [1, 2]
    assert committed.name == "noise"


def test_drawing_twice_from_one_key_draws_the_same_noise() -> None:
    key = RandomKey.seeded(0)
    a, next_a = key.normal((4, 5))
    b, next_b = key.normal((4, 5))
    assert torch.equal(a, b)
    assert ss.tree_equal(next_a, next_b)
    c, _ = next_a.normal((4, 5))
    assert not torch.equal(a, c)


def test_a_generator_draws_several_tensors_from_one_step() -> None:
    gen, nxt = RandomKey.seeded(1).generator()
    first = torch.randn(3, generator=gen)
    second = torch.randn(3, generator=gen)
    again, _ = RandomKey.seeded(1).normal((3,))
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    assert nxt.counter == 1


def test_dtypes_and_devices() -> None:
    key = RandomKey.seeded(2)
    full, _ = key.normal((6,), dtype=torch.float32)
    half, _ = key.normal((6,), dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert full.dtype == torch.float32
    meta, nxt = key.normal((6,), device="meta")
    assert meta.device.type == "meta"
    assert nxt.counter == 1
    assert ss.tree_equal(nxt, key.normal((6,))[1])


def test_a_key_on_meta_holds_no_value_to_advance() -> None:
    on_meta = ss.to_device(RandomKey.seeded(3), "meta")
    assert on_meta.view().device.type == "meta"
    noise, nxt = on_meta.normal((2,), device="meta")
    assert nxt is on_meta
    assert noise.device.type == "meta"


def test_the_key_words_are_pinned() -> None:
    # The hashes behind draws and splits are BLAKE2b: the same words on every machine.
    a, b = RandomKey.seeded(0).split(2)
    assert a.view().tolist() == [-2778965406601001363, 0]
    assert b.view().tolist() == [-3294558486423681866, 0]
    assert RandomKey.seeded(-1).view().tolist() == [-1, 0]
    assert RandomKey.seeded(2**64 - 1).view().tolist() == [-1, 0]  # modulo 2**64


def test_a_draw_is_the_same_in_another_process() -> None:
    code = (
        "import hashlib, torch, sessionstate as ss\n"
        "k = ss.RandomKey.seeded(11)\n"
        "k = k.split(3)[2]\n"
        "x, k = k.normal((64,))\n"
        "y, k = k.normal((5,), dtype=torch.bfloat16)\n"
        "print(hashlib.sha256(torch.cat([x, y.float()]).numpy().tobytes()).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    key = RandomKey.seeded(11).split(3)[2]
    x, key = key.normal((64,))
    y, key = key.normal((5,), dtype=torch.bfloat16)
    here = hashlib.sha256(torch.cat([x, y.float()]).numpy().tobytes()).hexdigest()
    assert out.stdout.strip() == here


def test_a_snapshot_continues_the_key_bit_for_bit() -> None:
    state = ss.SessionState(objects={"key": RandomKey.seeded(4).normal((2,))[1]})
    loaded = ss.loads_state(ss.dumps_state(state))
    assert ss.tree_equal(loaded, state)
    a, _ = state.object("key", RandomKey).normal((8,))
    b, _ = loaded.object("key", RandomKey).normal((8,))
    assert torch.equal(a, b)


def test_split_random_splits_every_key_and_shares_everything_else() -> None:
    x = torch.zeros(3)
    state = ss.SessionState(
        objects={"k1": RandomKey.seeded(0), "k2": RandomKey.seeded(1), "off": RandomKey()},
        attrs={"x": x},
    )
    records = state.split_random(3)
    assert len(records) == 3
    for i, record in enumerate(records):
        assert record.attrs["x"] is x
        # A key not allocated yet is split too: seeded, it is the seeded key's split.
        off = record.object("off", RandomKey)
        assert not off.is_allocated
        assert ss.tree_equal(off.allocate(seed=7), RandomKey.seeded(7).split(3)[i])
        for name in ("k1", "k2"):
            want = state.object(name, RandomKey).split(3)[i]
            assert ss.tree_equal(record.object(name), want)
    keyless = ss.SessionState(attrs={"x": x})
    assert keyless.split_random(2) == (keyless, keyless)


def test_a_key_split_before_it_is_allocated_is_seeded_as_that_split() -> None:
    # Splits of splits, and the key a step then draws from: as if seeded first.
    grand = RandomKey(name="noise").split(2)[1].split(3)[2]
    assert grand.pending == (1, 2)
    assert grand.name == "noise"
    assert ss.tree_equal(
        grand.allocate(seed=5), RandomKey.seeded(5, name="noise").split(2)[1].split(3)[2]
    )
    assert ss.tree_equal(grand.evict().allocate(seed=5), RandomKey.seeded(5, name="noise"))
    branches = [k.allocate(seed=5).normal((4,))[0] for k in RandomKey().split(3)]
    assert not torch.equal(branches[0], branches[1])
    assert not torch.equal(branches[1], branches[2])
    loaded = ss.loads_state(ss.dumps_state(ss.SessionState(objects={"key": grand})))
    assert ss.tree_equal(loaded.object("key"), grand)


def test_a_parked_key_refuses_to_split() -> None:
    state = ss.SessionState(objects={"key": RandomKey.seeded(0)}).park(names=["key"])
    with pytest.raises(ss.ParkedError, match=r"Cannot use `split` of RandomKey `key`"):
        state.split_random(2)


def test_errors() -> None:
    with pytest.raises(TypeError, match=r"`seed` must be an int, got 1\.5 \(float\)"):
        RandomKey.seeded(1.5)  # type: ignore[arg-type]
    with pytest.raises(NotAllocatedError, match=r"Cannot draw from RandomKey `random_key`"):
        RandomKey().normal((2,))
    with pytest.raises(ValueError, match=r"`n` must be a positive int, got 0 \(int\)"):
        RandomKey.seeded(0).split(0)
    with pytest.raises(ValueError, match=r"int64 tensor of shape \(2,\)"):
        RandomKey(torch.zeros(2))
    with pytest.raises(ValueError, match=r"`n` must be a positive int"):
        ss.SessionState().split_random(0)


# --- properties against a model -------------------------------------------------------------


@given(seed=_SEEDS, ops=st.lists(st.sampled_from(["draw", "split0", "split1", "reset"])))
def test_transitions_follow_the_model_and_never_change_a_key(seed: int, ops: list[str]) -> None:
    key = RandomKey.seeded(seed)
    stream, counter = seed % 2**64, 0  # the model: two words
    seen: list[tuple[RandomKey, torch.Tensor, str]] = []
    for op in ops:
        before = key.view().clone()
        noise, drawn = key.normal((3,))
        seen.append((key, before, _bits(noise)))
        if op == "draw":
            key, counter = drawn, counter + 1
        elif op == "reset":
            key, counter = key.reset(), 0
        else:
            children = key.split(2)
            key = children[int(op[-1])]
            stream, counter = key.view().tolist()[0] % 2**64, 0
        assert key.view().tolist() == [
            stream - 2**64 if stream >= 2**63 else stream,
            counter,
        ]
        assert key.counter == counter
    for old, words, bits in seen:  # every earlier key: unchanged, and draws as it did
        assert torch.equal(old.view(), words)
        assert _bits(old.normal((3,))[0]) == bits


@given(seed=_SEEDS, draws=st.integers(min_value=0, max_value=4), n=st.integers(1, 6))
def test_split_keys_draw_apart_from_each_other_and_the_parent(
    seed: int, draws: int, n: int
) -> None:
    key = RandomKey.seeded(seed)
    for _ in range(draws):
        key = key.normal(())[1]
    children = key.split(n)
    assert len(children) == n
    assert all(c.counter == 0 for c in children)
    noises = [_bits(c.normal((16,))[0]) for c in children]
    parent = [_bits(k.normal((16,))[0]) for k in (key, key.normal(())[1])]
    assert len(set(noises + parent)) == n + 2
    assert [ss.tree_equal(a, b) for a, b in zip(children, key.split(n), strict=True)] == [True] * n


@given(seed=_SEEDS, shape=_SHAPES, dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_a_key_through_a_snapshot_draws_the_same_bits(
    seed: int, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    key = RandomKey.seeded(seed).normal(())[1]
    loaded = ss.loads_state(ss.dumps_state(ss.SessionState(objects={"k": key}))).object("k")
    a, next_a = key.normal(shape, dtype=dtype)
    b, next_b = loaded.normal(shape, dtype=dtype)
    assert a.shape == shape
    assert a.dtype == dtype
    assert torch.equal(a, b)
    assert ss.tree_equal(next_a, next_b)


def test_a_split_depends_on_where_the_key_stands() -> None:
    # Two forks of one session at different steps: the keys split after two draws differ
    # from those split before them, and so does their noise.
    key = RandomKey.seeded(7)
    later = key.normal((3,))[1].normal((3,))[1]
    assert later.counter == 2
    before, after = key.split(2), later.split(2)
    for a, b in zip(before, after, strict=True):
        assert not torch.equal(a.view(), b.view())
        assert _bits(a.normal((16,))[0]) != _bits(b.normal((16,))[0])
