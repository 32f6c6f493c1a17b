"""Snapshots save a `KVHandle` by value: its tokens, over a standalone pool when loaded."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import sessionstate as ss
from sessionstate import KVHandle, KVPool, SessionState, dumps_state, loads_state, tree_equal


def _pool(name: str = "kv", blocks: int = 8) -> KVPool:
    return KVPool(blocks, block_tokens=4, token_shape=(2, 3), dtype=torch.bfloat16, name=name)


def _tokens(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 3, generator=g).to(torch.bfloat16)


def _plain(node: dict[str, Any]) -> Any:
    """A snapshot's JSON node as a plain value; a tensor as ``("view", index)``."""
    kind = node["type"]
    if kind == "tensor":
        return ("view", node["view"])
    if kind == "list":
        return [_plain(v) for v in node["items"]]
    if kind == "dict":
        return {k: _plain(v) for k, v in node["items"]}
    return node["value"]


def test_handle_round_trip_reads_the_same_tokens_over_a_standalone_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = _pool()
    handle = pool.append(pool.empty(), _tokens(10, 0))
    state = SessionState(attrs={"kv": handle, "step": 3})
    path = tmp_path / "s.safetensors"
    ss.save_state(state, path)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the snapshot loader unpickled")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    loaded = ss.load_state(path, expect=SessionState)
    got = loaded.attrs["kv"]
    assert isinstance(got, KVHandle)
    assert got.pool is not pool
    assert (got.pool.name, got.pool.num_blocks, got.pool.free_blocks) == ("kv", 3, 0)
    assert (got.pool.block_tokens, got.pool.token_shape) == (4, (2, 3))
    assert got.pool.storage.dtype == torch.bfloat16
    assert (got.blocks, got.tokens) == ((0, 1, 2), 10)
    assert tree_equal(loaded, state)
    assert torch.equal(got.read(), handle.read())
    assert ss.nbytes_by_device(loaded) == ss.nbytes_by_device(state) == {"cpu": 3 * 4 * 6 * 2}
    with safe_open(str(path), framework="pt") as f:
        document = json.loads(f.metadata()["sessionstate"])
    assert document["format_version"] == 4
    saved = document["leaves"]["sessionstate._kvpool:KVHandle"]
    payload = _plain(saved)
    view = document["views"][payload["pools"][0].pop("blocks")[1]]
    assert payload == {
        "pools": [{"name": "kv", "block_tokens": 4, "token_shape": [2, 3], "dtype": "bfloat16"}],
        "handles": [{"pool": 0, "blocks": [0, 1, 2], "tokens": 10}],
    }
    assert (view["dtype"], view["shape"]) == ("bfloat16", [3, 4, 2, 3])
    assert document["tree"]["fields"]["attrs"]["items"][0][1] == {
        "type": "leaf",
        "class": "sessionstate._kvpool:KVHandle",
        "index": 0,
    }


def test_a_handle_reads_different_tokens_after_a_round_trip_is_unequal() -> None:
    pool = _pool()
    handle = pool.append(pool.empty(), _tokens(5, 0))
    other = pool.append(pool.empty(), _tokens(5, 1))
    assert not tree_equal(loads_state(dumps_state({"kv": handle})), {"kv": other})


