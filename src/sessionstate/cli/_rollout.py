"""``sessionstate rollout``: plan with forks on both paths, and the bytes each way holds."""

from __future__ import annotations

import argparse
import json
from typing import Any

from sessionstate._env import ENV_ENABLE
from sessionstate.cli._common import fmt_bytes, load_model_config, positive_int, stdout_console
from sessionstate.models._registry import MODELS, get_model

__all__ = ["add_parsers", "run_rollout"]

_SESSION = "session"


def _latent_calm(outputs: Any) -> float:
    # A stand-in objective: the candidate whose last chunk's latents are the calmest.
    return -float(outputs[-1].video_latents.float().abs().mean())


def run_rollout(args: argparse.Namespace) -> dict[str, Any]:
    """Both paths: ``--history`` steps of one session, then one rollout; the report."""
    from sessionstate import tree_equal
    from sessionstate.models.planning import rollout

    spec = get_model(args.model)
    deploy, cfg = load_model_config(None, args.preset, spec.name)
    steady = {"prompt_change_every": 10**6}  # one prompt: a change would reset the session

    def inputs(steps: int, seed: int) -> list[Any]:
        episode = spec.episode(cfg, steps=steps, sessions=1, seed=seed, **steady)
        return [x for _, x in episode]

    history = inputs(args.history, args.seed)
    candidates = [inputs(args.horizon, args.seed + 1 + i) for i in range(args.branches)]
    plans = {}
    for name, flag in (("bespoke", "0"), ("managed", "1")):
        pipe = spec.pipeline(deploy, environ={ENV_ENABLE: flag})
        for x in history:
            pipe.forward(x, _SESSION)
        before = int(pipe.stats()["total_nbytes"])
        plan = rollout(pipe, _SESSION, candidates, _latent_calm)
        plans[name] = (plan, before, pipe.video_latents(_SESSION), pipe.session_ids())
    bespoke, managed = plans["bespoke"][0], plans["managed"][0]
    identical = (
        bespoke.best == managed.best
        and all(tree_equal(a, b) for a, b in zip(bespoke.outputs, managed.outputs, strict=True))
        and tree_equal(plans["bespoke"][2], plans["managed"][2])  # the kept session's video
    )
    return {
        "model": spec.name,
        "preset": cfg.name,
        "history": args.history,
        "branches": args.branches,
        "horizon": args.horizon,
        "seed": args.seed,
        "identical": identical,
        "best": managed.best,
        "scores": list(managed.scores),
        "session_nbytes": plans["managed"][1],
        "nbytes": {
            "managed": list(managed.nbytes),
            "bespoke (deep copies)": list(bespoke.nbytes),
        },
        "sessions_after": plans["managed"][3],
    }


def _cmd_rollout(args: argparse.Namespace) -> int:
    report = run_rollout(args)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["identical"] else 1
    from rich.table import Table

    console = stdout_console()
    verdict = "[bold green]IDENTICAL[/]" if report["identical"] else "[bold red]MISMATCH[/]"
    console.print(
        f"rollout {report['model']} {verdict}: {report['branches']} branches x "
        f"{report['horizon']} steps from a {report['history']}-step session (preset "
        f"{report['preset']}); kept branch {report['best']}, on both paths"
    )
    table = Table("after", "managed (forks)", "bespoke (deep copies)", "ratio")
    managed, copies = report["nbytes"]["managed"], report["nbytes"]["bespoke (deep copies)"]
    for k, (a, b) in enumerate(zip(managed, copies, strict=True)):
        label = f"step {k + 1}" if k < report["horizon"] else "best kept"
        table.add_row(label, fmt_bytes(a), fmt_bytes(b), f"{a / b:.2f}" if b else "-")
    console.print(table)
    console.print(f"one session before the rollout: {fmt_bytes(report['session_nbytes'])}")
    return 0 if report["identical"] else 1


def add_parsers(sub: Any) -> None:
    """Adds ``rollout`` to the subcommands ``sub``."""
    parser = sub.add_parser(
        "rollout",
        help="plan with forks: roll a session out along candidate inputs, keep the best",
        description="Step one session of a reference model, fork it into a branch per "
        "candidate input sequence, step every branch, keep the best-scoring one as the "
        "session, on both paths (the bespoke one deep-copies, the managed one forks): the "
        "outputs must be identical, and the table shows the bytes each way holds per step.",
    )
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="cosmos3", help="model (default cosmos3)"
    )
    parser.add_argument("--preset", choices=["tiny", "deploy"], default="tiny", help="preset")
    parser.add_argument("--history", type=positive_int, default=6, help="steps before the fork")
    parser.add_argument("--branches", type=positive_int, default=6, help="candidate futures")
    parser.add_argument("--horizon", type=positive_int, default=3, help="steps per candidate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_cmd_rollout)
