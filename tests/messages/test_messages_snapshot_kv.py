"""Every message of snapshots holding a `KVHandle` (a leaf saved by its class), pinned."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from sessionstate import (
    KVHandle,
    KVPool,
    SessionState,
    SnapshotError,
    StaleKVHandleError,
    dumps_state,
    loads_state,
)
from sessionstate._storage import register_snapshot_leaf
from tests.support import rewrite

NAME = "sessionstate._kvpool:KVHandle"


def _snapshot() -> bytes:
    pool = KVPool(4, block_tokens=4, token_shape=(2,), name="kv")
    handle = pool.append(pool.empty(), torch.ones(6, 2))
    return dumps_state(SessionState(attrs={"kv": handle}))


def test_a_rolled_back_handle_is_refused_at_save() -> None:
    pool = KVPool(2, block_tokens=2, token_shape=(), name="kv")
    dead: list[KVHandle] = []

    def failing_step() -> None:
        with pool.transaction():
            dead.append(pool.append(pool.empty(), torch.zeros(3)))
            raise RuntimeError("step failed")

    with pytest.raises(RuntimeError, match="step failed"):
        failing_step()
    msg = (
        "Cannot snapshot the leaf at `attrs['kv']`: KVHandle(pool='kv', blocks=(0, 1), "
        "tokens=3) was made by a step that failed and was rolled back, so its blocks went back "
        "to KV pool 'kv'. Snapshot the session's stored record instead."
    )
    with pytest.raises(StaleKVHandleError, match=re.escape(msg)):
        dumps_state(SessionState(attrs={"kv": dead[0]}))


def test_registering_a_class_without_the_methods() -> None:
    class Handle:
        @classmethod
        def __sessionstate_snapshot__(cls, leaves: object) -> object:
            return None

    msg = (
        f"Cannot register {Handle!r} (type) as a snapshot leaf: it must be a class defining "
        "the class methods `__sessionstate_restore__`; define them (see "
        "`register_snapshot_leaf`) or keep its values out of snapshots."
    )
    with pytest.raises(TypeError, match=re.escape(msg)):
        register_snapshot_leaf(Handle)


def test_an_unregistered_leaf_class_is_refused_at_load() -> None:
    def rename(doc: dict[str, Any]) -> None:
        doc["leaves"] = {"mypkg.engine:Handle": doc["leaves"].pop(NAME)}
        doc["tree"]["fields"]["attrs"]["items"][0][1]["class"] = "mypkg.engine:Handle"

    msg = (
        "Snapshot (bytes) holds leaves of class `mypkg.engine:Handle`, which is not registered "
        "as a snapshot leaf in this process; import the module that defines it before loading "
        "(only classes registered with `register_snapshot_leaf` are rebuilt; a loader imports "
        "no module outside `sessionstate`)."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(rewrite(_snapshot(), rename))


def test_inconsistent_handle_facts_are_refused_at_load() -> None:
    def stretch(doc: dict[str, Any]) -> None:
        handles = dict(doc["leaves"][NAME]["items"])["handles"]
        handles["items"][0]["items"][2][1]["value"] = 20

    msg = (
        "Snapshot (bytes) holds `KVHandle` leaves that their class refuses to restore "
        "(ValueError: handle 0 holds 2 blocks for 20 tokens of 4 per block: {'pool': 0, "
        "'blocks': [0, 1], 'tokens': 20}); load it with the library version that wrote it, or "
        "write it again."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(rewrite(_snapshot(), stretch))


def test_a_leaf_without_its_payload_is_refused_at_load() -> None:
    msg = (
        "Snapshot (bytes) has an invalid node at `attrs['kv']` (leaf of class "
        "'sessionstate._kvpool:KVHandle' without a payload); write it again."
    )
    with pytest.raises(SnapshotError, match=re.escape(msg)):
        loads_state(rewrite(_snapshot(), lambda doc: doc.pop("leaves")))
