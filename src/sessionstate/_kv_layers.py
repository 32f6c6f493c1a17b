"""Helpers of `EncodeOnceKV`: its argument checks, an empty layer table, layers as ranges."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from sessionstate._checks import describe, is_int

if TYPE_CHECKING:
    from sessionstate._kv import KVPair

_Layers = tuple[tuple["KVPair | None", ...], ...]


def _format_layers(layers: Iterable[int]) -> str:
    """Layer indices as ranges: ``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(layers):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ", ".join(parts)


def _missing(row: tuple[KVPair | None, ...]) -> list[int]:
    return [i for i, pair in enumerate(row) if pair is None]


def _empty(branches: int, num_layers: int) -> _Layers:
    return tuple((None,) * num_layers for _ in range(branches))


def _check_branches(branches: object) -> tuple[str, ...]:
    ok = (
        isinstance(branches, tuple)
        and len(branches) > 0
        and all(isinstance(b, str) for b in branches)
        and len(set(branches)) == len(branches)
    )
    if not ok:
        msg = (
            f"`branches` must be a non-empty tuple of distinct names, got {describe(branches)}; "
            "e.g. `branches=('cond', 'uncond')` for classifier-free guidance."
        )
        raise ValueError(msg)
    assert isinstance(branches, tuple)
    return branches


def _check_num_layers(num_layers: object) -> int:
    if not is_int(num_layers) or num_layers <= 0:
        msg = (
            f"`num_layers` must be a positive int (the transformer's layer count), got "
            f"{describe(num_layers)}."
        )
        raise ValueError(msg)
    return num_layers
