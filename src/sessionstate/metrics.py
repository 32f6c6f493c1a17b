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
``device``), ``_pool_blocks`` and ``_pool_free_blocks`` (by ``pool``). Counters:
``_lookups_total`` and ``_hits_total``, ``_evictions_total``, ``_refusals_total``,
``_parks_total`` and ``_unparks_total`` (by ``tier``), ``_kv_parks_total``,
``_prefetches_total`` (by ``outcome``: started, hit, dropped). Histograms:
``_park_seconds`` and ``_unpark_seconds`` (by ``tier``). The Observability page has the table.

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

from sessionstate._events import BUCKETS
from sessionstate._manager import SessionStateManager

__all__ = ["SessionStateCollector"]

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")


def _prometheus() -> Any:
    try:
        import prometheus_client.core as core
    except ImportError as exc:
        msg = (
            "Metrics need `prometheus_client`: install the extra, "
            "`pip install 'sessionstate[metrics]'`."
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

    def describe(self) -> list[Any]:
        """Nothing up front: the devices, tiers and pools are known only at a scrape."""
        return []

    def collect(self) -> Iterator[Any]:
        """One scrape: the manager's snapshot, as metric families."""
        core, p, constant = self._core, self.prefix, self.labels
        snap = self.manager.metrics_snapshot()
        stats: dict[str, int] = snap["stats"]
        names = list(constant)
        values = [constant[k] for k in names]

        def gauge(name: str, doc: str, label: str | None = None) -> Any:
            return core.GaugeMetricFamily(
                f"{p}_{name}", doc, labels=[*names, *([label] if label else [])]
            )

        def counter(name: str, doc: str, label: str | None = None) -> Any:
            return core.CounterMetricFamily(
                f"{p}_{name}", doc, labels=[*names, *([label] if label else [])]
            )

        sessions = gauge("sessions", "Sessions held, by state.", "state")
        for state, n in snap["sessions"].items():
            sessions.add_metric([*values, state.replace(":", "_")], n)
        yield sessions
        cap = gauge("max_sessions", "The session cap.")
        cap.add_metric(values, stats["max_sessions"])
        yield cap

        by_key = [
            ("resident_bytes", "nbytes:", "Resident bytes, each storage once.", "device"),
            ("engine_bytes", "engine_nbytes:", "Resident engine-block bytes.", "device"),
            ("parked_bytes", "nbytes_parked:", "Bytes the park tiers hold.", "tier"),
            ("budget_bytes", "max_bytes:", "The byte budget per device.", "device"),
        ]
        for name, key, doc, label in by_key:
            family = gauge(name, doc, label)
            for k, v in stats.items():
                if k.startswith(key):
                    family.add_metric([*values, k[len(key) :]], v)
            yield family
        usage = gauge("budget_usage_ratio", "Resident bytes over the budget.", "device")
        for k, budget in stats.items():
            if k.startswith("max_bytes:") and budget:
                device = k[len("max_bytes:") :]
                usage.add_metric([*values, device], stats.get(f"nbytes:{device}", 0) / budget)
        yield usage

        blocks = gauge("pool_blocks", "Blocks of each engine pool.", "pool")
        free = gauge("pool_free_blocks", "Free blocks of each engine pool.", "pool")
        for pool, total, nfree in snap["pools"]:
            blocks.add_metric([*values, pool], total)
            free.add_metric([*values, pool], nfree)
        yield blocks
        yield free

        plain = [
            ("lookups", stats["hits"] + stats["misses"], "Reads of a session."),
            ("hits", stats["hits"], "Reads that found the session."),
            ("evictions", stats["evictions"], "Sessions evicted."),
            ("refusals", snap["events"].get("refuse", 0), "Puts and reads refused."),
            ("kv_parks", stats.get("kv_parks", 0), "Parks that moved KV blocks."),
        ]
        for name, value, doc in plain:
            family = counter(name, doc)
            family.add_metric(values, value)
            yield family

        timings: dict[str, tuple[list[int], float, int]] = snap["timings"]
        for kind in ("park", "unpark"):
            total = counter(f"{kind}s", f"{kind.capitalize()}s, by tier.", "tier")
            seconds = core.HistogramMetricFamily(
                f"{p}_{kind}_seconds",
                f"Time to {kind} a session's objects.",
                labels=[*names, "tier"],
            )
            for tier in ("host", "disk"):
                counts, spent, n = timings.get(f"{kind}:{tier}", ([0] * (len(BUCKETS) + 1), 0.0, 0))
                total.add_metric([*values, tier], n)
                cumulative, running = [], 0
                for bound, count in zip([*map(str, BUCKETS), "+Inf"], counts, strict=True):
                    running += count
                    cumulative.append((bound, running))
                seconds.add_metric([*values, tier], buckets=cumulative, sum_value=spent)
            yield total
            yield seconds

        prefetches = counter("prefetches", "Prefetches by outcome.", "outcome")
        for outcome, key in (
            ("started", "prefetches"),
            ("hit", "prefetch_hits"),
            ("dropped", "prefetches_dropped"),
        ):
            prefetches.add_metric([*values, outcome], stats.get(key, 0))
        yield prefetches