def test_shared_blocks_are_stored_once_and_shared_again() -> None:
    pool = _pool()
    base = pool.append(pool.empty(), _tokens(6, 0))  # blocks 0, 1 (block 1 half full)
    longer = pool.append(base, _tokens(1, 1))  # writes into block 1 past base's end
    branch = pool.append(base, _tokens(3, 2))  # copies block 1's prefix (copy on write)
    stranger = pool.append(pool.empty(), _tokens(4, 3))  # in the pool, not in the snapshot
    state = SessionState(attrs={"base": base, "longer": longer, "branch": branch})
    loaded = loads_state(dumps_state(state), expect=SessionState)
    got = {k: loaded.attrs[k] for k in ("base", "longer", "branch")}
    assert tree_equal(loaded, state)
    assert all(h.pool is got["base"].pool for h in got.values())
    assert got["base"].blocks == got["longer"].blocks[:2]
    assert got["branch"].blocks[0] == got["base"].blocks[0]
    assert got["base"].pool.num_blocks == 4  # 0, 1, the branch's copy of 1, and its next
    assert ss.nbytes_by_device(loaded) == ss.nbytes_by_device(state)
    del stranger

    # The loaded pool knows block 1 was written past `base`'s end: appending copies it.
    del loaded, branch
    loaded_base, loaded_longer = got.pop("base"), got.pop("longer")
    got.clear()  # the loaded branch's blocks go back to the free list
    assert loaded_base.pool.free_blocks == 2
    again = loaded_base.pool.append(loaded_base, _tokens(1, 4))
    assert again.blocks[1] != loaded_base.blocks[1]
    assert torch.equal(loaded_longer.read(), longer.read())
    assert torch.equal(again.read()[:6], base.read())


def test_only_the_handles_tokens_are_saved() -> None:
    pool = _pool()
    base = pool.append(pool.empty(), _tokens(2, 0))
    other_branch = pool.append(base, _tokens(2, 1))  # fills block 0 past base's end
    data = dumps_state({"kv": base})
    stored = loads_state(data)["kv"].pool.storage
    assert torch.equal(stored[0, :2], base.read())
    assert not stored[0, 2:].any()  # the other branch's tokens are not in the snapshot
    assert torch.equal(other_branch.read()[:2], base.read())


def test_empty_and_windowed_handles_round_trip() -> None:
    pool = _pool()
    windowed = pool.append(pool.empty(), _tokens(13, 0), window=5)
    state = {"empty": pool.empty(), "windowed": windowed, "none": None}
    loaded = loads_state(dumps_state(state))
    assert tree_equal(loaded, state)
    assert loaded["empty"].tokens == 0
    assert loaded["empty"].nbytes_by_device() == {}
    assert loaded["windowed"].blocks == (0, 1)
    assert ss.nbytes_by_device(loaded) == ss.nbytes_by_device(state)


def test_handles_of_two_pools_load_over_two_pools() -> None:
    a, b = _pool("a"), _pool("b")
    ha = a.append(a.empty(), _tokens(3, 0))
    hb = b.append(b.empty(), _tokens(5, 1))
    loaded = loads_state(dumps_state([ha, hb, ha]))
    assert tree_equal(loaded, [ha, hb, ha])
    assert loaded[0] is loaded[2]  # one handle reached twice loads as one
    assert (loaded[0].pool.name, loaded[1].pool.name) == ("a", "b")
    assert loaded[0].pool is not loaded[1].pool


def test_a_pipeline_pool_adopts_a_loaded_handle() -> None:
    pool = _pool()
    handle = pool.append(pool.empty(), _tokens(7, 0))
    loaded = loads_state(dumps_state({"kv": handle}))["kv"]
    engine = _pool("engine")
    adopted = engine.adopt(loaded)
    assert adopted.pool is engine
    assert adopted == handle
    assert torch.equal(
        engine.append(adopted, _tokens(2, 1)).read(), torch.cat([handle.read(), _tokens(2, 1)])
    )


def test_inspect_counts_a_handles_blocks(tmp_path: Path) -> None:
    pool = _pool()
    handle = pool.append(pool.empty(), _tokens(5, 0))
    path = tmp_path / "s.safetensors"
    ss.save_state(SessionState(attrs={"kv": handle, "step": 1}), path)
    report = ss._storage.inspect_snapshot(path)
    rows = {row["name"]: row for row in report["values"]}
    assert report["format_version"] == 4
    assert rows["kv"]["structure"] == "KVHandle"
    assert rows["kv"]["nbytes"] == handle.nbytes_by_device()
    assert rows["step"]["nbytes"] == {}
