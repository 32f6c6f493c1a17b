"""The results' Targets table and markdown report (``latest.md``)."""

from __future__ import annotations

from typing import Any

from common import MIB

from sessionstate import DEFAULT_MAX_SESSIONS

# Target thresholds.
TARGET_STEP_GROWTH = 1.05  # issue 23; the series' growth is reported beside it
# Issue 40 restated the overhead target (a native fused update is not worth a compiled
# extension in a package that installs with pip alone): the overhead stays flat along a
# session, and the managed step falls below this factor of the bespoke one at 10 chunks.
TARGET_OVERHEAD_GROWTH = 1.2
TARGET_MANAGED_OVER_BESPOKE = 1.25
TARGET_RING_VS_FLOOR = 2.0
TARGET_STATS_US_PER_LEAF = 0.3
TARGET_STATS_SESSIONS = DEFAULT_MAX_SESSIONS  # stats() at a full manager


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    step = results["step_time"]
    first, last = step["checkpoints"][0]["step"], step["checkpoints"][-1]["step"]
    # Judged on forks of one session stepped in turns when the run has them (drift between
    # the first and the last window of the long series cancels); the series otherwise.
    growth = results.get("step_growth")
    # Measured with the two paths alternating in one process when the run has it (the
    # issue's method); the pyperf figure of runs before it otherwise.
    overhead = results.get("library_overhead_ab", results["library_overhead"])
    first_o, last_o = overhead["points"][0], overhead["points"][-1]
    ring = results["ring_commit"]
    stats_points = results["stats_scaling"]["points"]
    at = next((p for p in stats_points if p["sessions"] == TARGET_STATS_SESSIONS), stats_points[-1])
    rows = [
        {
            "target": f"managed step time at step {last} / at step {first}",
            "value": step["managed_last_over_first"]
            if growth is None
            else growth["last_over_first"],
            "cpu_value": step["managed_last_over_first_cpu"] if growth is None else None,
            "threshold": TARGET_STEP_GROWTH,
            "unit": "x",
        },
        {
            "target": f"library overhead per DreamZero step at {last_o['video_chunks']} video "
            f"chunks / at {first_o['video_chunks']}",
            "value": last_o["overhead_us"] / first_o["overhead_us"],
            "cpu_value": None,
            "threshold": TARGET_OVERHEAD_GROWTH,
            "unit": "x",
        },
        {
            "target": f"managed / bespoke DreamZero step, networks replayed, "
            f"{first_o['video_chunks']} video chunks",
            "value": _managed_us(first_o) / _bespoke_us(first_o),
            "cpu_value": None,
            "threshold": TARGET_MANAGED_OVER_BESPOKE,
            "unit": "x",
        },
        {
            "target": "ring commit / in-place preallocated ring (copy) floor",
            "value": ring["commit_over_inplace_copy_ring"],
            "cpu_value": None,
            "threshold": TARGET_RING_VS_FLOOR,
            "unit": "x",
        },
        {
            "target": f"stats() per tensor leaf at {at['sessions']} sessions",
            "value": at["per_tensor_leaf_us"],
            "cpu_value": None,
            "threshold": TARGET_STATS_US_PER_LEAF,
            "unit": "us",
        },
    ]
    rows += _accounting_rows(results)
    for row in rows:
        row["met"] = bool(row["value"] <= row["threshold"])
    rows.append(
        {
            "target": f"bespoke / managed step time at step {last} (reported, no threshold)",
            "value": step["checkpoints"][-1]["bespoke_over_managed"],
            "cpu_value": step["checkpoints"][-1]["bespoke_over_managed_cpu"],
            "threshold": None,
            "unit": "x",
            "met": None,
        }
    )
    return rows


def _managed_us(point: dict[str, Any]) -> float:
    # The alternating table's median, or the pyperf table's figure in runs before it.
    return float(point.get("managed_median_us", point.get("managed_us")))


def _bespoke_us(point: dict[str, Any]) -> float:
    return float(point.get("bespoke_median_us", point.get("bespoke_us")))


def _accounting_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    # Issue 23's accounting targets, each a ratio within the micro-benchmarks' run.
    rows = []
    put = results.get("put_after_commit")
    if put is not None:
        first, last = put["points"][0], put["points"][-1]
        rows.append(
            {
                "target": f"put after one commit at {last['video_chunks']} video chunks / at "
                f"{first['video_chunks']}",
                "value": last["put_over_shortest"],
                "cpu_value": None,
                "threshold": put["threshold"],
                "unit": "x",
            }
        )
    accounting = results.get("accounting")
    if accounting is not None:
        upkeep = accounting["ledger_upkeep"]
        rows += [
            {
                "target": f"ledger upkeep per put and stats() / a walk of the changed leaves, "
                f"{p['video_chunks']} video chunks",
                "value": p["upkeep_over_floor"],
                "cpu_value": None,
                "threshold": upkeep["threshold"],
                "unit": "x",
            }
            for p in upkeep["points"]
        ]
        nbytes = accounting["nbytes_by_device"]
        rows.append(
            {
                "target": f"nbytes_by_device / a walk counting each storage once "
                f"({nbytes['leaves']} leaves)",
                "value": nbytes["over_floor"],
                "cpu_value": None,
                "threshold": nbytes["threshold"],
                "unit": "x",
            }
        )
    return rows


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}f}" if abs(value) >= 0.01 else f"{value:.2g}"


