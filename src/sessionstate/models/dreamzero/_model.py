"""The model code both DreamZero session paths run: networks, geometry, the denoising step.

Nothing here holds session state: a path passes in what its session holds and keeps what
comes back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sessionstate import RandomKey, record, static_field
from sessionstate.models._kit import SessionMessages, live_key
from sessionstate.models.dreamzero.config import DreamZeroConfig
from sessionstate.models.dreamzero.networks import (
    DreamZeroNetworks,
    FeatMap,
    Noise,
    build_networks,
)
from sessionstate.models.dreamzero.transform import Observation

__all__ = [
    "BODY_FRAMES",
    "DreamZeroModel",
    "DreamZeroOutput",
    "conditioning_frame",
    "lost_continuation",
    "unknown_session",
]

BODY_FRAMES = 4
"""Pixel frames the VAE encoder takes per body chunk after the seed frame."""


@record
class DreamZeroOutput:
    """What one forward returns: the action chunk, the new video latents, and their frames.

    A record: a pytree of its tensors, with the reset reason (``"session"``, ``"window"`` or
    None) as static data, so `tree_equal`, `tree_map` and `save_state` take it whole.
    ``frames`` are the step's latents decoded to pixels (1, 3, F, H, W) in [-1, 1] by the
    session's streaming decode (with the config's ``decode_frames`` on; None when off).
    """

    actions: torch.Tensor
    video_latents: torch.Tensor
    reset: str | None = static_field()
    frames: torch.Tensor | None = None


_MESSAGES = SessionMessages("DreamZero", "obs")
unknown_session = _MESSAGES.unknown
"""The message for a lookup of a session that is not held."""
lost_continuation = _MESSAGES.lost
"""The message for ``forward(..., begin=False)`` of a session that is not held."""


def conditioning_frame(frames: torch.Tensor) -> torch.Tensor:
    """The frame a window is conditioned on: the last when T is 4 or 9, else the first.

    >>> conditioning_frame(torch.arange(4.0).view(1, 1, 4)).tolist()
    [[[3.0]]]
    """
    t = frames.shape[2]
    return frames[:, :, -1:] if t in (4, 9) else frames[:, :, :1]


def _ys_slice(ys: torch.Tensor, start: int, n: int) -> torch.Tensor:
    if start + n <= ys.shape[2]:
        return ys[:, :, start : start + n]
    return ys[:, :, ys.shape[2] - n :]


class DreamZeroModel:
    """The networks and geometry both paths share, and the stateless denoising step.

    Args:
        cfg: The model's geometry.
        device: Where the networks and per-step tensors live.
        host_device: Where accumulated video latents are kept.

    >>> from sessionstate.models.dreamzero import DreamZeroConfig
    >>> model = DreamZeroModel(DreamZeroConfig.preset("tiny"), "cpu", "cpu")
    >>> model.cfg.num_frame_per_block, model.device
    (2, device(type='cpu'))
    """

    def __init__(
        self, cfg: DreamZeroConfig, device: torch.device | str, host_device: torch.device | str
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.host_device = torch.device(host_device)
        self.nets: DreamZeroNetworks = build_networks(cfg, self.device)

    def noise(self, key: RandomKey) -> tuple[Noise, RandomKey]:
        """A block's starting noise drawn from the session's key, and the next key.

        A key not allocated (a record saved before sessions held one) is seeded from the
        config's ``seed`` first.

        >>> from sessionstate import RandomKey
        >>> from sessionstate.models.dreamzero import DreamZeroConfig
        >>> model = DreamZeroModel(DreamZeroConfig.preset("tiny"), "cpu", "cpu")
        >>> model.noise(RandomKey())[1].counter
        1
        """
        return self.nets.noise(live_key(key, self.cfg.seed))

    def generate(
        self,
        ref: torch.Tensor,
        ys: torch.Tensor,
        clip_feas: torch.Tensor,
        prompt_embeds: torch.Tensor,
        csf: int,
        obs: Observation,
        kv: torch.Tensor,
        noise: Noise,
    ) -> tuple[torch.Tensor, DreamZeroOutput]:
        """Denoise the next block from ``noise`` and post-process the actions (both paths, no
        state).

        Returns:
            The block's video latents (with the window's conditioning latent in front on its
            first block) and the step's output (``reset`` left None for the caller to set).
        """
        n = self.cfg.num_frame_per_block
        video, actions = self.nets.diffuse(
            ref, _ys_slice(ys, csf, n), clip_feas, prompt_embeds, kv, noise
        )
        if csf == 1:  # the window's first block carries its conditioning latent in front
            video = torch.cat([ref, video], dim=2)
        out = DreamZeroOutput(
            actions=self.nets.postprocess_actions(actions, obs.state.to(self.device)),
            video_latents=video,
            reset=None,
        )
        return video, out

    def generate_batch(
        self,
        inputs: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
        csfs: Sequence[int],
        observations: Sequence[Observation],
        kvs: Sequence[torch.Tensor],
        noises: Sequence[Noise],
        *,
        batch_invariant: bool = False,
    ) -> list[tuple[torch.Tensor, DreamZeroOutput]]:
        """`generate` of a batch of sessions whose denoiser inputs have one shape.

        ``inputs`` holds each session's ``(ref, ys, clip_feas, prompt_embeds)`` and ``noises``
        its starting noise (`noise`); the denoiser
        runs in one loop over the batch (`DreamZeroNetworks.diffuse_batch`; bit for bit each
        session's own `generate` with ``batch_invariant``). Returns each session's
        ``(video, output)``, as `generate` returns them.
        """
        n = self.cfg.num_frame_per_block
        refs = [x[0] for x in inputs]
        videos, actions = self.nets.diffuse_batch(
            refs,
            [_ys_slice(x[1], csf, n) for x, csf in zip(inputs, csfs, strict=True)],
            [x[2] for x in inputs],
            [x[3] for x in inputs],
            kvs,
            noises,
            batch_invariant=batch_invariant,
        )
        results = []
        for ref, video, raw, csf, obs in zip(
            refs, videos, actions, csfs, observations, strict=True
        ):
            if csf == 1:  # the window's first block carries its conditioning latent in front
                video = torch.cat([ref, video], dim=2)
            out = DreamZeroOutput(
                actions=self.nets.postprocess_actions(raw, obs.state.to(self.device)),
                video_latents=video,
                reset=None,
            )
            results.append((video, out))
        return results

    def decode(
        self, video: torch.Tensor, feat_map: FeatMap | None
    ) -> tuple[torch.Tensor | None, FeatMap | None]:
        """The step's pixel frames and the session's next decoder cache (both paths, no state).

        With ``decode_frames`` off: no frames, and the cache as it was.
        """
        if not self.cfg.decode_frames:
            return None, feat_map
        cache = self.nets.init_decode_map() if feat_map is None else feat_map
        return self.nets.decode_chunk(video, cache)
