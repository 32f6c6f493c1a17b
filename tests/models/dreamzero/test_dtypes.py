"""DreamZero runs in every dtype its config accepts, on CPU, bit-identically on both paths.

The shipped deploy dtype is bfloat16; CPU has no reduced-precision kernel for the KV
denoiser's patch pooling, so the model averages those patches in float32 and rounds once, and
it convolves in float32 and rounds once too (torch's reduced-precision CPU convolution is its
slow reference kernel on CPUs without AVX-512: a bfloat16 step cost ten float32 steps).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sessionstate import OmniDiffusionConfig
from sessionstate.models.dreamzero import DreamZeroPipeline
from sessionstate.models.dreamzero.episode import scripted_episode
from sessionstate.models.dreamzero.networks import DreamZeroNetworks, build_networks
from tests.models.dreamzero.dz_support import (
    assert_same_output,
    assert_same_sessions,
    pipeline_pair,
    tiny,
)
from tests.support import torch_threads


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


def tiny_networks(dtype: str) -> DreamZeroNetworks:
    return build_networks(tiny(dtype=dtype))


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


class _ConvolutionDtypes(TorchDispatchMode):
    """Records the input dtype of every convolution run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.convolution.default:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_cpu_convolutions_run_in_float32(dtype: str) -> None:
    # Torch's reduced-precision CPU convolution is its reference kernel with a reduced-precision
    # GEMM wherever oneDNN lacks one (as under the AVX2 kernels every test run asks for): a
    # bfloat16 step cost ten float32 steps. The model convolves in float32 and rounds once.
    cfg = tiny(dtype=dtype)
    pipe = DreamZeroPipeline(cfg, environ={"OMNI_DIFFUSION_SESSION_STATE_MANAGER": "1"})
    ((sid, obs),) = scripted_episode(cfg, steps=1, sessions=1, seed=2)
    with _ConvolutionDtypes() as seen:
        out = pipe.forward(obs, sid)
    assert len(seen.dtypes) > 100  # the VAE's causal convolutions, frame by frame
    assert set(seen.dtypes) == {torch.float32}
    assert out.video_latents.dtype == cfg.torch_dtype


def test_a_reduced_precision_convolution_is_the_float32_one_rounded_once() -> None:
    nets = tiny_networks("bfloat16")
    conv = next(m for m in nets.vae.modules() if isinstance(m, torch.nn.Conv3d))
    x = torch.randn(1, conv.in_channels, 3, 6, 6).bfloat16()
    bias = None if conv.bias is None else conv.bias.float()
    want = torch.nn.functional.conv3d(
        x.float(), conv.weight.float(), bias, conv.stride, conv.padding, conv.dilation
    ).bfloat16()
    assert torch.equal(conv._conv_forward(x, conv.weight, conv.bias), want)
    floats = tiny_networks("float32")
    assert all("_conv_forward" not in m.__dict__ for m in floats.vae.modules())
    assert pickle.loads(pickle.dumps(conv))._conv_forward.conv is not conv  # still pickles
