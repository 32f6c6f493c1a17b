"""One idea, what the manager holds parked: its tier, spool directory, handles and counts.

`Parking` carries out what the budget policy decided: it parks a session's objects on the
tier, checks a parked session's bytes before the manager makes room for them, unparks, and
releases the tier's handles it created once nothing stored needs them. The tiers themselves
(how bytes move) are the park tiers' in `sessionstate._storage`.

A parked object comes back as a fresh copy, and the tier's copy of it is still good for as
long as the session holds that object unchanged: the copy is *kept* (never one holding K/V)
instead of released, so parking the session again costs no copy of what did not change. An
object counts as unchanged while the session holds the very object restored, with every
tensor's version counter as it was (an in-place write through any view bumps it; writes that
bypass the counter, as the immutability guard also says, are not seen: records are
immutable). Objects unchanged since the unpark whose copy cannot be taken back whole (another
object parked with them changed) are parked apart from the changed ones, unless a storage
reaches both, so the next round can keep theirs. A kept copy goes as soon as one of its
objects is gone, when the session is parked again without it, dropped or evicted, and first
when the host pool is full.

A session's K/V objects are parked into a handle of their own, apart from its other objects
(unless a storage reaches both): a handle holding K/V is never shared between fork siblings,
and the objects beside it would otherwise be parked again by each of them.

It also owns the host tier's `HostBufferPool` (when the manager is given its bytes) and the
prefetches: a parked session whose handles are being restored in the background, with the
bytes that restore makes resident reserved (charged to the budget) until the session is
unparked or the prefetch is dropped.
"""

from __future__ import annotations

import tempfile
import time
import weakref
from collections.abc import Collection, Hashable, Iterable, Mapping
from typing import Any, Literal, TypeVar, cast

import torch

from sessionstate._errors import KVPoolExhaustedError, ParkingError, reason
from sessionstate._kv import EncodeOnceKV, KVCache
from sessionstate._manager._events import Reporter, SessionEvent, span
from sessionstate._session import SessionState, ValueKey
from sessionstate._stateobject import ParkedObject, StateObject
from sessionstate._storage import (
    HostBufferPool,
    HostPoolFullError,
    ParkedBytes,
    SpoolDir,
    Tier,
    is_engine_leaf,
    is_offloadable,
    reclaim_spool,
)
from sessionstate._tree import tree_leaves

__all__ = ["HostPoolFull", "Parking"]

_S = TypeVar("_S", bound=SessionState)

HostPoolFull = Literal["disk", "refuse"]
"""What a park the host buffer pool cannot hold does: spill to the disk tier, or refuse."""


