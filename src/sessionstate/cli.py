"""The ``sessionstate`` command line: A/B validation, size tables, and a demo.

Subcommands: ``ab``, ``sizes``, ``demo``, ``inspect``, ``cluster`` (each with ``--help``).

``sessionstate ab`` runs the same scripted DreamZero episode twice, each in its own process,
the two differing only in ``OMNI_DIFFUSION_SESSION_STATE_MANAGER=0/1``, and compares every
output with `torch.equal`. ``sessionstate sizes`` runs one session on the meta device and
prints what every value holds on each path. ``sessionstate inspect FILE`` describes a snapshot
written by `sessionstate.save_state` from its header alone. ``ab`` and ``sizes`` take
``--model`` (``dreamzero``, the default, or ``cosmos3``); each model describes itself to them
with a `sessionstate.models._registry.ModelSpec`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sessionstate.models._registry import DEFAULT_MODEL, MODELS, ModelSpec, get_model

__all__ = ["main"]

_MIB = 1024 * 1024


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line, no usage dump: `sessionstate ab: error: ...`.
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def _nbytes(text: str) -> int:
    from sessionstate._ledger import parse_nbytes

    try:
        value = parse_nbytes(text, name="--max-bytes")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 1048576 or 24GiB, got {text!r}"
        ) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive byte count, got {text!r}")
    return value


def _with_budget(deploy: Any, args: argparse.Namespace) -> Any:
    """The deploy config with ``--max-bytes`` and the park tier applied (if given)."""
    import attrs

    if getattr(args, "max_bytes", None) is None:
        return deploy
    tier = args.park_tier or ("host" if str(args.device).startswith("cuda") else "disk")
    return attrs.evolve(
        deploy, session_state_max_bytes=args.max_bytes, session_state_park_tier=tier
    )


def _load_model_config(
    config: str | None, preset: str | None, model_name: str = DEFAULT_MODEL
) -> tuple[Any, Any]:
    """The deploy config (its ``model`` section completed) and the model's config."""
    import attrs

    from sessionstate import OmniDiffusionConfig

    deploy = OmniDiffusionConfig.from_yaml(config) if config else OmniDiffusionConfig()
    model = dict(deploy.model)
    if preset is not None:
        model["preset"] = preset
    model.setdefault("preset", "tiny")
    return attrs.evolve(deploy, model=model), get_model(model_name).config_from_dict(model)


# -- ab -----------------------------------------------------------------------------------------


def _run_episode(args: argparse.Namespace) -> int:
    """Child process: run the episode on whichever path the environment selects."""
    import torch

    from sessionstate import SessionAdmissionError

    spec = get_model(args.model)
    deploy, cfg = _load_model_config(args.config, args.preset, spec.name)
    deploy = _with_budget(deploy, args)
    pipe = spec.pipeline(deploy, device=args.device, max_bespoke_sessions=args.max_sessions)
    total = args.steps * args.sessions
    records: list[dict[str, Any]] = []
    times: list[float] = []
    for i, (sid, obs) in enumerate(
        spec.episode(cfg, steps=args.steps, sessions=args.sessions, seed=args.seed)
    ):
        start = time.perf_counter()
        try:
            out = pipe.forward(obs, sid)
        except SessionAdmissionError:  # `on_full="refuse"` at the cap: a result to compare
            records.append({"session": sid, "refused": True})
        else:
            times.append(time.perf_counter() - start)
            records.append({"session": sid, **spec.outputs(out)})
        print(f"PROGRESS {i + 1} {total}", file=sys.stderr, flush=True)
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


