"""The argument checks the modules share: "an int, not a bool", and a value with its type.

`bool` subclasses `int`, so ``isinstance(True, int)`` holds; every count and index in the
library refuses booleans, through `is_int`. Messages show an offending value as `describe`
renders it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import TypeIs

__all__ = ["describe", "is_int"]


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
