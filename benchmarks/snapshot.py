"""Benchmark: snapshot save+load against torch.save+torch.load and a raw copy of the bytes.

Run from the repository root::

    .venv/bin/python benchmarks/snapshot.py                # deploy feature-cache shapes, H/W / 2
    .venv/bin/python benchmarks/snapshot.py --scale 1      # the full 603 MiB feature cache
    .venv/bin/python benchmarks/snapshot.py --smoke        # tiny preset shapes (seconds)

The record is a session holding the Wan encoder's causal-conv feature cache
(``vae_enc_feat_map``, 24 bf16 tensors) at the shapes the DreamZero pipeline produces after one
VAE body chunk, computed on the meta device at the deploy geometry and then materialised with
height and width divided by ``--scale`` (so a machine without 2 GiB to spare can run it). Each
method round-trips the same record:

- ``snapshot_file``: `save_state` to a file, then `load_state`;
- ``torch_file``: ``torch.save`` of the same record, then ``torch.load``;
- ``torch_durable_file``: the same, saved as `save_state` saves: into a file of its own,
  synced to disk (``fsync``), renamed into place, then the directory synced. `save_state`
  is durable, ``torch.save`` alone is not; the target compares like with like;
- ``snapshot_bytes`` / ``torch_bytes``: the same through memory (`dumps_state` /
  `loads_state`, and ``torch.save`` into a ``BytesIO``);
- ``raw_copy``: one fresh copy of every storage's bytes (``clone``), the floor.

Every save after the first is over an existing file. Times are medians over repeats after a
warm-up, reported per MiB (with the fastest and slowest repeat of each save), with the ratios
``snapshot / torch`` and ``snapshot / raw``. Writes JSON and a markdown report
(``benchmarks/results/snapshot.json`` and ``.md`` by default). Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from common import code_version

from sessionstate import (
    ENV_ENABLE,
    SessionState,
    TensorCache,
    dumps_state,
    load_state,
    loads_state,
    nbytes_by_device,
    save_state,
    tree_equal,
    tree_leaves,
)
from sessionstate._storage import collect_storages, storage_bytes
from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode

MIB = 1024 * 1024
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "snapshot.json"
TARGET = 1.2  # snapshot save+load within this factor of torch.save+torch.load (issue 23)


def feature_cache_shapes(preset: str) -> list[tuple[int, ...] | None]:
    """The feature cache's tensor shapes after one VAE body chunk (computed on meta)."""
    cfg = DreamZeroConfig.preset(preset)
    pipe = DreamZeroPipeline(cfg, device="meta", host_device="meta", environ={ENV_ENABLE: "1"})
    assert pipe.manager is not None
    # Five steps: the first seeds the VAE stream, the next four fill one body chunk.
    for sid, obs in scripted_episode(cfg, steps=5, sessions=1, seed=0, prompt_change_every=6):
        pipe.forward(obs, sid)
    state = pipe.manager.peek("session-0")
    assert state is not None
    feat_map = state.vae_enc_feat_map
    assert feat_map is not None
    return [None if t is None else tuple(t.shape) for t in feat_map]


