"""Device checks for a machine with a CUDA GPU (not part of `make test`, which needs none).

Runs, on ``cuda:0``:

1. the DreamZero A/B (`sessionstate ab`) with the networks and session tensors on the GPU,
   without a budget and under a byte budget with the host park tier;
2. byte accounting: a managed pipeline's ``stats()`` reports ``nbytes:cuda:0`` equal to an
   independent recount, and a view of a CUDA tensor counts its whole storage once;
3. `to_device` cpu -> cuda -> cpu keeps every bit and the alias structure;
4. snapshots: a CUDA record saved and loaded back onto CUDA, onto the CPU, and a CPU file
   loaded with ``device="cuda:0"``; bits, aliases and byte counts kept;
5. park/unpark on the host tier from CUDA: pinned host memory, every bit and alias kept,
   device bytes released while parked;
6. KV parking through the manager: `KVCache` objects over a `KVPool` on the device, a byte
   budget of two sessions' worth and a host buffer pool (pinned): parked sessions' blocks go
   back to the pool, unparked reads are bit-identical, and every block is back once the
   sessions are dropped; `park_until` frees pool blocks the same way;
7. prefetch: `SessionStateManager.prefetch` restores a parked session on the background
   worker (a side CUDA stream) while the caller's stream runs other work, and the `get`
   after it reads bit-identically (skipped if the manager has no ``prefetch``);
8. the host buffer pool pins what it reports: a pool of 3 MiB + 64 bytes (a power of two
   would round it to 4 MiB) reports ``pinned_nbytes`` equal to its size, its buffer is
   page-locked (``is_pinned``), torch's caching host allocator reserved nothing for it, and a
   non-blocking copy through it round-trips; a parked session's snapshot, taken with the KV
   pool full, records ``cuda:0`` for every storage and loads back onto it;
9. a compiled, donating step under CUDA graphs: `sessionstate.compile(step, donate=True,
   mode="reduce-overhead")` over a ring of fixed-size chunks and a cache rebuilt each step
   (integer-valued floats, so inductor's results are exact): 40 steps equal eager bit for bit,
   every leaf keeps its ``data_ptr`` from step 2 (the donated buffers are marked static with
   `torch._dynamo.mark_static_address`, so the graph replays at their addresses without
   copying them into static inputs), the CUDA-graph skip counters stay zero, and the time per
   step is reported against eager. On the CPU dry run it runs under ``aot_eager`` instead.

Prints one JSON object; exits non-zero if any check fails. Without CUDA it prints
``{"skipped": ...}`` and exits 0 (the project's tests need no GPU);
``SESSIONSTATE_CHECK_DEVICE=cpu`` runs every check on the CPU instead (a dry run of the
script, nothing pinned).

    python tools/gpu_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch

import sessionstate as ss
from sessionstate.testing import recount_nbytes_by_device

DEV = os.environ.get("SESSIONSTATE_CHECK_DEVICE", "cuda:0")
results: dict[str, Any] = {}
failures: list[str] = []


def check(name: str, ok: bool, **facts: Any) -> None:
    results[name] = {"ok": bool(ok), **facts}
    if not ok:
        failures.append(name)


def alias_graph(tree: Any) -> list[tuple[int, int]]:
    leaves = [x for x in ss.tree_leaves(tree) if isinstance(x, torch.Tensor)]
    ids = [x.untyped_storage()._cdata for x in leaves]
    return [(i, j) for i in range(len(ids)) for j in range(i + 1, len(ids)) if ids[i] == ids[j]]


def ab(*extra: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "sessionstate.cli", "ab", "--preset", "tiny", "--json"]
    out = subprocess.run([*cmd, *extra], capture_output=True, text=True, check=False)
    if out.returncode not in (0, 1):
        return {"error": out.stderr[-2000:]}
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def _kv_session(pool: ss.KVPool, seed: int) -> ss.SessionState:
    """A session of 40 tokens of bf16 KV (3 blocks of the pool) and a 4 KiB feature cache."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(40, *pool.token_shape, generator=g).to(torch.bfloat16).to(DEV)
    feat = torch.randn(1024, generator=g).to(DEV)
    return ss.SessionState(
        objects={
            "kv": ss.KVCache(name="kv").allocate().append(pool, kv),
            "feat": ss.TensorCache(name="feat").allocate().commit((feat,)),
        }
    )


def _kv_read(state: ss.SessionState | None) -> torch.Tensor | None:
    return None if state is None else state.object("kv", ss.KVCache).read()


