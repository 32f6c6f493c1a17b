"""The observation reader: the ring of the last 2 latent frames reads bit-identically to the
whole history, at the deploy latent geometry (44x80, 32 pre-quant channels, float32).

The measured hazard: ``quant_conv`` (a kernel-size-1 conv, pointwise in time) over a long
history and then sliced to the last 2 frames may differ bitwise from the same conv over
those 2 frames alone, because oneDNN picks its blocking by the input's length (seen on CPU
with 2 threads). `DreamZeroNetworks.normalize_latents` applies the conv one contiguous
frame at a time, so the bespoke reader (whole history) and the managed one (the ring) must
agree bit for bit whatever the history length and thread count.

Only ``quant_conv`` and the normalisation are exercised, so the VAE is tiny in width; the
latent geometry is the deploy one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from sessionstate.models.dreamzero.networks import DreamZeroNetworks, build_networks
from tests.models.dreamzero.dz_support import tiny
from tests.support import torch_threads

HISTORY_LENGTHS = (2, 3, 20, 33, 64)
THREADS = (1, 2)
CHANNELS = 32  # 2 * z_dim: the encoder output before quant_conv
NFPB = 2


@pytest.fixture(scope="module")
def nets() -> DreamZeroNetworks:
    cfg = tiny(view_height=176, view_width=320)
    assert (cfg.latent_height, cfg.latent_width) == (44, 80)
    assert 2 * cfg.vae_z_dim == CHANNELS
    assert cfg.num_frame_per_block == NFPB
    return build_networks(cfg)


@pytest.fixture(scope="module")
def histories(nets: DreamZeroNetworks) -> dict[int, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, w = nets.cfg.latent_height, nets.cfg.latent_width
    # One pre-quant frame at a time, as the stream produces them, then grown by concatenation
    # as the bespoke state does.
    frames = [torch.randn((1, CHANNELS, 1, h, w), generator=g) for _ in range(max(HISTORY_LENGTHS))]
    return {t: torch.cat(frames[:t], dim=2) for t in HISTORY_LENGTHS}


@pytest.fixture(params=THREADS, ids=[f"threads-{n}" for n in THREADS])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    with torch_threads(request.param):
        yield request.param


def _ring(history: torch.Tensor) -> list[torch.Tensor]:
    # What the managed `vae_encoder_out` ring holds: the last NFPB frames, one chunk each.
    t = history.shape[2]
    return [history[:, :, i : i + 1].clone() for i in range(max(0, t - NFPB), t)]


@pytest.mark.parametrize("t", HISTORY_LENGTHS)
def test_ring_reads_bit_identically_to_the_whole_history(
    nets: DreamZeroNetworks, histories: dict[int, torch.Tensor], threads: int, t: int
) -> None:
    history = histories[t]
    ring = _ring(history)
    assert history.dtype == torch.float32
    assert history.shape == (1, CHANNELS, t, 44, 80)

    bespoke = nets.observation_latents([history], NFPB)
    managed = nets.observation_latents(ring, NFPB)

    assert bespoke.shape == managed.shape == (1, CHANNELS // 2, NFPB, 44, 80)
    assert torch.equal(bespoke, managed)
    normalized = nets.normalize_latents([history])
    assert normalized.shape[2] == t
    assert torch.equal(normalized[:, :, t - NFPB :], nets.normalize_latents(ring))


def test_reader_ignores_thread_count(
    nets: DreamZeroNetworks, histories: dict[int, torch.Tensor]
) -> None:
    history = histories[max(HISTORY_LENGTHS)]
    reads = []
    for n in THREADS:
        with torch_threads(n):
            reads.append(nets.observation_latents(_ring(history), NFPB))
    assert all(torch.equal(reads[0], r) for r in reads[1:])


def test_seed_frame_alone_is_left_padded(nets: DreamZeroNetworks) -> None:
    g = torch.Generator().manual_seed(1)
    seed = torch.randn((1, CHANNELS, 1, 44, 80), generator=g)
    read = nets.observation_latents([seed], NFPB)
    one = nets.normalize_latents([seed])
    assert read.shape[2] == NFPB
    assert torch.equal(read, torch.cat([one, one], dim=2))


def test_naive_whole_history_conv_is_recorded_not_assumed(
    nets: DreamZeroNetworks,
    histories: dict[int, torch.Tensor],
    record_property: Callable[[str, object], None],
) -> None:
    """Record whether the naive formulation differs here; assert only what must hold.

    The naive reader runs ``quant_conv`` once over the whole history and slices the last 2
    frames. Whether that matches the conv over the 2 frames alone depends on the oneDNN
    build and thread count, so it is recorded (``record_property``, and printed: see ``-rP``),
    never asserted. What must hold is the same mathematics to float rounding; the bitwise
    claim is made for our per-frame formulation only (the tests above).
    """
    differs = {}
    for n in THREADS:
        with torch_threads(n):
            for t, history in histories.items():
                whole = nets.vae.quant_conv(history)[:, :, t - NFPB :]
                alone = nets.vae.quant_conv(torch.cat(_ring(history), dim=2))
                key = f"naive_quant_conv_differs_T{t}_threads{n}"
                differs[key] = not torch.equal(whole, alone)
                record_property(key, differs[key])
                torch.testing.assert_close(whole, alone, rtol=1e-5, atol=1e-5)
    print("naive whole-history quant_conv bitwise differs:", differs)
