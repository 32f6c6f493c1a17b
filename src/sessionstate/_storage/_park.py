"""One idea, parking: moving a tree's bytes out of residence and back, without losing a bit.

The host and disk tiers, their batched movers, the handle they return (`ParkedBytes`) and its
lifecycle (prefetch, release, the spool directory's owner) are one module because they share
the storage walk and the handle.

Both tiers move each distinct *storage* once (never each leaf) and describe every tensor leaf
as a view of one (the snapshot format's storage walk, `collect_storages`, and its rebuild,
`rebuild_views`). Unparking allocates one storage per parked storage on the device it came
from, copies the bytes back and rebuilds every leaf as the same view: two views of one storage
are views of one storage again, and `nbytes_by_device` of the rebuilt tree equals the
original's.

- ``"host"``: host memory, one slot per device (`park_into_slots`). A tensor that is the whole
  of a storage no other tensor of the tree reaches (contiguous from its start to its end: most
  of a session's state) is not walked as a storage and a view: the tensors of one device and
  dtype are copied as one consolidated run of the slot, in one batched call with the rest,
  and restored in one batched call as fresh tensors, each its own allocation of its
  storage's size (so each storage is still counted once, by its own bytes, and freed on its
  own). A CUDA storage is copied into pinned memory with a non-blocking copy, and the
  devices are synchronised before `park_tree` returns, so the caller may release the device
  memory as soon as it holds the handle (a device-to-host copy is not valid on the host
  until synchronised).
- ``"disk"``: the tree's tensors in one snapshot file per parked tree (`save_state`'s format, not
  synced to disk: it does not outlive the process) in a spool
  directory; unparking loads it (`load_state`, checksummed). The file's owner is its handle:
  `ParkedBytes.release` deletes it, and so does the handle's finalizer once nothing holds it.

Engine-owned leaves (those reporting their own storages through
``__sessionstate_storage_entries__``) whose class implements the offload protocol
(`OffloadsStorages`, as `KVHandle` does) are moved too: their engine copies what they hold
(``__sessionstate_offload__``, each block once) and the tier holds the copy with the tree's
tensors; unparking asks the engine for fresh memory (``__sessionstate_reload__``: the same
pool, all or nothing) and puts the new leaves where the old ones were. The old leaves' memory
returns to the engine once nothing holds them. Engine leaves without the protocol stay in
memory, in place, and come back as the same objects; `ParkedBytes.engine` lists them so the
byte accounting keeps counting what they hold.

A spool directory that a process writes into is its own subdirectory of the spool root
(`SpoolDir`), named ``sessionstate-spool-<pid>-<token>`` and holding a lock file locked for as
long as the process holds the directory. `reclaim_spool` deletes the subdirectories whose lock
is free: their process ended (even by ``kill -9``) without removing them.
"""

from __future__ import annotations

import abc
import concurrent.futures
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: spool directories are not reclaimed
    fcntl = None  # type: ignore[assignment]

import contextlib

from sessionstate._checks import describe
from sessionstate._errors import UnsupportedTensorError
from sessionstate._protocols import (
    OFFLOAD_HOOKS,
    STANDALONE_HOOK,
    STORAGE_ENTRIES_HOOK,
    DeferredRead,
)
from sessionstate._storage._decode import load_state
from sessionstate._storage._encode import record_device, write_snapshot
from sessionstate._storage._format import (
    ViewSpec,
    _check_tensor,
    collect_storages,
    rebuild_views,
    storage_bytes,
    storage_identity,
)
from sessionstate._storage._hostpool import HostBufferPool
from sessionstate._tree import (
    PyTree,
    PyTreeSpec,
    tree_flatten,
    tree_flatten_with_keys,
    tree_leaves,
    tree_unflatten,
)

__all__ = [
    "TIERS",
    "ParkedBytes",
    "SpoolDir",
    "Tier",
    "check_tier",
    "is_engine_leaf",
    "is_offloadable",
    "park_tree",
    "reclaim_spool",
]

logger = logging.getLogger("sessionstate")

Tier = Literal["host", "disk"]
TIERS: tuple[Tier, ...] = ("host", "disk")

_names = itertools.count()
_TENSOR: Any = object()  # marks a tensor leaf's place among the kept leaves
_OFFLOADED: Any = object()  # marks an offloaded engine leaf's place among the kept leaves
_DEFERRED: Any = object()  # marks a `DeferredRead`'s place among an offload payload's leaves
_ALIGNMENT = 64  # where each storage starts in a host slot (a cache line; any dtype's alignment)
_SPOOL_PREFIX = "sessionstate-spool-"
_STAGING_PREFIX = f".{_SPOOL_PREFIX}staging-"
_LOCK_NAME = ".lock"
_STAGING_GRACE_S = 60.0  # a staging directory younger than this may still be taking its lock


def is_engine_leaf(leaf: object, /) -> bool:
    """Whether ``leaf`` reports engine-owned storages (a `KVHandle`): never moved by parking.

    >>> import torch
    >>> is_engine_leaf(torch.zeros(1)), is_engine_leaf(3)
    (False, False)
    """
    return not isinstance(leaf, torch.Tensor) and hasattr(type(leaf), STORAGE_ENTRIES_HOOK)


def is_offloadable(leaf: object, /) -> bool:
    """Whether ``leaf`` is an engine leaf whose class parking moves (`OffloadsStorages`).

    >>> import torch
    >>> from sessionstate import KVPool
    >>> is_offloadable(KVPool(1, block_tokens=1, token_shape=()).empty()), is_offloadable(3)
    (True, False)
    """
    cls = type(leaf)
    return is_engine_leaf(leaf) and all(hasattr(cls, hook) for hook in OFFLOAD_HOOKS)