def _kv_manager(pool: ss.KVPool) -> tuple[ss.SessionStateManager, dict[str, torch.Tensor]]:
    """Three sessions under a budget of two on the device, parking into a host buffer pool."""
    records = {sid: _kv_session(pool, i) for i, sid in enumerate("abc")}
    want = {sid: r.object("kv", ss.KVCache).read().clone() for sid, r in records.items()}
    one = records["a"].nbytes_by_device()[DEV]
    manager = ss.SessionStateManager(
        max_bytes={DEV: 2 * one}, park_tier="host", host_pool_bytes="8MiB"
    )
    for sid in "abc":
        manager.put(sid, records.pop(sid))
    return manager, want


def kv_park_checks() -> None:
    pool = ss.KVPool(16, block_tokens=16, token_shape=(2, 4, 64), dtype=torch.bfloat16,
                     device=DEV, name="gpu-kv")  # fmt: skip
    manager, want = _kv_manager(pool)
    host_pool = manager.host_pool
    parked = manager.peek("a")
    stats = manager.stats()
    free_while_parked = pool.free_blocks
    reads = {sid: _kv_read(manager.get(sid)) for sid in "abc"}  # each get may park another
    identical = all(
        got is not None and got.device == want[sid].device and torch.equal(got, want[sid])
        for sid, got in reads.items()
    )
    after = manager.stats()
    # park_until: the least recently used sessions' KV goes back to the pool, then returns.
    held = pool.num_blocks - pool.free_blocks
    freed = manager.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
    back = _kv_read(manager.get("c"))
    manager.clear()
    del parked, reads, back
    check(
        "kv_park_unpark_through_the_manager",
        stats.get("kv_parks", 0) >= 1
        and stats.get("evictions") == 0
        and free_while_parked == pool.num_blocks - 2 * 3  # one session's 3 blocks went back
        and identical
        and after.get("kv_unparks", 0) >= 1
        and freed
        and pool.free_blocks == pool.num_blocks,
        pinned_host_pool=None if host_pool is None else host_pool.pinned,
        stats={
            k: v
            for k, v in after.items()
            if k.startswith(("kv_", "parks", "unparks", "host_pool", "nbytes", "engine"))
        },
        blocks_held_before_park_until=held,
        free_blocks_at_the_end=pool.free_blocks,
    )
    check(
        "kv_park_host_pool_pinned",
        host_pool is not None and (host_pool.pinned or not DEV.startswith("cuda")),
        pinned=None if host_pool is None else host_pool.pinned,
    )


def prefetch_checks() -> None:
    if not callable(getattr(ss.SessionStateManager, "prefetch", None)):
        results["prefetch"] = {"ok": True, "skipped": "SessionStateManager has no prefetch"}
        return
    pool = ss.KVPool(16, block_tokens=16, token_shape=(2, 4, 64), dtype=torch.bfloat16,
                     device=DEV, name="gpu-kv-prefetch")  # fmt: skip
    manager, want = _kv_manager(pool)  # "a" is parked
    started = manager.prefetch("a", make_room=True)  # parks "b" first, never evicts
    # Work on the caller's stream while the restore runs on the worker's side stream.
    x = torch.randn(512, 512, device=DEV)
    for _ in range(8):
        x = x @ x / 512
    got = _kv_read(manager.get("a"))
    stats = manager.stats()
    others = {sid: _kv_read(manager.get(sid)) for sid in "bc"}
    identical = (
        got is not None
        and torch.equal(got, want["a"])
        and all(r is not None and torch.equal(r, want[sid]) for sid, r in others.items())
    )
    manager.clear()
    del got, others
    check(
        "prefetch_then_get",
        started and identical and stats.get("prefetch_hits", 0) >= 1
        and stats.get("evictions") == 0 and pool.free_blocks == pool.num_blocks,
        started=started,
        stats={k: v for k, v in stats.items() if "prefetch" in k or k.startswith("kv_")},
        free_blocks_at_the_end=pool.free_blocks,
    )  # fmt: skip


