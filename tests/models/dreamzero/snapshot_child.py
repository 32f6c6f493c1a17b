"""The fresh process of the snapshot continuation test.

Usage: ``python snapshot_child.py WORKDIR``. Reads ``WORKDIR/plan.safetensors`` (the
observations, the steps to continue and which snapshots to restore), restores each
``WORKDIR/after-<k>.safetensors`` into a fresh manager-backed pipeline, continues the session
and writes every output and the final record to ``WORKDIR/continued.safetensors``. Everything
goes through snapshots: nothing here unpickles.
"""

from __future__ import annotations

import sys
from pathlib import Path

import sessionstate as ss

STATE_MODULE = "sessionstate.models.dreamzero.state"


def main(workdir: Path) -> None:
    plan = ss.load_state(workdir / "plan.safetensors")
    # The first restore finds `DreamZeroSession` by importing its module itself: the loader
    # may import modules under `sessionstate.`, and nothing here has imported it yet.
    imported_before = STATE_MODULE in sys.modules
    manager = ss.SessionStateManager()
    manager.restore("probe", workdir / f"after-{plan['ks'][0]}.safetensors")
    imported_by_load = not imported_before and STATE_MODULE in sys.modules

    from sessionstate.models.dreamzero import DreamZeroConfig, DreamZeroPipeline, Observation

    cfg = DreamZeroConfig.preset("tiny")
    observations = [
        Observation(images=o["images"], prompt=o["prompt"], state=o["state"])
        for o in plan["observations"]
    ]
    results: dict[str, object] = {"imported_by_load": imported_by_load}
    for k in plan["ks"]:
        pipe = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1"})
        assert pipe.manager is not None
        pipe.manager.restore("s", workdir / f"after-{k}.safetensors")
        outputs = []
        for obs in observations[k : k + plan["continue_steps"]]:
            out = pipe.forward(obs, "s")
            outputs.append({"actions": out.actions, "video": out.video_latents, "reset": out.reset})
        results[f"k{k}"] = {"outputs": outputs, "state": pipe.manager.peek("s")}
    ss.save_state(results, workdir / "continued.safetensors")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
