"""How a session record travels between workers: bytes, and a digest to acknowledge them.

`encode_record` / `decode_record` are the one place the byte format is chosen. They use
torch's own serialization, which moves every storage once (aliases inside a record survive
the round trip) and rebuilds the record's classes by import; both ends of a migration run the
same library, so the classes resolve to the same code.
"""

from __future__ import annotations

import hashlib
import io

import torch

from sessionstate._session import SessionState

__all__ = ["decode_record", "digest", "encode_record"]


def encode_record(state: SessionState, /) -> bytes:
    """The bytes of ``state``, every storage written once.

    >>> from sessionstate import SessionState
    >>> len(encode_record(SessionState(attrs={"step": 1}))) > 0
    True
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def decode_record(data: bytes, /) -> SessionState:
    """The record `encode_record` wrote, on the CPU.

    Raises:
        TypeError: if ``data`` does not hold a `SessionState`.

    >>> from sessionstate import SessionState, tree_equal
    >>> state = SessionState(attrs={"step": 1})
    >>> tree_equal(decode_record(encode_record(state)), state)
    True
    """
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    if not isinstance(state, SessionState):
        msg = (
            f"Session bytes decoded to {type(state).__name__}, not a SessionState; pass the "
            "bytes a worker's `export_session` returned."
        )
        raise TypeError(msg)
    return state


def digest(data: bytes, /) -> str:
    """The SHA-256 hex digest both ends of a migration compute over the same bytes.

    >>> digest(b"")[:8]
    'e3b0c442'
    """
    return hashlib.sha256(data).hexdigest()