def host_pool_pin_checks() -> None:
    from sessionstate._storage import HostBufferPool

    cuda = DEV.startswith("cuda")
    stats = getattr(torch.cuda, "host_memory_stats", None)
    before = stats().get("reserved_bytes.all.current", 0) if cuda and stats else None
    nbytes = 3 * 2**20 + 64
    pool = HostBufferPool(nbytes, pin_memory=cuda)
    after = stats().get("reserved_bytes.all.current", 0) if cuda and stats else None
    x = torch.randn(nbytes // 4 - 16, device=DEV)
    view = pool.allocate(x.numel() * 4)
    view.copy_(x.view(torch.uint8).flatten(), non_blocking=True)
    y = view.to(DEV, non_blocking=True).view(torch.float32)
    if cuda:
        torch.cuda.synchronize()
    check(
        "host_pool_pins_what_it_reports",
        pool.stats()["pinned_nbytes"] == (pool.total if cuda else 0)
        and pool.buffer.is_pinned() == cuda
        and before == after
        and torch.equal(x, y),
        total=pool.total,
        pinned_nbytes=pool.stats()["pinned_nbytes"],
        is_pinned=pool.buffer.is_pinned(),
        caching_host_allocator_reserved=(before, after),
    )


def parked_snapshot_checks() -> None:
    pool = ss.KVPool(
        3, block_tokens=16, token_shape=(2,), dtype=torch.bfloat16, device=DEV, name="kv"
    )
    m = ss.SessionStateManager()
    m.put("a", _kv_session(pool, 1))
    want = _kv_read(m.peek("a"))
    m.park_until(lambda: pool.free_blocks == pool.num_blocks, frees=pool.owns_entry)
    hog = pool.append(pool.empty(), torch.zeros(48, 2, dtype=torch.bfloat16, device=DEV))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "a.safetensors")
        m.snapshot("a", path)
        back = ss.load_state(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        document = json.loads(header["__metadata__"]["sessionstate"])
        devices = sorted({s["device"] for s in document["storages"]})
    got = _kv_read(back)
    check(
        "snapshot_of_parked_session_records_its_device",
        devices == [str(torch.device(DEV))]
        and pool.free_blocks == 0
        and got is not None
        and want is not None
        and got.device == want.device
        and torch.equal(got, want),
        devices=devices,
    )
    del hog


def _compiled_session() -> ss.SessionState:
    ring = ss.LatentBuffer(name="latents", dim=0).allocate(maxlen=4)
    cache = ss.TensorCache(name="feat").allocate().commit(torch.zeros(256, 256, device=DEV))
    return ss.SessionState(objects={"latents": ring, "feat": cache}, attrs={"steps": 0})


def _compiled_step(state: ss.SessionState, x: torch.Tensor) -> tuple[ss.SessionState, Any]:
    state = state.update_object("latents", lambda r: r.commit(x))
    feat = state.object("feat", ss.TensorCache).view()
    state = state.update_object("feat", lambda c: c.commit(feat + x.sum()))
    window = state.object("latents", ss.LatentBuffer).concat()
    return state.with_attrs(steps=state.attrs["steps"] + 1), window.sum(0)


def compiled_step_checks(steps: int = 40) -> None:
    """A donating compiled step replayed as a CUDA graph at stable addresses (check 9)."""
    import time

    from torch._dynamo.utils import counters

    cuda = DEV.startswith("cuda")
    kwargs: dict[str, Any] = {"mode": "reduce-overhead"} if cuda else {"backend": "aot_eager"}
    fast = ss.compile(_compiled_step, donate=True, **kwargs)
    xs = [torch.full((1, 256), float(i % 7), device=DEV) for i in range(steps)]
    state, eager = _compiled_session(), _compiled_session()
    addresses, same = [], True
    for i, x in enumerate(xs):
        if cuda:  # one replay per step; the record's leaves are inputs, written in place
            torch.compiler.cudagraph_mark_step_begin()
        state, out = fast(state, x.clone())
        eager, expected = _compiled_step(eager, x.clone())
        same = same and torch.equal(out, expected) and ss.tree_equal(state, eager)
        addresses.append([t.data_ptr() for t in ss.tree_leaves(state) if torch.is_tensor(t)])
        if i == 4:  # the ring is full: its buffers are the ones every later step writes
            for t in ss.tree_leaves(state):
                if torch.is_tensor(t):
                    torch._dynamo.mark_static_address(t)

    def timed(run: Any, box: list[Any]) -> tuple[float, Any]:
        s = box.pop()  # the only reference: the first timed step donates too
        fresh = [x.clone() for x in xs]  # each committed once: the caller keeps none
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in fresh:
            if cuda:
                torch.compiler.cudagraph_mark_step_begin()
            s, _ = run(s, x)
        if cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / len(fresh), s

    eager_s, eager = timed(_compiled_step, [eager])
    donated_before = fast.donated
    box = [state]
    del state
    compiled_s, state = timed(fast, box)
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k and "skip" in k}
    check(
        "compiled_donated_step",
        same
        and all(a == addresses[5] for a in addresses[5:])
        and fast.donated >= steps - 2
        and fast.donated - donated_before == steps
        and ss.tree_equal(state, eager)
        and not any(skips.values()),
        structures=fast.structures,
        compiles=fast.compiles,
        donated=fast.donated,
        copied=fast.copied,
        cudagraph_skips=skips,
        eager_ms=round(eager_s * 1e3, 4),
        compiled_ms=round(compiled_s * 1e3, 4),
        speedup=round(eager_s / compiled_s, 2) if compiled_s else None,
    )