class Parking:
    """Parks and unparks sessions' objects on one tier, and owns what it parked.

    The caller serialises access (the manager holds its lock).

    Args:
        tier: ``"host"`` or ``"disk"``.
        spool_root: The root the disk tier spools into (the system temporary directory when
            None); the spool directory itself is created on the first park. A disk tier
            reclaims, when it is built, what processes that ended without cleaning up left
            in the root.
        host_pool: The host tier copies into ranges of this pool (given back when the
            session is unparked, or its kept copy goes, dropped or evicted); None: a new host
            tensor per storage.
        host_pool_full: A park the host pool cannot hold: ``"disk"`` parks it to the disk
            tier instead (in the spool directory; counted as a spill), ``"refuse"`` raises
            `ParkingError` (caused by `HostPoolFullError`), which the budget treats as a
            session with nothing parkable.
        keep_copies: Whether an unpark keeps the copies of the objects it restored while
            they are unchanged (see above); False: it releases them.

    >>> import torch
    >>> from sessionstate import SessionState, TensorCache
    >>> parking = Parking("host", None)
    >>> cache = TensorCache(name="c").allocate().commit(torch.zeros(4))
    >>> parked = parking.park("a", SessionState(objects={"c": cache}), ["c"])
    >>> parked.parked, parking.stats()["nbytes_parked:host"]
    (('c',), 16)
    """

    def __init__(
        self,
        tier: Tier,
        spool_root: str | None,
        /,
        *,
        host_pool: HostBufferPool | None = None,
        host_pool_full: HostPoolFull = "disk",
        keep_copies: bool = True,
        reporter: Reporter | None = None,
    ) -> None:
        self.tier: Tier = tier
        self.reporter = reporter if reporter is not None else Reporter()
        self._spool_root = spool_root
        self._spool_dir: SpoolDir | None = None
        self.host_pool = host_pool if tier == "host" else None
        self._host_pool_full: HostPoolFull = host_pool_full
        self._parked: dict[Hashable, dict[str, ParkedObject]] = {}
        self._parked_by: dict[int, int] = {}  # per handle id, the sessions holding it parked
        self._handles: dict[int, ParkedBytes] = {}  # the tier handles this manager created
        # Sharing across sessions (forks): a resident object parked by one session, by the
        # object's id while it lives (the weak reference says it is the same object), and an
        # object unparked from a handle's key, while a session holds it. A handle holding K/V
        # is never shared so: restoring it for one key would take pool blocks for all.
        self._parked_as: dict[int, tuple[weakref.ref[StateObject], ParkedObject]] = {}
        self._parked_as_of: dict[int, list[int]] = {}  # per handle id, its `_parked_as` keys
        self._restored: dict[int, dict[str | None, _Handed]] = {}
        # Per session just unparked, the restored objects whose counters `restored` reads.
        self._to_version: dict[Hashable, list[tuple[str, _Handed]]] = {}
        self._kv_handles: set[int] = set()  # handles holding K/V (never shared so)
        # Per handle parked here, the ids of the objects parked into it together: a sibling
        # takes the handle only if it holds every one of them (else it would hold, and bring
        # back, bytes it no longer has).
        self._groups: dict[int, frozenset[int]] = {}
        # Parked objects of a record being stored (not tracked yet): their bytes are held.
        self.storing: tuple[ParkedObject, ...] = ()
        # Parked objects of records a batch being stored replaced: their bytes are held until
        # the batch is stored whole (then `abandon`ed) or put back (a refusal's rollback).
        self.replacing: tuple[ParkedObject, ...] = ()
        # Whether an object a sibling unparked is handed to the next (off under the
        # immutability guard, whose versions are per session).
        self.share_restored = True
        self._parks = 0
        self._unparks = 0
        self._kv_parks = 0  # parks that moved K/V (see `park`)
        self._kv_unparks = 0
        self._kv_parked: set[Hashable] = set()  # sessions whose parked objects hold K/V
        self._spills = 0  # parks the host pool could not hold, spooled to disk instead
        # Per resident session, the objects its last unpark restored (still unchanged, as far
        # as the last look saw), and the handles kept for it: still holding those objects'
        # bytes, taken back by its next park when all of their objects are unchanged. A
        # kept handle is in `_handles`, in no session's `_parked`.
        self.keep_copies = keep_copies
        self._clean: dict[Hashable, dict[str, _Restored]] = {}
        self._kept: dict[Hashable, dict[int, tuple[ParkedBytes, tuple[str, ...]]]] = {}
        self._gone: set[Hashable] = set()  # sessions one of whose restored objects was freed
        # Per (handle id, key) of a kept-eligible park: the object whose bytes it holds, with
        # its version counters then (an unpark handed that very object back, unchanged, may
        # keep the copy too).
        self._bytes_of: dict[
            int, dict[str | None, tuple[weakref.ref[StateObject], tuple[int, ...]]]
        ] = {}
        self._reparks = 0  # parks that took a kept handle back
        self._taking: frozenset[int] = frozenset()  # kept handles the running park takes back
        self._reparked_nbytes = 0  # the bytes those parks did not copy
        # Prefetched sessions: the bytes their background restores make resident, per device
        # (charged to the budget until the session is unparked or the prefetch dropped).
        self._reserved: dict[Hashable, dict[str, int]] = {}
        self._prefetches = 0
        self._prefetch_hits = 0
        self._prefetches_dropped = 0
        if tier == "disk":  # what dead processes left on this spool root goes now
            reclaim_spool(spool_root if spool_root is not None else tempfile.gettempdir())

    def is_parked(self, session_id: Hashable, /) -> bool:
        """Whether the record stored for ``session_id`` holds a parked object."""
        return session_id in self._parked

    def track(
        self,
        session_id: Hashable,
        state: SessionState,
        /,
        parked: dict[str, ParkedObject] | None = None,
    ) -> None:
        """``state`` is now stored for ``session_id``: keep its parked objects' handles.

        ``parked``: ``state``'s parked objects by name, when the caller has them already.
        """
        if self._gone:  # restored objects were freed: their kept copies go
            self._sweep()
        if parked is None:
            parked = parked_objects(state)
        if not parked and session_id not in self._parked and session_id not in self._reserved:
            self._kv_parked.discard(session_id)  # resident before and after: nothing to move
            return
        prefetched = session_id in self._reserved
        self._unreserve(session_id, dropped=True)
        if not parked and session_id not in self._parked:  # resident before and after
            self._kv_parked.discard(session_id)
            return
        kept = {id(handle) for handle in _handles_of(parked.values())}
        for handle in _handles_of(self._set_parked(session_id, {}).values()):
            if id(handle) in kept:
                continue
            if prefetched or not self._held_elsewhere(handle):
                _drop_prefetch(handle)  # its background restore went with its reservation
            if not self._held_elsewhere(handle):
                self._release(handle)
        if parked:
            self._set_parked(session_id, parked)
        else:
            self._kv_parked.discard(session_id)

    def forked(self, source_id: Hashable, branch_id: Hashable, /) -> None:
        """``branch_id`` now holds ``source_id``'s parked objects (tracked already): its
        unpark moves the same K/V."""
        if source_id in self._kv_parked and branch_id in self._parked:
            self._kv_parked.add(branch_id)

    def untrack(self, session_id: Hashable, /) -> None:
        """``session_id`` is gone from the table: release the handles it held."""
        prefetched = session_id in self._reserved
        self._unreserve(session_id, dropped=True)
        for handle in _handles_of(self._set_parked(session_id, {}).values()):
            held = self._held_elsewhere(handle)  # a fork's sibling still needs it
            if prefetched or not held:
                _drop_prefetch(handle)  # its background restore went with its reservation
            if not held:
                self._release(handle)
        self._let_go(session_id)
        self._to_version.pop(session_id, None)
        self._kv_parked.discard(session_id)

    def park(
        self,
        session_id: Hashable,
        state: _S,
        names: list[str],
        /,
        held: Mapping[ValueKey, Any] | None = None,
    ) -> _S:
        """``state`` with ``names`` parked on the tier, tracked as stored for ``session_id``.

        The objects are parked (a pure transition) before anything is tracked, so a failure
        leaves the session resident and intact. On the host tier with a host pool that cannot
        hold them, kept copies are let go first; then they go to the disk tier
        (``host_pool_full="disk"``) or the park is refused.

        ``held``: the ledger's values of ``state`` (by `ValueKey`: each value's storage
        entries), which say whether objects unchanged since the session's last unpark share
        a storage with the others; without them every object is copied, parked together.

        Raises:
            ParkingError: if the tier cannot take the objects (caused by `HostPoolFullError`
                when the host pool refuses them).
        """
        # Parks are rare (under pressure only): a walk of the parked objects is affordable.
        # An object another session parked already (a fork's shared object) is not copied
        # again: this session holds the same parked bytes.
        # This session's kept copies first, then what a sibling parked.
        clean = self._clean.pop(session_id, {})
        kept = self._kept.pop(session_id, {})
        reused, apart, taken = _unchanged(state, names, clean, kept, held)
        shared = self._parked_already(state, [name for name in names if name not in reused], held)
        names = [name for name in names if name not in shared]
        apart = [name for name in apart if name not in shared]
        in_use = {id(parked.handle) for parked in shared.values()}
        for handle_id, (handle, _) in kept.items():
            # A copy no longer whole (its objects changed) goes, unless a sibling holds it.
            if (
                handle_id not in taken
                and handle_id not in in_use
                and not self._held_elsewhere(handle)
            ):
                self._release(handle)
        copied = [name for name in names if name not in reused and name not in apart]
        # K/V apart from the rest: a handle holding K/V is never shared, so the other objects
        # parked with it would be parked again by every sibling.
        kv_group, copied = _kv_apart(state, copied, held)
        new: _S = state
        made: list[tuple[list[str], list[ParkedBytes]]] = []  # per park, its names and handles
        spilled = False
        start = time.perf_counter()
        # Held while the tier parks: a full host pool letting kept copies go must not release
        # the ones this park takes back (a sibling may keep the same handle).
        self._taking = frozenset(taken)
        try:
            for group in (kv_group, copied, apart):
                if group:
                    new, spill = self._park_on_tier(session_id, new, group, names)
                    spilled = spilled or spill
                    parked = [cast(ParkedObject, new.objects[n]) for n in group]
                    made.append((group, _handles_of(parked)))
        except BaseException:
            for _, handles in made:  # the first group parked, the second failed
                for handle in handles:
                    handle.release()
            if clean:
                self._clean[session_id] = clean
            if taken:
                self._kept[session_id] = {i: kept[i] for i in taken}
            raise
        finally:
            self._taking = frozenset()
        seconds = time.perf_counter() - start
        if shared or reused:
            new = new._replace({**new.objects, **shared, **reused}, dict(new._attrs))
        moved = 0
        moves_kv = False
        for group, handles in made:
            # K/V moved: the library's K/V objects, or engine leaves the handles offloaded
            # (read from the handles: no walk of the objects).
            kv = any(isinstance(state.objects[n], _KV_OBJECTS) for n in group) or any(
                handle.offloads for handle in handles
            )
            moves_kv = moves_kv or kv
            for handle in handles:
                moved += handle.nbytes
                self._handles[id(handle)] = handle
                if kv:
                    self._kv_handles.add(id(handle))
                else:
                    self._groups[id(handle)] = frozenset(
                        id(state.objects[n])
                        for n in group
                        if getattr(new.objects[n], "handle", None) is handle
                    )
            if not kv:
                for name in group:
                    self._remember_parked(state.objects[name], new.objects[name])
                    item = None if held is None else held.get(("o", name))
                    self._note_bytes(state.objects[name], new.objects[name], None, item)
        for name, again in reused.items():
            self._note_bytes(state.objects[name], again, clean[name].versions)
            self._remember_parked(state.objects[name], again)  # a fork's sibling may share it
        for handle_id in taken:  # the objects the handle holds the bytes of, now
            self._groups[handle_id] = frozenset(id(state.objects[m]) for m in kept[handle_id][1])
        if taken:
            self._reparks += 1
            self._reparked_nbytes += sum(kept[i][0].nbytes for i in taken)
        self._set_parked(session_id, parked_objects(new))
        self._parks += 1
        tier = "disk" if spilled else self.tier
        self.reporter.emit(SessionEvent("park", session_id, moved, seconds, tier))
        self._spills += spilled
        if moves_kv:
            self._kv_parks += 1
            self._kv_parked.add(session_id)
        return new

    def _park_on_tier(
        self, session_id: Hashable, state: _S, group: list[str], names: list[str]
    ) -> tuple[_S, bool]:
        # ``group`` parked into one handle of the tier: the state, and whether it spilled to
        # disk. A host pool that cannot hold it lets go of the kept copies first.
        try:
            try:
                with span("sessionstate::park"):
                    try:
                        return self._park_group(state, group), False
                    except HostPoolFullError:
                        if not self._drop_kept_copies():
                            raise
                    return self._park_group(state, group), False
            except HostPoolFullError:
                if self._host_pool_full != "disk":
                    raise
                new = state.park("disk", names=group, spool_dir=self._spool(spill=True))
                return new, True
        except Exception as exc:
            fix = (
                "make `host_pool_bytes` larger, pass `host_pool_full='disk'` to spill to "
                "disk, or raise `max_bytes`"
                if isinstance(exc, HostPoolFullError)
                else "free room on the tier (or pick the other one), or raise `max_bytes`"
            )
            msg = (
                f"Cannot park session {session_id!r} (objects {names}) on the "
                f"{self.tier} tier: {reason(exc)}. The session is left resident and intact; {fix}."
            )
            raise ParkingError(msg) from exc

    def _park_group(self, state: _S, group: list[str]) -> _S:
        return state.park(self.tier, names=group, spool_dir=self._spool(), pool=self.host_pool)

    # -- prefetch -----------------------------------------------------------------------------

    def parked_need(self, session_id: Hashable, /) -> dict[str, int]:
        """The bytes unparking ``session_id`` makes resident, per device (nothing is read)."""
        need: dict[str, int] = {}
        for handle in _handles_of(self._parked[session_id].values()):
            for device, nbytes in handle.nbytes_by_device.items():
                need[device] = need.get(device, 0) + nbytes
        return need

    def prefetching_sessions(self) -> int:
        """Sessions with a prefetch started and not yet taken or dropped."""
        return len(self._reserved)

    def parked_nbytes(self, session_id: Hashable, /) -> dict[str, int]:
        """The bytes the tiers hold for ``session_id``, by tier (each handle once)."""
        out: dict[str, int] = {}
        for handle in _handles_of(self._parked[session_id].values()):
            out[handle.tier] = out.get(handle.tier, 0) + handle.nbytes
        return out

    def is_prefetched(self, session_id: Hashable, /) -> bool:
        """Whether a prefetch of ``session_id`` was started and not yet taken or dropped."""
        return session_id in self._reserved

    def start_prefetch(self, session_id: Hashable, need: dict[str, int], /) -> None:
        """Start restoring ``session_id``'s parked handles in the background; reserve ``need``.

        Nothing here waits for the restore, or lets it take the manager's lock.
        """
        with span("sessionstate::prefetch"):
            for handle in _handles_of(self._parked[session_id].values()):
                handle.start_prefetch()
        self._reserved[session_id] = dict(need)
        self._prefetches += 1
        tiers = {h.tier for h in _handles_of(self._parked[session_id].values())}
        tier = tiers.pop() if len(tiers) == 1 else None
        self.reporter.emit(SessionEvent("prefetch", session_id, sum(need.values()), 0.0, tier))

    def count_dropped_prefetch(self) -> None:
        """Count a prefetch that was asked for and did not fit."""
        self._prefetches_dropped += 1

    def reserved(self, *, besides: Hashable | None = None) -> dict[str, int]:
        """The bytes prefetches hold resident, per device, except ``besides``' (all when None)."""
        out: dict[str, int] = {}
        for session_id, need in self._reserved.items():
            if besides is not None and session_id == besides:
                continue
            for device, nbytes in need.items():
                out[device] = out.get(device, 0) + nbytes
        return out

    def pending(self, session_id: Hashable, /) -> list[ParkedBytes]:
        """``session_id``'s handles with a background restore started (for waiting)."""
        if session_id not in self._reserved:
            return []
        return [h for h in _handles_of(self._parked[session_id].values()) if h.prefetching]

    def pending_all(self, *, besides: Collection[Hashable] = ()) -> list[ParkedBytes]:
        """The handles with a background restore started, of every session but ``besides``."""
        return [h for sid in self._reserved if sid not in besides for h in self.pending(sid)]

    def drop_prefetches(self, *, keep: Collection[Hashable] = ()) -> bool:
        """Drop every prefetch but ``keep``'s; return whether any was dropped.

        Their reservations go, and so do their restored trees: a running restore is waited
        for first (a copy; it never takes the manager's lock), so what it took (a pool's
        blocks) is back when this returns, unless someone else holds it.
        """
        dropped = [sid for sid in self._reserved if sid not in keep]
        for session_id in dropped:
            self._unreserve(session_id, dropped=True)
            for handle in _handles_of(self._parked[session_id].values()):
                _drop_prefetch(handle)
        return bool(dropped)

    def _unreserve(self, session_id: Hashable, *, dropped: bool) -> None:
        if self._reserved.pop(session_id, None) is not None and dropped:
            self._prefetches_dropped += 1

    def unreserve(self, session_id: Hashable, /) -> None:
        """``session_id`` is being unparked: its bytes are charged as its own from now on."""
        self._reserved.pop(session_id, None)

    def check(self, session_id: Hashable, /, counted: set[int] | None = None) -> dict[str, int]:
        """Check that ``session_id``'s parked bytes can be restored; return what they need.

        Reads and checks the bytes into host memory (a spool file's checksums), allocating no
        device memory, so the manager makes room only for bytes that will come back. Returns
        the bytes unparking makes resident, per device: none for a handle whose objects come
        back as the very objects a sibling unparked and still holds (`handed_back`; not read
        either), nor for one in ``counted`` (the ids of handles a batch unparks before this
        session, whose objects it then hands back), to which this session's are added.

        Raises:
            ParkingError: if the bytes cannot be restored (a damaged spool file); nothing
                changes and the session stays parked.
        """
        parked = self._parked[session_id]
        back = {id(parked[name].handle) for name in self.handed_back(session_id)}
        handles = [h for h in _handles_of(parked.values()) if id(h) not in back]
        try:
            for handle in handles:
                handle.prefetch()
        except Exception as exc:
            raise self._unpark_error(session_id, exc) from exc
        need: dict[str, int] = {}
        for handle in handles:
            if counted is not None and id(handle) in counted:
                continue
            if counted is not None and self._shared_restore(handle):
                counted.add(id(handle))
            for device, nbytes in handle.nbytes_by_device.items():
                need[device] = need.get(device, 0) + nbytes
        return need

    def handed_back(self, session_id: Hashable, /) -> dict[str, StateObject]:
        """The objects unparking ``session_id`` now would hand back rather than restore: by
        name, the very objects a sibling unparked from the same parked bytes and still holds,
        unchanged (they cost no byte; the sessions holding them must stay resident until it
        unparks)."""
        if not self.share_restored:
            return {}
        return self._restored_already(self._parked[session_id])

    def _shared_restore(self, handle: ParkedBytes) -> bool:
        # Whether what an unpark restores from ``handle`` is handed to the next sibling that
        # unparks it (this manager's, holding no K/V), as `unpark` records it.
        handle_id = id(handle)
        return (
            self.share_restored and handle_id in self._handles and handle_id not in self._kv_handles
        )

    def discard(self, session_id: Hashable, /) -> None:
        """Drop what `check` read for ``session_id`` (the unpark will not happen now), and
        its prefetch, if any."""
        self._unreserve(session_id, dropped=True)
        for handle in _handles_of(self._parked.get(session_id, {}).values()):
            _drop_prefetch(handle)

    def unpark(self, session_id: Hashable, state: _S, /) -> _S:
        """``state`` resident again, its parked bytes released; counted as an unpark.

        Raises:
            KVPoolExhaustedError: if a `KVPool` lacks the blocks to take the session's KV
                back (naming the bytes needed and free); the session stays parked.
            ParkingError: if the bytes cannot be restored otherwise; the session stays parked.
        """
        parked = self._parked[session_id]
        self.unreserve(session_id)
        handles = _handles_of(parked.values())
        prefetched = any(handle.prefetching for handle in handles)
        # What a sibling unparked from the same parked bytes and still holds comes back as
        # that very object: the sessions share it again instead of holding a copy each.
        again = self._restored_already(state.objects) if self.share_restored else {}
        start = time.perf_counter()
        try:
            with span("sessionstate::unpark"):
                if again:
                    state = state._replace({**state.objects, **again}, dict(state._attrs))
                new = state.unpark()
        except Exception as exc:
            raise self._unpark_error(session_id, exc) from exc
        handed: list[tuple[str, _Handed]] = []
        for name, obj in state.objects.items():
            if isinstance(obj, ParkedObject) and self._shared_restore(obj.handle):
                entry = self._remember_restored(obj, new.objects[name])
                handed.append((name, entry))
        self._to_version.pop(session_id, None)
        if handed:
            self._to_version[session_id] = handed
        seconds = time.perf_counter() - start
        if prefetched and any(handle.last_restore_prefetched for handle in handles):
            self._prefetch_hits += 1
        self._set_parked(session_id, {})
        # A sibling's prefetch of the same parked bytes was taken by this unpark: its
        # reservation has nothing behind it any more.
        for other in [o for o in self._reserved if o in self._parked]:
            if not any(h.prefetching for h in _handles_of(self._parked[other].values())):
                self._unreserve(other, dropped=True)
        for tier in sorted({handle.tier for handle in handles}):
            nbytes = sum(h.nbytes for h in handles if h.tier == tier)
            self.reporter.emit(SessionEvent("unpark", session_id, nbytes, seconds, tier))
        self._let_go(session_id)  # (a record put over a resident one keeps none normally)
        kept = self._note_restored(session_id, parked, new, again)
        for handle in handles:
            if id(handle) not in kept and not self._held_elsewhere(handle):
                self._release(handle)
        self._unparks += 1
        if session_id in self._kv_parked:
            self._kv_parked.discard(session_id)
            self._kv_unparks += 1
        return new

    def _note_restored(
        self,
        session_id: Hashable,
        parked: dict[str, ParkedObject],
        new: SessionState,
        again: Mapping[str, StateObject],
    ) -> dict[int, tuple[ParkedBytes, tuple[str, ...]]]:
        # Note the objects this unpark restored, and keep the handles whose objects all may
        # be told unchanged later: this manager's, holding no K/V. Their version counters are
        # read by `restored`, from the ledger's walk of them; until then none counts as
        # unchanged. An object handed back as it was (``again``: not restored) is noted only
        # if it is the object parked (and `restored` finds it unchanged since).
        if not self.keep_copies:
            return {}
        clean: dict[str, _Restored] = {}
        members: dict[int, list[str]] = {}
        gone = self._gone

        def freed(_: object, session_id: Hashable = session_id) -> None:
            gone.add(session_id)

        for name, obj in parked.items():
            members.setdefault(id(obj.handle), []).append(name)
            restored = new.objects[name]
            if isinstance(restored, _KV_OBJECTS):
                continue
            expect = None
            if name in again:  # the very object parked, and unchanged since: its bytes
                known = self._bytes_of.get(id(obj.handle), {}).get(obj.key)
                if known is None or known[0]() is not restored:
                    continue
                expect = known[1]
            clean[name] = _Restored(weakref.ref(restored, freed), obj, expect)
        kept: dict[int, tuple[ParkedBytes, tuple[str, ...]]] = {}
        for obj in parked.values():
            handle = obj.handle
            handle_id = id(handle)
            if (
                handle_id not in kept
                and self._handles.get(handle_id) is handle
                and handle_id not in self._kv_handles
                and not handle.offloads
                and all(n in clean for n in members[handle_id])
            ):
                handle.discard_prefetch()  # the disk tier's host copy: not kept with it
                kept[handle_id] = (handle, tuple(members[handle_id]))
        if clean:
            self._clean[session_id] = clean
        if kept:
            self._kept[session_id] = kept
        return kept

    def restored(self, session_id: Hashable, held: Mapping[ValueKey, Any], /) -> None:
        """``session_id`` was unparked and is stored; ``held``: the ledger's values of its
        record. Reads the version counters of the objects the unpark restored (their leaves
        from the ledger's items: no walk), and lets go of the kept copies of those that
        cannot be told unchanged."""
        read: dict[int, tuple[int, ...] | None] = {}  # by object id: each read once
        for name, entry in self._to_version.pop(session_id, ()):
            obj = entry.ref()
            if obj is not None:  # a sibling may take it as it is now, and only so
                entry.versions = read[id(obj)] = _versions(obj, held.get(("o", name)))
        clean = self._clean.get(session_id)
        if not clean:
            return
        for name, restored in list(clean.items()):
            obj = restored.ref()
            if obj is None:
                versions = None
            elif id(obj) in read:
                versions = read[id(obj)]
            else:
                versions = _versions(obj, held.get(("o", name)))
            if versions is None or (restored.expect is not None and versions != restored.expect):
                del clean[name]
            else:
                restored.versions = versions
        self._drop_broken(session_id, clean)

    def _drop_broken(self, session_id: Hashable, clean: dict[str, _Restored]) -> None:
        # ``session_id``'s kept copies with an object no longer in ``clean`` go.
        kept = self._kept.get(session_id, {})
        for handle_id, (handle, members) in list(kept.items()):
            if not all(m in clean for m in members):
                del kept[handle_id]
                if not self._held_elsewhere(handle):
                    self._release(handle)
        if not kept:
            self._kept.pop(session_id, None)
        if not clean:
            self._clean.pop(session_id, None)

    def _note_bytes(
        self,
        obj: StateObject,
        parked: StateObject,
        versions: tuple[int, ...] | None,
        item: Any = None,
    ) -> None:
        # ``parked``'s key of its handle holds ``obj``'s bytes as of ``versions`` (None: now,
        # read from ``item``, the ledger's item of ``obj``, when it has one).
        if not isinstance(parked, ParkedObject):
            return
        if versions is None:
            versions = _versions(obj, item)
            if versions is None:
                return
        by_key = self._bytes_of.setdefault(id(parked.handle), {})
        by_key[parked.key] = (weakref.ref(obj), versions)

    def _let_go(self, session_id: Hashable) -> None:
        # ``session_id``'s restored objects are no longer followed; its kept copies go.
        self._clean.pop(session_id, None)
        for handle, _ in self._kept.pop(session_id, {}).values():
            if not self._held_elsewhere(handle):
                self._release(handle)

    def _sweep(self) -> None:
        # Restored objects were freed: their sessions' kept copies missing one go.
        while self._gone:
            session_id = self._gone.pop()
            clean = self._clean.get(session_id)
            if clean is None:
                continue
            for name in [n for n, r in clean.items() if r.ref() is None]:
                del clean[name]
            self._drop_broken(session_id, clean)

    def _drop_kept_copies(self) -> bool:
        # The host pool is full: every kept copy in it goes; whether any went.
        dropped = False
        for session_id in list(self._kept):
            kept = self._kept[session_id]
            for handle_id, (handle, _) in list(kept.items()):
                if handle.tier == "host":
                    del kept[handle_id]
                    if not self._held_elsewhere(handle):
                        self._release(handle)
                        dropped = True
            if not kept:
                del self._kept[session_id]
        return dropped

    def _kept_nbytes(self, parked: set[int]) -> dict[str, int]:
        # The bytes the tiers hold for resident sessions (kept copies), by tier; each handle
        # once, and none a session holds parked (``parked``: their ids), counted as parked.
        out = {"host": 0, "disk": 0}
        seen = set(parked)
        for kept in self._kept.values():
            for handle_id, (handle, _) in kept.items():
                if handle_id not in seen:
                    seen.add(handle_id)
                    out[handle.tier] += handle.nbytes
        return out

    def _parked_anywhere(self, handle: ParkedBytes) -> bool:
        return id(handle) in self._parked_by

    def _set_parked(
        self, session_id: Hashable, parked: dict[str, ParkedObject], /
    ) -> dict[str, ParkedObject]:
        # ``session_id``'s parked objects are now ``parked`` (none: empty); returns those it
        # held before. Keeps the count of sessions holding each handle parked.
        counts = self._parked_by
        old = self._parked.pop(session_id, {})
        for handle in _handles_of(old.values()):
            left = counts[id(handle)] - 1
            if left:
                counts[id(handle)] = left
            else:
                del counts[id(handle)]
        if parked:
            self._parked[session_id] = parked
            for handle in _handles_of(parked.values()):
                counts[id(handle)] = counts.get(id(handle), 0) + 1
        return old

    @property
    def used(self) -> bool:
        """Whether anything was ever parked here."""
        return self._parks > 0

    def stats(self) -> dict[str, int]:
        """The parking keys of the manager's `stats()`.

        ``kv_parks`` and ``kv_unparks`` count the parks (and unparks) that moved K/V: an
        `EncodeOnceKV` or `KVCache` object, or any object holding a `KVHandle` (whose blocks
        move with it). ``prefetches`` counts the background restores started,
        ``prefetch_hits`` the unparks that took one's result, ``prefetches_dropped`` those
        that did not fit when asked for or were dropped later (to make room, or because the
        session was replaced, dropped or evicted first). With a host pool:
        ``host_pool_nbytes`` (its size), ``host_pool_free_nbytes``, ``host_pool_pinned_nbytes``
        (bytes page-locked for it: its size when pinned, exactly) and ``host_pool_spills``
        (parks it could not hold that went to disk).
        """
        return self.summary()[0]

    def summary(self) -> tuple[dict[str, int], dict[str, int]]:
        """`stats`, and the parked sessions per tier (one with objects on both tiers counts as
        disk), from one walk of the parked sessions."""
        if self._gone:
            self._sweep()
        parked = {"host": 0, "disk": 0}
        by_tier: dict[str, int] = {}
        seen: set[int] = set()  # each handle once: forks hold parked bytes together
        for objects in self._parked.values():
            tier = "host"
            for handle in _handles_of(objects.values()):
                if id(handle) not in seen:
                    seen.add(id(handle))
                    parked[handle.tier] += handle.nbytes
                if handle.tier == "disk":
                    tier = "disk"
            by_tier[tier] = by_tier.get(tier, 0) + 1
        kept = self._kept_nbytes(seen)
        stats = {
            "parked_sessions": len(self._parked),
            "parks": self._parks,
            "unparks": self._unparks,
            "kv_parks": self._kv_parks,
            "kv_unparks": self._kv_unparks,
            "nbytes_parked:host": parked["host"],
            "nbytes_parked:disk": parked["disk"],
            "nbytes_kept:host": kept["host"],
            "nbytes_kept:disk": kept["disk"],
            "reparks": self._reparks,
            "nbytes_reparked": self._reparked_nbytes,
            "prefetches": self._prefetches,
            "prefetch_hits": self._prefetch_hits,
            "prefetches_dropped": self._prefetches_dropped,
            **self.host_pool_stats(),
        }
        return stats, by_tier

    def host_pool_stats(self) -> dict[str, int]:
        """The host pool's keys of `stats` (none without a pool)."""
        if self.host_pool is None:
            return {}
        pool = self.host_pool.stats()
        return {
            "host_pool_nbytes": pool["total"],
            "host_pool_free_nbytes": pool["free"],
            "host_pool_pinned_nbytes": pool["pinned_nbytes"],
            "host_pool_spills": self._spills,
        }

    def _unpark_error(
        self, session_id: Hashable, exc: Exception
    ) -> ParkingError | KVPoolExhaustedError:
        # A pool that lacks the blocks to take a session's KV back stays a pool exhaustion
        # (the planner of the model that owns the pool answers it); anything else is the tier's.
        parked = self._parked[session_id]
        tiers = sorted({obj.handle.tier for obj in parked.values()})
        msg = (
            f"Cannot unpark session {session_id!r} (objects {sorted(parked)}) from the "
            f"{' and '.join(tiers)} tier: {reason(exc)}. The session stays parked and intact; "
            "retry once the cause is fixed, or `drop` it."
        )
        if isinstance(exc, KVPoolExhaustedError):
            return KVPoolExhaustedError(msg, pool=exc.pool, needed=exc.needed)
        return ParkingError(msg)

    def _spool(self, *, spill: bool = False) -> SpoolDir | None:
        # The manager's own locked subdirectory of the spool root, removed with the manager;
        # what a process that died (`kill -9`) left there is reclaimed by the next one. The
        # host tier needs one only to spill what its pool cannot hold.
        if self.tier != "disk" and not spill:
            return None
        if self._spool_dir is None:
            self._spool_dir = SpoolDir(
                self._spool_root if self._spool_root is not None else tempfile.gettempdir()
            )
        return self._spool_dir

    def abandon(self, objects: Iterable[ParkedObject], /) -> None:
        """A record holding ``objects`` was not stored: release what no stored record holds."""
        for handle in _handles_of(objects):
            if id(handle) in self._handles and not self._held_elsewhere(handle):
                _drop_prefetch(handle)
                self._release(handle)

    def _held_elsewhere(self, handle: ParkedBytes) -> bool:
        # Whether a stored record still holds ``handle`` (forks share their parked bytes);
        # the caller already took the session that let it go out of `_parked`. A walk of the
        # parked objects: releases are as rare as parks.
        handle_id = id(handle)
        return (
            handle_id in self._taking
            or any(obj.handle is handle for obj in self.storing)
            or any(obj.handle is handle for obj in self.replacing)
            or any(handle_id in kept for kept in self._kept.values())
            or self._parked_anywhere(handle)
        )

    def _release(self, handle: ParkedBytes) -> None:
        # Only the handles this manager created: a record put with objects parked elsewhere
        # keeps its bytes for whoever parked them.
        if self._handles.pop(id(handle), None) is handle:
            handle.release()
            self._forget_handle(handle)

    def _parked_already(
        self, state: SessionState, names: list[str], held: Mapping[ValueKey, Any] | None = None
    ) -> dict[str, ParkedObject]:
        # The objects among `names` another session parked (the same objects, still alive,
        # unchanged since: their version counters as then), as the parked objects that
        # session holds: a handle only when this session holds every object parked into it,
        # so it holds and brings back exactly its own bytes.
        found: dict[str, ParkedObject] = {}
        for name in names:
            obj = state.objects[name]
            known = self._parked_as.get(id(obj))
            if known is None or known[0]() is not obj or id(known[1].handle) not in self._handles:
                continue
            parked = known[1]
            then = self._bytes_of.get(id(parked.handle), {}).get(parked.key)
            item = None if held is None else held.get(("o", name))
            if then is not None and then[0]() is obj and _versions(obj, item) == then[1]:
                found[name] = parked
        if not found:
            return {}
        # Every object of the handle found unchanged, not just held: objects restored from
        # one storage share it but not a version counter, so a write through one of them
        # leaves the others' counters as they were.
        unchanged = {id(state.objects[name]) for name in found}
        out: dict[str, ParkedObject] = {}
        for name, parked in found.items():
            group = self._groups.get(id(parked.handle))
            if group is not None and group <= unchanged:
                out[name] = parked
        return out

    def _remember_parked(self, obj: StateObject, parked: StateObject) -> None:
        if not isinstance(parked, ParkedObject):
            return
        key = id(obj)
        table = self._parked_as

        def gone(_: object, key: int = key) -> None:
            table.pop(key, None)

        table[key] = (weakref.ref(obj, gone), parked)
        self._parked_as_of.setdefault(id(parked.handle), []).append(key)

    def _restored_already(self, record: Mapping[str, StateObject]) -> dict[str, StateObject]:
        # Per handle, all of its objects in ``record`` (a record's objects) or none: each
        # alive and unchanged since it came back (its bytes the parked ones). Objects
        # restored from one storage share it but not a version counter: one written through
        # leaves the others' as they were, so one changed object keeps every object of its
        # handle from coming back.
        found: dict[int, dict[str, StateObject | None]] = {}
        for name, obj in record.items():
            if isinstance(obj, ParkedObject):
                entry = self._restored.get(id(obj.handle), {}).get(obj.key)
                alive = None
                if entry is not None and entry.versions is not None:
                    candidate = entry.ref()
                    if candidate is not None and _versions(candidate) == entry.versions:
                        alive = candidate
                found.setdefault(id(obj.handle), {})[name] = alive
        out: dict[str, StateObject] = {}
        for objects in found.values():
            out.update(
                {n: o for n, o in objects.items() if o is not None}
                if all(o is not None for o in objects.values())
                else {}
            )
        return out

    def _remember_restored(self, parked: ParkedObject, obj: StateObject) -> _Handed:
        key = parked.key
        table = self._restored.setdefault(id(parked.handle), {})

        def gone(_: object, key: str | None = key) -> None:
            table.pop(key, None)

        entry = table[key] = _Handed(weakref.ref(obj, gone))
        return entry

    def _forget_handle(self, handle: ParkedBytes) -> None:
        # A released handle's id may be reused: nothing may point at it any more.
        self._restored.pop(id(handle), None)
        self._bytes_of.pop(id(handle), None)
        for obj_id in self._parked_as_of.pop(id(handle), ()):
            known = self._parked_as.get(obj_id)
            if known is not None and known[1].handle is handle:
                del self._parked_as[obj_id]
        self._kv_handles.discard(id(handle))
        self._groups.pop(id(handle), None)


