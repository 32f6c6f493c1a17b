"""Prometheus metrics over a `SessionStateManager` (the optional ``metrics`` extra).

`SessionStateCollector` is a ``prometheus_client`` collector: register it with a registry
(``REGISTRY.register(SessionStateCollector(manager))``) and every scrape reads what the
manager already keeps (`SessionStateManager.metrics_snapshot`: its lock taken once, no record
walked). Names follow the serving ecosystem's conventions: a prefix (``sessionstate`` unless
given, so a server can mount them under its own), ``_bytes`` / ``_seconds`` / ``_total``
suffixes, and constant labels (``model_name``, ``stage``, ``replica``) given once.

Gauges: ``<prefix>_sessions`` (by ``state``: resident, parked_host, parked_disk, prefetching),
``_max_sessions``, ``_resident_bytes`` and ``_engine_bytes`` (by ``device``),
``_parked_bytes`` (by ``tier``), ``_budget_bytes`` and ``_budget_usage_ratio`` (by
``device``), ``_shared_sessions`` (sessions sharing a storage: a family of forks),
``_pool_blocks`` and ``_pool_free_blocks`` (by ``pool``). Counters:
``_lookups_total`` and ``_hits_total``, ``_evictions_total``, ``_forks_total`` (branches
made), ``_refusals_total``,
``_parks_total`` and ``_unparks_total`` (by ``tier``), ``_kv_parks_total``,
``_prefetches_total`` (by ``outcome``: started, hit, dropped), ``_migrations_total`` (by
``direction``: out, in; a `SessionWorker`'s exports and imports). Histograms:
``_park_seconds`` and ``_unpark_seconds`` (by ``tier``), ``_migration_seconds`` (by
``direction``). The Observability page has the table.

>>> from prometheus_client import CollectorRegistry, generate_latest
>>> from sessionstate import SessionStateManager
>>> registry = CollectorRegistry()
>>> registry.register(SessionStateCollector(SessionStateManager(), labels={"replica": "0"}))
>>> print(generate_latest(registry).decode().splitlines()[2])
sessionstate_sessions{replica="0",state="resident"} 0.0
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from sessionstate._manager import SessionStateManager
from sessionstate._manager._events import BUCKETS

__all__ = ["SessionStateCollector"]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")


def _prometheus() -> Any:
    try:
        import prometheus_client.core as core
    except ImportError as exc:
        msg = (
            "Metrics need `prometheus_client`: install the `metrics` extra from your clone, "
            "`pip install -e '.[metrics]'` (no release of sessionstate is on PyPI yet)."
        )
        raise ImportError(msg) from exc
    return core


class SessionStateCollector:
    """A ``prometheus_client`` collector of one manager's metrics (see the module's table).

    Args:
        manager: The manager (a model pipeline's is its ``manager``).
        prefix: The metric names' prefix.
        labels: Constant labels on every sample (e.g. ``{"model_name": "dreamzero"}``).

    Raises:
        ImportError: if ``prometheus_client`` is not installed, naming the extra.
        ValueError: for a prefix or label name Prometheus does not accept.
    """

    def __init__(
        self,
        manager: SessionStateManager[Any],
        *,
        prefix: str = "sessionstate",
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self._core = _prometheus()
        if not isinstance(manager, SessionStateManager):
            msg = (
                f"`manager` must be a SessionStateManager, got {type(manager).__name__}; a "
                "model pipeline's is its `manager`."
            )
            raise TypeError(msg)
        labels = dict(labels or {})
        for name in (prefix, *labels):
            if not isinstance(name, str) or not _NAME.match(name) or name.startswith("__"):
                msg = (
                    f"{name!r} is not a Prometheus metric or label name; use letters, digits "
                    "and underscores, not starting with a digit (e.g. 'vllm_omni')."
                )
                raise ValueError(msg)
        self.manager = manager
        self.prefix = prefix
        self.labels = labels
        self._label_cache: dict[tuple[str, str], dict[str, str]] = {}
        self._histograms: dict[tuple[str, str], tuple[list[int], float, list[Any]]] = {}

    def describe(self) -> list[Any]:
        """Nothing up front: the devices, tiers and pools are known only at a scrape."""
        return []

    def collect(self) -> Iterator[Any]:
        """One scrape: the manager's snapshot, as metric families.

        Built as plain ``Metric``s and ``Sample``s (both public in ``prometheus_client.core``)
        rather than through the ``*MetricFamily`` helpers, which zip and copy the label names
        for every sample: a scrape is a handful of families, and this keeps it near the cost
        of the snapshot (``benchmarks/scrape.py``). Label dicts are cached per value, and a
        histogram's samples until its observations change. Samples are immutable tuples,
        so two scrapes may share them.
        """
        p, sample = self.prefix, self._core.Sample
        snap = self.manager.metrics_snapshot()
        stats: dict[str, int] = snap["stats"]
        family, labels = self._family, self._labels
        none = self.labels

        sessions = family("sessions", "Sessions held, by state.", "gauge")
        sessions.samples = [
            sample(f"{p}_sessions", labels("state", state.replace(":", "_")), n)
            for state, n in snap["sessions"].items()
        ]
        yield sessions
        cap = family("max_sessions", "The session cap.", "gauge")
        cap.samples = [sample(f"{p}_max_sessions", none, stats["max_sessions"])]
        yield cap

        by_key: dict[str, list[tuple[str, int]]] = {key: [] for key, *_ in _BY_KEY}
        for k, v in stats.items():
            key, sep, rest = k.partition(":")
            if sep and key in by_key:
                by_key[key].append((rest, v))
        for key, name, doc, label in _BY_KEY:
            gauge = family(name, doc, "gauge")
            gauge.samples = [sample(f"{p}_{name}", labels(label, k), v) for k, v in by_key[key]]
            yield gauge
        usage = family("budget_usage_ratio", "Resident bytes over the budget.", "gauge")
        usage.samples = [
            sample(
                f"{p}_budget_usage_ratio",
                labels("device", device),
                stats.get(f"nbytes:{device}", 0) / budget,
            )
            for device, budget in by_key["max_bytes"]
            if budget
        ]
        yield usage

        shared = family(
            "shared_sessions", "Sessions holding a storage another session holds too.", "gauge"
        )
        shared.samples = [sample(f"{p}_shared_sessions", none, stats.get("shared_sessions", 0))]
        yield shared

        blocks = family("pool_blocks", "Blocks of each engine pool.", "gauge")
        free = family("pool_free_blocks", "Free blocks of each engine pool.", "gauge")
        for pool, total, nfree in snap["pools"]:
            blocks.samples.append(sample(f"{p}_pool_blocks", labels("pool", pool), total))
            free.samples.append(sample(f"{p}_pool_free_blocks", labels("pool", pool), nfree))
        yield blocks
        yield free

        plain = [
            ("lookups", stats["hits"] + stats["misses"], "Reads of a session."),
            ("hits", stats["hits"], "Reads that found the session."),
            ("evictions", stats["evictions"], "Sessions evicted."),
            ("refusals", snap["events"].get("refuse", 0), "Puts and reads refused."),
            ("kv_parks", stats.get("kv_parks", 0), "Parks that moved KV blocks."),
            ("reparks", stats.get("reparks", 0), "Parks that took a kept copy back."),
            ("forks", stats.get("forks", 0), "Branches made by `fork`."),
        ]
        for name, value, doc in plain:
            counter = family(name, doc, "counter")
            counter.samples = [sample(f"{p}_{name}_total", none, value)]
            yield counter

        timings: dict[str, tuple[list[int], float, int]] = snap["timings"]
        for kind, stem, label, values, doc in _TIMED:
            total = family(f"{stem}s", f"{stem.capitalize()}s, by {label}.", "counter")
            seconds = family(f"{stem}_seconds", doc, "histogram")
            for value in values:
                counts, spent, n = timings.get(f"{kind}:{value}", _NO_TIMINGS)
                total.samples.append(sample(f"{p}_{stem}s_total", labels(label, value), n))
                seconds.samples += self._histogram(stem, label, value, counts, spent)
            yield total
            yield seconds

        prefetches = family("prefetches", "Prefetches by outcome.", "counter")
        prefetches.samples = [
            sample(f"{p}_prefetches_total", labels("outcome", outcome), stats.get(key, 0))
            for outcome, key in (
                ("started", "prefetches"),
                ("hit", "prefetch_hits"),
                ("dropped", "prefetches_dropped"),
            )
        ]
        yield prefetches

    def _family(self, name: str, doc: str, kind: str) -> Any:
        return self._core.Metric(f"{self.prefix}_{name}", doc, kind)

    def _labels(self, label: str, value: str) -> dict[str, str]:
        # The constant labels and one more, the same dict at every scrape (nobody writes to it).
        key = (label, value)
        cached = self._label_cache.get(key)
        if cached is None:
            cached = self._label_cache[key] = {**self.labels, label: value}
        return cached

    def _histogram(
        self, stem: str, label: str, value: str, counts: list[int], spent: float
    ) -> list[Any]:
        # One histogram's samples (cumulative buckets, count, sum), rebuilt only when its
        # observations changed since the last scrape: between two scrapes most do not.
        key = (stem, value)
        cached = self._histograms.get(key)
        if cached is not None and cached[0] == counts and cached[1] == spent:
            return cached[2]
        sample, name = self._core.Sample, f"{self.prefix}_{stem}_seconds"
        own = self._labels(label, value)
        out, running = [], 0
        for bound, count in zip([*map(str, BUCKETS), "+Inf"], counts, strict=True):
            running += count
            out.append(sample(f"{name}_bucket", {**own, "le": bound}, running))
        out += [sample(f"{name}_count", own, running), sample(f"{name}_sum", own, spent)]
        self._histograms[key] = (counts, spent, out)
        return out


_BY_KEY = [
    ("nbytes", "resident_bytes", "Resident bytes, each storage once.", "device"),
    ("engine_nbytes", "engine_bytes", "Resident engine-block bytes.", "device"),
    ("nbytes_parked", "parked_bytes", "Bytes the park tiers hold.", "tier"),
    (
        "nbytes_kept",
        "kept_bytes",
        "Bytes the park tiers keep for resident sessions (copies of unchanged objects).",
        "tier",
    ),
    ("max_bytes", "budget_bytes", "The byte budget per device.", "device"),
]
"""The `stats()` keys read per device or tier: key, metric name, help, label."""

_TIMED = [
    ("park", "park", "tier", ("host", "disk"), "Time to park a session's objects."),
    ("unpark", "unpark", "tier", ("host", "disk"), "Time to unpark a session's objects."),
    (
        "migrate",
        "migration",
        "direction",
        ("out", "in"),
        "Time to export (out) or import (in) a session for a migration.",
    ),
]
"""The timed events (kind, metric stem, label, its values, help): a ``_total`` counter and a
``_seconds`` histogram each."""

_NO_TIMINGS: tuple[list[int], float, int] = ([0] * (len(BUCKETS) + 1), 0.0, 0)
