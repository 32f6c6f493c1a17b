"""The argument checks the modules share: "an int, not a bool", and a value with its type.

`bool` subclasses `int`, so ``isinstance(True, int)`` holds; every count and index in the
library refuses booleans, through `is_int`. Messages show an offending value as `describe`
renders it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["check_count", "describe", "is_int"]


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
