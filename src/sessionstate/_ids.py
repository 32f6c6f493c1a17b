"""Session ids: the one rule every session table applies (the manager, a bespoke path)."""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["check_session_id"]


def check_session_id(session_id: object) -> Hashable:
    """Return ``session_id`` if it is a valid session id: any hashable value, as a dict key.

    Except None, which almost always means a missing id, and NaN (alone or inside a tuple or
    frozenset), which is unequal to itself, so a session stored under it could never be read
    again. The manager and the models' pipelines apply the same rule with the same messages.

    Raises:
        TypeError: for an unhashable value or None, naming it, its type and the rule.
        ValueError: for an id that is or holds NaN.

    >>> check_session_id(42), check_session_id(("user", 7))
    (42, ('user', 7))
    """
    if session_id is None:
        msg = (
            "`session_id` must not be None: None almost always means a missing id. Pass the "
            "session's id (any hashable value such as a str or an int; the model pipelines "
            "default to 'default')."
        )
        raise TypeError(msg)
    try:
        hash(session_id)
    except TypeError:
        msg = (
            f"`session_id` must be hashable (any value a dict accepts as a key: a str, an int, "
            f"a tuple, ...), got {session_id!r} ({type(session_id).__name__}); pass an "
            "immutable id such as a str or a tuple."
        )
        raise TypeError(msg) from None
    if _holds_nan(session_id):
        msg = (
            f"`session_id` must equal itself, got {session_id!r} "
            f"({type(session_id).__name__}), which is or holds NaN: a session stored under it "
            "could never be read again. Pass an id such as a str or an int."
        )
        raise ValueError(msg)
    return session_id


def _holds_nan(value: object) -> bool:
    if isinstance(value, tuple | frozenset):
        return any(_holds_nan(item) for item in value)
    if isinstance(value, float | complex):
        return value != value  # only NaN is unequal to itself
    return False
