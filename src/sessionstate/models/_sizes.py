"""What the models' size tables share: one session run on both paths, counted per value."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from sessionstate import nbytes_by_device
from sessionstate._env import ENV_ENABLE

__all__ = ["measure_both_paths", "values_table"]

PipelineFactory = Callable[[Mapping[str, str]], Any]
"""Builds a model pipeline from an environment (the flag picks its path)."""


def measure_both_paths(
    build: PipelineFactory, episode: Callable[[], Iterable[tuple[str, Any]]], /
) -> tuple[dict[str, dict[str, int]], dict[str, int], dict[str, dict[str, Any]]]:
    """Run ``episode`` on the bespoke path, then on the managed one, and count session-0.

    Returns, per path (``"bespoke"``, ``"managed"``): the bytes of each value, the session's
    bytes with every storage counted once, and the values themselves.

    >>> from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    >>> from sessionstate.models.dreamzero.episode import scripted_episode
    >>> cfg = DreamZeroConfig.preset("tiny")
    >>> held, totals, _ = measure_both_paths(
    ...     lambda env: DreamZeroPipeline(cfg, device="meta", host_device="meta", environ=env),
    ...     lambda: scripted_episode(cfg, steps=2, sessions=1, seed=0),
    ... )
    >>> sorted(totals), held["managed"]["call_count"]
    (['bespoke', 'managed'], 0)
    """
    held: dict[str, dict[str, int]] = {}
    totals: dict[str, int] = {}
    values_by_path: dict[str, dict[str, Any]] = {}
    for flag, name in (("0", "bespoke"), ("1", "managed")):
        pipe = build({ENV_ENABLE: flag})
        for sid, inputs in episode():
            pipe.forward(inputs, sid)
        values = pipe.session_values("session-0")
        held[name] = {k: sum(nbytes_by_device(v).values()) for k, v in values.items()}
        totals[name] = sum(nbytes_by_device(list(values.values())).values())
        values_by_path[name] = values
    return held, totals, values_by_path


def values_table(
    held: Mapping[str, Mapping[str, int]], buckets: Mapping[str, str], /
) -> dict[str, dict[str, Any]]:
    """The ``values`` section of a size table: each value's bucket and bytes on both paths.

    >>> values_table({"managed": {"x": 4}, "bespoke": {"x": 8}}, {"x": "attrs"})
    {'x': {'bucket': 'attrs', 'managed_nbytes': 4, 'bespoke_nbytes': 8}}
    """
    return {
        k: {
            "bucket": buckets[k],
            "managed_nbytes": held["managed"][k],
            "bespoke_nbytes": held["bespoke"][k],
        }
        for k in buckets
    }
