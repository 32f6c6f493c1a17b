"""How a session record travels between workers: a snapshot in parts, and a digest of it.

A record travels in the snapshot format, in parts (`dumps_parts` / `loads_parts`): the
checksummed header, and every storage once as a NumPy array over the record's memory. Ray's
serialiser passes NumPy arrays out of band, so the storages go into the object store with one
copy and come out of it as read-only views with none; the destination copies each once into
its own tensors, checking its checksum as it copies. Aliases are kept, records are rebuilt
through their constructors, nothing is unpickled by the library. A family of sessions (a source
and its forks) travels as one snapshot of the list of records: a storage they share is one
part, sent once, and the records decoded from it share it again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from sessionstate._errors import SnapshotError
from sessionstate._session import SessionState
from sessionstate._storage import SnapshotParts, dumps_parts, loads_parts

__all__ = ["decode_family", "decode_record", "digest", "encode_family", "encode_record"]


def encode_record(state: SessionState, /) -> SnapshotParts:
    """``state`` as a snapshot in parts, every storage once and none copied (on the CPU).

    >>> from sessionstate import SessionState
    >>> encode_record(SessionState(attrs={"step": 1})).nbytes > 0
    True
    """
    return dumps_parts(state)


def decode_record(parts: SnapshotParts, /) -> SessionState:
    """The record `encode_record` made, each storage on the device it was saved from.

    The parts may be read-only views of the object store: the record owns its memory.

    Raises:
        SnapshotError: if ``parts`` is not an intact snapshot of a `SessionState` (a
            storage that fails its checksum, parts that do not match the header).

    >>> from sessionstate import SessionState, tree_equal
    >>> state = SessionState(attrs={"step": 1})
    >>> tree_equal(decode_record(encode_record(state)), state)
    True
    """
    return loads_parts(parts, expect=SessionState)


def encode_family(states: Sequence[SessionState], /) -> SnapshotParts:
    """``states`` as one snapshot in parts: a storage several of them hold is one part.

    >>> import torch
    >>> from sessionstate import SessionState
    >>> shared = SessionState(attrs={"x": torch.zeros(256)})
    >>> encode_family([shared, shared]).nbytes < 2 * encode_record(shared).nbytes
    True
    """
    return dumps_parts(list(states))


def decode_family(parts: SnapshotParts, /) -> list[SessionState]:
    """The records `encode_family` made, sharing again every storage they shared.

    Raises:
        SnapshotError: if ``parts`` is not an intact snapshot of a list of `SessionState`
            records.

    >>> import torch
    >>> from sessionstate import SessionState
    >>> shared = SessionState(attrs={"x": torch.zeros(4)})
    >>> a, b = decode_family(encode_family([shared, shared]))
    >>> a.attrs["x"].untyped_storage().data_ptr() == b.attrs["x"].untyped_storage().data_ptr()
    True
    """
    records = loads_parts(parts)
    if not isinstance(records, list) or not all(isinstance(r, SessionState) for r in records):
        msg = (
            f"The parts hold a {type(records).__name__}, not a family of session records (a "
            "list, as `encode_family` makes); decode one session's parts with `decode_record`."
        )
        raise SnapshotError(msg)
    return records


def digest(parts: SnapshotParts, /) -> str:
    """The digest both ends of a migration compute over the same snapshot.

    It hashes the snapshot's header only (SHA-256): the header holds the JSON document, its
    checksum and a checksum of every storage, and `decode_record` verifies each storage and
    the document against it, so parts that decode and carry the same header are the same
    record. Hashing the header keeps the acknowledgement cheap for sessions of hundreds of
    MiB. It is the digest of the same snapshot as bytes (`dumps_state`) would have.

    >>> from sessionstate import SessionState
    >>> parts = encode_record(SessionState(attrs={"step": 1}))
    >>> digest(parts) == digest(encode_record(SessionState(attrs={"step": 1}))), len(digest(parts))
    (True, 64)
    """
    return hashlib.sha256(parts.header).hexdigest()
