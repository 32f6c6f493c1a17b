"""How a session record travels between workers: bytes, and a digest to acknowledge them.

A record travels in the snapshot format (`dumps_state` / `loads_state`): every storage once,
aliases kept, records rebuilt through their constructors, nothing unpickled.
"""

from __future__ import annotations

import hashlib

from sessionstate._session import SessionState
from sessionstate._storage import dumps_state, loads_state

__all__ = ["decode_record", "digest", "encode_record"]


def encode_record(state: SessionState, /) -> bytes:
    """The bytes of ``state``, every storage written once.

    >>> from sessionstate import SessionState
    >>> len(encode_record(SessionState(attrs={"step": 1}))) > 0
    True
    """
    return dumps_state(state)


def decode_record(data: bytes, /) -> SessionState:
    """The record `encode_record` wrote, each storage on the device it was saved from.

    Raises:
        SnapshotError: if ``data`` is not a snapshot of a `SessionState`.

    >>> from sessionstate import SessionState, tree_equal
    >>> state = SessionState(attrs={"step": 1})
    >>> tree_equal(decode_record(encode_record(state)), state)
    True
    """
    return loads_state(data, expect=SessionState)


def digest(data: bytes, /) -> str:
    """The digest both ends of a migration compute over the same snapshot bytes.

    It hashes the snapshot's header only (SHA-256): the header holds a checksum of every
    storage, and `decode_record` verifies each storage against it, so bytes that decode and
    carry the same header are the same record. Hashing the header keeps the acknowledgement
    cheap for sessions of hundreds of MiB.

    >>> from sessionstate import SessionState
    >>> data = encode_record(SessionState(attrs={"step": 1}))
    >>> digest(data) == digest(bytes(data)), len(digest(data))
    (True, 64)
    """
    view = memoryview(data)
    size = int.from_bytes(view[:8], "little") if len(view) >= 8 else 0
    return hashlib.sha256(view[: 8 + size]).hexdigest()
