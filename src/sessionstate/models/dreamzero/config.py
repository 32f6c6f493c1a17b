"""DreamZero model settings and the ``deploy`` / ``tiny`` presets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from sessionstate.models._kit import an_int, is_int, one_of, positive_int
from sessionstate.models._presets import from_preset, from_section

__all__ = ["FRAMES_PER_CHUNK", "MAX_DREAMZERO_SESSIONS", "PRESETS", "DreamZeroConfig"]

FRAMES_PER_CHUNK = 4
"""Stitched frames kept in the ring; the first call of a window uses 1 frame."""

MAX_DREAMZERO_SESSIONS = 64
"""The bespoke path's fixed session cap (not configurable, as upstream)."""

_MASK_CHANNELS = 4
"""Channels of the conditioning mask joined to the latents (networks use the same count)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_crop(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        msg = f"`crop_scale` must be a number in (0, 1], got {value!r}."
        raise ValueError(msg)


def _check_window(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not is_int(value) or (value <= 0 and value != -1):
        msg = (
            f"`local_attn_size` must be a positive int (latent frames per window) or -1 (no "
            f"window resets), got {value!r} ({type(value).__name__})."
        )
        raise ValueError(msg)


def _check_flag(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        msg = f"`{attribute.name}` must be true or false, got {value!r} ({type(value).__name__})."
        raise TypeError(msg)


@attrs.frozen(kw_only=True)
class DreamZeroConfig:
    """Geometry and sizes of the DreamZero-shaped pipeline.

    The ``deploy`` preset is the shipped geometry: three 180x320 cameras, centre-cropped
    (0.95) and resized to 176x320, stitched to 352x640; bfloat16; the Wan 2.1 VAE at its
    released width (base_dim 96, z_dim 16); ``num_frame_per_block = 2``. The ``tiny`` preset
    keeps the structure at small widths, in float32, for CPU tests.

    The KV cache geometry of the ``deploy`` preset is the Wan 2.1 14B transformer's (40
    layers, 40 heads of 128), one latent frame (``frame_seqlen`` = 880 tokens) per block, and
    an attention window of ``kv_window_frames`` latent frames; the stand-in denoiser writes
    and reads KV of exactly that shape, so byte counts on ``meta`` are the deploy ones.

    >>> cfg = DreamZeroConfig.preset("deploy")
    >>> (cfg.canvas_height, cfg.canvas_width), (cfg.latent_height, cfg.latent_width)
    ((352, 640), (44, 80))
    """

    name: str = "custom"
    camera_height: int = attrs.field(default=180, validator=positive_int)
    camera_width: int = attrs.field(default=320, validator=positive_int)
    crop_scale: float = attrs.field(default=0.95, validator=_check_crop)
    view_height: int = attrs.field(default=176, validator=positive_int)
    view_width: int = attrs.field(default=320, validator=positive_int)
    dtype: str = attrs.field(default="bfloat16", validator=one_of(_DTYPES))
    vae_base_dim: int = attrs.field(default=96, validator=positive_int)
    vae_z_dim: int = attrs.field(default=16, validator=positive_int)
    num_frame_per_block: int = attrs.field(default=2, validator=positive_int)
    num_frames: int = attrs.field(default=33, validator=positive_int)
    local_attn_size: int = attrs.field(default=-1, validator=_check_window)
    text_len: int = attrs.field(default=512, validator=positive_int)
    text_dim: int = attrs.field(default=4096, validator=positive_int)
    clip_grid: int = attrs.field(default=16, validator=positive_int)
    clip_dim: int = attrs.field(default=1280, validator=positive_int)
    hidden_dim: int = attrs.field(default=64, validator=positive_int)
    action_horizon: int = attrs.field(default=24, validator=positive_int)
    action_dim: int = attrs.field(default=8, validator=positive_int)
    num_inference_steps: int = attrs.field(default=4, validator=positive_int)
    kv_layers: int = attrs.field(default=40, validator=positive_int)
    kv_heads: int = attrs.field(default=40, validator=positive_int)
    kv_head_dim: int = attrs.field(default=128, validator=positive_int)
    kv_block_tokens: int = attrs.field(default=880, validator=positive_int)
    kv_window_frames: int = attrs.field(default=9, validator=positive_int)
    seed: int = attrs.field(default=0, validator=an_int)
    decode_frames: bool = attrs.field(default=False, validator=_check_flag)
    """Decode each step's video latents to pixel frames, streaming, with a per-session cache.

    On, every step's output carries its pixel frames (`DreamZeroOutput.frames`), decoded by
    the Wan decoder from that step's latents alone: the session holds the decoder's
    causal-conv cache (``vae_dec_feat_map``, about 1 GiB at deploy) between steps, so the frames
    of a session's steps, joined, are the frames one decoder call over its whole latent
    history gives. On in the ``deploy`` preset, off in ``tiny`` (a CPU test geometry).
    """

    def __attrs_post_init__(self) -> None:
        # Relations between fields, so a bad geometry fails here and not at step 0 in torch.
        if (self.num_frames - 1) % 4:
            valid = 1 + 4 * ((self.num_frames - 1) // 4)
            msg = (
                f"`num_frames` must be 1 more than a multiple of 4 (the Wan VAE encodes one "
                f"frame, then 4 at a time), got {self.num_frames}; use {valid} or {valid + 4}."
            )
            raise ValueError(msg)
        if self.num_frame_per_block > self.num_latent_frames:
            msg = (
                f"`num_frame_per_block` ({self.num_frame_per_block}) cannot exceed the latent "
                f"frames of a `num_frames` clip ({self.num_frames} frames -> "
                f"{self.num_latent_frames} latent frames); use `num_frame_per_block` <= "
                f"{self.num_latent_frames}, or `num_frames` >= "
                f"{1 + 4 * (self.num_frame_per_block - 1)}."
            )
            raise ValueError(msg)
        if self.vae_z_dim < _MASK_CHANNELS:
            msg = (
                f"`vae_z_dim` must be at least {_MASK_CHANNELS} (the conditioning mask has "
                f"{_MASK_CHANNELS} channels), got {self.vae_z_dim}; use {_MASK_CHANNELS} or "
                "more (16 at deploy)."
            )
            raise ValueError(msg)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model dtype as a `torch.dtype`."""
        return _DTYPES[self.dtype]

    @property
    def canvas_height(self) -> int:
        """Height of the stitched canvas (two views stacked)."""
        return 2 * self.view_height

    @property
    def canvas_width(self) -> int:
        """Width of the stitched canvas (two views side by side)."""
        return 2 * self.view_width

    @property
    def latent_height(self) -> int:
        """Latent height (the Wan VAE compresses space by 8)."""
        return self.canvas_height // 8

    @property
    def latent_width(self) -> int:
        """Latent width (the Wan VAE compresses space by 8)."""
        return self.canvas_width // 8

    @property
    def frame_seqlen(self) -> int:
        """Tokens per latent frame (2x2 patches of the latent grid), 880 at deploy."""
        return (self.latent_height // 2) * (self.latent_width // 2)

    @property
    def kv_token_shape(self) -> tuple[int, int, int, int]:
        """The shape of one token's KV: ``(layers, 2, heads, head_dim)`` (keys and values)."""
        return (self.kv_layers, 2, self.kv_heads, self.kv_head_dim)

    @property
    def num_latent_frames(self) -> int:
        """Latent frames of a ``num_frames`` clip (the Wan VAE compresses time by 4)."""
        return 1 + (self.num_frames - 1) // 4

    @classmethod
    def preset(cls, name: str, /, **overrides: Any) -> DreamZeroConfig:
        """A named preset (``deploy`` or ``tiny``), optionally with fields overridden.

        Raises:
            KeyError: for an unknown preset name.

        >>> DreamZeroConfig.preset("tiny", seed=3).seed
        3
        """
        return from_preset("DreamZero", PRESETS, name, **overrides)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], /) -> DreamZeroConfig:
        """Build from a deploy config's ``model`` section: ``preset`` plus field overrides.

        Raises:
            KeyError: for an unknown key or preset, naming it and the known ones.

        >>> DreamZeroConfig.from_dict({"preset": "tiny", "local_attn_size": 5}).local_attn_size
        5
        """
        return from_section("DreamZero", PRESETS, cls, data)


PRESETS: dict[str, DreamZeroConfig] = {
    "deploy": DreamZeroConfig(name="deploy", decode_frames=True),
    "tiny": DreamZeroConfig(
        name="tiny",
        camera_height=40,
        camera_width=72,
        view_height=16,
        view_width=32,
        dtype="float32",
        vae_base_dim=8,
        num_frames=9,
        local_attn_size=9,
        text_len=16,
        text_dim=32,
        clip_grid=2,
        clip_dim=16,
        hidden_dim=16,
        action_horizon=4,
        num_inference_steps=2,
        kv_layers=1,
        kv_heads=2,
        kv_head_dim=8,
        kv_block_tokens=16,
        kv_window_frames=4,
    ),
}
