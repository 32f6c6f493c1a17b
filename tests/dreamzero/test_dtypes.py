"""DreamZero runs in every dtype its config accepts, on CPU, bit-identically on both paths.

The shipped deploy dtype is bfloat16; CPU has no reduced-precision kernel for the KV
denoiser's patch pooling, so the model averages those patches in float32 and rounds once.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from dz_support import assert_same_output, assert_same_sessions, pipeline_pair, tiny

from sessionstate import OmniDiffusionConfig
from sessionstate.models.dreamzero import DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode
from support import torch_threads


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_runs_on_cpu_bit_identically_on_both_paths(dtype: str) -> None:
    cfg = tiny(dtype=dtype)
    bespoke, managed = pipeline_pair(cfg, cap=2)
    for sid, obs in scripted_episode(cfg, steps=3, sessions=3, seed=5):
        a = bespoke.forward(obs, sid)
        b = managed.forward(obs, sid)
        assert_same_output(a, b, sid)
        assert_same_sessions(bespoke, managed, cfg)
    held = managed.session_values(managed.session_ids()[-1])
    assert held["prompt_embeds"].dtype == cfg.torch_dtype  # type: ignore[union-attr]
    assert bespoke.stats()["evictions"] == managed.stats()["evictions"] > 0


def test_the_deploy_config_dtype_runs_on_cpu() -> None:
    config = OmniDiffusionConfig(model={"preset": "tiny", "dtype": "bfloat16"})
    outs = []
    for flag in ("0", "1"):
        pipe = DreamZeroPipeline(config, environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": flag})
        assert pipe.nets.dtype == torch.bfloat16
        outs.append(
            [
                pipe.forward(obs, sid)
                for sid, obs in scripted_episode(pipe.cfg, steps=2, sessions=1, seed=6)
            ]
        )
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a.actions, b.actions)
        assert torch.equal(a.video_latents, b.video_latents)
