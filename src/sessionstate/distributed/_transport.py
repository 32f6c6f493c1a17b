"""How a session record travels between workers: bytes, and a digest to acknowledge them.

A record travels in the snapshot format (`dumps_state` / `loads_state`): every storage once,
aliases kept, records rebuilt through their constructors, nothing unpickled.
"""

from __future__ import annotations

import hashlib

from sessionstate._session import SessionState
from sessionstate._snapshot import dumps_state, loads_state

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
    """The SHA-256 hex digest both ends of a migration compute over the same bytes.

    >>> digest(b"")[:8]
    'e3b0c442'
    """
    return hashlib.sha256(data).hexdigest()