_KV_OBJECTS = (EncodeOnceKV, KVCache)


def _drop_prefetch(handle: ParkedBytes) -> None:
    # A running background restore is waited for first (a copy: it never takes the manager's
    # lock), so what it took (a pool's blocks, a host pool's ranges) is back when the caller
    # returns, unless someone else holds it.
    handle.wait_prefetch()
    handle.discard_prefetch()


def _handles_of(objects: Iterable[ParkedObject]) -> list[ParkedBytes]:
    # Objects parked together share one handle: each handle once.
    return list({id(obj.handle): obj.handle for obj in objects}.values())


def parked_objects(state: SessionState, /) -> dict[str, ParkedObject]:
    """``state``'s parked objects by name (a lookup per object: puts call it every step)."""
    out: dict[str, ParkedObject] = {}
    for name, obj in state._objects.items():
        parked = _PARKED_TYPES.get(type(obj))
        if parked is None:
            parked = _PARKED_TYPES[type(obj)] = issubclass(type(obj), ParkedObject)
        if parked:
            out[name] = cast(ParkedObject, obj)
    return out


# Per state-object class, whether it is a `ParkedObject` (an ABC's isinstance costs more).
_PARKED_TYPES: dict[type, bool] = {}


class _Handed:
    """An object an unpark restored, which a sibling unparking the same parked bytes may be
    handed instead of a copy: a weak reference to it, and its tensors' version counters once
    read (None until then, and then it is never handed)."""

    __slots__ = ("ref", "versions")

    def __init__(self, ref: weakref.ref[StateObject]) -> None:
        self.ref = ref
        self.versions: tuple[int, ...] | None = None


