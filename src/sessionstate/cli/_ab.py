"""``sessionstate ab``: one scripted episode on each path, in two processes, compared.

The parent spawns ``python -m sessionstate.cli _episode`` twice, the children differing only
in the environment flag that selects the path, and compares every output with `torch.equal`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from sessionstate._env import ENV_ENABLE, ENV_MAX_SESSIONS, ENV_ON_FULL
from sessionstate.cli._common import (
    ArgumentParser,
    HelpFormatter,
    add_budget_arguments,
    budget,
    budget_text,
    check_device,
    fmt_bytes,
    load_model_config,
    nbytes,
    positive_int,
    stdout_console,
    with_budget,
)
from sessionstate.cli._sizes import progress_columns
from sessionstate.models._registry import DEFAULT_MODEL, MODELS, Lazy, ModelSpec, get_model

# The counters each path reports under a byte budget or a KV pool size (0 on the bespoke path).
_PARKING_KEYS = ("parks", "unparks", "kv_parks", "kv_unparks", "evictions", "parked_sessions")
# With `--prefetch`, also (0 on the bespoke path, which has nothing to prefetch).
_PREFETCH_KEYS = ("prefetches", "prefetch_hits", "prefetches_dropped")

# The child's stderr protocol: one line per step, one when the decode phase starts.
_PROGRESS = "PROGRESS "
_DECODE = "PHASE decode"


def run_episode(args: argparse.Namespace) -> int:
    """Child process: run the episode on whichever path the environment selects."""
    import torch

    spec = get_model(args.model)
    deploy, cfg = load_model_config(args.config, args.preset, spec.name, _overrides(args))
    deploy = with_budget(deploy, args)
    if args.kv_pool_bytes is not None:  # the managed path's engine pool (the bespoke has none)
        import attrs

        deploy = attrs.evolve(deploy, session_state_kv_pool_bytes=args.kv_pool_bytes)
        if args.max_bytes is None:  # where the pool's planner parks KV: as `with_budget` picks
            tier = args.park_tier or ("host" if str(args.device).startswith("cuda") else "disk")
            deploy = attrs.evolve(deploy, session_state_park_tier=tier)
    pipe = spec.pipeline(deploy, device=args.device, max_bespoke_sessions=args.max_sessions)
    total = args.steps * args.sessions
    records: list[dict[str, Any]] = []
    times: list[float] = []
    episode = list(spec.episode(cfg, steps=args.steps, sessions=args.sessions, seed=args.seed))
    profiler: Any = contextlib.nullcontext()
    if args.trace:
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            experimental_config=all_threads_config(),
        )
    with profiler:
        _steps(args, pipe, episode, records, times, total)
    if args.trace:
        profiler.export_chrome_trace(args.trace)
        name_worker_tracks(Path(args.trace))
    print(_DECODE, file=sys.stderr, flush=True)
    torch.save(
        {
            "managed": pipe.managed,
            "records": records,
            **spec.finals(pipe),
            "median_step_s": statistics.median(times) if times else 0.0,
            "stats": pipe.stats(),
        },
        args.out,
    )
    return 0


def _steps(
    args: argparse.Namespace,
    pipe: Any,
    episode: list[tuple[Any, Any]],
    records: list[dict[str, Any]],
    times: list[float],
    total: int,
) -> None:
    import torch

    from sessionstate import SessionAdmissionError

    spec = get_model(args.model)
    if getattr(args, "batch", None):
        _batched_steps(args, pipe, episode, records, times, total)
        return
    for i, (sid, obs) in enumerate(episode):
        start = time.perf_counter()
        if args.prefetch and i + 1 < len(episode) and episode[i + 1][0] != sid:
            # The episode's order is known: the next step's session is copied back while
            # this step runs (others parked to fit it). Outputs must not change.
            pipe.prefetch(episode[i + 1][0], make_room=True)
        try:
            with torch.profiler.record_function(f"step {sid}") if args.trace else _NO_RANGE:
                out = pipe.forward(obs, sid)
        except SessionAdmissionError as exc:  # at the cap or the budget: a result to compare
            records.append({"session": sid, "refused": True, "reason": str(exc)})
        else:
            times.append(time.perf_counter() - start)
            records.append({"session": sid, **spec.outputs(out)})
        print(f"{_PROGRESS}{i + 1} {total}", file=sys.stderr, flush=True)


_NO_RANGE = contextlib.nullcontext()


def batches(episode: list[tuple[Any, Any]], size: int) -> list[dict[Any, Any]]:
    """The episode's steps in order, cut into batches of at most ``size`` distinct sessions.

    A batch ends where it is full or where a session would step twice in it.

    >>> [list(b) for b in batches([("a", 1), ("b", 2), ("a", 3), ("c", 4)], 3)]
    [['a', 'b'], ['a', 'c']]
    """
    out: list[dict[Any, Any]] = []
    for sid, x in episode:
        if not out or len(out[-1]) == size or sid in out[-1]:
            out.append({})
        out[-1][sid] = x
    return out


def _batched_steps(
    args: argparse.Namespace,
    pipe: Any,
    episode: list[tuple[Any, Any]],
    records: list[dict[str, Any]],
    times: list[float],
    total: int,
) -> None:
    # `--batch N`: every path steps the episode N sessions at a time with `forward_many`
    # (the bespoke path one by one, the managed one as a batch, batch-invariant).
    from sessionstate import SessionAdmissionError

    spec = get_model(args.model)
    groups = batches(episode, args.batch)
    done = 0
    for i, group in enumerate(groups):
        start = time.perf_counter()
        if args.prefetch and i + 1 < len(groups):
            following = next(iter(groups[i + 1]))
            if following not in group:
                pipe.prefetch(following, make_room=True)
        try:
            outs = pipe.forward_many(group, batch_invariant=True)
        except SessionAdmissionError as exc:
            records.extend({"session": sid, "refused": True, "reason": str(exc)} for sid in group)
        else:
            times.append((time.perf_counter() - start) / len(group))
            records.extend({"session": sid, **spec.outputs(outs[sid])} for sid in group)
        done += len(group)
        print(f"{_PROGRESS}{done} {total}", file=sys.stderr, flush=True)


PREFETCH_TRACK = "sessionstate-prefetch"
"""The name of the prefetch worker's thread, and of its track in an ``ab --trace`` trace."""