def main() -> int:
    if DEV.startswith("cuda") and not torch.cuda.is_available():
        print(json.dumps({"skipped": f"no CUDA device ({DEV}): nothing checked", "ok": True}))
        return 0
    results["torch"] = torch.__version__
    results["device_name"] = torch.cuda.get_device_name(0) if DEV.startswith("cuda") else DEV

    plain = ab("--device", DEV, "--steps", "12", "--sessions", "3")
    check(
        "ab_cuda",
        plain.get("identical") is True,
        outputs_compared=plain.get("outputs_compared"),
        paths=plain.get("paths"),
        error=plain.get("error"),
    )
    budget = ab(
        "--device", DEV, "--steps", "24", "--sessions", "6", "--max-bytes", "2100000",
        "--park-tier", "host",
    )  # fmt: skip
    managed = (budget.get("paths") or {}).get("managed", {})
    check(
        "ab_cuda_budget_host_tier",
        budget.get("identical") is True and managed.get("parks", 0) > 0,
        outputs_compared=budget.get("outputs_compared"),
        managed=managed,
        error=budget.get("error"),
    )

    from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
    from sessionstate.models.dreamzero.episode import scripted_episode

    cfg = DreamZeroConfig.preset("tiny")
    env = {"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"}
    pipe = DreamZeroPipeline(cfg, device=DEV, environ=env)
    for sid, obs in scripted_episode(cfg, steps=6, sessions=2, seed=0):
        pipe.forward(obs, sid)
    assert pipe.manager is not None
    stats = pipe.manager.stats()
    records = [pipe.manager.peek(sid) for sid in pipe.manager.session_ids()]
    recount = recount_nbytes_by_device(records)
    check(
        "stats_cuda_equals_recount",
        stats.get(f"nbytes:{DEV}", 0) > 0 and stats.get(f"nbytes:{DEV}") == recount.get(DEV),
        stats={k: v for k, v in stats.items() if k.startswith(("nbytes", "engine"))},
        recount=recount,
    )
    x = torch.zeros(1024, device=DEV)
    counted = ss.nbytes_by_device({"a": x[10:20], "b": x.view(32, 32)})
    check("view_counts_whole_storage_once", counted == {DEV: 4096}, counted=counted)

    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    state = ss.SessionState(
        objects={"ring": ss.LatentBuffer(dim=0).allocate(maxlen=3).commit(base[:2])},
        attrs={"view": base[2:, 1:].t(), "same": base, "bf": torch.randn(5).bfloat16()},
    )
    on_gpu = ss.to_device(state, DEV)
    back = ss.to_device(on_gpu, "cpu")
    check(
        "to_device_round_trip",
        ss.tree_equal(back, state)
        and alias_graph(on_gpu) == alias_graph(state)
        and ss.nbytes_by_device(on_gpu) == {DEV: ss.nbytes_by_device(state)["cpu"]},
        gpu_nbytes=ss.nbytes_by_device(on_gpu),
    )

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gpu.safetensors")
        ss.save_state(on_gpu, path)
        same = ss.load_state(path)
        cpu = ss.load_state(path, device="cpu")
        cpu_path = os.path.join(tmp, "cpu.safetensors")
        ss.save_state(state, cpu_path)
        onto = ss.load_state(cpu_path, device=DEV)
        check(
            "snapshot_cuda",
            ss.tree_equal(same, on_gpu)
            and ss.tree_equal(cpu, state)
            and ss.tree_equal(onto, on_gpu)
            and alias_graph(same) == alias_graph(on_gpu) == alias_graph(onto)
            and ss.nbytes_by_device(same) == ss.nbytes_by_device(on_gpu)
            and ss.nbytes_by_device(onto) == ss.nbytes_by_device(on_gpu),
            loaded=ss.nbytes_by_device(same),
        )

    cache = ss.TensorCache().allocate().commit((torch.randn(256, 256, device=DEV),) * 2)
    session = ss.SessionState(objects={"cache": cache, "ring": on_gpu.objects["ring"]})
    parked = session.park("host")
    resident = parked.unpark()
    check(
        "park_host_tier_from_cuda",
        ss.tree_equal(resident, session)
        and alias_graph(resident) == alias_graph(session)
        and ss.nbytes_by_device(parked).get(DEV, 0) == 0
        and ss.nbytes_by_device(resident) == ss.nbytes_by_device(session),
        parked_nbytes=ss.nbytes_by_device(parked),
    )

    kv_park_checks()
    prefetch_checks()
    host_pool_pin_checks()
    parked_snapshot_checks()
    compiled_step_checks()

    results["failures"] = failures
    print(json.dumps(results, indent=2, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
