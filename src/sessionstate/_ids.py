"""Session ids: the one rule every session table applies (the manager, a bespoke path)."""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["check_session_id"]


def check_session_id(session_id: object) -> Hashable:
    """Return ``session_id`` if it is a valid session id: any hashable value, as a dict key.

    The manager and the models' bespoke paths apply the same rule with the same message.

    Raises:
        TypeError: for an unhashable value, naming it, its type and the rule.

    >>> check_session_id(42), check_session_id(("user", 7))
    (42, ('user', 7))
    """
    try:
        hash(session_id)
    except TypeError:
        msg = (
            f"`session_id` must be hashable (any value a dict accepts as a key: a str, an int, "
            f"a tuple, ...), got {session_id!r} ({type(session_id).__name__}); pass an "
            "immutable id such as a str or a tuple."
        )
        raise TypeError(msg) from None
    return session_id
