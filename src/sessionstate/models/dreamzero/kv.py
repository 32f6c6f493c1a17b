"""The denoiser's KV cache, kept two ways: mutable blocks per session, or an engine pool.

Both paths keep the window's KV in blocks of ``kv_block_tokens`` tokens and follow the same
rules, so they read bit-identical caches and hold the same bytes:

- a window (and a session) starts with an empty cache (upstream's ``_kv_create``);
- each step appends the KV of its clean reference latents (the prefill);
- leading blocks that hold only tokens older than the newest ``kv_window_frames`` latent
  frames are let go (a sliding attention window, block by block);
- the denoiser reads every token still held.

The bespoke path keeps a list of block tensors in its mutable state and writes into them in
place. The managed path keeps a `KVHandle` in the record, over a `KVPool` the pipeline owns
(see `sessionstate.KVPool` for when blocks return to the pool).
"""

from __future__ import annotations

import math

import torch

from sessionstate import KVHandle, KVPool
from sessionstate.models.dreamzero.config import DreamZeroConfig

__all__ = [
    "append_blocks",
    "append_handle",
    "build_kv_pool",
    "pool_blocks",
    "read_blocks",
    "window_tokens",
]


def pool_blocks(cfg: DreamZeroConfig, max_sessions: int) -> int:
    """Blocks a pipeline's pool holds: room for twice ``max_sessions`` full windows.

    The slack is for records kept by callers past their session's eviction and for a step in
    flight, whose new blocks exist before its predecessor's are released.

    >>> pool_blocks(DreamZeroConfig.preset("tiny"), 1)
    16
    """
    step_tokens = cfg.num_frame_per_block * cfg.frame_seqlen
    window_tokens = cfg.kv_window_frames * cfg.frame_seqlen
    per_handle = math.ceil(
        (window_tokens + cfg.kv_block_tokens + step_tokens) / cfg.kv_block_tokens
    )
    return 2 * (max_sessions + 1) * per_handle


def build_kv_pool(cfg: DreamZeroConfig, device: torch.device | str, max_sessions: int) -> KVPool:
    """The managed path's engine-owned KV pool on ``device`` (nothing allocated on ``meta``).

    >>> pool = build_kv_pool(DreamZeroConfig.preset("tiny"), "cpu", 1)
    >>> pool.num_blocks, pool.block_tokens, pool.token_shape
    (16, 16, (1, 2, 2, 8))
    """
    return KVPool(
        pool_blocks(cfg, max_sessions),
        block_tokens=cfg.kv_block_tokens,
        token_shape=cfg.kv_token_shape,
        dtype=cfg.torch_dtype,
        device=device,
        name="dreamzero_kv",
    )


def window_tokens(cfg: DreamZeroConfig) -> int:
    """Tokens of the attention window: ``kv_window_frames`` latent frames."""
    return cfg.kv_window_frames * cfg.frame_seqlen


def append_handle(
    pool: KVPool, handle: KVHandle | None, kv: torch.Tensor, cfg: DreamZeroConfig
) -> KVHandle:
    """Managed: a new handle with ``kv`` appended (to an empty cache when ``handle`` is None).

    A handle of another pipeline's pool (a record moved between pipelines) is copied in first.
    """
    start = pool.empty() if handle is None else pool.adopt(handle)
    return pool.append(start, kv, window=window_tokens(cfg))


def append_blocks(
    blocks: list[torch.Tensor], tokens: int, kv: torch.Tensor, cfg: DreamZeroConfig
) -> int:
    """Bespoke: write ``kv`` into the block list in place; return the new token count.

    >>> cfg = DreamZeroConfig.preset("tiny")
    >>> blocks: list[torch.Tensor] = []
    >>> append_blocks(blocks, 0, torch.zeros(56, *cfg.kv_token_shape), cfg), len(blocks)
    (40, 3)
    """
    bt = cfg.kv_block_tokens
    written = 0
    while written < kv.shape[0]:
        offset = tokens % bt
        if offset == 0:
            blocks.append(kv.new_zeros((bt, *cfg.kv_token_shape)))
        take = min(bt - offset, kv.shape[0] - written)
        blocks[-1][offset : offset + take] = kv[written : written + take]
        written += take
        tokens += take
    while blocks and tokens - bt >= window_tokens(cfg):
        blocks.pop(0)
        tokens -= bt
    return tokens


def read_blocks(blocks: list[torch.Tensor], tokens: int) -> torch.Tensor:
    """Bespoke: the cache's tokens gathered, exactly as `KVPool.read` gathers a handle's."""
    return torch.cat(blocks)[:tokens]
