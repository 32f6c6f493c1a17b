"""Observability: Prometheus metrics equal `stats()`, a footprint per session, events, ranges.

A budgeted DreamZero episode is scraped over HTTP (`prometheus_client`'s own server and
parser); each metric equals what `stats()` says at that moment. Scrapes racing steps never
show a torn state. `session_stats` of every session sums to the manager's totals. Parks,
unparks, prefetches, evictions and refusals reach the `on_event` callback and the log, and
show as profiler ranges.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from sessionstate import (
    KVCache,
    KVPool,
    LatentBuffer,
    SessionAdmissionError,
    SessionState,
    SessionStateLostError,
    SessionStateManager,
    TensorCache,
)
from sessionstate._manager._events import SessionEvent
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode
from tests.support import assert_stats_equal_a_recount, torch_threads

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from sessionstate.metrics import SessionStateCollector  # noqa: E402


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def _budgeted_pipeline() -> DreamZeroPipeline:
    cfg = DreamZeroConfig.preset("tiny")
    env = {
        "OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1",
        "OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_BYTES": "1300000",
    }
    return DreamZeroPipeline(cfg, environ=env)


def test_a_scrape_over_http_equals_stats_during_a_budgeted_episode() -> None:
    pipe = _budgeted_pipeline()
    manager = pipe.manager
    assert manager is not None
    registry = CollectorRegistry()
    registry.register(SessionStateCollector(manager, labels={"model_name": "dreamzero"}))
    server, thread = prometheus_client.start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        episode = list(scripted_episode(pipe.cfg, steps=3, sessions=4, seed=2))
        for i, (sid, obs) in enumerate(episode):
            pipe.forward(obs, sid)
            if i % 4 != 3:
                continue
            with urllib.request.urlopen(url, timeout=30) as reply:
                got = _samples(reply.read().decode())
            stats = manager.stats()
            snap = manager.metrics_snapshot()
            assert got[("sessionstate_max_sessions", ())] == stats["max_sessions"]
            assert got[("sessionstate_hits_total", ())] == stats["hits"]
            assert got[("sessionstate_lookups_total", ())] == stats["hits"] + stats["misses"]
            assert got[("sessionstate_evictions_total", ())] == stats["evictions"]
            assert got[("sessionstate_kv_parks_total", ())] == stats["kv_parks"]
            for key, value in stats.items():
                if key.startswith("nbytes:"):
                    name = ("sessionstate_resident_bytes", (("device", key[7:]),))
                    assert got[name] == value
                if key.startswith("nbytes_parked:"):
                    assert got[("sessionstate_parked_bytes", (("tier", key[14:]),))] == value
                if key.startswith("max_bytes:"):
                    device = key[10:]
                    assert got[("sessionstate_budget_bytes", (("device", device),))] == value
                    ratio = got[("sessionstate_budget_usage_ratio", (("device", device),))]
                    assert ratio == pytest.approx(stats.get(f"nbytes:{device}", 0) / value)
            for state, n in snap["sessions"].items():
                key = ("sessionstate_sessions", (("state", state.replace(":", "_")),))
                assert got[key] == n
            assert (
                sum(snap["sessions"][s] for s in ("resident", "parked:host", "parked:disk"))
                == (stats["sessions"])
            )
            parks = sum(got[("sessionstate_parks_total", (("tier", t),))] for t in ("host", "disk"))
            assert parks == stats["parks"]
            unparks = sum(
                got[("sessionstate_unparks_total", (("tier", t),))] for t in ("host", "disk")
            )
            assert unparks == stats["unparks"]
            assert (
                got[("sessionstate_prefetches_total", (("outcome", "hit"),))]
                == (stats["prefetch_hits"])
            )
        assert manager.stats()["parks"] > 0  # the budget parked: the park metrics moved
    finally:
        server.shutdown()
        thread.join(timeout=30)


def test_scrapes_racing_steps_see_whole_states() -> None:
    # The collector reads under the manager's lock once: resident and parked sessions always
    # add up to the sessions held, and the byte keys to the total, whatever step is running.
    pipe = _budgeted_pipeline()
    manager = pipe.manager
    assert manager is not None
    collector = SessionStateCollector(manager)
    episode = list(scripted_episode(pipe.cfg, steps=3, sessions=4, seed=3))
    stop = threading.Event()
    seen: list[dict[str, Any]] = []

    def scrape() -> None:
        while not stop.wait(0.002):  # a scrape every 2 ms, racing the steps
            families = {f.name: f for f in collector.collect()}
            sessions = {
                s.labels["state"]: s.value for s in families["sessionstate_sessions"].samples
            }
            resident = sum(s.value for s in families["sessionstate_resident_bytes"].samples)
            seen.append({"sessions": sessions, "resident": resident})

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for sid, obs in episode:
            pipe.forward(obs, sid)
    finally:
        stop.set()
        scraper.join(timeout=60)
    assert seen
    for scrape_ in seen:
        held = scrape_["sessions"]
        assert held["resident"] + held["parked_host"] + held["parked_disk"] <= 4
        assert held["resident"] >= 0


def test_session_stats_sum_to_the_managers_totals() -> None:
    pool = KVPool(16, block_tokens=2, token_shape=(2,), name="kv", step_tokens=2)
    m = SessionStateManager(max_bytes={"cpu": 200}, pools=(pool,))  # two sessions of 96
    for i, sid in enumerate("abc"):
        kv = KVCache().allocate().append(pool, torch.full((3, 2), float(i)))
        feat = TensorCache().allocate().commit(torch.full((16,), float(i)))
        m.put(sid, SessionState(objects={"kv": kv, "feat": feat}))
    del kv, feat
    stats = m.stats()
    per = {sid: m.session_stats(sid) for sid in m.session_ids()}
    assert sum(s["nbytes"].get("cpu", 0) for s in per.values()) == stats["nbytes:cpu"]
    assert (
        sum(s["engine_nbytes"].get("cpu", 0) for s in per.values()) == (stats["engine_nbytes:cpu"])
    )
    parked = [sid for sid, s in per.items() if not s["resident"]]
    assert parked  # the budget parked the oldest
    for sid in parked:
        assert per[sid]["nbytes_parked"]["host"] > 0
        assert per[sid]["blocks"] == {"kv": 0}
    resident = [sid for sid, s in per.items() if s["resident"]]
    assert all(per[sid]["blocks"] == {"kv": 2} for sid in resident)
    assert sorted(s["lru_rank"] for s in per.values()) == [0, 1, 2]
    assert (
        sum(s["nbytes_parked"].get("host", 0) for s in per.values())
        == (stats["nbytes_parked:host"])
    )
    with pytest.raises(SessionStateLostError, match="No stats for session 'z'"):
        m.session_stats("z")


def test_the_fork_metrics_equal_stats_as_a_family_grows_and_lets_go() -> None:
    m = SessionStateManager()
    registry = CollectorRegistry()
    registry.register(SessionStateCollector(m))

    def scrape() -> tuple[float, float]:
        got = _samples(prometheus_client.generate_latest(registry).decode())
        return got[("sessionstate_forks_total", ())], got[("sessionstate_shared_sessions", ())]

    history = LatentBuffer(name="h", dim=0).allocate().commit(torch.zeros(64))
    m.put("a", SessionState(objects={"h": history}))
    m.put("x", SessionState(attrs={"y": torch.zeros(4)}))
    assert scrape() == (0, 0) == (m.stats()["forks"], m.stats()["shared_sessions"])
    m.fork("a", "b", "c")
    stats = m.stats()
    assert (stats["forks"], stats["shared_sessions"]) == (2, 3)
    assert scrape() == (2, 3)
    # "c" lets the history go (a record of its own): two still share it.
    m.put("c", SessionState(attrs={"z": torch.zeros(2)}))
    assert (m.stats()["forks"], m.stats()["shared_sessions"]) == (2, 2)
    assert scrape() == (2, 2)
    m.drop("b")
    assert scrape() == (2, 0) == (m.stats()["forks"], m.stats()["shared_sessions"])


def test_a_restored_family_is_counted_as_sharing(tmp_path: Path) -> None:
    # `shared_sessions` is present from the start, and a family restored with `restore_many`
    # (no `fork` here) is counted as `session_stats` reports it, in `stats()` and the gauge.
    source = SessionStateManager()
    history = LatentBuffer(name="h", dim=0).allocate().commit(torch.zeros(64))
    source.put("a", SessionState(objects={"h": history}))
    source.fork("a", "b", "c")
    source.snapshot_many(["a", "b", "c"], tmp_path / "family.safetensors")
    m = SessionStateManager()
    registry = CollectorRegistry()
    registry.register(SessionStateCollector(m))

    def scrape() -> float:
        got = _samples(prometheus_client.generate_latest(registry).decode())
        return got[("sessionstate_shared_sessions", ())]

    m.put("x", SessionState(attrs={"y": torch.zeros(4)}))
    assert (m.stats()["forks"], m.stats()["shared_sessions"], scrape()) == (0, 0, 0)
    m.restore_many(tmp_path / "family.safetensors")
    sharing = [sid for sid in m.session_ids() if m.session_stats(sid)["shared_with"]]
    assert sharing == ["a", "b", "c"]
    assert (m.stats()["forks"], m.stats()["shared_sessions"], scrape()) == (0, 3, 3)


def test_session_stats_of_forks_sum_to_the_totals_with_shared_bytes_once() -> None:
    # A source with a KV cache, a history and a tensor attribute, forked twice; each branch
    # steps (its own chunk, a copy of the partial block). What each session holds alone, plus
    # what they share counted once (the source's shared part: it reaches every shared
    # storage), is the manager's total; and each session's kinds add up to its bytes.
    pool = KVPool(16, block_tokens=4, token_shape=(2,), name="kv")
    m = SessionStateManager(pools=(pool,))
    handle = pool.append(pool.empty(), torch.arange(12.0).view(6, 2))
    history = LatentBuffer(name="h", dim=0).allocate().commit(torch.arange(8.0))
    kv = KVCache(name="kv").allocate().commit(handle)
    m.put("a", SessionState(objects={"kv": kv, "h": history}, attrs={"x": torch.zeros(4)}))
    del handle, history, kv
    m.fork("a", "b", "c")
    for i, sid in enumerate("bc"):
        state = m.require(sid)
        grown = pool.append(state.object("kv", KVCache).view(), torch.full((1, 2), float(i)))
        state = state.update_object("kv", lambda c, h=grown: c.commit(h))
        m.put(sid, state.update_object("h", lambda b, v=i: b.commit(torch.full((2,), float(v)))))
    del grown, state
    total = m.stats()["nbytes:cpu"]
    per = {sid: m.session_stats(sid) for sid in m.session_ids()}
    alone = sum(s["nbytes"]["cpu"] - s["nbytes_shared"].get("cpu", 0) for s in per.values())
    shared_once = per["a"]["nbytes_shared"]["cpu"]
    assert shared_once > 0
    assert alone > 0
    assert alone + shared_once == total
    for s in per.values():
        kinds = s["nbytes_by_kind"]
        assert sum(part.get("cpu", 0) for part in kinds.values()) == s["nbytes"]["cpu"]
        assert kinds["engine"] == s["engine_nbytes"]
        assert kinds["attrs"] == {"cpu": 16}  # `x`, shared by all three
    assert per["a"]["nbytes_by_kind"]["objects"] == {"cpu": 8 * 4}
    assert per["b"]["nbytes_by_kind"]["objects"] == {"cpu": 8 * 4 + 2 * 4}


def test_events_reach_the_callback_and_the_log(caplog: pytest.LogCaptureFixture) -> None:
    events: list[SessionEvent] = []

    def record() -> SessionState:
        return SessionState(objects={"c": TensorCache().allocate().commit(torch.zeros(16))})

    m = SessionStateManager(2, max_bytes={"cpu": 64}, on_event=events.append)
    with caplog.at_level(logging.DEBUG, logger="sessionstate"):
        m.put("a", record())
        m.put("b", record())  # parks "a"
        m.get("a")  # parks "b" for the room, unparks "a"
        assert m.prefetch("b", make_room=True)  # parks "a" again
        m.put("c", record())  # the cap: evicts the least recently used
    kinds = [e.kind for e in events]
    assert [(e.kind, e.session_id) for e in events[:4]] == [
        ("park", "a"),
        ("park", "b"),
        ("unpark", "a"),
        ("park", "a"),
    ]
    assert "prefetch" in kinds
    assert "evict" in kinds
    park = events[0]
    assert (park.session_id, park.nbytes, park.tier) == ("a", 64, "host")
    assert park.seconds > 0
    assert "park session 'a': 64 bytes (host tier)" in caplog.text
    refusing = SessionStateManager(1, on_full="refuse", on_event=events.append)
    refusing.put("x", SessionState())
    with pytest.raises(SessionAdmissionError):
        refusing.put("y", SessionState())
    assert events[-1].kind == "refuse"
    assert events[-1].session_id == "y"


def test_a_failing_callback_never_fails_the_manager(caplog: pytest.LogCaptureFixture) -> None:
    def broken(event: SessionEvent) -> None:
        raise RuntimeError("the tracer is down")

    m = SessionStateManager(max_bytes={"cpu": 64}, on_event=broken)
    for sid in "ab":
        m.put(sid, SessionState(objects={"c": TensorCache().allocate().commit(torch.zeros(16))}))
    assert m.peek("a").parked == ("c",)  # type: ignore[union-attr]
    assert "the tracer is down" in caplog.text
    with pytest.raises(TypeError, match="`on_event` must be a callable"):
        SessionStateManager(on_event=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("all_threads", [False, True])
def test_parks_unparks_and_steps_are_profiler_ranges(all_threads: bool) -> None:
    # A profiler that records every thread (`ab --trace`) leaves the thread's flag off.
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True) if all_threads else None
    pool = KVPool(4, block_tokens=2, token_shape=(), step_tokens=2, window_tokens=2)
    m = SessionStateManager(pools=(pool,))

    def grow(state: SessionState) -> tuple[SessionState, None]:
        kv = state.object("kv", KVCache).append(pool, torch.ones(2), window=2)
        return state.with_object("kv", kv), None

    def fresh() -> SessionState:
        return SessionState(objects={"kv": KVCache().allocate()})

    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, experimental_config=config) as prof:
        for sid in "aba":
            m.step(sid, grow, new=fresh)
    names = {event.key for event in prof.key_averages()}
    assert {"sessionstate::step", "sessionstate::park", "sessionstate::unpark"} <= names


def test_the_collector_refuses_bad_names_and_managers() -> None:
    with pytest.raises(ValueError, match="is not a Prometheus metric or label name"):
        SessionStateCollector(SessionStateManager(), prefix="9lives")
    with pytest.raises(TypeError, match="must be a SessionStateManager"):
        SessionStateCollector(object())  # type: ignore[arg-type]


def test_a_migration_is_counted_and_timed_on_both_workers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A worker's export and import are "migrate" events of its manager: the collector shows
    # them as `migrations_total` and `migration_seconds` by direction. In-process, no Ray.
    from sessionstate.distributed import DreamZeroFactory, SessionWorker

    src = SessionWorker("w0", DreamZeroFactory(preset="tiny"))
    dst = SessionWorker("w1", DreamZeroFactory(preset="tiny"))
    ((sid, obs),) = scripted_episode(DreamZeroConfig.preset("tiny"), steps=1, sessions=1, seed=0)
    src.step(sid, obs, epoch=1, create=True)
    with caplog.at_level(logging.DEBUG, logger="sessionstate"):
        data, _ = src.export_session(sid, epoch=1)
        dst.import_session(sid, data, epoch=2)
    for worker, direction in ((src, "out"), (dst, "in")):
        families = {f.name: f for f in SessionStateCollector(worker.manager).collect()}
        counts = {
            s.labels["direction"]: s.value for s in families["sessionstate_migrations"].samples
        }
        assert counts == {"out": direction == "out", "in": direction == "in"}
        seconds = {
            s.name: s.value
            for s in families["sessionstate_migration_seconds"].samples
            if s.labels["direction"] == direction
        }
        assert seconds["sessionstate_migration_seconds_count"] == 1
        assert seconds["sessionstate_migration_seconds_sum"] > 0
    assert f"migrate session {sid!r}: {data.nbytes} bytes (out) in" in caplog.text
    assert f"migrate session {sid!r}: {data.nbytes} bytes (in) in" in caplog.text


def test_evictions_warn_once_a_minute_with_a_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sessionstate._manager import _events

    now = [0.0]
    monkeypatch.setattr(_events, "_now", lambda: now[0])
    m = SessionStateManager(1)
    with caplog.at_level(logging.WARNING, logger="sessionstate"):
        for i in range(5):  # the first: the manager's eviction warning; three more quiet
            m.put(f"s{i}", SessionState())
        now[0] = _events.WARN_EVERY
        m.put("s5", SessionState())  # a minute on: one line, with the count
        m.put("s6", SessionState())
    lines = [r.getMessage() for r in caplog.records if r.name == "sessionstate"]
    assert len(lines) == 2
    assert lines[0].startswith("Session 's0' was evicted by the session cap")
    assert lines[1] == (
        "evict session 's4': 0 bytes in 0.000000 s; evicted by the session cap "
        "(max_sessions=1) (3 more evicted since the last warning, logged at DEBUG; "
        "`stats()['evictions']` counts them all)"
    )
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert m.stats()["evictions"] == 6


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_a_callback_raising_beyond_exception_leaves_the_manager_whole(
    raised: type[BaseException],
) -> None:
    # The callback raises during the unpark (and the parks it makes room with): the get
    # finishes its work, then the interrupt propagates; nothing is left half done.
    armed = False

    def interrupt(event: SessionEvent) -> None:
        if armed and event.kind == "unpark":
            raise raised

    def record(fill: float) -> SessionState:
        return SessionState(objects={"c": TensorCache().allocate().commit(torch.full((16,), fill))})

    m = SessionStateManager(max_bytes={"cpu": 100}, on_event=interrupt)
    m.put("a", record(1.0))
    m.put("b", record(2.0))  # parks "a"
    assert m.peek("a").parked == ("c",)
    armed = True
    with pytest.raises(raised):
        m.get("a")
    armed = False
    a = m.require("a")  # resident and readable: the unpark was whole
    assert not a.parked
    assert torch.equal(a.object("c", TensorCache).view(), torch.full((16,), 1.0))
    assert m.session_stats("a")["resident"]
    assert m.peek("b").parked == ("c",)
    s = m.stats()
    assert (s["unparks"], s["parked_sessions"], s["nbytes:cpu"]) == (1, 1, 64)
    assert_stats_equal_a_recount(m)


# -- reliability round 5 (issue 50) -----------------------------------------------------------


def test_a_storage_an_object_and_an_attribute_share_counts_as_the_objects() -> None:
    # `x` is an attribute and, through a view, the object's tensor too: the object's bytes.
    base = torch.zeros(8)
    cache = TensorCache(name="c").allocate().commit(base)
    m = SessionStateManager()
    m.put("a", SessionState(objects={"c": cache}, attrs={"x": base[2:], "own": torch.ones(2)}))
    kinds = m.session_stats("a")["nbytes_by_kind"]
    assert kinds == {"engine": {}, "objects": {"cpu": 8 * 4}, "attrs": {"cpu": 2 * 4}}


def test_a_scrape_reads_the_pool_refusal_repark_and_kept_metrics_as_stats_says() -> None:
    pool = KVPool(8, block_tokens=2, token_shape=(1,), name="kv")
    m = SessionStateManager(
        max_sessions=3, on_full="refuse", max_bytes={"cpu": 500}, park_tier="host", pools=(pool,)
    )
    registry = CollectorRegistry()
    registry.register(SessionStateCollector(m))
    kv = KVCache().allocate().append(pool, torch.ones(3, 1))  # 2 blocks of 8
    m.put("kv", SessionState(objects={"kv": kv}))
    del kv
    for sid, n in (("a", 100), ("b", 60)):  # 400 and 240 bytes: "b" parks "a"
        cache = TensorCache(name="c").allocate().commit(torch.full((n,), float(ord(sid))))
        m.put(sid, SessionState(objects={"c": cache}))
    del cache
    m.get("a")  # unparks "a" (its copy kept) and parks "b"
    m.get("b")  # parks "a" again, taking its kept copy back
    m.get("a")
    m.get("kv")  # its blocks taken again, whatever the budget parked
    refused = 0
    for sid in "cd":
        with pytest.raises(SessionAdmissionError):
            m.put(sid, SessionState())
        refused += 1
    got = _samples(prometheus_client.generate_latest(registry).decode())
    stats = m.stats()
    assert stats["reparks"] >= 1
    assert stats["nbytes_kept:host"] == 400  # "a"'s copy, beside "b" parked (240)
    assert stats["nbytes_parked:host"] == 240
    assert got[("sessionstate_pool_blocks", (("pool", "kv"),))] == pool.num_blocks == 8
    assert got[("sessionstate_pool_free_blocks", (("pool", "kv"),))] == pool.free_blocks == 6
    assert got[("sessionstate_refusals_total", ())] == refused == 2
    assert got[("sessionstate_reparks_total", ())] == stats["reparks"]
    for tier in ("host", "disk"):
        kept = got[("sessionstate_kept_bytes", (("tier", tier),))]
        assert kept == stats[f"nbytes_kept:{tier}"]