def all_threads_config() -> Any:
    """A profiler config that records every thread, so the prefetch worker's restores show.

    torch's profiler records only the thread that started it, and threads it starts, unless
    told otherwise; the switch, ``profile_all_threads`` (torch 2.13 has it), is only on the
    private ``_ExperimentalConfig``: there is no public one. None (the thread alone) where the
    installed torch has no such switch.

    >>> config = all_threads_config()
    >>> config is None or type(config).__name__ == "_ExperimentalConfig"
    True
    """
    try:
        from torch._C._profiler import _ExperimentalConfig
    except ImportError:
        return None
    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch, without the switch
        return None


def name_worker_tracks(path: Path) -> None:
    """Name the track of each prefetch worker thread in the Chrome trace at ``path``.

    torch names every thread's track ``thread <tid> (python)``; the prefetch worker's, found
    by its Python thread name (`PREFETCH_TRACK`), is renamed so it reads as what it is.
    """
    import threading

    workers = {t.native_id for t in threading.enumerate() if t.name.startswith(PREFETCH_TRACK)}
    if not workers:
        return
    trace = json.loads(path.read_text())
    for event in trace.get("traceEvents", []):
        if (
            isinstance(event, dict)
            and event.get("ph") == "M"
            and event.get("name") == "thread_name"
            and event.get("tid") in workers
        ):
            event["args"] = {"name": PREFETCH_TRACK}
    path.write_text(json.dumps(trace))


def merge_traces(parts: dict[str, Path], out: str) -> None:
    """Write the two paths' Chrome traces as one: a process per path, named after it.

    Each child's events keep their threads (a prefetch's background restore is its own
    track); only the process ids are replaced, so the two paths sit one above the other.
    """
    events: list[dict[str, Any]] = []
    for pid, (name, path) in enumerate(parts.items(), start=1):
        trace = json.loads(path.read_text())
        for event in trace.get("traceEvents", []):
            if isinstance(event, dict) and "pid" in event:
                events.append({**event, "pid": pid})
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
    Path(out).write_text(json.dumps({"traceEvents": events}))


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    # Model fields the command line sets over the config's.
    return {"decode_frames": True} if getattr(args, "decode_frames", False) else {}