def _spawn(args: argparse.Namespace, flag: str, out: Path, progress: Any, task: Any) -> None:
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
        cmd += ["--max-bytes", str(args.max_bytes)]
        if args.park_tier:
            cmd += ["--park-tier", args.park_tier]
    # Both sides get the same cap: the managed side reads it from the environment, the
    # bespoke side (whose cap is a constant upstream) from `--max-sessions`.
    from sessionstate._config import ENV_ENABLE, ENV_MAX_SESSIONS, ENV_ON_FULL

    env = dict(os.environ)
    env[ENV_ENABLE] = flag
    env[ENV_MAX_SESSIONS] = str(args.max_sessions)
    if args.on_full is not None:
        env[ENV_ON_FULL] = args.on_full
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    tail: list[str] = []
    for line in proc.stderr:
        if line.startswith("PROGRESS "):
            if progress is not None:
                progress.update(task, advance=1)
        else:
            tail.append(line)
    if proc.wait() != 0:
        msg = f"the {'managed' if flag == '1' else 'bespoke'} run failed:\n{''.join(tail[-20:])}"
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
            compared += 1
            if not torch.equal(a[key], b[key]):
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


def _cmd_ab(args: argparse.Namespace) -> int:
    import torch

    spec = get_model(args.model)
    deploy, cfg = _load_model_config(args.config, args.preset, spec.name)  # fail here, not in both
    total = args.steps * args.sessions
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        progress_cm: Any = None
        if not args.json:
            from rich.progress import Progress

            progress_cm = Progress(transient=True)
        with progress_cm if progress_cm is not None else contextlib.nullcontext():
            for flag, name in (("0", "bespoke"), ("1", "managed")):
                task = None
                if progress_cm is not None:
                    task = progress_cm.add_task(f"{name} path", total=total)
                out = Path(tmp) / f"{name}.pt"
                _spawn(args, flag, out, progress_cm, task)
                results[name] = torch.load(out, weights_only=False)
    if results["bespoke"]["managed"] or not results["managed"]["managed"]:
        msg = "the flag did not select the intended paths (check the deploy config)"
        raise RuntimeError(msg)
    compared, mismatch = _compare(results["bespoke"], results["managed"], spec)
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
                    {
                        key: res["stats"].get(key, 0)
                        for key in ("parks", "unparks", "evictions", "parked_sessions")
                    }
                    if args.max_bytes is not None
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
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_ab(report)
    return 0 if mismatch is None else 1


