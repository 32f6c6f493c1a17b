"""The argument checks the modules share: "an int, not a bool", a value with its type, the
rule for a session id, and the validators that the configs' fields and the manager's
arguments are checked with (`positive_int`, `an_int`, `one_of`, `a_bool`, `check_bool`).

`bool` subclasses `int`, so ``isinstance(True, int)`` holds; every count and index in the
library refuses booleans, through `is_int`. Messages show an offending value as `describe`
renders it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = [
    "a_bool",
    "an_int",
    "check_bool",
    "check_count",
    "check_session_id",
    "describe",
    "is_int",
    "one_of",
    "positive_int",
]


def is_int(value: object) -> TypeIs[int]:
    """Whether ``value`` is an int and not a bool.

    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    """
    return isinstance(value, int) and not isinstance(value, bool)


def describe(value: object) -> str:
    """``value``'s repr and its type's name, as error messages show an offending value.

    >>> describe(0), describe("2")
    ('0 (int)', "'2' (str)")
    """
    return f"{value!r} ({type(value).__name__})"


def check_count(value: object, name: str, /, *, minimum: int = 1, fix: str = "") -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum`` (0 or 1).

    Raises:
        ValueError: naming ``name``, the rule and the value, then ``fix`` (a clause such as
            ``"; the default is 64"``).

    >>> check_count(3, "blocks"), check_count(0, "blocks", minimum=0)
    (3, 0)
    >>> check_count(True, "blocks")
    Traceback (most recent call last):
    ...
    ValueError: `blocks` must be a positive int, got True (bool).
    """
    if not is_int(value) or value < minimum:
        rule = "a positive int" if minimum == 1 else "a non-negative int"
        msg = f"`{name}` must be {rule}, got {describe(value)}{fix}."
        raise ValueError(msg)
    return value


def check_bool(value: object, name: str, /) -> bool:
    """``value`` if it is a bool.

    Raises:
        TypeError: naming ``name`` and the value.

    >>> check_bool(1, "check_immutable")
    Traceback (most recent call last):
    ...
    TypeError: `check_immutable` must be a bool (True or False), got 1 (int).
    """
    if not isinstance(value, bool):
        msg = f"`{name}` must be a bool (True or False), got {describe(value)}."
        raise TypeError(msg)
    return value


# -- attrs field validators: ``validator=positive_int`` and so on --------------------------


def positive_int(instance: object, attribute: Any, value: object) -> None:
    """An attrs validator: the field holds an int (not a bool) of at least 1.

    >>> import attrs
    >>> @attrs.frozen
    ... class Shape:
    ...     width: int = attrs.field(validator=positive_int)
    >>> Shape(0)
    Traceback (most recent call last):
    ...
    ValueError: `width` must be a positive int, got 0 (int).
    """
    check_count(value, attribute.name)


def an_int(instance: object, attribute: Any, value: object) -> None:
    """An attrs validator: the field holds an int (not a bool); raises TypeError."""
    if not is_int(value):
        msg = f"`{attribute.name}` must be an int, got {describe(value)}."
        raise TypeError(msg)


def a_bool(instance: object, attribute: Any, value: object) -> None:
    """An attrs validator for a field read from a config file: the field holds a bool.

    Spelled as YAML spells them (``true or false``); raises TypeError.
    """
    if not isinstance(value, bool):
        msg = f"`{attribute.name}` must be a bool (true or false), got {describe(value)}."
        raise TypeError(msg)


def one_of(choices: Collection[str], /) -> Callable[[object, Any, object], None]:
    """An attrs validator factory: the field holds one of ``choices`` (listed sorted).

    >>> import attrs
    >>> @attrs.frozen
    ... class Model:
    ...     dtype: str = attrs.field(validator=one_of({"float32", "bfloat16"}))
    >>> Model("int8")
    Traceback (most recent call last):
    ...
    ValueError: `dtype` must be one of ['bfloat16', 'float32'], got 'int8'.
    """
    shown = sorted(choices)

    def validate(instance: object, attribute: Any, value: object) -> None:
        if value not in choices:
            msg = f"`{attribute.name}` must be one of {shown}, got {value!r}."
            raise ValueError(msg)

    return validate


ON_FULL_CHOICES: Mapping[str, str] = {
    "evict": "drops the least recently used session at the cap",
    "refuse": "refuses the new one",
}
"""What a new session does when the session table is at its cap (``on_full``)."""

HOST_POOL_FULL_CHOICES: Mapping[str, str] = {
    "disk": "spills a park the host pool cannot hold to the disk tier",
    "refuse": "refuses it",
}
"""What a park the host buffer pool cannot hold does (``host_pool_full``)."""


def check_choice(value: object, name: str, choices: Mapping[str, str], /) -> str:
    """``value`` if it is one of ``choices`` (each mapped to what it does).

    The one check of a setting with named choices (``on_full``, ``host_pool_full``), for every
    entry point: the manager, the deploy config, the testing machines.

    Raises:
        TypeError: for a value that is not a str.
        ValueError: for another str; both name the value and what each choice does.

    >>> check_choice("lru", "on_full", ON_FULL_CHOICES)
    Traceback (most recent call last):
    ...
    ValueError: `on_full` must be 'evict' or 'refuse', got 'lru' (str): 'evict' drops the least recently used session at the cap, 'refuse' refuses the new one.
    """  # noqa: E501 - a doctest line
    if isinstance(value, str) and value in choices:
        return value
    names = [repr(c) for c in choices]
    listed = ", ".join(names[:-1]) + f" or {names[-1]}"
    what = ", ".join(f"{c!r} {does}" for c, does in choices.items())
    msg = f"`{name}` must be {listed}, got {describe(value)}: {what}."
    raise (ValueError if isinstance(value, str) else TypeError)(msg)


def check_window(window: object, /) -> None:
    """Refuse a KV window that is neither None (keep every token) nor an int >= 0.

    >>> check_window(4)
    >>> check_window(-1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: `window` must be a non-negative int (the newest tokens to keep), got -1; ...
    """
    if window is None:
        return
    if not is_int(window):
        msg = (
            f"`window` must be an int (the newest tokens to keep) or None, got {window!r} "
            f"({type(window).__name__})."
        )
        raise TypeError(msg)
    if window < 0:
        msg = (
            f"`window` must be a non-negative int (the newest tokens to keep), got {window!r}; "
            "pass None to keep every token."
        )
        raise ValueError(msg)


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
    if type(session_id) in _PLAIN_IDS:  # the common ids: hashable, never None or NaN
        return session_id
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


_PLAIN_IDS = frozenset({str, int})


def _holds_nan(value: object) -> bool:
    if isinstance(value, tuple | frozenset):
        return any(_holds_nan(item) for item in value)
    if isinstance(value, float | complex):
        return value != value  # only NaN is unequal to itself
    return False