def episode_command(args: argparse.Namespace, out: Path) -> list[str]:
    """The command line of one child of ``ab``, writing its results to ``out``."""
    cmd = [
        sys.executable, "-m", "sessionstate.cli", "_episode",
        "--steps", str(args.steps), "--sessions", str(args.sessions), "--seed", str(args.seed),
        "--out", str(out), "--model", args.model,
    ]  # fmt: skip
    if args.config:
        cmd += ["--config", args.config]
    if args.preset:
        cmd += ["--preset", args.preset]
    cmd += ["--max-sessions", str(args.max_sessions)]
    if args.device != "cpu":
        cmd += ["--device", args.device]
    if args.max_bytes is not None:
        cmd += ["--max-bytes", budget_text(args.max_bytes)]
    if args.park_tier and (args.max_bytes is not None or args.kv_pool_bytes is not None):
        cmd += ["--park-tier", args.park_tier]
    if args.kv_pool_bytes is not None:
        cmd += ["--kv-pool-bytes", str(args.kv_pool_bytes)]
    if getattr(args, "prefetch", False):
        cmd += ["--prefetch"]
    if getattr(args, "decode_frames", False):
        cmd += ["--decode-frames"]
    if getattr(args, "batch", None):
        cmd += ["--batch", str(args.batch)]
    if getattr(args, "trace", None):
        cmd += ["--trace", str(out.with_suffix(".trace.json"))]
    return cmd


def _spawn(args: argparse.Namespace, flag: str, out: Path, progress: Any, task: Any) -> None:
    cmd = episode_command(args, out)
    # Both sides get the same cap: the managed side reads it from the environment, the
    # bespoke side (whose cap is a constant upstream) from `--max-sessions`.
    env = dict(os.environ)
    env[ENV_ENABLE] = flag
    env[ENV_MAX_SESSIONS] = str(args.max_sessions)
    if args.on_full is not None:
        env[ENV_ON_FULL] = args.on_full
    name = "managed" if flag == "1" else "bespoke"
    tail: list[str] = []
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if line.startswith(_PROGRESS):
                if progress is not None:
                    progress.update(task, advance=1)
            elif line.startswith(_DECODE):
                if progress is not None:
                    progress.update(task, description=f"{name} path: decoding")
            else:
                tail.append(line)
    except BaseException:  # Ctrl-C or anything else: the child never outlives the parent
        proc.kill()
        proc.wait()
        raise
    status = proc.wait()
    if status in (130, -signal.SIGINT):  # Ctrl-C reached the child's process group first
        raise KeyboardInterrupt
    if status != 0:
        msg = f"the {name} run failed:\n{''.join(tail[-20:])}"
        raise RuntimeError(msg)


def _compare(
    bespoke: dict[str, Any], managed: dict[str, Any], spec: ModelSpec | None = None
) -> tuple[int, str | None]:
    import torch

    spec = spec or get_model(DEFAULT_MODEL)

    compared = 0
    a_recs, b_recs = bespoke["records"], managed["records"]
    if len(a_recs) != len(b_recs):
        return compared, f"step count differs: {len(a_recs)} vs {len(b_recs)}"
    for i, (a, b) in enumerate(zip(a_recs, b_recs, strict=True)):
        if a.get("refused") or b.get("refused"):
            if not (a.get("refused") and b.get("refused")):
                path = "bespoke" if a.get("refused") else "managed"
                return compared, f"step {i} ({a['session']}): refused on the {path} path only"
            continue
        for key in spec.tensor_outputs:
            x, y = a.get(key), b.get(key)
            if x is None and y is None:  # an output the model does not produce in this run
                continue
            compared += 1
            if x is None or y is None or not torch.equal(x, y):
                return compared, f"step {i} ({a['session']}): {key}"
        compared += 1
        if a["reset"] != b["reset"]:
            return compared, f"step {i} ({a['session']}): reset {a['reset']} vs {b['reset']}"
    for key in spec.final_outputs:
        if sorted(bespoke[key]) != sorted(managed[key]):
            return compared, f"{key}: sessions differ"
        for sid in sorted(bespoke[key]):
            compared += 1
            x, y = bespoke[key][sid], managed[key][sid]
            if (x is None) != (y is None) or (x is not None and not torch.equal(x, y)):
                return compared, f"{key} of {sid}"
    return compared, None