def check_tier(tier: object, /, name: str = "tier") -> Tier:
    """``tier`` if it names a parking tier; otherwise a `ValueError` naming ``name``.

    >>> check_tier("disk")
    'disk'
    """
    if tier == "host" or tier == "disk":
        return tier
    msg = f"`{name}` must be 'host' or 'disk', got {describe(tier)}."
    raise ValueError(msg)


class ParkedBytes(abc.ABC):
    """The bytes of one parked tree, held by a tier, and how to rebuild the tree from them.

    Each tier is a subclass that says how its bytes load (`_load`).

    `restore` may run any number of times (each builds fresh storages) until `release`.

    Attributes:
        tier: ``"host"`` or ``"disk"``.
        label: What was parked, for messages (e.g. ``"object `cache` of session 'a'"``).
        nbytes: Bytes the tier holds (each storage once).
        nbytes_by_device: Bytes that unparking makes resident again, per device.
        engine: The engine-owned leaves left in place (those without the offload protocol),
            per top-level key of the parked tree when it is a dict (how `SessionState.park`
            parks several objects), else under None; they still hold their engine's memory
            and are counted where they are.
    """

    tier: Tier
    _flat: _Flat  # set by every tier: the tree's structure and how to rebuild it

    def __init__(
        self,
        *,
        label: str,
        storages: Sequence[torch.UntypedStorage],
        engine: Mapping[str | None, tuple[Any, ...]] | None = None,
        deferred: Sequence[DeferredRead] = (),
        whole: Sequence[torch.Tensor] = (),
    ) -> None:
        # ``whole``: tensors each the whole of its storage, counted by their bytes.
        self.label = label
        self.engine: dict[str | None, tuple[Any, ...]] = dict(engine or {})
        by_device: dict[torch.device, int] = {}
        for storage in storages:
            device = storage.device
            by_device[device] = by_device.get(device, 0) + storage.nbytes()
        for t in whole:
            device = t.device
            by_device[device] = by_device.get(device, 0) + t.nbytes
        named: dict[str, int] = {}
        for device, nbytes in by_device.items():
            named[str(device)] = named.get(str(device), 0) + nbytes
        for read in deferred:
            name = str(read.device)
            named[name] = named.get(name, 0) + read.nbytes
        self.nbytes_by_device = {d: n for d, n in named.items() if n}
        self.nbytes = sum(self.nbytes_by_device.values())
        self.released = False
        self.last_restore_prefetched = False
        """Whether the last `restore` took the tree a background restore built."""
        self._background: _Box | None = None
        self._background_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ParkedBytes(tier={self.tier!r}, label={self.label!r}, nbytes={self.nbytes})"

    @property
    def offloads(self) -> bool:
        """Whether the tier holds engine leaves' bytes (`KVHandle` blocks), to reload them."""
        return bool(self._flat.groups)

    def restore(self) -> PyTree:
        """Rebuild the parked tree: fresh storages on their devices, every leaf a view of one.

        Takes the tree a background restore (`start_prefetch`) built, waiting for it if it is
        still running; else (none started, or it failed) restores in the foreground, raising
        the foreground's own error.

        Raises:
            RuntimeError: if the bytes were released by their owner.
            KVPoolExhaustedError: if an engine pool lacks the blocks to take its leaves back.
        """
        self._check_held()
        self.last_restore_prefetched = False
        loaded = self._take_background()
        if loaded is not None:
            kind, value = loaded
            if kind == "tree":
                self.last_restore_prefetched = True
                return value
            # CUDA: the transfer ran on a side stream (complete: synchronised); the engine
            # reload runs here, on the consumer's stream, ordered with its work.
            _record_on_current_streams(value)
            tree = self._flat.rebuild(value)
            self.last_restore_prefetched = True
            return tree
        return self._restore()

    def read(self) -> PyTree:
        """The parked tree rebuilt in host memory, to read or save; the bytes stay parked.

        Takes no device memory and no engine memory: every tensor is a fresh CPU copy (within
        `recorded_devices`, a snapshot of it records the device it came from), and an engine
        leaf whose class reads its offload payload standalone (``__sessionstate_standalone__``;
        a `KVHandle`: a pool of just its blocks) is rebuilt so. Another engine leaf is reloaded
        into its engine, as `restore` does.

        Raises:
            RuntimeError: if the bytes were released by their owner.
            SnapshotError: if the disk tier's file is damaged.
        """
        self._check_held()
        return self._flat.rebuild(self._read(), standalone=True)

    def start_prefetch(self) -> None:
        """Start rebuilding the tree on the background worker; `restore` takes the result.

        One worker thread per process runs the background restores, one at a time. A tree of
        CPU storages is restored whole there (engine leaves reloaded too: the blocks it takes
        are off their pool's free list until the tree is taken or dropped, and return to the
        pool when a dropped tree is collected). With CUDA storages only the transfer runs
        there, on a side stream that first waits for the caller's current stream; it is
        synchronised before the result is handed over, and `restore` records the consumer's
        stream on the new storages (``record_stream``: the caching allocator then does not
        reuse them for the side stream while the consumer's work may still read them). The
        engine reload (taking a pool's blocks, a device-to-device copy) waits for `restore`,
        on the consumer's stream: a block the consumer frees while its kernels still read it
        is never written from another stream.

        A background restore that fails costs nothing but its work: `restore` and `prefetch`
        then run in the foreground and raise their own errors. Starting twice starts once.

        Raises:
            RuntimeError: if the bytes were released by their owner.
        """
        self._check_held()
        with self._background_lock:
            if self._background is not None:
                return
            box = _Box()
            streams = _consumer_streams(self.nbytes_by_device)
            work = _load_on_side_streams if streams else _restore_whole
            box.future = _executor().submit(work, self, box, streams)
            self._background = box

    @property
    def prefetching(self) -> bool:
        """Whether a background restore was started and not yet taken or dropped."""
        return self._background is not None

    def wait_prefetch(self) -> None:
        """Wait for a started background restore to finish (its errors are kept for later)."""
        box = self._background
        if box is not None:
            box.wait()

    def prefetch(self) -> None:
        """Read the bytes into host memory and check them, so `restore` only copies them back.

        Allocates no device memory: a manager checks a parked session this way before it
        makes room on a device for it. The host tier holds its bytes in host memory already;
        the disk tier reads its file (checksums verified) and keeps the host copy for the next
        `restore` (or until `discard_prefetch`). A background restore (`start_prefetch`) is
        waited for: if it succeeded, its tree is the check; if it failed, it is dropped and
        the check runs in the foreground, so the answer is the one it would have been
        without it (a damaged file raises here again).

        Raises:
            RuntimeError: if the bytes were released by their owner.
            SnapshotError: if the disk tier's file is damaged.
        """
        self._check_held()
        box = self._background
        if box is None:
            self._check()
            return
        box.wait()
        if box.error is None:
            return
        with self._background_lock:
            if self._background is box:
                self._background = None
        logger.debug("A background restore of %s failed: %s", self.label, box.error)
        self._check()

    def discard_prefetch(self) -> None:
        """Drop what `prefetch` read and what a background restore built or is building.

        A finished background restore's tree is dropped now (engine blocks it took go back to
        their pool as it is collected: at once unless someone else holds it), a running
        one's when it finishes.
        """
        with self._background_lock:
            box, self._background = self._background, None
            if box is not None:
                box.value = None

    def release(self) -> None:
        """Give the bytes back to the tier; `restore` refuses afterwards."""
        self.released = True
        self.discard_prefetch()

    def _check(self) -> None:
        # The foreground check `prefetch` runs (the disk tier reads its file).
        return

    def _take_background(self) -> tuple[str, Any] | None:
        with self._background_lock:
            box = self._background
        if box is None:
            return None
        box.wait()
        with self._background_lock:
            if self._background is not box:  # dropped meanwhile
                return None
            self._background = None
            result, box.value = box.value, None
        if box.error is not None:  # not fatal: the foreground retries and raises its own
            logger.debug("A background restore of %s failed: %s", self.label, box.error)
            return None
        return result

    @abc.abstractmethod
    def _read(self) -> list[torch.Tensor]:
        """The tensors `_load` returns, as fresh CPU copies, their devices noted with
        `record_device`."""

    @abc.abstractmethod
    def _load(self) -> list[torch.Tensor]:
        """The tier's bytes as tensors on their devices (the tree's tensors, then the offload
        payloads'), before the engine leaves are reloaded."""

    def _check_held(self) -> None:
        if self.released:
            msg = (
                f"The parked bytes of {self.label} were released by their owner (the session "
                "was dropped, replaced or unparked since); read the session from its manager "
                "again."
            )
            raise RuntimeError(msg)

    def _restore(self) -> PyTree:
        return self._flat.rebuild(self._load())