class _Restored:
    """An object an unpark restored: a weak reference to it, the parked object it came from,
    its tensors' version counters once read (None until then), and, for an object handed
    back rather than restored, the counters its parked bytes were taken at."""

    __slots__ = ("expect", "parked", "ref", "versions")

    def __init__(
        self,
        ref: weakref.ref[StateObject],
        parked: ParkedObject,
        expect: tuple[int, ...] | None = None,
    ) -> None:
        self.ref = ref
        self.parked = parked
        self.expect = expect
        self.versions: tuple[int, ...] | None = None


def _versions(obj: StateObject, item: Any = None) -> tuple[int, ...] | None:
    # Every tensor's version counter, in leaf order; None when a leaf cannot be told
    # unchanged (an inference-mode tensor keeps no counter; an engine leaf's memory is its
    # engine's). ``item``: the ledger's item of ``obj``, whose leaves are read when it is
    # that object's (no walk).
    leaves = item.leaves if item is not None and item.value is obj else tree_leaves(obj)
    out: list[int] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.is_inference():
                return None
            out.append(leaf._version)
        elif is_engine_leaf(leaf):
            return None
    return tuple(out)


def _kv_apart(
    state: SessionState, names: list[str], held: Mapping[ValueKey, Any] | None
) -> tuple[list[str], list[str]]:
    """``names`` split into the objects holding K/V and the others, when both are there and
    no storage (or engine block) reaches both; else nothing set apart and ``names``.

    The K/V objects are the library's (`KVCache`, `EncodeOnceKV`) and any holding a leaf that
    parking offloads (a `KVHandle`). The storages are read from ``held`` (the ledger's
    values): unknown or out of date, nothing is split.
    """
    if held is None or len(names) < 2:
        return [], names
    objects = state.objects
    kv: list[str] = []
    rest: list[str] = []
    entries: dict[bool, set[Any]] = {True: set(), False: set()}
    for name in names:
        item = held.get(("o", name))
        obj = objects[name]
        if item is None or item.value is not obj:
            return [], names
        holds_kv = isinstance(obj, _KV_OBJECTS) or any(is_offloadable(x) for x in item.leaves)
        (kv if holds_kv else rest).append(name)
        entries[holds_kv].update(entry[1] for entry in item.entries)
    if not kv or not rest or not entries[True].isdisjoint(entries[False]):
        return [], names
    return kv, rest


