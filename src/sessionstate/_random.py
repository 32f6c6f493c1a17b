"""`RandomKey`: a session's random state as a state object, drawn from by pure transitions.

A sampler's noise is session state: a snapshot that leaves out where its generator stood does
not continue bit for bit, and two forks of a session that share one generator draw the same
futures. So the key is a record with a tensor leaf (a snapshot saves it, a migration moves it,
accounting counts its 16 bytes) and every use of it is a pure transition, as in JAX: a draw
returns the noise and the next key, a split returns new keys, and the key drawn from stays
valid and unchanged.

The key is counter-based: two int64 words, a *stream* and a *counter*. A draw hashes the two
(BLAKE2b, domain-separated) into the seed of a fresh host `torch.Generator`, draws with it on
the CPU, moves the result to the device asked for, and returns the key with its counter
advanced. A split hashes them, with the child's index, into the streams of new keys (counter
0). Nothing depends on the process, the device or the platform beyond torch's CPU generator,
so a draw is the same everywhere the same key is drawn from.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import ClassVar

import attrs
import torch

from sessionstate._checks import check_count, describe, is_int
from sessionstate._errors import NotAllocatedError
from sessionstate._stateobject import StateObject
from sessionstate._tree import field, register_record, static_field

__all__ = ["RandomKey"]

_MASK = (1 << 64) - 1


def _hash(domain: bytes, *words: int) -> int:
    # One 64-bit value from `words` (each taken modulo 2**64), apart per `domain`: the seeds
    # of draws and the streams of splits never come from the same hash input.
    data = struct.pack(f"<{len(words)}Q", *(w & _MASK for w in words))
    digest = hashlib.blake2b(data, digest_size=8, person=b"ss.key." + domain).digest()
    return int.from_bytes(digest, "little")


def _signed(word: int) -> int:
    # A 64-bit word as the int64 that holds its bits.
    word &= _MASK
    return word - (1 << 64) if word >= 1 << 63 else word


def _key_tensor(stream: int, counter: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.tensor([_signed(stream), _signed(counter)], dtype=torch.int64, device=device)


def _check_key(instance: RandomKey, attribute: object, value: object) -> None:
    if value is None:
        return
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype != torch.int64
        or tuple(value.shape) != (2,)
    ):
        got = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else describe(value)
        )
        msg = (
            f"RandomKey `{instance.name}` holds its key as an int64 tensor of shape (2,) "
            f"(stream, counter), got {got}; build keys with `RandomKey.seeded(seed)`."
        )
        raise ValueError(msg)


@register_record
@attrs.frozen(eq=False)
class RandomKey(StateObject):
    """A session's random key: draws noise and splits by pure transitions (JAX-style).

    ``RandomKey.seeded(seed)`` (or ``RandomKey().allocate(seed=...)``) makes a key;
    `normal` draws a standard normal tensor and returns it with the next key; `generator`
    returns a host `torch.Generator` to draw several tensors with, and the next key; `split`
    returns ``n`` new keys, each its own stream. The same key always draws the same bits, in
    any process, on any machine; a key never changes, so drawing twice from one key draws the
    same noise twice (keep the key a draw returns).

    The key is a 16-byte int64 tensor (stream, counter): a snapshot saves it, `to_device`
    moves it (a draw reads it, wherever it is, and still draws on the host), and a manager's
    `fork` splits it per branch (`SessionStateManager.fork`). It is not parkable: parking 16
    bytes frees nothing, and a fork must read it. `reset` rewinds the counter to the stream's
    first draw; `evict` forgets the key (`allocate` again).

    A key not allocated splits too (a record loaded from a file written before sessions held
    keys, forked before its first step): each new key remembers which split it is
    (``pending``), and `allocate` seeds it as that split of the seeded key, so branches draw
    apart from the seed and their place in the fork, as splits of an allocated key do.

    Args:
        key: The key's two words (stream, counter), int64; None while not allocated.
        name: Used in error messages.
        pending: While not allocated, the splits it was made by (each the index of the new
            key it took), which `allocate` applies to the seeded key; empty otherwise.

    >>> key = RandomKey.seeded(0)
    >>> noise, key2 = key.normal((2,))
    >>> again, _ = key.normal((2,))
    >>> torch.equal(noise, again), key2.counter, key.counter
    (True, 1, 0)
    >>> a, b = key.split(2)
    >>> torch.equal(a.normal((2,))[0], b.normal((2,))[0])
    False
    """

    key: torch.Tensor | None = field(default=None, validator=_check_key)
    name: str = static_field(default="random_key", kw_only=True)
    pending: tuple[int, ...] = static_field(default=(), kw_only=True, converter=tuple)

    parkable: ClassVar[bool] = False

    @classmethod
    def seeded(cls, seed: int, /, *, name: str = "random_key") -> RandomKey:
        """A key from an int seed (taken modulo 2**64): its stream is the seed, its counter 0.

        Raises:
            TypeError: if ``seed`` is not an int.

        >>> RandomKey.seeded(7).view()
        tensor([7, 0])
        """
        if not is_int(seed):
            msg = f"A random key's `seed` must be an int, got {describe(seed)}; pass e.g. `0`."
            raise TypeError(msg)
        return cls(_key_tensor(seed, 0), name=name)

    @property
    def is_allocated(self) -> bool:
        """Whether the key holds a value (and was not evicted since).

        >>> RandomKey().is_allocated, RandomKey.seeded(0).is_allocated
        (False, True)
        """
        return self.key is not None

    @property
    def counter(self) -> int:
        """How many draws this key's stream has made since it was seeded or split off.

        >>> RandomKey.seeded(0).normal(())[1].counter
        1
        """
        return self._words()[1]

    def allocate(self, *, seed: int = 0) -> RandomKey:  # type: ignore[override]
        """Return a key seeded with ``seed`` (see `seeded`), keeping this one's name.

        A key split while not allocated becomes that split of the seeded key.

        >>> RandomKey(name="noise").allocate(seed=3).view()
        tensor([3, 0])
        >>> _, branch = RandomKey().split(2)
        >>> torch.equal(branch.allocate(seed=3).view(), RandomKey.seeded(3).split(2)[1].view())
        True
        """
        key = RandomKey.seeded(seed, name=self.name)
        for i in self.pending:
            key = key.split(i + 1)[i]
        return key

    def commit(self, key: torch.Tensor, /) -> RandomKey:
        """Return a key holding ``key`` (two int64 words: stream, counter) instead.

        For a key kept outside the record (read with `view`): ``commit`` puts it back.

        Raises:
            NotAllocatedError: if this key is not allocated.
            ValueError: if ``key`` is not an int64 tensor of shape (2,).

        >>> RandomKey.seeded(0).commit(torch.tensor([5, 2])).counter
        2
        """
        self._require_allocated("commit to")
        return attrs.evolve(self, key=key)

    def view(self) -> torch.Tensor:
        """The key's two words (stream, counter), an int64 tensor of shape (2,).

        Raises:
            NotAllocatedError: if the key is not allocated.

        >>> RandomKey.seeded(1).view().tolist()
        [1, 0]
        """
        self._require_allocated("view")
        assert self.key is not None
        return self.key

    def reset(self) -> RandomKey:
        """Return the key rewound to its stream's first draw (counter 0).

        >>> key = RandomKey.seeded(0)
        >>> torch.equal(key.normal((3,))[1].reset().view(), key.view())
        True
        """
        stream, _ = self._words("reset")
        return self._at(stream, 0)

    def evict(self) -> RandomKey:
        """Return the key forgotten (not allocated); `allocate` to seed it again.

        >>> RandomKey.seeded(0).evict().is_allocated
        False
        """
        return attrs.evolve(self, key=None, pending=())

    def generator(self) -> tuple[torch.Generator, RandomKey]:
        """A host `torch.Generator` seeded from this key, and the next key.

        For a step that draws several tensors from one stream: draw them all from the
        generator, in a fixed order, and keep the next key.

        Raises:
            NotAllocatedError: if the key is not allocated.

        >>> gen, nxt = RandomKey.seeded(0).generator()
        >>> torch.randn(2, generator=gen).shape, nxt.counter
        (torch.Size([2]), 1)
        """
        stream, counter = self._words("draw from")
        gen = torch.Generator(device="cpu")
        gen.manual_seed(_hash(b"draw", stream, counter))
        return gen, self._at(stream, counter + 1)

    def normal(
        self,
        shape: Sequence[int],
        /,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> tuple[torch.Tensor, RandomKey]:
        """Standard normal noise of ``shape``, drawn on the host and moved to ``device``, and
        the next key.

        On the ``meta`` device nothing is drawn (the tensor is empty) and the key still
        advances, so a run on meta holds the keys a real run would.

        Raises:
            NotAllocatedError: if the key is not allocated.

        >>> noise, nxt = RandomKey.seeded(0).normal((2, 3), dtype=torch.bfloat16)
        >>> noise.dtype, tuple(noise.shape), nxt.counter
        (torch.bfloat16, (2, 3), 1)
        """
        gen, nxt = self.generator()
        target = torch.device(device) if device is not None else torch.device("cpu")
        if target.type == "meta":
            return torch.empty(tuple(shape), dtype=dtype, device="meta"), nxt
        noise = torch.randn(tuple(shape), generator=gen, dtype=dtype)
        return noise.to(target), nxt

    def split(self, n: int = 2, /) -> tuple[RandomKey, ...]:
        """``n`` new keys, each its own stream; this key stays valid and draws apart from them.

        A split of the same key gives the same keys (a split is a pure function), so split
        once per fork and hand each branch its own. A key not allocated gives ``n`` keys not
        allocated, each seeded by `allocate` as the same split of the seeded key.

        Raises:
            ValueError: if ``n`` is not a positive int.

        >>> a, b = RandomKey.seeded(0).split(2)
        >>> a.counter, torch.equal(a.view(), b.view())
        (0, False)
        >>> [k.pending for k in RandomKey().split(2)]
        [(0,), (1,)]
        """
        n = check_count(n, "n", fix="; a split makes at least one key")
        if self.key is None:
            return tuple(attrs.evolve(self, pending=(*self.pending, i)) for i in range(n))
        stream, counter = self._words("split")
        return tuple(self._at(_hash(b"split", stream, counter, i), 0) for i in range(n))

    def _at(self, stream: int, counter: int) -> RandomKey:
        # The key (stream, counter), on this key's device (a moved record's key stays there).
        assert self.key is not None
        device = None if self.key.device.type == "cpu" else self.key.device
        if device is not None and device.type == "meta":
            return self  # a key on meta holds no value to advance
        return attrs.evolve(self, key=_key_tensor(stream, counter, device))

    def _words(self, action: str = "read") -> tuple[int, int]:
        self._require_allocated(action)
        assert self.key is not None
        if self.key.device.type == "meta":
            return 0, 0
        stream, counter = self.key.tolist()
        return stream & _MASK, counter & _MASK

    def _require_allocated(self, action: str) -> None:
        if self.key is None:
            msg = (
                f"Cannot {action} RandomKey `{self.name}`: it is not allocated; call "
                "`.allocate(seed=...)` first (or build it with `RandomKey.seeded(seed)`)."
            )
            raise NotAllocatedError(msg)
