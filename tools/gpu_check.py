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
   device bytes released while parked.

Prints one JSON object; exits non-zero if any check fails.

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


def main() -> int:
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

    results["failures"] = failures
    print(json.dumps(results, indent=2, default=str))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