def deploy_on_cpu_warning(preset: str, device: str) -> str | None:
    """The warning ``ab`` prints before running the deploy geometry on a CPU, else None.

    >>> deploy_on_cpu_warning("tiny", "cpu") is None
    True
    >>> deploy_on_cpu_warning("deploy", "cuda") is None
    True
    """
    if preset != "deploy" or not device.startswith("cpu"):
        return None
    return (
        "sessionstate ab: warning: the deploy geometry runs minutes per step on CPU; "
        "pass `--device cuda` on a machine with a GPU, or `--preset tiny` for a quick check."
    )


def budget_refusal(results: dict[str, Any]) -> str | None:
    """Why the managed path refused a step the bespoke path served, if the budget did it.

    The bespoke path has no byte budget, so such a step is a budget set below what the
    workload needs, not a difference between the paths.
    """
    for i, (a, b) in enumerate(
        zip(results["bespoke"]["records"], results["managed"]["records"], strict=False)
    ):
        reason = b.get("reason", "")
        if b.get("refused") and not a.get("refused") and "`max_bytes`" in reason:
            return f"step {i} ({b['session']}): {reason}"
    return None


def budget_evictions(results: dict[str, Any]) -> int:
    """How many more sessions the managed path evicted than the bespoke one (at least 0).

    Under a byte budget the extra evictions are the budget's: the bespoke path, which has no
    budget, kept those sessions, so their later steps restart on one path only.
    """
    held = {name: int(res["stats"].get("evictions", 0)) for name, res in results.items()}
    return max(0, held["managed"] - held["bespoke"])


def _cmd_ab(args: argparse.Namespace) -> int:
    import torch

    from sessionstate import DEFAULT_MAX_SESSIONS

    check_device(args.device)  # one line here, not a traceback from each child
    if args.max_sessions is None:
        args.max_sessions = DEFAULT_MAX_SESSIONS
    spec = get_model(args.model)
    if isinstance(spec.pipeline, Lazy):  # a missing extra: one line here, not one per child
        spec.pipeline.load()
    overrides = _overrides(args)
    deploy, cfg = load_model_config(args.config, args.preset, spec.name, overrides)  # fail here
    warning = deploy_on_cpu_warning(cfg.name, args.device)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    total = args.steps * args.sessions
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        progress_cm: Any = None
        if not args.json:
            from rich.console import Console
            from rich.progress import Progress

            progress_cm = Progress(
                *progress_columns(), console=Console(stderr=True), transient=True
            )
        with progress_cm if progress_cm is not None else contextlib.nullcontext():
            for flag, name in (("0", "bespoke"), ("1", "managed")):
                task = None
                if progress_cm is not None:
                    task = progress_cm.add_task(f"{name} path", total=total)
                out = Path(tmp) / f"{name}.pt"
                _spawn(args, flag, out, progress_cm, task)
                results[name] = torch.load(out, weights_only=False)
        if args.trace:
            paths = {f"{name} path": Path(tmp) / f"{name}.trace.json" for name in results}
            merge_traces(paths, args.trace)
    if results["bespoke"]["managed"] or not results["managed"]["managed"]:
        msg = "the flag did not select the intended paths (check the deploy config)"
        raise RuntimeError(msg)
    compared, mismatch = _compare(results["bespoke"], results["managed"], spec)
    if mismatch is not None and args.max_bytes is not None:
        refusal = budget_refusal(results)
        if refusal is not None:
            msg = (
                f"the byte budget `--max-bytes {budget_text(args.max_bytes)}` is below what this "
                "workload needs: the managed path refused a step the bespoke path (which has no "
                "budget) served, so the two cannot be compared. Raise `--max-bytes` above one "
                f"session's bytes. The refusal, {refusal}"
            )
            raise ValueError(msg)
        evicted = budget_evictions(results)
        if evicted:
            msg = (
                f"the byte budget `--max-bytes {budget_text(args.max_bytes)}` is below what this "
                f"workload needs: even after parking, the managed path evicted {evicted} more "
                f"session(s) than the bespoke path (which has no budget), and they restarted "
                f"there, so the two cannot be compared (first difference: {mismatch}). Raise "
                f"`--max-bytes`, or run fewer `--sessions`."
            )
            raise ValueError(msg)
    refusals = {
        name: sum(bool(r.get("refused")) for r in res["records"]) for name, res in results.items()
    }
    # Reported when asked for or when any step was refused; the default report is unchanged.
    show_refusals = args.on_full is not None or any(refusals.values())
    report: dict[str, Any] = {
        "identical": mismatch is None,
        "outputs_compared": compared,
        "first_mismatch": mismatch,
        "steps": args.steps,
        "sessions": args.sessions,
        "max_sessions": args.max_sessions,
        "seed": args.seed,
        "preset": cfg.name,
        "paths": {
            name: {
                "median_step_ms": round(res["median_step_s"] * 1000, 3),
                "nbytes_by_device": {
                    k.removeprefix("nbytes:"): v
                    for k, v in res["stats"].items()
                    if k.startswith("nbytes:")
                },
                "sessions_held": res["stats"]["sessions"],
                **(
                    {key: res["stats"].get(key, 0) for key in _PARKING_KEYS}
                    if args.max_bytes is not None or args.kv_pool_bytes is not None
                    else {"evictions": res["stats"].get("evictions", 0)}
                ),
                **(
                    {key: res["stats"].get(key, 0) for key in _PREFETCH_KEYS}
                    if args.prefetch
                    else {}
                ),
                **({"refusals": refusals[name]} if show_refusals else {}),
            }
            for name, res in results.items()
        },
    }
    if spec.name != DEFAULT_MODEL:  # the default model's report is unchanged
        report = {"model": spec.name, **report}
    if show_refusals:
        from sessionstate import resolve_session_state_config

        report["on_full"] = args.on_full or resolve_session_state_config(deploy).on_full
    if args.max_bytes is not None:
        report["max_bytes"] = args.max_bytes
        report["device"] = args.device
    if args.kv_pool_bytes is not None:
        report["kv_pool_bytes"] = args.kv_pool_bytes
    if args.prefetch:
        report["prefetch"] = True
    if args.batch:
        report["batch"] = args.batch
    if getattr(cfg, "decode_frames", False):
        report["decode_frames"] = True
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_ab(report, spec)
    return 0 if mismatch is None else 1


