"""The snapshot codec of `KVHandle` leaves: the blocks they reach, saved once, and back.

`snapshot_payload` and `restore_handles` are what `KVHandle.__sessionstate_snapshot__` and
`KVHandle.__sessionstate_restore__` return: a snapshot stores, per pool, only the blocks its
handles reach, and restores them into standalone pools of just those blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from sessionstate._errors import StaleKVHandleError

if TYPE_CHECKING:
    from sessionstate._kvpool import KVHandle, KVPool

__all__ = ["restore_handles", "snapshot_payload"]


def snapshot_payload(leaves: Sequence[tuple[str, KVHandle]]) -> dict[str, Any]:
    """The snapshot payload of ``leaves``: per pool its blocks' data, per handle its facts.

    A block reached by several handles is stored once, holding the tokens the longest of
    them reads; tokens past that (another branch's) are stored as zeros.

    Raises:
        StaleKVHandleError: for a handle made by a step that was rolled back.

    >>> from sessionstate import KVPool
    >>> pool = KVPool(4, block_tokens=2, token_shape=(3,))
    >>> handle = pool.append(pool.empty(), torch.ones(3, 3))
    >>> payload = snapshot_payload([("kv", handle)])
    >>> payload["handles"], tuple(payload["pools"][0]["blocks"].shape)
    ([{'pool': 0, 'blocks': [0, 1], 'tokens': 3}], (2, 2, 3))
    """
    pools: list[KVPool] = []
    slots: list[dict[int, int]] = []  # per pool: block id -> index in its saved blocks
    fills: list[list[int]] = []  # per pool and saved block: tokens the handles read
    handles: list[dict[str, Any]] = []
    for key, handle in leaves:
        if not handle.alive:
            msg = (
                f"Cannot snapshot the leaf at `{key}`: {handle!r} was made by a step that "
                f"failed and was rolled back, so its blocks went back to KV pool "
                f"{handle.pool.name!r}. Snapshot the session's stored record instead."
            )
            raise StaleKVHandleError(msg)
        pool = handle.pool
        g = next((i for i, p in enumerate(pools) if p is pool), None)
        if g is None:
            g = len(pools)
            pools.append(pool)
            slots.append({})
            fills.append([])
        local = []
        for j, block in enumerate(handle.blocks):
            fill = min(pool.block_tokens, handle.tokens - j * pool.block_tokens)
            slot = slots[g].setdefault(block, len(fills[g]))
            if slot == len(fills[g]):
                fills[g].append(fill)
            fills[g][slot] = max(fills[g][slot], fill)
            local.append(slot)
        handles.append({"pool": g, "blocks": local, "tokens": handle.tokens})
    saved = []
    for pool, slot_of, filled in zip(pools, slots, fills, strict=True):
        with pool._lock:
            index = torch.tensor(list(slot_of), dtype=torch.long, device=pool.storage.device)
            data = pool.storage.index_select(0, index)  # a copy of just these blocks
        for slot, fill in enumerate(filled):
            data[slot, fill:].zero_()
        saved.append(
            {
                "name": pool.name,
                "block_tokens": pool.block_tokens,
                "token_shape": list(pool.token_shape),
                "dtype": str(pool.storage.dtype).removeprefix("torch."),
                "blocks": data,
            }
        )
    return {"pools": saved, "handles": handles}


def restore_handles(payload: Any, pool_type: type[KVPool]) -> list[KVHandle]:
    """The handles a snapshot payload describes, over standalone pools of their blocks.

    Raises:
        ValueError: for a payload that does not describe valid handles.

    >>> from sessionstate import KVPool
    >>> pool = KVPool(4, block_tokens=2, token_shape=(3,))
    >>> handle = pool.append(pool.empty(), torch.ones(3, 3))
    >>> (back,) = restore_handles(snapshot_payload([("kv", handle)]), KVPool)
    >>> torch.equal(back.read(), handle.read())
    True
    """
    if not isinstance(payload, Mapping):
        raise ValueError(f"the payload is a {type(payload).__name__}, not a dict")
    saved = payload.get("pools")
    if not isinstance(saved, list):
        raise ValueError("the payload has no pool list")
    pools = [_pool_from_snapshot(pool_type, i, p) for i, p in enumerate(saved)]
    held = [int(p["blocks"].shape[0]) for p in saved]
    out: list[KVHandle] = []
    claimed: list[dict[int, int]] = [{} for _ in pools]
    facts = payload.get("handles")
    if not isinstance(facts, list):
        raise ValueError("the payload has no handle list")
    for i, fact in enumerate(facts):
        problem = _handle_problem(fact, pools, held)
        if problem is not None:
            raise ValueError(f"handle {i} {problem}: {fact!r:.120}")
        pool = pools[fact["pool"]]
        bt = pool.block_tokens
        for j, block in enumerate(fact["blocks"]):
            fill = min(bt, fact["tokens"] - j * bt)
            claimed[fact["pool"]][block] = max(claimed[fact["pool"]].get(block, 0), fill)
        out.append(pool._handle(tuple(fact["blocks"]), fact["tokens"]))
    for pool, filled in zip(pools, claimed, strict=True):
        pool._settle(filled)
    return out


def _handle_problem(fact: Any, pools: Sequence[KVPool], held: Sequence[int]) -> str | None:
    """Why a saved handle's facts are invalid, or None."""
    if not isinstance(fact, Mapping):
        return "is not a dict"
    pool, blocks, tokens = fact.get("pool"), fact.get("blocks"), fact.get("tokens")
    if type(pool) is not int or not 0 <= pool < len(pools):
        return "names no saved pool"
    if type(tokens) is not int or tokens < 0 or not isinstance(blocks, list):
        return "has no valid token count or block list"
    bt = pools[pool].block_tokens
    if any(type(b) is not int or not 0 <= b < held[pool] for b in blocks):
        return "names a block its pool does not hold"
    if len(set(blocks)) != len(blocks) or len(blocks) != -(-tokens // bt):
        return f"holds {len(blocks)} blocks for {tokens} tokens of {bt} per block"
    return None


def _pool_from_snapshot(pool_type: type[KVPool], i: int, saved: Any) -> KVPool:
    """A standalone pool holding the saved blocks of pool ``i`` of a snapshot payload.

    The pool holds exactly the saved blocks, so it takes no more memory than the snapshot's
    storage of them (the blocks must not overlap: an expanded view of one block would declare
    blocks the file does not hold); a saved pool of no blocks gets one block.
    """
    data = saved.get("blocks") if isinstance(saved, Mapping) else None
    name, bt = (saved.get("name"), saved.get("block_tokens")) if data is not None else (0, 0)
    shape = saved.get("token_shape") if data is not None else None
    ok = (
        isinstance(data, torch.Tensor)
        and isinstance(name, str)
        and type(bt) is int
        and bt > 0
        and isinstance(shape, list)
        and all(type(n) is int and n >= 0 for n in shape)
        and data.dim() == 2 + len(shape)
        and tuple(data.shape[1:]) == (bt, *shape)
        and saved.get("dtype") == str(data.dtype).removeprefix("torch.")
    )
    if not ok:
        raise ValueError(f"pool {i} is not a valid saved KV pool: {_describe(saved)}")
    assert isinstance(data, torch.Tensor)
    assert isinstance(shape, list)
    assert isinstance(name, str)
    assert isinstance(bt, int)
    if not data.is_contiguous():
        msg = (
            f"pool {i} ({name!r}) declares {data.shape[0]} blocks as a view with strides "
            f"{data.stride()} that overlaps itself, more blocks than the file holds"
        )
        raise ValueError(msg)
    n = int(data.shape[0])
    try:
        pool = pool_type(
            max(n, 1),
            block_tokens=bt,
            token_shape=shape,
            dtype=data.dtype,
            device=data.device,
            name=name,
        )
    except RuntimeError as exc:  # one block of a saved pool with none: too large to allocate
        msg = f"pool {i} ({name!r}) has blocks of shape {(bt, *shape)} that cannot be allocated"
        raise ValueError(msg) from exc
    pool.storage[:n].copy_(data)
    return pool


def _describe(saved: Any) -> str:
    """A saved pool for a message: its keys and values, tensors by shape and dtype only."""
    if not isinstance(saved, Mapping):
        return f"{saved!r:.80}"
    parts = []
    for k, v in saved.items():
        shown = f"tensor{list(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else f"{v!r:.40}"
        parts.append(f"{k!r}: {shown}")
    return "{" + ", ".join(parts) + "}"