def _print_ab(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
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
    table = Table("path", "median step (ms)", "bytes held at end", "sessions")
    if "on_full" in report:
        table.add_column("refused steps")
    for name, path in report["paths"].items():
        held = ", ".join(f"{d}: {n / _MIB:.2f} MiB" for d, n in path["nbytes_by_device"].items())
        row = [name, f"{path['median_step_ms']:.2f}", held, str(path["sessions_held"])]
        if "refusals" in path:
            row.append(str(path["refusals"]))
        table.add_row(*row)
    console.print(table)


# -- sizes --------------------------------------------------------------------------------------


def size_table(preset: str, steps: int, *, model: str = DEFAULT_MODEL) -> dict[str, Any]:
    """Per-value bytes of one session of ``model`` on both paths after ``steps`` steps (meta).

    >>> table = size_table("tiny", 2)
    >>> table["values"]["vae_encoder_out"]["bucket"]
    'object'
    >>> size_table("tiny", 2, model="cosmos3")["values"]["text_kv"]["bucket"]
    'object'
    """
    return get_model(model).size_table(preset, steps)


def _cmd_sizes(args: argparse.Namespace) -> int:
    spec = get_model(args.model)
    steps = spec.size_steps if args.steps is None else args.steps
    table = size_table(args.preset, steps, model=spec.name)
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    out = Table(
        "value", "bucket", "managed", "bespoke",
        title=f"One {spec.title} session, preset {args.preset}, after {steps} steps (meta)",
    )  # fmt: skip
    for name, row in table["values"].items():
        out.add_row(
            name,
            row["bucket"],
            _fmt_bytes(row["managed_nbytes"]),
            _fmt_bytes(row["bespoke_nbytes"]),
        )
    totals = table["session_nbytes"]
    out.add_row("[bold]session", "", _fmt_bytes(totals["managed"]), _fmt_bytes(totals["bespoke"]))
    many = table["sessions_64_nbytes"]
    out.add_row(
        "[bold]64 sessions", "",
        f"{many['managed'] / 1024**3:.2f} GiB", f"{many['bespoke'] / 1024**3:.2f} GiB",
    )  # fmt: skip
    rows, lines = spec.size_footer(table)
    for row in rows:
        out.add_row(*row)
    console.print(out)
    for line in lines:
        console.print(line)
    return 0


def _fmt_bytes(n: int) -> str:
    if n == 0:
        return "-"
    if n < 10 * 1024:
        return f"{n} B"
    return f"{n / _MIB:.4f} MiB"


# -- demo -----------------------------------------------------------------------------------------


def _cmd_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from sessionstate.models.dreamzero import DreamZeroPipeline
    from sessionstate.models.dreamzero.episode import scripted_episode

    deploy, cfg = _load_model_config(None, args.preset)
    deploy = _with_budget(deploy, args)
    environ = dict(os.environ, OMNI_DIFFUSION_SESSION_STATE_MANAGER="1")
    if args.max_sessions is not None:
        environ["OMNI_DIFFUSION_SESSION_STATE_MANAGER_MAX_SESSIONS"] = str(args.max_sessions)
    pipe = DreamZeroPipeline(deploy, environ=environ, device=args.device)
    assert pipe.manager is not None
    console = Console()
    episode = scripted_episode(cfg, steps=args.steps, sessions=args.sessions, seed=args.seed)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("DreamZero sessions", total=args.steps * args.sessions)
        for sid, obs in episode:
            pipe.forward(obs, sid)
            progress.update(task, advance=1)

    stats = pipe.manager.stats()
    table = Table("stat", "value", title="SessionStateManager.stats()")
    for key, value in stats.items():
        shown = f"{value / _MIB:.3f} MiB" if "nbytes" in key else str(value)
        table.add_row(key, shown)
    console.print(table)

    sizes = pipe.manager.nbytes_by_session()
    largest = max(sizes, key=lambda sid: sum(sizes[sid].values()))
    state = pipe.manager.peek(largest)
    assert state is not None
    breakdown = Table("value", "bucket", "bytes", title=f"Largest session: {largest}")
    for name, by_device in state.nbytes_by_value().items():
        bucket = "object" if name in state.objects else "attrs"
        breakdown.add_row(name, bucket, _fmt_bytes(sum(by_device.values())))
    console.print(breakdown)
    return 0


# -- inspect --------------------------------------------------------------------------------------


def _cmd_inspect(args: argparse.Namespace) -> int:
    from sessionstate._snapshot import inspect_snapshot

    report = inspect_snapshot(args.file)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    about = Table("field", "value", title=f"Snapshot {report['file']}")
    about.add_row("root", report["root"])
    about.add_row("format_version", str(report["format_version"]))
    about.add_row("library_version", str(report["library_version"]))
    about.add_row("torch_version", str(report["torch_version"]))
    about.add_row("file size", _fmt_bytes(report["file_nbytes"]))
    about.add_row("storages", str(len(report["storages"])))
    for device, nbytes in sorted(report["nbytes"].items()):
        about.add_row(f"nbytes:{device}", _fmt_bytes(nbytes))
    for key, value in report["metadata"].items():
        about.add_row(f"metadata:{key}", value)
    console.print(about)
    values = Table("value", "bucket", "structure", "tensors", "bytes", title="Values")
    for row in report["values"]:
        held = ", ".join(f"{_fmt_bytes(n)} ({d})" for d, n in sorted(row["nbytes"].items()))
        values.add_row(
            row["name"], row["bucket"], row["structure"], str(row["tensors"]), held or "-"
        )
    console.print(values)
    return 0


# -- cluster --------------------------------------------------------------------------------------


def _cmd_cluster(args: argparse.Namespace) -> int:
    import ray

    from sessionstate.distributed import cluster_episode, init_local_ray

    started = bool(init_local_ray(num_cpus=args.num_cpus))
    try:
        report = cluster_episode(
            workers=args.workers,
            preset=args.preset,
            sessions=args.sessions,
            steps=args.steps,
            seed=args.seed,
            migrate_every=args.migrate_every,
        )
    finally:
        if started:
            ray.shutdown()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_cluster(report)
    return 0 if report["identical"] else 1


def _print_cluster(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    verdict = "[bold green]IDENTICAL[/]" if report["identical"] else "[bold red]MISMATCH[/]"
    console.print(
        f"cluster vs one process {verdict}: {report['outputs_compared']} outputs compared with "
        f"torch.equal, {report['migrations']} migrations (median "
        f"{report['median_migration_ms']} ms), {report['sessions']} sessions x "
        f"{report['steps']} steps, preset {report['preset']}"
    )
    if report["first_mismatch"]:
        console.print(f"first mismatch: {report['first_mismatch']}")
    table = Table("worker", "sessions", "resident bytes", "steps served")
    for name, row in report["workers"].items():
        table.add_row(
            name, ", ".join(row["sessions"]) or "-", _fmt_bytes(row["nbytes"]), str(row["steps"])
        )
    console.print(table)


# -- entry point ----------------------------------------------------------------------------------


def _add_budget_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cpu", help="where the networks and session tensors live (cpu)"
    )
    parser.add_argument(
        "--max-bytes",
        type=_nbytes,
        help="the managed path's byte budget on --device (e.g. 24GiB); least recently used "
        "sessions are parked to stay under it",
    )
    parser.add_argument(
        "--park-tier",
        choices=["host", "disk"],
        help="where the budget parks state (default: host for a CUDA device, else disk)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``sessionstate`` command.

    >>> build_parser().parse_args(["ab", "--steps", "3"]).steps
    3
    """
    parser = _ArgumentParser(prog="sessionstate", description=__doc__)
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        parser_class=_ArgumentParser,
        metavar="{ab,sizes,demo,inspect,cluster}",
    )

    ab = sub.add_parser(
        "ab",
        help="A/B-validate the manager-backed DreamZero path against the bespoke one",
        description="Run one scripted episode twice, in two processes that differ only in "
        "OMNI_DIFFUSION_SESSION_STATE_MANAGER=0/1, and compare every output with torch.equal. "
        "Exits 0 iff identical.",
    )
    ab.add_argument(
        "--model", choices=sorted(MODELS), default=DEFAULT_MODEL, help="model (default dreamzero)"
    )
    ab.add_argument("--config", help="deploy YAML (its `model` section picks the preset)")
    ab.add_argument("--preset", choices=["tiny", "deploy"], help="model preset (default tiny)")
    ab.add_argument("--steps", type=_positive_int, default=24, help="steps per session")
    ab.add_argument("--sessions", type=_positive_int, default=3, help="interleaved sessions")
    ab.add_argument("--seed", type=int, default=0, help="seed of the scripted observations")
    ab.add_argument(
        "--max-sessions",
        type=_positive_int,
        default=64,
        help="session cap of both paths (default 64, the bespoke constant); lower it to "
        "compare LRU eviction",
    )
    ab.add_argument(
        "--on-full",
        choices=["evict", "refuse"],
        help="what a new session does at the cap, on both paths (sets "
        "OMNI_DIFFUSION_SESSION_STATE_MANAGER_ON_FULL; default: the deploy config's "
        "session_state_on_full); refused steps are counted per path and must agree",
    )
    _add_budget_arguments(ab)
    ab.add_argument("--json", action="store_true", help="print one JSON object")
    ab.set_defaults(func=_cmd_ab)

    sizes = sub.add_parser(
        "sizes",
        help="bytes each DreamZero session value holds, per path (meta device)",
        description="Run one session on the meta device (nothing is allocated) and print the "
        "bytes each value holds on the managed and the bespoke path.",
    )
    sizes.add_argument(
        "--model", choices=sorted(MODELS), default=DEFAULT_MODEL, help="model (default dreamzero)"
    )
    sizes.add_argument("--preset", choices=["tiny", "deploy"], default="deploy")
    sizes.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="steps to run (default: 400 for dreamzero, 8 for cosmos3)",
    )
    sizes.add_argument("--json", action="store_true", help="print one JSON object")
    sizes.set_defaults(func=_cmd_sizes)

    demo = sub.add_parser(
        "demo",
        help="run several DreamZero sessions through the manager and show what they hold",
        description="Run a multi-session DreamZero workload on the manager-backed path, then "
        "print stats() and the per-value bytes of the largest session.",
    )
    demo.add_argument("--preset", choices=["tiny", "deploy"], default="tiny")
    demo.add_argument("--sessions", type=_positive_int, default=4, help="interleaved sessions")
    demo.add_argument("--steps", type=_positive_int, default=16, help="steps per session")
    demo.add_argument("--max-sessions", type=_positive_int, help="the manager's session cap")
    demo.add_argument("--seed", type=int, default=0, help="seed of the scripted observations")
    _add_budget_arguments(demo)
    demo.set_defaults(func=_cmd_demo)

    inspect = sub.add_parser(
        "inspect",
        help="describe a session snapshot file: structure, bytes per value, metadata",
        description="Print the structure, the bytes each value holds and the metadata of a "
        "snapshot written by `sessionstate.save_state`, read from its header alone.",
    )
    inspect.add_argument("file", help="the snapshot (.safetensors) file")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(func=_cmd_inspect)

    cluster = sub.add_parser(
        "cluster",
        help="run the DreamZero episode across local Ray workers, migrating sessions",
        description="Run one scripted episode through session-affine Ray workers, migrating "
        "the session just stepped after every --migrate-every calls, and compare every "
        "output with a single-process run (torch.equal). Exits 0 iff identical. Needs the "
        "`ray` extra; starts a local, offline Ray cluster unless one is running.",
    )
    cluster.add_argument("--workers", type=_positive_int, default=2, help="worker actors")
    cluster.add_argument("--preset", choices=["tiny", "deploy"], default="tiny")
    cluster.add_argument("--sessions", type=_positive_int, default=6, help="sessions")
    cluster.add_argument("--steps", type=_positive_int, default=24, help="steps per session")
    cluster.add_argument("--seed", type=int, default=0, help="seed of the scripted observations")
    cluster.add_argument(
        "--migrate-every", type=_positive_int, default=5, help="calls between migrations"
    )
    cluster.add_argument(
        "--num-cpus", type=_positive_int, default=2, help="CPUs of the local Ray cluster"
    )
    cluster.add_argument("--json", action="store_true", help="print one JSON object")
    cluster.set_defaults(func=_cmd_cluster)

    episode = sub.add_parser("_episode")  # internal: one side of `ab`, unlisted
    episode.add_argument("--config")
    episode.add_argument("--preset")
    episode.add_argument("--steps", type=int, required=True)
    episode.add_argument("--sessions", type=int, required=True)
    episode.add_argument("--seed", type=int, required=True)
    episode.add_argument("--out", required=True)
    episode.add_argument("--max-sessions", type=int, default=64)
    episode.add_argument("--device", default="cpu")
    episode.add_argument("--max-bytes", type=int)
    episode.add_argument("--park-tier", choices=["host", "disk"])
    episode.add_argument("--model", default=DEFAULT_MODEL)
    episode.set_defaults(func=_run_episode)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``sessionstate`` command; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad arguments
        return exc.code if isinstance(exc.code, int) else 2
    try:
        status: int = args.func(args)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"sessionstate {args.command}: error: {message}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    raise SystemExit(main())