def _counted(spec: ModelSpec, report: dict[str, Any]) -> str:
    # Decoded frames are an output only of a run that decodes them.
    produced = [k for k in spec.tensor_outputs if k != "frames" or report.get("decode_frames")]
    per_step = [*produced, "reset reason"]
    return (
        f"outputs compared: per served step {', '.join(per_step)}; per session at the end "
        f"{', '.join(spec.final_outputs)}"
    )


def _print_ab(report: dict[str, Any], spec: ModelSpec | None = None) -> None:
    from rich.table import Table

    spec = spec or get_model(report.get("model", DEFAULT_MODEL))
    console = stdout_console()
    verdict = "[bold green]IDENTICAL[/]" if report["identical"] else "[bold red]MISMATCH[/]"
    model = f"{report['model']} " if "model" in report else ""
    console.print(
        f"A/B {model}{verdict}: {report['outputs_compared']} outputs compared with torch.equal "
        f"({report['sessions']} sessions x {report['steps']} steps, seed {report['seed']}, "
        f"preset {report['preset']}"
        + (f", on_full {report['on_full']})" if "on_full" in report else ")")
    )
    if report["first_mismatch"]:
        console.print(f"first mismatch: {report['first_mismatch']}")
    # Counters only: a short run's step time is noise (`--json` has it; `benchmarks/` times).
    counters = [
        key
        for key in (
            "evictions",
            "parks",
            "unparks",
            "kv_parks",
            "kv_unparks",
            "prefetches",
            "prefetch_hits",
            "refusals",
        )
        if key in _first(report)
    ]
    headers = {
        "refusals": "refused steps",
        "kv_parks": "KV parks",
        "kv_unparks": "KV unparks",
        "prefetch_hits": "prefetch hits",
    }
    table = Table("path", "bytes held at end", "sessions", *(headers.get(k, k) for k in counters))
    for name, path in report["paths"].items():
        held = ", ".join(f"{d}: {fmt_bytes(n)}" for d, n in path["nbytes_by_device"].items())
        row = [name, held, str(path["sessions_held"])]
        row += [str(path.get(key, 0)) for key in counters]
        table.add_row(*row)
    console.print(table)
    console.print(_counted(spec, report))


