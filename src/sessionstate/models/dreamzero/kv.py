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

# The variable is not a public name yet; its one home is `_env`.
from sessionstate.models._kit import ENV_KV_POOL_BYTES, session_blocks
from sessionstate.models.dreamzero.config import DreamZeroConfig

__all__ = [
    "append_blocks",
    "append_handle",
    "block_nbytes",
    "build_kv_pool",
    "default_pool_bytes",
    "handle_blocks",
    "pool_blocks",
    "read_blocks",
    "resident_sessions",
    "step_tokens",
    "window_tokens",
]


def handle_blocks(cfg: DreamZeroConfig) -> int:
    """Blocks one session's handle can hold at once: a full window, a partial block, a step.

    >>> handle_blocks(DreamZeroConfig.preset("tiny"))
    4
    """
    return session_blocks(cfg.kv_block_tokens, step_tokens(cfg), window_tokens(cfg))


def step_tokens(cfg: DreamZeroConfig) -> int:
    """Tokens one step appends to a session's KV: a block of latent frames."""
    return cfg.num_frame_per_block * cfg.frame_seqlen


def block_nbytes(cfg: DreamZeroConfig) -> int:
    """Bytes of one KV block: ``kv_block_tokens`` tokens of `DreamZeroConfig.kv_token_shape`.

    >>> block_nbytes(DreamZeroConfig.preset("tiny"))
    2048
    """
    itemsize = torch.empty((), dtype=cfg.torch_dtype, device="meta").element_size()
    return cfg.kv_block_tokens * math.prod(cfg.kv_token_shape) * itemsize


def default_pool_bytes(cfg: DreamZeroConfig, max_sessions: int) -> int:
    """The pool's bytes when no figure is given: room for twice ``max_sessions`` windows.

    The slack is for records kept by callers past their session's eviction and for a step in
    flight, whose new blocks exist before its predecessor's are released. Give
    ``session_state_kv_pool_bytes`` at a deploy geometry: there this figure is far more than
    a device holds.

    >>> default_pool_bytes(DreamZeroConfig.preset("tiny"), 1) // 2048
    16
    """
    return 2 * (max_sessions + 1) * handle_blocks(cfg) * block_nbytes(cfg)


def pool_blocks(cfg: DreamZeroConfig, nbytes: int) -> int:
    """The whole blocks ``nbytes`` holds.

    Raises:
        ValueError: if they cannot hold one session's window, giving the bytes it needs.

    >>> pool_blocks(DreamZeroConfig.preset("tiny"), 10_000)
    4
    """
    block, need = block_nbytes(cfg), handle_blocks(cfg)
    blocks = nbytes // block
    if blocks < need:
        msg = (
            f"A DreamZero KV pool of {nbytes} bytes holds {blocks} blocks of {block} bytes, "
            f"but one session's window needs {need} blocks ({need * block} bytes); set "
            f"`session_state_kv_pool_bytes` (or {ENV_KV_POOL_BYTES}) to at least "
            f"{need * block}."
        )
        raise ValueError(msg)
    return blocks


def resident_sessions(cfg: DreamZeroConfig, num_blocks: int) -> int:
    """Sessions whose full windows a pool of ``num_blocks`` blocks holds at once.

    >>> resident_sessions(DreamZeroConfig.preset("tiny"), 16)
    4
    """
    return num_blocks // handle_blocks(cfg)


def build_kv_pool(cfg: DreamZeroConfig, device: torch.device | str, nbytes: int) -> KVPool:
    """The managed path's engine-owned KV pool of ``nbytes`` on ``device`` (none on ``meta``).

    Raises:
        ValueError: if ``nbytes`` cannot hold one session's window (see `pool_blocks`).

    >>> pool = build_kv_pool(DreamZeroConfig.preset("tiny"), "cpu", 32 * 1024)
    >>> pool.num_blocks, pool.block_tokens, pool.token_shape
    (16, 16, (1, 2, 2, 8))
    """
    return KVPool(
        pool_blocks(cfg, nbytes),
        block_tokens=cfg.kv_block_tokens,
        token_shape=cfg.kv_token_shape,
        dtype=cfg.torch_dtype,
        device=device,
        name="dreamzero_kv",
        step_tokens=step_tokens(cfg),
        window_tokens=window_tokens(cfg),
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