def build_record(shapes: Sequence[tuple[int, ...] | None], scale: int, dtype: torch.dtype) -> Any:
    """A session holding the feature cache, height and width divided by ``scale``."""
    generator = torch.Generator().manual_seed(0)
    feat: list[torch.Tensor | None] = []
    for shape in shapes:
        if shape is None:
            feat.append(None)
            continue
        scaled = (*shape[:-2], math.ceil(shape[-2] / scale), math.ceil(shape[-1] / scale))
        feat.append(torch.randn(scaled, generator=generator).to(dtype))
    cache = TensorCache(name="vae_enc_feat_map").allocate().commit(tuple(feat))
    return SessionState(objects={"vae_enc_feat_map": cache}, attrs={"call_count": 5})


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of ``fn`` in each of ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def fsync(path: str) -> None:
    """Sync ``path`` (a file or a directory) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def run(*, preset: str, scale: int, repeats: int) -> dict[str, Any]:
    """Measure every method on one record; returns the JSON-ready results."""
    shapes = feature_cache_shapes(preset)
    dtype = torch.bfloat16 if preset == "deploy" else torch.float32
    state = build_record(shapes, scale, dtype)
    nbytes = sum(nbytes_by_device(state).values())
    mib = nbytes / MIB
    tensors = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor)]
    storages, _ = collect_storages([(str(i), t) for i, t in enumerate(tensors)])

    with tempfile.TemporaryDirectory() as tmp:
        snap_path = os.path.join(tmp, "state.safetensors")
        torch_path = os.path.join(tmp, "state.pt")
        loaded = {}

        def snapshot_save() -> None:
            save_state(state, snap_path)

        def snapshot_load() -> None:
            loaded["snapshot"] = load_state(snap_path)

        def torch_save() -> None:
            torch.save(state, torch_path)

        def torch_load() -> None:
            loaded["torch"] = torch.load(torch_path, weights_only=False)

        def torch_save_durable() -> None:
            partial = torch_path + ".partial"
            with open(partial, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, torch_path)
            fsync(tmp)

        def snapshot_bytes() -> None:
            loads_state(dumps_state(state))

        def torch_bytes() -> None:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            torch.load(buffer, weights_only=False)

        def raw_copy() -> None:
            for storage in storages:
                storage_bytes(storage).clone()

        runs = {
            "snapshot_save": timed(snapshot_save, repeats),
            "snapshot_load": timed(snapshot_load, repeats),
            "torch_save": timed(torch_save, repeats),
            "torch_save_durable": timed(torch_save_durable, repeats),
            "torch_load": timed(torch_load, repeats),
            "snapshot_bytes": timed(snapshot_bytes, repeats),
            "torch_bytes": timed(torch_bytes, repeats),
            "raw_copy": timed(raw_copy, repeats),
        }
        seconds = {k: statistics.median(v) for k, v in runs.items()}
        file_sizes = {
            "snapshot": os.path.getsize(snap_path),
            "torch": os.path.getsize(torch_path),
        }
    seconds["snapshot_file"] = seconds["snapshot_save"] + seconds["snapshot_load"]
    seconds["torch_file"] = seconds["torch_save"] + seconds["torch_load"]
    seconds["torch_durable_file"] = seconds["torch_save_durable"] + seconds["torch_load"]
    save_spread_ms = {
        k: [1000 * min(runs[k]), 1000 * max(runs[k])]
        for k in ("snapshot_save", "torch_save", "torch_save_durable")
    }
    ms_per_mib = {k: 1000 * v / mib for k, v in seconds.items()}
    ratios = {
        "snapshot_file_over_torch_durable_file": seconds["snapshot_file"]
        / seconds["torch_durable_file"],
        "snapshot_file_over_torch_file": seconds["snapshot_file"] / seconds["torch_file"],
        "snapshot_bytes_over_torch_bytes": seconds["snapshot_bytes"] / seconds["torch_bytes"],
        "snapshot_file_over_raw_copy": seconds["snapshot_file"] / seconds["raw_copy"],
        "snapshot_bytes_over_raw_copy": seconds["snapshot_bytes"] / seconds["raw_copy"],
    }
    return {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "loadavg_start": list(os.getloadavg()),
            **code_version(),
        },
        "preset": preset,
        "scale": scale,
        "repeats": repeats,
        "record": {
            "tensors": len(tensors),
            "storages": len(storages),
            "nbytes": nbytes,
            "mib": mib,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "file_nbytes": file_sizes,
        "bit_identical": tree_equal(loaded["snapshot"], state),
        "ms_per_mib": ms_per_mib,
        "save_spread_ms": save_spread_ms,
        "ratios": ratios,
        "target": {
            "what": "snapshot save+load (file) / torch.save+torch.load (file, saved as durably)",
            "threshold": TARGET,
            "measured": ratios["snapshot_file_over_torch_durable_file"],
            "met": ratios["snapshot_file_over_torch_durable_file"] <= TARGET,
        },
    }


def markdown(results: dict[str, Any]) -> str:
    """The results as a short markdown report."""
    rec = results["record"]
    ms = results["ms_per_mib"]
    ratios = results["ratios"]
    target = results["target"]
    lines = [
        "# Snapshot benchmark",
        "",
        f"Record: the Wan encoder feature cache, preset `{results['preset']}`, height and width "
        f"/ {results['scale']}: {rec['tensors']} {rec['dtype']} tensors, {rec['storages']} "
        f"storages, {rec['mib']:.2f} MiB. Medians of {results['repeats']} repeats; torch "
        f"{results['machine']['torch']}, {results['machine']['cores']} cores, one-minute load "
        f"{results['machine']['loadavg_start'][0]:.1f}; commit "
        f"`{results['machine']['commit'][:7]}`. Loaded snapshot "
        f"bit-identical: {results['bit_identical']}.",
        "",
        "| method | ms/MiB |",
        "|---|---|",
    ]
    for key in (
        "snapshot_save",
        "snapshot_load",
        "snapshot_file",
        "torch_save",
        "torch_save_durable",
        "torch_load",
        "torch_file",
        "torch_durable_file",
        "snapshot_bytes",
        "torch_bytes",
        "raw_copy",
    ):
        lines.append(f"| {key} | {ms[key]:.3f} |")
    lines += ["", "Every save over an existing file, fastest and slowest repeat:", ""]
    lines += ["| save | fastest ms | slowest ms |", "|---|---|---|"]
    lines += [f"| {k} | {lo:.0f} | {hi:.0f} |" for k, (lo, hi) in results["save_spread_ms"].items()]
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in ratios.items()]
    lines += [
        "",
        f"Target: {target['what']} <= {target['threshold']}: measured "
        f"{target['measured']:.2f}, {'met' if target['met'] else 'not met'}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and write ``--out`` (JSON) and its markdown twin."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smoke", action="store_true", help="tiny preset shapes: seconds")
    parser.add_argument("--scale", type=int, default=2, help="divide height and width by this")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per method")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON")
    args = parser.parse_args(argv)
    if args.smoke:
        results = run(preset="tiny", scale=1, repeats=1)
    else:
        results = run(preset="deploy", scale=args.scale, repeats=args.repeats)
    results["smoke"] = bool(args.smoke)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    report = markdown(results)
    args.out.with_suffix(".md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
