"""Bytes held per session vs steps, and the peak RSS of a long run: each path in its own process.

The bytes come from the library's accounting of ``pipe.session_values`` (tiny preset, and the
deploy geometry on the ``meta`` device, where nothing is allocated); the peak RSS from the
worker process of each path. `run.py` calls `bench_memory`; this file is also the worker::

    python benchmarks/memory.py --worker managed --steps 400 --samples 1,10,400 --deploy-steps 400
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from common import MIB, PATHS, Sizes, path_environ

from sessionstate import nbytes_by_device
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode


def _maxrss_kib() -> int:
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss // 1024 if sys.platform == "darwin" else rss


def _vm_hwm_kib() -> int | None:
    """The peak RSS of this process's own address space (Linux), a cross-check of ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


# On Linux a process's ru_maxrss starts at its parent's RSS at fork time (the high-water mark
# of the address space it replaced at exec), so a worker forked from this large process would
# report our peak, not its own. A small launcher process in between has a small address space
# of its own, and the worker it starts measures from there.
_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


def _value_bytes(values: dict[str, object]) -> dict[str, int]:
    return {name: sum(nbytes_by_device(value).values()) for name, value in values.items()}


def memory_worker(
    path: str, steps: int, samples: Sequence[int], deploy_steps: int
) -> dict[str, Any]:
    """Run one path for ``steps`` steps; bytes held at ``samples`` and the peak RSS.

    Then, on the ``meta`` device (nothing allocated), the same accounting at the deploy
    geometry for ``deploy_steps`` steps.
    """
    cfg = DreamZeroConfig.preset("tiny", local_attn_size=-1)
    environ = path_environ(path)
    pipe = DreamZeroPipeline(cfg, environ=environ)
    rss_baseline_kib = _maxrss_kib()
    hwm_baseline_kib = _vm_hwm_kib()
    tiny = []
    episode = scripted_episode(cfg, steps=steps, sessions=1, seed=0, prompt_change_every=10**9)
    for i, (sid, obs) in enumerate(episode, start=1):
        pipe.forward(obs, sid)
        if i in samples:
            per_value = _value_bytes(pipe.session_values(sid))
            tiny.append({"step": i, "total": sum(per_value.values()), "per_value": per_value})
    rss_peak_kib = _maxrss_kib()
    hwm_peak_kib = _vm_hwm_kib()

    deploy_cfg = DreamZeroConfig.preset("deploy", local_attn_size=-1)
    meta = DreamZeroPipeline(deploy_cfg, device="meta", host_device="meta", environ=environ)
    deploy = []
    deploy_samples = set(_scaled_samples(samples, deploy_steps))
    episode = scripted_episode(
        deploy_cfg, steps=deploy_steps, sessions=1, seed=0, prompt_change_every=10**9
    )
    for i, (sid, obs) in enumerate(episode, start=1):
        meta.forward(obs, sid)
        if i in deploy_samples:
            per_value = _value_bytes(meta.session_values(sid))
            deploy.append({"step": i, "total": sum(per_value.values()), "per_value": per_value})
    return {
        "path": path,
        "steps": steps,
        "rss_baseline_kib": rss_baseline_kib,
        "rss_peak_kib": rss_peak_kib,
        "rss_growth_kib": rss_peak_kib - rss_baseline_kib,
        "vm_hwm_baseline_kib": hwm_baseline_kib,
        "vm_hwm_peak_kib": hwm_peak_kib,
        "tiny_bytes_by_step": tiny,
        "deploy_meta_bytes_by_step": deploy,
        "torch_threads": torch.get_num_threads(),
    }


def _scaled_samples(samples: Sequence[int], target: int) -> list[int]:
    return sorted({s for s in samples if s <= target} | {target})


def bench_memory(sizes: Sizes, threads: int) -> dict[str, Any]:
    """Both paths in their own subprocesses (run side by side: RSS is per process)."""
    procs = {}
    for path in PATHS:
        cmd = [
            sys.executable,
            "-c",
            _LAUNCHER,
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            path,
            "--threads",
            str(threads),
            "--steps",
            str(sizes.memory_steps),
            "--samples",
            ",".join(map(str, sizes.memory_samples)),
            "--deploy-steps",
            str(sizes.memory_deploy_steps),
        ]
        procs[path] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    results = {}
    for path, proc in procs.items():
        out, err = proc.communicate()
        if proc.returncode != 0:
            msg = f"memory worker `{path}` failed (exit {proc.returncode}):\n{err.decode()}"
            raise RuntimeError(msg)
        results[path] = json.loads(out.decode().strip().splitlines()[-1])
    summary = {}
    for path, result in results.items():
        tiny = result["tiny_bytes_by_step"]
        deploy = result["deploy_meta_bytes_by_step"]
        summary[path] = {
            "rss_peak_mib": result["rss_peak_kib"] / 1024,
            "rss_growth_mib": result["rss_growth_kib"] / 1024,
            "tiny_last_total_bytes": tiny[-1]["total"],
            "deploy_last_total_mib": deploy[-1]["total"] / MIB,
            "deploy_last_vae_encoder_out_mib": deploy[-1]["per_value"]["vae_encoder_out"] / MIB,
        }
    return {"paths": results, "summary": summary}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--worker", choices=sorted(PATHS), required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--samples", required=True, help="comma-separated steps")
    parser.add_argument("--deploy-steps", type=int, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    samples = [int(s) for s in args.samples.split(",")]
    print(json.dumps(memory_worker(args.worker, args.steps, samples, args.deploy_steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