_executors: dict[int, concurrent.futures.ThreadPoolExecutor] = {}  # per process id
_executor_lock = threading.Lock()
_side_streams: dict[torch.device, Any] = {}


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    # One worker per process (a forked child makes its own: the parent's thread is not there).
    with _executor_lock:
        pool = _executors.get(os.getpid())
        if pool is None:
            pool = _executors[os.getpid()] = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="sessionstate-prefetch"
            )
        return pool


class _Box:
    """A background restore's result, held where its handle can drop it at once.

    (A future's result lives as long as the future, which the executor may hold a little
    longer; dropping the box's value gives engine blocks back as soon as the tree goes.)
    """

    def __init__(self) -> None:
        self.future: concurrent.futures.Future[None] | None = None
        self.value: tuple[str, Any] | None = None
        self.error: BaseException | None = None

    def wait(self) -> None:
        if self.future is not None:
            concurrent.futures.wait([self.future])


def _settle(handle: ParkedBytes, box: _Box, work: Callable[[], tuple[str, Any]]) -> None:
    try:
        handle._check_held()
        value = work()
    except Exception as exc:
        box.error = exc
        return
    with handle._background_lock:
        if handle._background is box:  # else dropped while it ran: the value goes now
            box.value = value
    del value


def _restore_whole(handle: ParkedBytes, box: _Box, streams: object) -> None:
    _settle(handle, box, lambda: ("tree", handle._restore()))


def _consumer_streams(nbytes_by_device: Mapping[str, int]) -> dict[torch.device, Any]:
    # The caller's current stream on each CUDA device the bytes go back to (none on CPU).
    devices = [torch.device(d) for d in nbytes_by_device if d.startswith("cuda")]
    return {d: torch.cuda.current_stream(d) for d in devices}


def _load_on_side_streams(
    handle: ParkedBytes, box: _Box, consumers: Mapping[torch.device, Any]
) -> None:
    def work() -> tuple[str, Any]:
        with contextlib.ExitStack() as stack:
            for device, consumer in consumers.items():
                with _executor_lock:
                    side = _side_streams.get(device)
                    if side is None:
                        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                        _side_streams[device] = side
                side.wait_stream(consumer)  # after what the consumer queued before now
                stack.enter_context(torch.cuda.stream(side))
            # The copy functions synchronise each device they copy to before returning.
            return "loaded", handle._load()

    _settle(handle, box, work)


def _record_on_current_streams(tensors: Sequence[torch.Tensor]) -> None:
    # Storages allocated on a side stream, now used on the consumer's: without this the
    # caching allocator could hand their memory to the side stream again as soon as they are
    # freed, while the consumer's queued kernels still read them.
    for t in tensors:
        if t.device.type == "cuda":
            t.record_stream(torch.cuda.current_stream(t.device))


