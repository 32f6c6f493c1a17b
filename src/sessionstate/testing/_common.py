"""Checks and defaults shared by the strategies and the machines."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn, TypeVar

import torch
from hypothesis import strategies as st

from sessionstate._checks import describe, is_int

_T = TypeVar("_T")

DEFAULT_MAXLENS: st.SearchStrategy[int | None] = st.one_of(st.none(), st.integers(1, 4))

DEFAULT_CAPS: st.SearchStrategy[int] = st.integers(1, 4)

DEFAULT_SESSION_IDS: st.SearchStrategy[str] = st.sampled_from(("a", "b", "c", "d", "e", "f"))


def fail(msg: str) -> NoReturn:
    # Contract checks raise explicitly rather than `assert`, so they survive `python -O`.
    raise AssertionError(msg)


def expect_raises(exc_type: type[BaseException], action: str, fn: Callable[[], object]) -> None:
    try:
        fn()
    except exc_type:
        return
    fail(f"{action} should raise {exc_type.__name__}, but it returned normally.")


def check_positive(name: str, value: object) -> int:
    if not is_int(value) or value <= 0:
        msg = f"`{name}` must be a positive int, got {describe(value)}."
        raise ValueError(msg)
    return value


def check_non_negative(name: str, value: object) -> int:
    if not is_int(value) or value < 0:
        msg = f"`{name}` must be a non-negative int, got {describe(value)}."
        raise ValueError(msg)
    return value


def check_choices(name: str, values: Sequence[_T], allowed: Sequence[_T] | None = None) -> list[_T]:
    chosen = list(values)
    if not chosen:
        msg = f"`{name}` must name at least one option, got {describe(values)}."
        raise ValueError(msg)
    if allowed is not None:
        unknown = [v for v in chosen if v not in allowed]
        if unknown:
            msg = f"`{name}` has unknown options {unknown}; choose from {list(allowed)}."
            raise ValueError(msg)
    return chosen


def check_devices(devices: Sequence[str]) -> list[str]:
    chosen = check_choices("devices", devices)
    for device in chosen:
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            msg = (
                f"`devices` must hold device strings such as 'cpu', 'meta' or 'cuda:0', got "
                f"{describe(device)}."
            )
            raise ValueError(msg) from None
    return chosen


def as_maxlen_strategy(
    maxlen: int | st.SearchStrategy[int | None] | None,
) -> st.SearchStrategy[int | None]:
    if isinstance(maxlen, st.SearchStrategy):
        return maxlen
    if maxlen is not None:
        check_positive("maxlen", maxlen)
    return st.just(maxlen)


def as_strategy(value: _T | st.SearchStrategy[_T]) -> st.SearchStrategy[_T]:
    return value if isinstance(value, st.SearchStrategy) else st.just(value)
