"""Cosmos3 model settings and the ``deploy`` / ``tiny`` presets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from sessionstate.models._kit import an_int, one_of, positive_int
from sessionstate.models._presets import from_preset, from_section

__all__ = ["MAX_COSMOS3_SESSIONS", "PRESETS", "Cosmos3Config"]

MAX_COSMOS3_SESSIONS = 64
"""The bespoke path's fixed session cap (as DreamZero's)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_number(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        msg = f"`{attribute.name}` must be a number, got {value!r} ({type(value).__name__})."
        raise TypeError(msg)


@attrs.frozen(kw_only=True)
class Cosmos3Config:
    """Geometry and sizes of the Cosmos3-shaped pipeline.

    The ``deploy`` preset carries an assumed real geometry (no published one exists): the
    reasoner is a Cosmos-Reason1-7B / Qwen2.5-VL-7B-shaped decoder, 28 layers with
    grouped-query attention of 4 K/V heads of dimension 128 (28 query heads, hidden size
    3584), read over a 512-token prompt in bfloat16; the generation pathway denoises chunks of
    4 latent frames of a 704x1280 video (Wan VAE latents: 16 channels, 88x160, patchified 2x2
    into 3520 tokens per frame), 35 denoising steps, one chunk of latent context. The state
    sizes depend only on these numbers. The ``tiny`` preset keeps the structure at small
    widths, in float32, for CPU tests.

    >>> cfg = Cosmos3Config.preset("deploy")
    >>> cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.text_len, cfg.num_tokens
    (28, 4, 128, 512, 14080)
    """

    name: str = "custom"
    num_layers: int = attrs.field(default=28, validator=positive_int)
    num_heads: int = attrs.field(default=28, validator=positive_int)
    num_kv_heads: int = attrs.field(default=4, validator=positive_int)
    head_dim: int = attrs.field(default=128, validator=positive_int)
    text_len: int = attrs.field(default=512, validator=positive_int)
    text_dim: int = attrs.field(default=3584, validator=positive_int)
    latent_channels: int = attrs.field(default=16, validator=positive_int)
    chunk_frames: int = attrs.field(default=4, validator=positive_int)
    latent_height: int = attrs.field(default=88, validator=positive_int)
    latent_width: int = attrs.field(default=160, validator=positive_int)
    patch: int = attrs.field(default=2, validator=positive_int)
    context_chunks: int = attrs.field(default=1, validator=positive_int)
    control_dim: int = attrs.field(default=8, validator=positive_int)
    num_inference_steps: int = attrs.field(default=35, validator=positive_int)
    guidance_scale: float = attrs.field(default=7.0, validator=_check_number)
    dtype: str = attrs.field(default="bfloat16", validator=one_of(_DTYPES))
    seed: int = attrs.field(default=0, validator=an_int)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            msg = (
                f"`num_heads` ({self.num_heads}) must be a multiple of `num_kv_heads` "
                f"({self.num_kv_heads}): each K/V head serves a group of query heads."
            )
            raise ValueError(msg)
        if self.latent_height % self.patch or self.latent_width % self.patch:
            msg = (
                f"`patch` ({self.patch}) must divide the latent size "
                f"{self.latent_height}x{self.latent_width}."
            )
            raise ValueError(msg)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The model dtype as a `torch.dtype`."""
        return _DTYPES[self.dtype]

    @property
    def model_dim(self) -> int:
        """Width of the generation pathway (query heads times head dimension)."""
        return self.num_heads * self.head_dim

    @property
    def num_tokens(self) -> int:
        """Generation tokens per chunk (latent frames times patches per frame)."""
        return (
            self.chunk_frames
            * (self.latent_height // self.patch)
            * (self.latent_width // self.patch)
        )

    @classmethod
    def preset(cls, name: str, /, **overrides: Any) -> Cosmos3Config:
        """A named preset (``deploy`` or ``tiny``), optionally with fields overridden.

        Raises:
            KeyError: for an unknown preset name.

        >>> Cosmos3Config.preset("tiny", seed=3).seed
        3
        """
        return from_preset("Cosmos3", PRESETS, name, **overrides)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], /) -> Cosmos3Config:
        """Build from a deploy config's ``model`` section: ``preset`` plus field overrides.

        Raises:
            KeyError: for an unknown key or preset, naming it and the known ones.

        >>> Cosmos3Config.from_dict({"preset": "tiny", "guidance_scale": 2.0}).guidance_scale
        2.0
        """
        return from_section("Cosmos3", PRESETS, cls, data)


PRESETS: dict[str, Cosmos3Config] = {
    "deploy": Cosmos3Config(name="deploy"),
    "tiny": Cosmos3Config(
        name="tiny",
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        text_len=8,
        text_dim=8,
        latent_channels=4,
        chunk_frames=2,
        latent_height=4,
        latent_width=4,
        patch=1,
        context_chunks=2,
        control_dim=4,
        num_inference_steps=3,
        guidance_scale=3.0,
        dtype="float32",
    ),
}