class _Flat:
    """A tree split into its tensors and the rest (structure, other leaves kept in place).

    Offloadable engine leaves are replaced by their classes' offload payloads: the payloads'
    tensors join the tree's (so the tier moves them with the rest), their other values are
    kept, and `rebuild` reloads the leaves into their engines.

    With ``whole=True`` (the host tier) the tensors that are each the whole of a storage no
    other tensor of the tree reaches, contiguous from its start (`_is_whole`: what most state
    holds), are set apart in ``whole`` (their places among the tensors in ``whole_at``): the
    tier moves them as consolidated copies, one per device and dtype, and restores each as a
    fresh tensor of its own; the others go storage by storage (``storages``, ``views``).
    """

    def __init__(
        self, tree: PyTree, label: str, *, defer: bool = False, whole: bool = False
    ) -> None:
        # Key paths only name a leaf in an error: they are built when one is raised (a walk
        # with key paths costs more than the rest of a small tree's park). One pass sorts
        # the leaves: tensors, engine leaves that offload, the rest.
        leaves, treespec = tree_flatten(tree)
        groups: dict[type, list[int]] = {}
        marks: list[Any] = []
        tensors: list[torch.Tensor] = []
        stays = False  # whether an engine leaf without the offload protocol stays in place
        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                tensors.append(x)
                marks.append(_TENSOR)
            elif is_engine_leaf(x) and is_offloadable(x):
                groups.setdefault(type(x), []).append(i)
                marks.append(_OFFLOADED)
            else:
                stays = stays or is_engine_leaf(x)
                marks.append(x)
        try:
            payloads = _offload(groups, leaves, [""] * len(leaves))
        except Exception:
            payloads = _offload(groups, leaves, tree_flatten_with_keys(tree)[0])
            raise  # pragma: no cover - the offload with key paths raised the same error
        self.groups = [(cls, at) for cls, at in groups.items()]
        p_leaves: list[Any] = []
        self.payload_leaves: list[Any] = []
        self.deferred: list[DeferredRead] = []
        if groups:
            p_leaves, self.payload_spec = tree_flatten(payloads)
            if not defer:  # a tier without host memory of its own: the engines copy out now
                p_leaves = [x.read() if isinstance(x, DeferredRead) else x for x in p_leaves]
            for x in p_leaves:
                if isinstance(x, torch.Tensor):
                    tensors.append(x)
                    self.payload_leaves.append(_TENSOR)
                elif isinstance(x, DeferredRead):
                    self.deferred.append(x)
                    self.payload_leaves.append(_DEFERRED)
                else:
                    self.payload_leaves.append(x)
        self.tensors = tensors
        self.whole: list[torch.Tensor] = []
        self.whole_at: list[int] = []
        try:
            if whole:
                self.whole_at = _whole_places(tensors)
                self.whole = [tensors[i] for i in self.whole_at]
                rest = sorted(set(range(len(tensors))).difference(self.whole_at))
                self.rest_at = rest
                self.storages, self.views = collect_storages([("", tensors[i]) for i in rest])
            else:
                self.rest_at = list(range(len(tensors)))
                self.storages, self.views = collect_storages([("", t) for t in tensors])
        except UnsupportedTensorError:
            keys = tree_flatten_with_keys(tree)[0]
            named = [k for k, x in zip(keys, leaves, strict=True) if isinstance(x, torch.Tensor)]
            if groups:
                p_keys = tree_flatten_with_keys(payloads)[0]
                named += [
                    f"<offloaded {k}>"
                    for k, x in zip(p_keys, p_leaves, strict=True)
                    if isinstance(x, torch.Tensor)
                ]
            _collect(list(zip(named, tensors, strict=True)), label)
            raise  # pragma: no cover - the walk with key paths raised the same error
        self.treespec: PyTreeSpec = treespec
        self.leaves = marks
        self.engine = _engine_leaves(tree) if stays else {}

    def ordered(
        self, whole: Sequence[torch.Tensor], rest: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The tensors in the tree's order, from the whole ones and the others (each in its
        own order)."""
        if not whole:
            return list(rest)
        if not rest:
            return list(whole)
        out: list[Any] = [None] * (len(whole) + len(rest))
        for i, t in zip(self.whole_at, whole, strict=True):
            out[i] = t
        for i, t in zip(self.rest_at, rest, strict=True):
            out[i] = t
        return out

    def rebuild(self, tensors: Sequence[torch.Tensor], *, standalone: bool = False) -> PyTree:
        # ``tensors``: the tree's and the payloads' tensors, then the deferred reads' (host
        # tensors their engines copy back from). ``standalone``: engine leaves whose class
        # can are rebuilt outside their engine.
        it = iter(tensors)
        leaves = [next(it) if x is _TENSOR else x for x in self.leaves]
        if self.groups:
            marks = self.payload_leaves
            n = sum(x is _TENSOR for x in marks)
            d = sum(x is _DEFERRED for x in marks)
            loaded = iter(tensors[len(tensors) - d - n :])
            deferred = iter(tensors[len(tensors) - d :])
            payloads = tree_unflatten(
                self.payload_spec,
                [
                    next(loaded) if x is _TENSOR else next(deferred) if x is _DEFERRED else x
                    for x in marks
                ],
            )
            # All or nothing: a reload that fails drops the leaves reloaded before it, whose
            # memory goes back to their engines with them.
            for (cls, at), payload in zip(self.groups, payloads, strict=True):
                hook = getattr(cls, STANDALONE_HOOK, None) if standalone else None
                built = (hook or getattr(cls, OFFLOAD_HOOKS[1]))(payload)
                for i, leaf in zip(at, built, strict=True):
                    leaves[i] = leaf
        return tree_unflatten(self.treespec, leaves)


def _offload(groups: Mapping[type, list[int]], leaves: Sequence[Any], keys: Sequence[str]) -> Any:
    return [
        getattr(cls, OFFLOAD_HOOKS[0])([(keys[i], leaves[i]) for i in at])
        for cls, at in groups.items()
    ]


def _whole_places(tensors: Sequence[torch.Tensor]) -> list[int]:
    # The places of the tensors that are each the whole of a storage no other tensor of the
    # walk reaches: contiguous from the start of their storage to its end, and plain (no
    # lazy negation or conjugation), so that restored as a fresh tensor of the same shape
    # each holds the same bytes in a storage of the same size. Every tensor is checked as
    # `collect_storages` checks it.
    seen: dict[Any, int] = {}  # storage identity (as `collect_storages` has it) -> place
    shared: set[int] = set()
    whole: list[int] = []
    for i, t in enumerate(tensors):
        _check_tensor(t, "")
        storage = t.untyped_storage()
        identity = storage_identity(t, storage)
        first = seen.get(identity)
        if first is not None:
            shared.add(first)
            continue
        seen[identity] = i
        if (
            identity[0] != "object"  # a storage with memory: identified by its addresses
            and t.nbytes == storage.nbytes()
            and t.storage_offset() == 0
            and t.is_contiguous()
            and not t.is_neg()
            and not t.is_conj()
        ):
            whole.append(i)
    return [i for i in whole if i not in shared] if shared else whole


def _engine_leaves(tree: PyTree) -> dict[str | None, tuple[Any, ...]]:
    # The engine leaves parking leaves in place: those without the offload protocol.
    def stays(leaf: object) -> bool:
        return is_engine_leaf(leaf) and not is_offloadable(leaf)

    if isinstance(tree, dict):
        out = {key: tuple(filter(stays, tree_leaves(value))) for key, value in tree.items()}
        return {key: leaves for key, leaves in out.items() if leaves}
    leaves = tuple(filter(stays, tree_leaves(tree)))
    return {None: leaves} if leaves else {}


class _HostBytes(ParkedBytes):
    tier: Tier = "host"

    def __init__(self, tree: PyTree, *, label: str, pool: HostBufferPool | None = None) -> None:
        # Restores into the pool's ranges (`cpu_restores`) take their destinations storage
        # by storage: every tensor goes so then.
        whole = pool is None or not pool.cpu_restores
        flat = _Flat(tree, label, defer=True, whole=whole)
        super().__init__(
            label=label,
            storages=flat.storages,
            engine=flat.engine,
            deferred=flat.deferred,
            whole=flat.whole,
        )
        self._flat = flat
        self._devices = [s.device for s in flat.storages]
        self._whole_devices = [t.device for t in flat.whole]
        self._pool = pool
        # One slot per device: every storage, every engine's deferred copy and, consolidated
        # per dtype, every whole tensor, at its own offset in it (a tiny session is a few
        # calls, not a few per storage).
        self._slots, buffers = park_into_slots(
            [storage_bytes(s) for s in flat.storages],
            flat.deferred,
            pool=pool,
            label=label,
            whole=flat.whole,
        )
        n, d = len(flat.storages), len(flat.deferred)
        self._buffers, self._deferred = (
            buffers[:n],
            [
                b.view(d.dtype).view(d.shape)
                for b, d in zip(buffers[n : n + d], flat.deferred, strict=True)
            ],
        )
        self._whole = buffers[n + d :]  # each whole tensor's bytes, shaped as it was
        # Hold the host copies only.
        flat.storages, flat.tensors, flat.deferred, flat.whole = [], [], [], []
        if pool is not None:  # the handle owns its slots: released or collected, they go back
            offsets = [pool.offset_of(slot) for slot in self._slots if slot.numel()]
            self._give_back = weakref.finalize(self, pool.give_back_later, offsets)

    def _read(self) -> list[torch.Tensor]:
        # Copies: the slots (a host pool's ranges) go back when the session is unparked.
        storages = [b.clone().untyped_storage() for b in self._buffers]
        for storage, device in zip(storages, self._devices, strict=True):
            record_device(storage, str(device))
        whole = torch._foreach_clone(self._whole) if self._whole else []
        for t, device in zip(whole, self._whole_devices, strict=True):
            record_device(t.untyped_storage(), str(device))
        rest = rebuild_views(storages, self._flat.views)
        return self._flat.ordered(whole, rest) + [d.clone() for d in self._deferred]

    def _load(self) -> list[torch.Tensor]:
        # The engines copy their deferred bytes back from the slot themselves, straight into
        # their own memory (a pool's fresh blocks).
        if self._pool is None:
            storages = copy_storages_to_devices(self._buffers, self._devices)
        else:
            storages = copy_storages_to_devices(self._buffers, self._devices, pool=self._pool)
        whole = clone_to_devices(self._whole, self._whole_devices)
        rest = rebuild_views(storages, self._flat.views)
        return self._flat.ordered(whole, rest) + self._deferred

    def release(self) -> None:
        running = self._background
        super().release()
        self._buffers, self._deferred, self._whole = [], [], []
        if self._pool is not None:
            if running is not None and running.future is not None and not running.future.done():
                # A background restore may still read the ranges: they go back when it ends.
                running.future.add_done_callback(lambda _: self._give_back())
            else:
                self._give_back()


class _DiskBytes(ParkedBytes):
    tier: Tier = "disk"

    def __init__(self, tree: PyTree, *, label: str, spool_dir: str | os.PathLike[str]) -> None:
        flat = _Flat(tree, label)
        super().__init__(label=label, storages=flat.storages, engine=flat.engine)
        tensors = flat.tensors
        flat.storages, flat.tensors = [], []  # the file holds the tensors; keep the rest
        self._flat = flat
        self._devices = [t.device for t in tensors]
        self._prefetched: list[torch.Tensor] | None = None
        directory = Path(spool_dir)
        self.path = directory / f"parked-{os.getpid()}-{next(_names)}.safetensors"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # Not synced to disk: a spool file does not outlive the process that parked it.
            write_snapshot(tensors, self.path, durable=False)
        except OSError as exc:
            msg = (
                f"Cannot park {label} to disk: writing `{self.path}` failed ({exc}). Free space "
                "in the spool directory, point the manager at another one, or use the host tier."
            )
            raise OSError(msg) from exc
        # The handle owns its file: released, or collected with nobody holding it, it goes.
        self._remove = weakref.finalize(self, _unlink, str(self.path), os.getpid())

    def _check(self) -> None:
        if self._prefetched is None:
            self._prefetched = load_state(self.path, device="cpu")

    def discard_prefetch(self) -> None:
        super().discard_prefetch()
        self._prefetched = None

    def _read(self) -> list[torch.Tensor]:
        host: list[torch.Tensor] = load_state(self.path, device="cpu")
        for tensor, device in zip(host, self._devices, strict=True):
            record_device(tensor.untyped_storage(), str(device))
        return host

    def _load(self) -> list[torch.Tensor]:
        host, self._prefetched = self._prefetched, None
        if host is None:
            host = load_state(self.path, device="cpu")
        return _to_devices(host, self._devices)

    def release(self) -> None:
        super().release()
        self._prefetched = None
        self._remove()


def _to_devices(tensors: list[torch.Tensor], devices: list[torch.device]) -> list[torch.Tensor]:
    # Host tensors onto the devices they were parked from, each storage copied once (so views
    # of one storage stay views of one storage); host storages are used as they are.
    if all(device.type == "cpu" for device in devices):
        return tensors
    storages, views = collect_storages([(str(i), t) for i, t in enumerate(tensors)])
    targets: dict[int, torch.device] = {}
    for view, device in zip(views, devices, strict=True):
        targets.setdefault(view.storage, device)
    moving = [i for i, s in enumerate(storages) if targets[i].type != "cpu"]
    copies = copy_storages_to_devices(
        [storage_bytes(storages[i]) for i in moving], [targets[i] for i in moving]
    )
    for i, copy in zip(moving, copies, strict=True):
        storages[i] = copy
    return rebuild_views(storages, views)


def _unlink(path: str, owner: int) -> None:
    if os.getpid() != owner:  # a forked child exiting leaves its parent's files alone
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class SpoolDir:
    """A spool directory this process owns: a locked subdirectory of a spool root.

    Created as ``<root>/sessionstate-spool-<pid>-<token>`` holding a lock file that stays
    locked while the `SpoolDir` lives (so while the process lives: the kernel drops the lock
    when it dies, even by ``kill -9``). Creating one first reclaims what dead processes left
    in ``root`` (`reclaim_spool`). The directory and its files are removed when the `SpoolDir`
    is collected, or at interpreter exit.

    >>> import tempfile
    >>> spool = SpoolDir(tempfile.mkdtemp())
    >>> spool.path.name.startswith("sessionstate-spool-")
    True
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        reclaim_spool(root)
        staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=root))
        fd = None
        try:
            fd = _lock(staging / _LOCK_NAME)
            path = root / f"{_SPOOL_PREFIX}{os.getpid()}-{staging.name[len(_STAGING_PREFIX) :]}"
            os.rename(staging, path)  # the lock is on the file: it moves with the directory
        except BaseException:
            _remove_spool(str(staging), fd, os.getpid())
            raise
        self.path = path
        self._finalizer = weakref.finalize(self, _remove_spool, str(path), fd, os.getpid())

    def __fspath__(self) -> str:
        return str(self.path)