def _unchanged(
    state: SessionState,
    names: list[str],
    clean: Mapping[str, _Restored],
    kept: Mapping[int, tuple[ParkedBytes, tuple[str, ...]]],
    held: Mapping[ValueKey, Any] | None,
) -> tuple[dict[str, StateObject], list[str], list[int]]:
    """Which of ``names`` a park need not copy, and which it parks apart.

    Returns the parked objects of the kept handles all of whose objects ``state`` still holds
    unchanged (by name), the other unchanged names (parked apart from the changed ones, so
    the next round can keep their copy), and the ids of the kept handles taken back. Nothing
    is taken back or set apart when a storage (or an engine block) reaches two of those
    groups (parked apart, it would be copied twice and come back as two), or the storages
    are not known (``held`` missing or out of date).
    """
    if not clean or held is None:
        return {}, [], []
    objects = state.objects
    unchanged: set[str] = set()
    for name in names:
        restored = clean.get(name)
        if restored is not None and restored.versions is not None:
            obj = objects[name]
            if restored.ref() is obj and _versions(obj, held.get(("o", name))) == restored.versions:
                unchanged.add(name)
    if not unchanged:
        return {}, [], []
    reused: dict[str, StateObject] = {}
    taken: list[int] = []
    groups: list[list[str]] = []
    for handle_id, (_, members) in kept.items():
        if all(m in unchanged for m in members):
            reused.update((m, clean[m].parked) for m in members)
            taken.append(handle_id)
            groups.append(list(members))
    apart = [name for name in names if name in unchanged and name not in reused]
    groups.append(apart)
    groups.append([name for name in names if name not in unchanged])
    seen: set[Any] = set()
    for group in groups:
        mine: set[Any] = set()
        for name in group:
            item = held.get(("o", name))
            if item is None or item.value is not objects[name]:
                return {}, [], []
            mine.update(entry[1] for entry in item.entries)
        if not seen.isdisjoint(mine):
            return {}, [], []
        seen |= mine
    return reused, apart, taken
