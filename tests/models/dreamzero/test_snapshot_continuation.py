"""A DreamZero session snapshotted mid-rollout continues bit-identically in a fresh process.

One uninterrupted managed run is the reference. After chosen steps its session is written
with `SessionStateManager.snapshot`; a second Python process restores each snapshot into a
fresh pipeline, continues, and its outputs must be `torch.equal` to the reference's, and its
final record `tree_equal` to the reference's record at the same step.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import sessionstate as ss
from sessionstate.models.dreamzero import DreamZeroPipeline, DreamZeroSession
from tests.models.dreamzero.dz_support import observations, tiny

STEPS = 7
CONTINUE = 2
CHILD = Path(__file__).with_name("snapshot_child.py")


def test_snapshot_continues_bit_identically_in_a_fresh_process(tmp_path: Path) -> None:
    cfg = tiny()
    obs = observations(cfg, STEPS, seed=11)
    pipe = DreamZeroPipeline(cfg, environ={ss.ENV_ENABLE: "1"})
    assert pipe.manager is not None
    outputs, states = [], []
    for o in obs:
        outputs.append(pipe.forward(o, "s"))
        state = pipe.manager.peek("s")
        assert isinstance(state, DreamZeroSession)
        states.append(state)

    # Choose the steps from what the run did: the first step, one with a 4-frame VAE body
    # chunk half filled, and the step that performed a window reset.
    pending = [
        i + 1
        for i, s in enumerate(states)
        if s.vae_pending_body_frames is not None and s.vae_pending_body_frames.shape[2] == 2
    ]
    window_resets = [i + 1 for i, out in enumerate(outputs) if out.reset == "inference"]
    assert pending, "no step left a half-filled VAE body chunk; lengthen the run"
    assert window_resets, "no window reset happened; lengthen the run"
    ks = sorted({1, pending[0], window_resets[0]})
    assert len(ks) == 3
    assert all(k + CONTINUE <= STEPS for k in ks)

    for k in ks:
        # Reproduce the session as it was after step k, then snapshot it from the manager.
        probe = ss.SessionStateManager()
        probe.put("s", states[k - 1])
        probe.snapshot("s", tmp_path / f"after-{k}.safetensors")
    plan = {
        "ks": ks,
        "continue_steps": CONTINUE,
        "observations": [
            {"images": dict(o.images), "prompt": o.prompt, "state": o.state} for o in obs
        ],
    }
    ss.save_state(plan, tmp_path / "plan.safetensors")

    # A hang guard only; nothing here measures time.
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    continued = ss.load_state(tmp_path / "continued.safetensors")

    assert continued["imported_by_load"] is True
    for k in ks:
        got = continued[f"k{k}"]
        for j, out in enumerate(got["outputs"]):
            ref = outputs[k + j]
            where = f"continued from step {k}, step {k + j + 1}"
            assert out["reset"] == ref.reset, where
            assert torch.equal(out["actions"], ref.actions), where
            assert torch.equal(out["video"], ref.video_latents), where
        assert ss.tree_equal(got["state"], states[k + CONTINUE - 1]), f"state after {k}"
        assert ss.nbytes_by_device(got["state"]) == ss.nbytes_by_device(states[k + CONTINUE - 1])