def _kib_to_mib(kib: int | None) -> str:
    return "n/a" if kib is None else f"{kib / 1024:.1f}"


def _growth_lines(growth: dict[str, Any] | None) -> list[str]:
    if growth is None:
        return []
    first, last = growth["first_step"], growth["last_step"]
    return [
        f"Forked (the target's measure): the managed session's records after step {first} and "
        f"after step {last}, put back in turns, {growth['window_steps']} steps timed from each, "
        f"{growth['rounds']} rounds: median step {_fmt(growth['first_median_ms'])} ms from "
        f"step {first}, {_fmt(growth['last_median_ms'])} ms from step {last}; the median of "
        f"the rounds' ratios is {_fmt(growth['last_over_first'], 3)}x (fastest steps: "
        f"{_fmt(growth['first_fastest_ms'])} and {_fmt(growth['last_fastest_ms'])} ms, "
        f"{_fmt(growth['last_over_first_fastest'], 3)}x). Each fork's outputs are equal "
        f"round after round: {growth['forks_deterministic']}.",
        "",
    ]


def render_markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    quick = "Quick (smoke) run: sizes too small to mean anything. " if results["quick"] else ""
    code = f"commit `{m['commit'][:12]}`" if "commit" in m else "an unrecorded commit"
    if m.get("dirty"):
        code += " with uncommitted changes to `src/`"
    when = f" on {m['date']}" if "date" in m else ""
    lines = [
        "# Benchmark results",
        "",
        f"{quick}Measured at {code}{when}. "
        f"Generated by `benchmarks/run.py` in {results['duration_s']:.0f} s on "
        f"{m['cpu']}, {m['usable_cores']} usable cores, torch {m['torch']} "
        f"({m['torch_threads']} intra-op threads), Python {m['python']}. "
        f"One-minute load average {m['loadavg_start'][0]:.1f} at start, "
        f"{m['loadavg_end'][0]:.1f} at the end of the timings.",
        "",
    ]
    if results["noisy"]:
        lines += [
            "> **Noisy machine:** the load average exceeded the number of usable cores during "
            "the run (other processes were competing for the CPU). Absolute times are "
            "inflated and jittery; compare the ratios, which are measured side by side.",
            "",
        ]
    lines += [
        "## Targets",
        "",
        "| target | measured | threshold | met | CPU-time cross-check |",
        "|---|---|---|---|---|",
    ]
    for row in results["targets"]:
        unit = row["unit"]
        threshold = "-" if row["threshold"] is None else f"<= {row['threshold']} {unit}"
        met = "-" if row["met"] is None else ("met" if row["met"] else "**not met**")
        lines.append(
            f"| {row['target']} | {_fmt(row['value'])} {unit} | {threshold} | {met} "
            f"| {_fmt(row['cpu_value'])} {unit if row['cpu_value'] is not None else ''} |"
        )
    lines += [
        "",
        "Measured: wall clock (`time.perf_counter`), medians; met or not is judged on it. "
        "The step times come from the side-by-side A/B harness (medians over repeats after a "
        "warm-up), with the same statistic in CPU time (`time.process_time`) as a cross-check "
        "that time spent waiting for a busy CPU does not inflate; the micro-benchmarks are "
        "pyperf's medians over its worker processes.",
    ]

    st = results["step_time"]
    lines += [
        "",
        f"## 1. Per-step time vs session length (DreamZero tiny, {st['steps']} steps, "
        f"{st['repeats']} repeat(s), {st['window_steps']}-step windows)",
        "",
        "| step (window) | bespoke median ms | managed median ms | bespoke / managed "
        "| bespoke mean ms | managed mean ms | bespoke CPU ms | managed CPU ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in st["checkpoints"]:
        lo, hi = row["window"]
        lines.append(
            f"| {row['step']} ({lo}-{hi}) | {_fmt(row['bespoke_median_ms'])} "
            f"| {_fmt(row['managed_median_ms'])} | {_fmt(row['bespoke_over_managed'])} "
            f"| {_fmt(row['bespoke_mean_ms'])} | {_fmt(row['managed_mean_ms'])} "
            f"| {_fmt(row['bespoke_cpu_median_ms'])} | {_fmt(row['managed_cpu_median_ms'])} |"
        )
    lines += [
        "",
        f"Growth, last window / first (median): managed {_fmt(st['managed_last_over_first'])}x, "
        f"bespoke {_fmt(st['bespoke_last_over_first'])}x; "
        f"(mean, VAE encode steps included): managed "
        f"{_fmt(st['managed_last_over_first_mean'])}x, bespoke "
        f"{_fmt(st['bespoke_last_over_first_mean'])}x; (CPU time, median): managed "
        f"{_fmt(st['managed_last_over_first_cpu'])}x, bespoke "
        f"{_fmt(st['bespoke_last_over_first_cpu'])}x. "
        f"Outputs (actions and video latents) bit-identical on every step: "
        f"{st['bit_identical_outputs']}.",
        "",
        *_growth_lines(results.get("step_growth")),
        "Median step time along the session (ms):",
        "",
        "| steps | bespoke | managed | bespoke / managed |",
        "|---|---|---|---|",
    ]
    series = st["series"]
    stride = max(1, len(series) // 8)
    for row in series[stride - 1 :: stride]:
        lo, hi = row["steps"]
        lines.append(
            f"| {lo}-{hi} | {_fmt(row['bespoke_median_ms'])} | {_fmt(row['managed_median_ms'])} "
            f"| {_fmt(row['bespoke_median_ms'] / row['managed_median_ms'])} |"
        )

    rd = results["reader"]
    lines += [
        "",
        f"### Reader alone at the deploy latent geometry ({rd['dtype']} frames "
        f"{tuple(rd['frame_shape'])}, {_fmt(rd['frame_mib'], 4)} MiB each)",
        "",
        "| latent frames held | bespoke whole history ms | ring of 2 ms | bespoke / ring "
        "| bit-identical |",
        "|---|---|---|---|---|",
    ]
    for p in rd["points"]:
        lines.append(
            f"| {p['frames']} | {_fmt(p['bespoke_ms'])} | {_fmt(p['ring_ms'])} "
            f"| {_fmt(p['bespoke_over_ring'])} | {p['bit_identical']} |"
        )

    lo = results["library_overhead"]
    ab = results.get("library_overhead_ab")
    lines += [
        "",
        "## 2. Library overhead per DreamZero step (no model compute)",
        "",
        "`DreamZeroPipeline.forward` on each path with the networks replayed (each answer "
        "computed once): the managed step's time minus the bespoke step's is what the library "
        "adds.",
        "",
    ]
    if ab is not None:
        lines += [
            "Each path in its own pyperf worker processes (medians): on a machine whose speed "
            "drifts between processes, the difference of two such medians is noisy; the "
            "alternating table below is steadier.",
            "",
        ]
    lines += [
        "| video latent chunks held | managed step us | bespoke step us | overhead us "
        "| managed with `check_immutable=True` us |",
        "|---|---|---|---|---|",
    ]
    for p in lo["points"]:
        lines.append(
            f"| {p['video_chunks']} | {_fmt(p['managed_us'])} | {_fmt(p['bespoke_us'])} "
            f"| {_fmt(p['overhead_us'])} | {_fmt(p['checked_us'])} |"
        )
    if ab is not None:
        lines += [
            "",
            f"The two paths alternating in one process (`benchmarks/overhead_ab.py`): per "
            f"round a fresh session of each grown to the length, then {ab['steps_per_round']} "
            f"steps, the fastest kept; medians over {ab['rounds']} rounds. The overhead target "
            "is judged on this table.",
            "",
            "| video latent chunks held | managed step us | bespoke step us | overhead us "
            "| fastest managed us | fastest bespoke us | overhead of the fastest us |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in ab["points"]:
            lines.append(
                f"| {p['video_chunks']} | {_fmt(p['managed_median_us'])} "
                f"| {_fmt(p['bespoke_median_us'])} | {_fmt(p['overhead_us'])} "
                f"| {_fmt(p['managed_min_us'])} | {_fmt(p['bespoke_min_us'])} "
                f"| {_fmt(p['overhead_min_us'])} |"
            )

    rc = results["ring_commit"]
    lines += [
        "",
        f"## 3. Ring commit of one {_fmt(rc['chunk_mib'], 4)} MiB bf16 latent frame "
        f"{tuple(rc['chunk_shape'])} (ring of 2)",
        "",
        "| operation | us | LatentBuffer.commit / this |",
        "|---|---|---|",
        f"| `LatentBuffer.commit` (by reference) | {_fmt(rc['commit_us'])} | 1 |",
        f"| in-place preallocated ring, `buf[:, :, i % 2].copy_(chunk)` "
        f"| {_fmt(rc['inplace_copy_ring_us'])} | {_fmt(rc['commit_over_inplace_copy_ring'])} |",
        f"| plain copy, `dst.copy_(chunk)` (memcpy floor, "
        f"{_fmt(rc['memcpy_gib_per_s'])} GiB/s) "
        f"| {_fmt(rc['memcpy_us'])} | {_fmt(rc['commit_over_memcpy'])} |",
        f"| list index assignment, `ring[i % 2] = chunk` (by reference) "
        f"| {_fmt(rc['inplace_ref_ring_us'])} | {_fmt(rc['commit_over_inplace_ref_ring'])} |",
        "",
        "Commit into an accumulating buffer (`maxlen=None`, as `video_latents_across_time`) "
        "vs the chunks it already holds:",
        "",
        "| chunks held | commit us |",
        "|---|---|",
        *(f"| {p['chunks_held']} | {_fmt(p['commit_us'])} |" for p in rc["accumulate_commit"]),
    ]

    ss = results["stats_scaling"]
    lines += [
        "",
        f"## 4. stats() scaling ({ss['video_chunks_per_session']} video chunks per session, "
        f"{ss['prompt_groups_sharing_storages']} prompt groups sharing storages)",
        "",
        "| sessions | tensor leaves | stats() us | us per tensor leaf "
        "| after a step of every session, us per leaf | of which tree_leaves us "
        "| ByteCounter us | floor walk us per leaf |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in ss["points"]:
        lines.append(
            f"| {p['sessions']} | {p['tensor_leaves']} | {_fmt(p['call_us'])} "
            f"| {_fmt(p['per_tensor_leaf_us'], 3)} | {_fmt(p['per_tensor_leaf_after_step_us'], 3)} "
            f"| {_fmt(p['flatten_us'])} | {_fmt(p['byte_counter_us'])} "
            f"| {_fmt(p['floor_walk_per_tensor_leaf_us'], 3)} |"
        )

    mem = results["memory"]
    bespoke, managed = mem["paths"]["bespoke"], mem["paths"]["managed"]
    lines += [
        "",
        "## 5. Memory per session",
        "",
        "Bytes held by one session (library accounting of `pipe.session_values`), tiny preset:",
        "",
        "| step | bespoke bytes | managed bytes | bespoke vae_encoder_out "
        "| managed vae_encoder_out |",
        "|---|---|---|---|---|",
    ]
    for b, mg in zip(bespoke["tiny_bytes_by_step"], managed["tiny_bytes_by_step"], strict=True):
        lines.append(
            f"| {b['step']} | {b['total']:,} | {mg['total']:,} "
            f"| {b['per_value']['vae_encoder_out']:,} | {mg['per_value']['vae_encoder_out']:,} |"
        )
    lines += [
        "",
        "Same accounting at the deploy geometry (352x640 bf16, real Wan encoder width), "
        "run on the `meta` device (nothing allocated), MiB:",
        "",
        "| step | bespoke total | managed total | bespoke vae_encoder_out "
        "| managed vae_encoder_out | video_latents_across_time (both) |",
        "|---|---|---|---|---|---|",
    ]
    for b, mg in zip(
        bespoke["deploy_meta_bytes_by_step"], managed["deploy_meta_bytes_by_step"], strict=True
    ):
        lines.append(
            f"| {b['step']} | {b['total'] / MIB:.2f} | {mg['total'] / MIB:.2f} "
            f"| {b['per_value']['vae_encoder_out'] / MIB:.4f} "
            f"| {mg['per_value']['vae_encoder_out'] / MIB:.4f} "
            f"| {mg['per_value']['video_latents_across_time'] / MIB:.2f} |"
        )
    lines += [
        "",
        f"Peak RSS of a {bespoke['steps']}-step tiny run, each path in its own process: "
        f"bespoke {bespoke['rss_peak_kib'] / 1024:.1f} MiB "
        f"(+{bespoke['rss_growth_kib'] / 1024:.1f} MiB over the built pipeline), "
        f"managed {managed['rss_peak_kib'] / 1024:.1f} MiB "
        f"(+{managed['rss_growth_kib'] / 1024:.1f} MiB). Cross-check, the worker's own "
        f"address-space peak (VmHWM): bespoke {_kib_to_mib(bespoke['vm_hwm_peak_kib'])} MiB, "
        f"managed {_kib_to_mib(managed['vm_hwm_peak_kib'])} MiB.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Re-render ``latest.md`` (or the report beside any results JSON) from the JSON alone."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__)
    default = Path(__file__).resolve().parent / "results" / "latest.json"
    parser.add_argument("results", type=Path, nargs="?", default=default, help="a run's JSON")
    args = parser.parse_args(argv)
    path: Path = args.results
    path.with_suffix(".md").write_text(render_markdown(json.loads(path.read_text())))
    print(f"wrote {path.with_suffix('.md')} from {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