def _first(report: dict[str, Any]) -> dict[str, Any]:
    paths: dict[str, Any] = next(iter(report["paths"].values()), {})
    return paths


def add_parsers(sub: Any) -> None:
    """Adds ``ab`` to the subcommands ``sub``."""
    ab = sub.add_parser(
        "ab",
        help="A/B-validate a model's manager-backed path against its bespoke one "
        "(DreamZero or Cosmos3)",
        description=f"Run one scripted episode twice, in two processes that differ only in "
        f"{ENV_ENABLE}=0/1, and compare every output with torch.equal. Exits 0 iff identical.",
    )
    ab.add_argument(
        "--model", choices=sorted(MODELS), default=DEFAULT_MODEL, help="model (default dreamzero)"
    )
    ab.add_argument("--config", help="deploy YAML (its `model` section picks the preset)")
    ab.add_argument("--preset", choices=["tiny", "deploy"], help="model preset (default tiny)")
    ab.add_argument("--steps", type=positive_int, default=24, help="steps per session")
    ab.add_argument("--sessions", type=positive_int, default=3, help="interleaved sessions")
    ab.add_argument("--seed", type=int, default=0, help="seed of the scripted observations")
    ab.add_argument(
        "--max-sessions",
        type=positive_int,
        default=None,
        help="session cap of both paths (default: sessionstate.DEFAULT_MAX_SESSIONS, the "
        "bespoke constant); lower it to compare LRU eviction",
    )
    ab.add_argument(
        "--on-full",
        choices=["evict", "refuse"],
        help=f"what a new session does at the cap, on both paths (sets {ENV_ON_FULL}; "
        "default: the deploy config's session_state_on_full); refused steps are counted per "
        "path and must agree",
    )
    add_budget_arguments(ab)
    ab.add_argument(
        "--kv-pool-bytes",
        type=nbytes,
        help="the managed path's KV pool size (e.g. 64MiB; default: the config's "
        "session_state_kv_pool_bytes); when a step needs blocks the pool lacks, the least "
        "recently used sessions' KV is parked",
    )
    ab.add_argument(
        "--prefetch",
        action="store_true",
        help="before each step, prefetch the next step's session on the managed path (its "
        "parked bytes copied back in the background, other sessions parked to fit it); "
        "prefetches and hits are reported per path, and the outputs must not change",
    )
    ab.add_argument(
        "--trace",
        metavar="PATH",
        help="write a Chrome/Perfetto trace of both paths to PATH (a process per path: each "
        "step, the library's parks, unparks, prefetches and steps as ranges)",
    )
    ab.add_argument(
        "--decode-frames",
        action="store_true",
        help="DreamZero: decode every step's latents to pixel frames with each session's "
        "streaming decode state (on in the deploy preset); the frames are compared too",
    )
    ab.add_argument(
        "--batch",
        type=positive_int,
        metavar="N",
        help="step the episode N sessions at a time with `forward_many`: the managed path "
        "as one batch (its networks once per shape bucket, batch-invariant), the bespoke "
        "path one by one; the outputs must not change",
    )
    ab.add_argument("--json", action="store_true", help="print one JSON object")
    ab.set_defaults(func=_cmd_ab)


def episode_parser() -> argparse.ArgumentParser:
    """The parser of ``_episode``, one side of ``ab`` (internal, not a listed subcommand)."""
    episode = ArgumentParser(prog="sessionstate _episode", formatter_class=HelpFormatter)
    episode.add_argument("--config")
    episode.add_argument("--preset")
    episode.add_argument("--steps", type=int, required=True)
    episode.add_argument("--sessions", type=int, required=True)
    episode.add_argument("--seed", type=int, required=True)
    episode.add_argument("--out", required=True)
    episode.add_argument("--max-sessions", type=int, required=True)
    episode.add_argument("--device", default="cpu")
    episode.add_argument("--max-bytes", type=budget)
    episode.add_argument("--park-tier", choices=["host", "disk"])
    episode.add_argument("--kv-pool-bytes", type=int)
    episode.add_argument("--model", default=DEFAULT_MODEL)
    episode.add_argument("--prefetch", action="store_true")
    episode.add_argument("--decode-frames", action="store_true")
    episode.add_argument("--trace")
    episode.add_argument("--batch", type=int)
    episode.set_defaults(func=run_episode, command="_episode")
    return episode