def _lock(path: Path) -> int | None:
    if fcntl is None:  # pragma: no cover - not POSIX
        return None
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a file system without locks: nobody can lock it to reclaim it either
        os.close(fd)
        return None
    return fd


def _remove_spool(path: str, fd: int | None, owner: int) -> None:
    if os.getpid() != owner:  # a forked child exiting leaves its parent's directory alone
        return
    shutil.rmtree(path, ignore_errors=True)  # under the lock: nobody reclaims it meanwhile
    if fd is not None:
        os.close(fd)


def reclaim_spool(root: str | os.PathLike[str], /) -> list[str]:
    """Delete the spool subdirectories in ``root`` that no live process holds; return them.

    A subdirectory is reclaimed when its lock file can be locked (its process ended without
    removing it). Directories of live processes, and anything else in ``root``, are left alone.
    Not on POSIX (no ``fcntl``), nothing is reclaimed.

    >>> import tempfile
    >>> reclaim_spool(tempfile.mkdtemp())
    []
    """
    if fcntl is None:  # pragma: no cover - not POSIX
        return []
    reclaimed: list[str] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return reclaimed
    for entry in entries:
        staging = entry.name.startswith(_STAGING_PREFIX)
        if not (staging or entry.name.startswith(_SPOOL_PREFIX)):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            if staging and time.time() - entry.stat().st_mtime < _STAGING_GRACE_S:
                continue  # its process may be about to lock it
            fd = os.open(os.path.join(entry.path, _LOCK_NAME), os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # held: its process is alive
            continue
        _remove_spool(entry.path, fd, os.getpid())
        reclaimed.append(entry.path)
        logger.info("Removed the spool directory %s, left by a process that ended.", entry.path)
    return reclaimed


def _collect(
    tensors: list[tuple[str, torch.Tensor]], label: str
) -> tuple[list[torch.UntypedStorage], list[ViewSpec]]:
    try:
        return collect_storages(tensors)
    except UnsupportedTensorError as exc:
        msg = f"Cannot park {label}: {exc}"
        raise UnsupportedTensorError(msg) from None


def park_into_slots(
    sources: Sequence[torch.Tensor],
    deferred: Sequence[DeferredRead] = (),
    /,
    *,
    pool: HostBufferPool | None = None,
    label: str = "the storages",
    whole: Sequence[torch.Tensor] = (),
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy ``sources`` (byte tensors), ``deferred`` reads and ``whole`` tensors into one host
    slot per device.

    Returns the slots and, per source, then per deferred read, then per whole tensor, its
    bytes: a view of its device's slot at an offset aligned to 64 bytes (a source's or a
    read's), or a view shaped as the tensor, of ``dtype``, in one contiguous run of the slot
    per device and dtype that the whole tensors of that device and dtype share, one after the
    other (a whole tensor must be contiguous). A slot is a range of ``pool``
    (`HostBufferPool.allocate`; every slot is taken before anything is copied: if they do not
    all fit, those taken go back and `HostPoolFullError` names the bytes), else a new host
    tensor (page-locked for a CUDA device). The copies are issued together, in one batched
    call (non-blocking from CUDA into page-locked memory), and each CUDA device is
    synchronised once at the end, so they are complete when this returns.

    >>> import torch
    >>> x, y = torch.arange(4, dtype=torch.int32), torch.ones(3, dtype=torch.uint8)
    >>> slots, views = park_into_slots([x.view(torch.uint8), y])
    >>> len(slots), [v.numel() for v in views], views[1].data_ptr() - slots[0].data_ptr()
    (1, [16, 3], 64)
    >>> z = torch.arange(6.0).view(2, 3)
    >>> slots, views = park_into_slots([], whole=[z, z + 1])
    >>> views[1].shape, views[1].data_ptr() - slots[0].data_ptr(), views[1][1].tolist()
    (torch.Size([2, 3]), 24, [4.0, 5.0, 6.0])
    """
    alignment = _ALIGNMENT if pool is None else max(_ALIGNMENT, pool.alignment)
    devices: dict[torch.device, int] = {}  # each device's slot size so far
    places: list[tuple[torch.device, int, int]] = []
    for device, nbytes in [(t.device, t.numel()) for t in sources] + [
        (d.device, d.nbytes) for d in deferred
    ]:
        offset = devices.get(device, 0)
        places.append((device, offset, nbytes))
        devices[device] = offset + -(-nbytes // alignment) * alignment
    runs: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    run_bytes: dict[tuple[torch.device, torch.dtype], int] = {}
    for i, t in enumerate(whole):
        key = (t.device, t.dtype)
        runs.setdefault(key, []).append(i)
        run_bytes[key] = run_bytes.get(key, 0) + t.nbytes
    spans: list[tuple[torch.device, torch.dtype, int, int, list[int]]] = []
    for (device, dtype), at in runs.items():
        nbytes = run_bytes[device, dtype]
        offset = devices.get(device, 0)
        spans.append((device, dtype, offset, nbytes, at))
        devices[device] = offset + -(-nbytes // alignment) * alignment
    count = len(places) + len(whole)
    slots = _take_slots(devices, pool, label, count)
    try:
        views = [slots[device][offset : offset + n] for device, offset, n in places]
        shaped: list[Any] = [None] * len(whole)
        for device, dtype, offset, nbytes, at in spans:
            run = slots[device][offset : offset + nbytes].view(dtype)
            members = [whole[i] for i in at]
            # One call makes every member's view of the run (torch's own helper for
            # bucketed copies: the run split in order, each piece viewed as the member).
            for i, view in zip(at, _unflatten(run, members), strict=True):
                shaped[i] = view
        _copy_out(
            [*sources, *whole],
            [*views[: len(sources)], *shaped],
            deferred,
            views[len(sources) :],
            devices,
        )
    except BaseException:
        if pool is not None:
            for slot in slots.values():
                pool.free(slot)
        raise
    return list(slots.values()), views + shaped


def _unflatten(run: torch.Tensor, members: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    # Views of ``run``, one per member, shaped as it, in order (no public name in torch).
    views: list[torch.Tensor] = torch._C._nn.unflatten_dense_tensors(run, list(members))
    return views


def clone_to_devices(
    views: Sequence[torch.Tensor], devices: Sequence[torch.device], /
) -> list[torch.Tensor]:
    """A fresh tensor per host view, on its device, holding its values; synchronised.

    Each is its own allocation, of the view's shape and dtype (contiguous): one batched call
    clones the CPU ones, one batched copy fills the others (non-blocking from page-locked
    memory).

    >>> import torch
    >>> slot = torch.arange(6.0)
    >>> a, b = clone_to_devices([slot[:2], slot[2:].view(2, 2)], [torch.device("cpu")] * 2)
    >>> b.tolist(), b.untyped_storage().data_ptr() != slot.untyped_storage().data_ptr()
    ([[2.0, 3.0], [4.0, 5.0]], True)
    """
    if not views:
        return []
    if all(device.type == "cpu" for device in devices):
        return list(torch._foreach_clone(list(views)))
    targets = [
        torch.empty(v.shape, dtype=v.dtype, device=d) for v, d in zip(views, devices, strict=True)
    ]
    synchronise = {d for d in devices if d.type == "cuda"}
    torch._foreach_copy_(targets, list(views), non_blocking=bool(synchronise))
    for device in synchronise:
        torch.cuda.synchronize(device)
    return targets


def _take_slots(
    sizes: Mapping[torch.device, int], pool: HostBufferPool | None, label: str, count: int
) -> dict[torch.device, torch.Tensor]:
    # Every slot first, or none: a park that does not fit takes nothing from the pool.
    if pool is None:
        return {
            d: torch.empty(n, dtype=torch.uint8, pin_memory=d.type == "cuda")
            for d, n in sizes.items()
        }
    taken: dict[torch.device, torch.Tensor] = {}
    for device, nbytes in sizes.items():
        view = pool.try_allocate(nbytes)
        if view is None:
            for t in taken.values():
                pool.free(t)
            raise pool.full_error(sum(sizes.values()), what=f"{label} ({count} storages)")
        taken[device] = view
    return taken


def _copy_out(
    sources: Sequence[torch.Tensor],
    views: Sequence[torch.Tensor],
    deferred: Sequence[DeferredRead],
    deferred_views: Sequence[torch.Tensor],
    devices: Iterable[torch.device],
) -> None:
    # ``devices``: every device the sources and the reads are on.
    synchronise = [device for device in devices if device.type == "cuda"]
    if sources:
        # `_foreach_copy_` is torch's one batched copy (no public name): one call for all the
        # storages, not one per storage; non-blocking from CUDA into page-locked memory.
        torch._foreach_copy_(list(views), list(sources), non_blocking=bool(synchronise))
    for read, view in zip(deferred, deferred_views, strict=True):
        read.copy_into(view)
    for device in synchronise:
        torch.cuda.synchronize(device)


def copy_storages_to_host(
    storages: Sequence[torch.UntypedStorage],
    /,
    *,
    pool: HostBufferPool | None = None,
    label: str = "the storages",
) -> list[torch.Tensor]:
    """Copy each storage into host bytes (`park_into_slots`: one slot per device); synchronised.

    >>> import torch
    >>> x = torch.arange(4, dtype=torch.int32)
    >>> copy_storages_to_host([x.untyped_storage()])[0].numel()
    16
    """
    return park_into_slots([storage_bytes(s) for s in storages], pool=pool, label=label)[1]


def copy_storages_to_devices(
    buffers: Sequence[torch.Tensor],
    devices: Sequence[torch.device],
    /,
    *,
    pool: HostBufferPool | None = None,
) -> list[torch.UntypedStorage]:
    """New storages, one on each of ``devices``, holding ``buffers``' bytes; synchronised.

    A CUDA destination is a fresh allocation (the caching allocator reuses memory). A CPU
    destination is one too, unless ``pool`` serves restores (`HostBufferPool.cpu_restores`):
    then it is a range of the pool that returns when the storage is freed.

    >>> import torch
    >>> buf = torch.arange(4, dtype=torch.uint8)
    >>> copy_storages_to_devices([buf], [torch.device("cpu")])[0].nbytes()
    4
    """
    targets: list[torch.Tensor] = []
    synchronise: set[torch.device] = set()
    for buffer, device in zip(buffers, devices, strict=True):
        target = None
        if pool is not None and pool.cpu_restores and device.type == "cpu":
            target = pool.resident(buffer.numel())
        if target is None:
            target = torch.empty(buffer.numel(), dtype=torch.uint8, device=device)
        if device.type == "cuda":
            synchronise.add(device)
        targets.append(target)
    if targets:
        # One batched copy (see `_copy_out`); non-blocking from page-locked memory.
        torch._foreach_copy_(targets, list(buffers), non_blocking=bool(synchronise))
    for device in synchronise:
        torch.cuda.synchronize(device)
    return [t.untyped_storage() for t in targets]


_default_spools: dict[int, SpoolDir] = {}  # per process id: a forked child makes its own
_default_lock = threading.Lock()


def default_spool_dir() -> str:
    """This process's spool directory in the system temporary directory (one per process).

    Created on first use (a `SpoolDir`, reclaiming what dead processes left there) and
    removed at interpreter exit.

    >>> import os
    >>> os.path.isdir(default_spool_dir()), default_spool_dir() == default_spool_dir()
    (True, True)
    """
    with _default_lock:
        spool = _default_spools.get(os.getpid())
        if spool is None or not spool.path.is_dir():
            spool = _default_spools[os.getpid()] = SpoolDir(tempfile.gettempdir())
        return str(spool.path)


def park_tree(
    tree: PyTree,
    tier: Tier = "host",
    /,
    *,
    label: str = "the tree",
    spool_dir: str | os.PathLike[str] | None = None,
    pool: HostBufferPool | None = None,
) -> ParkedBytes:
    """Move ``tree``'s storages to ``tier``, each once; return the handle that rebuilds it.

    Pure: ``tree`` is left unchanged (its storages are freed once nothing else holds them).

    Args:
        tree: A pytree of plain dense tensors, engine leaves that offload (`KVHandle`: their
            blocks are moved too, and reloaded into the same pool) and other leaves (kept in
            memory as they are).
        tier: ``"host"`` or ``"disk"``.
        label: Names what is parked in error messages.
        spool_dir: The directory the disk tier writes to (this process's spool directory in
            the system temporary directory when None, see `default_spool_dir`).
        pool: The host tier copies into ranges of this `HostBufferPool` (given back when the
            handle is released or collected) instead of a new host tensor per storage.

    Raises:
        UnsupportedTensorError: for a meta, sparse, nested or subclass tensor, naming its key.
        OSError: if the disk tier cannot write its file (the message names the file).
        StaleKVHandleError: for a `KVHandle` made by a step that was rolled back.
        HostPoolFullError: if ``pool`` cannot hold the tree's storages (nothing is taken).

    >>> import torch
    >>> from sessionstate import tree_equal
    >>> x = torch.arange(6.0)
    >>> handle = park_tree((x, x[2:]), "host")
    >>> a, b = handle.restore()
    >>> shared = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    >>> tree_equal((a, b), (x, x[2:])), shared
    (True, True)
    """
    tier = check_tier(tier)
    if tier == "host":
        return _HostBytes(tree, label=label, pool=pool)
    return _DiskBytes(tree, label=label, spool_dir=spool_dir or default_spool_dir())
