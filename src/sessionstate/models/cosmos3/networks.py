"""The networks: small seeded stand-ins for the Cosmos3 reasoner and generation pathway.

The reasoner reads the prompt and yields one attention key/value pair per transformer layer;
the generation pathway's layer ``i`` attends from its video tokens to the reasoner's K/V of
layer ``i``. Every function here is pure, except the fields the bespoke path keeps on the
transformer instance (`GenerationTransformer.cached_rope` and each block's ``cached_kv``),
which only the bespoke path reads or writes.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Sequence

import torch
from torch import nn

from sessionstate import KVPair, RandomKey
from sessionstate.models.cosmos3.config import Cosmos3Config

__all__ = ["Cosmos3Networks", "GenerationBlock", "GenerationTransformer", "build_networks"]


class Reasoner(nn.Module):
    """Stand-in for the reasoner's text pathway: per-layer K/V of the prompt tokens."""

    def __init__(self, cfg: Cosmos3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(257, cfg.text_dim)
        kv_width = cfg.num_kv_heads * cfg.head_dim
        self.to_kv = nn.ModuleList(
            nn.Linear(cfg.text_dim, 2 * kv_width) for _ in range(cfg.num_layers)
        )
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(cfg.num_layers, cfg.text_dim))

    def layer_kv(self, tokens: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Yield ``(key, value)`` of every layer in order, each (1, kv_heads, L, head_dim)."""
        cfg = self.cfg
        hidden = self.embed(tokens)
        for i, proj in enumerate(self.to_kv):
            kv = proj(hidden).view(1, cfg.text_len, 2, cfg.num_kv_heads, cfg.head_dim)
            # Contiguous (1, heads, L, d) tensors, each its own allocation, as a cache holds them.
            key = kv[:, :, 0].transpose(1, 2).contiguous()
            value = kv[:, :, 1].transpose(1, 2).contiguous()
            yield key, value
            hidden = torch.tanh(hidden * self.scale[i])


class GenerationBlock(nn.Module):
    """One generation layer: rotary queries attend to the reasoner's K/V of this layer.

    ``cached_kv`` is the bespoke path's per-instance cache (branch -> pair), as upstream's
    ``cached_kv`` fields: it belongs to the module, not to a session.
    """

    def __init__(self, cfg: Cosmos3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.to_q = nn.Linear(cfg.model_dim, cfg.model_dim)
        self.to_out = nn.Linear(cfg.model_dim, cfg.model_dim)
        self.cached_kv: dict[str, KVPair] = {}

    def forward(self, x: torch.Tensor, rope: torch.Tensor, kv: KVPair) -> torch.Tensor:
        cfg = self.cfg
        b, n = x.shape[0], x.shape[1]
        q = self.to_q(x).view(b, n, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        q = apply_rope(q, rope)
        group = cfg.num_heads // cfg.num_kv_heads
        k = kv.key.repeat_interleave(group, dim=1)
        v = kv.value.repeat_interleave(group, dim=1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(cfg.head_dim), dim=-1)
        attn = (weights @ v).transpose(1, 2).reshape(b, n, cfg.model_dim)
        out: torch.Tensor = x + self.to_out(attn)
        return out


class GenerationTransformer(nn.Module):
    """Stand-in for the generation pathway: patchify, conditioned blocks, unpatchify.

    ``cached_rope`` and ``cached_kv_key`` are the bespoke path's per-instance fields.
    """

    def __init__(self, cfg: Cosmos3Config) -> None:
        super().__init__()
        self.cfg = cfg
        patch_dim = cfg.latent_channels * cfg.patch * cfg.patch
        self.proj_in = nn.Linear(patch_dim, cfg.model_dim)
        self.time = nn.Linear(1, cfg.model_dim)
        self.control = nn.Linear(cfg.control_dim, cfg.model_dim)
        self.context = nn.Linear(patch_dim, cfg.model_dim)
        self.blocks = nn.ModuleList(GenerationBlock(cfg) for _ in range(cfg.num_layers))
        self.proj_out = nn.Linear(cfg.model_dim, patch_dim)
        self.cached_rope: torch.Tensor | None = None
        self.cached_kv_key: Hashable | None = None

    def clear_cached_kv(self) -> None:
        """Drop every block's cached K/V (the bespoke path's reset)."""
        for block in self.blocks:
            assert isinstance(block, GenerationBlock)
            block.cached_kv = {}

    def forward(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        context: torch.Tensor,
        control: torch.Tensor,
        rope: torch.Tensor,
        kv: Sequence[KVPair],
    ) -> torch.Tensor:
        # A batch of B sessions: latents, context (B, C, T, H, W), control (B, D) or (D,) for
        # one, K/V (B, heads, L, d); sigma and the rotary tables are the batch's.
        x = self.proj_in(patchify(latents, self.cfg.patch))
        cond = self.time(sigma.reshape(1, 1)) + self.control(control.reshape(x.shape[0], -1))
        cond = cond + self.context(patchify(context, self.cfg.patch).mean(dim=1))
        x = torch.nn.functional.silu(x + cond[:, None])
        for block, pair in zip(self.blocks, kv, strict=True):
            x = block(x, rope, pair)
        return unpatchify(self.proj_out(x), latents.shape, self.cfg.patch)


def patchify(latents: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, T, H, W) -> (B, T * H/p * W/p, C * p * p)."""
    b, c, t, h, w = latents.shape
    x = latents.reshape(b, c, t, h // p, p, w // p, p)
    return x.permute(0, 2, 3, 5, 1, 4, 6).reshape(b, t * (h // p) * (w // p), c * p * p)


def unpatchify(tokens: torch.Tensor, shape: torch.Size, p: int) -> torch.Tensor:
    """The inverse of `patchify` for a latent of ``shape``."""
    b, c, t, h, w = shape
    x = tokens.reshape(b, t, h // p, w // p, c, p, p)
    return x.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, t, h, w)


def rope_freqs(num_tokens: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """Rotary cos/sin tables of the generation tokens: (2, num_tokens, head_dim // 2), float32."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(num_tokens, device=device).float(), inv)
    return torch.stack([angles.cos(), angles.sin()])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, N, d) by the tables of `rope_freqs`."""
    cos, sin = rope[0].to(x.dtype), rope[1].to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class Cosmos3Networks:
    """All networks of the pipeline, built once per process and shared by every session.

    Build it with `build_networks`.
    """

    def __init__(self, cfg: Cosmos3Config, device: torch.device | str) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(cfg.seed)
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                with torch.device(self.device):
                    self.reasoner = Reasoner(cfg)
                    self.transformer = GenerationTransformer(cfg)
            finally:
                torch.set_default_dtype(previous)
        for module in (self.reasoner, self.transformer):
            module.eval().requires_grad_(False)
        sigmas = torch.linspace(1.0, 0.0, cfg.num_inference_steps + 1, dtype=torch.float64)
        self.sigmas = sigmas.to(self.dtype).tolist()

    def tokenize(self, prompt: str) -> torch.Tensor:
        """Byte-level token ids, padded/truncated to ``text_len``: (1, L) int64, on the host."""
        ids = [b + 1 for b in prompt.encode("utf-8")][: self.cfg.text_len]
        ids += [0] * (self.cfg.text_len - len(ids))
        return torch.tensor([ids], dtype=torch.int64)

    @torch.no_grad()
    def encode_layers(self, tokens: torch.Tensor) -> Iterator[KVPair]:
        """The reasoner's K/V of ``tokens``, one `KVPair` per layer, computed lazily in order."""
        for key, value in self.reasoner.layer_kv(tokens.to(self.device)):
            yield KVPair(key, value)

    def rope(self) -> torch.Tensor:
        """The generation pathway's rotary tables (a pure function of the geometry)."""
        return rope_freqs(self.cfg.num_tokens, self.cfg.head_dim, self.device)

    def noise(self, key: RandomKey) -> tuple[torch.Tensor, RandomKey]:
        """A chunk's starting noise, drawn on the host from the session's ``key``, and the
        next key (`RandomKey.normal`; on the meta device nothing is drawn).

        >>> from sessionstate import RandomKey
        >>> from sessionstate.models.cosmos3 import Cosmos3Config
        >>> nets = build_networks(Cosmos3Config.preset("tiny"))
        >>> noise, key = nets.noise(RandomKey.seeded(0))
        >>> tuple(noise.shape), key.counter
        ((1, 4, 2, 4, 4), 1)
        """
        cfg = self.cfg
        shape = (1, cfg.latent_channels, cfg.chunk_frames, cfg.latent_height, cfg.latent_width)
        return key.normal(shape, dtype=self.dtype, device=self.device)

    def empty_context(self) -> torch.Tensor:
        """The context of a session's first chunk: one chunk of zeros."""
        cfg = self.cfg
        shape = (1, cfg.latent_channels, cfg.chunk_frames, cfg.latent_height, cfg.latent_width)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def velocity(
        self,
        latents: torch.Tensor,
        sigma: float,
        context: torch.Tensor,
        control: torch.Tensor,
        rope: torch.Tensor,
        kv: Sequence[KVPair],
    ) -> torch.Tensor:
        """One branch's flow velocity."""
        s = torch.tensor(sigma, dtype=self.dtype, device=self.device)
        out: torch.Tensor = self.transformer(latents, s, context, control, rope, kv)
        return out

    @torch.no_grad()
    def guided_velocity(
        self,
        latents: torch.Tensor,
        sigma: float,
        context: torch.Tensor,
        control: torch.Tensor,
        rope: torch.Tensor,
        cond: Sequence[KVPair],
        uncond: Sequence[KVPair],
    ) -> torch.Tensor:
        """Classifier-free guidance: ``uncond + scale * (cond - uncond)``."""
        v_cond = self.velocity(latents, sigma, context, control, rope, cond)
        v_uncond = self.velocity(latents, sigma, context, control, rope, uncond)
        return v_uncond + self.cfg.guidance_scale * (v_cond - v_uncond)


def build_networks(cfg: Cosmos3Config, device: torch.device | str = "cpu") -> Cosmos3Networks:
    """Build every network from its config with seeded random weights (no download).

    On ``device="meta"`` nothing is allocated; shapes and byte counts are still exact.

    >>> from sessionstate.models.cosmos3 import Cosmos3Config
    >>> nets = build_networks(Cosmos3Config.preset("deploy"), device="meta")
    >>> len(nets.transformer.blocks), next(nets.encode_layers(nets.tokenize("hi"))).key.shape
    (28, torch.Size([1, 4, 512, 128]))
    """
    return Cosmos3Networks(cfg, device)
