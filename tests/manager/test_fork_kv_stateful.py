"""A hypothesis machine over forks of sessions holding KV: the sharing graph and the pool.

Random sequences of create / fork / step / drop / park a session's KV / read a session back /
family snapshot and restore, against a model that knows each session's history chunks by
number (a fork takes its source's, a step adds a new one, with one KV block) and its KV
tokens. After every operation: each session's `shared_with` is exactly the sessions the model
says share a chunk with it (the sharing graph), its KV reads back as the model says, the byte
counts equal a recount, the pool's free blocks are its total less the blocks the live handles
hold, each block once, and those are exactly one per chunk the resident sessions hold: a
family parked and read back in any order shares its K/V blocks as before.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from sessionstate import KVCache, KVPool, LatentBuffer, SessionState, SessionStateManager
from tests.support import assert_stats_equal_a_recount

TOKENS = 2  # a step appends one full block: branches share every block written before


class ForkKVMachine(RuleBasedStateMachine):
    sessions = Bundle("sessions")

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp())
        self.pool = KVPool(64, block_tokens=TOKENS, token_shape=(), name="kv")
        self.m: SessionStateManager[SessionState] = SessionStateManager(pools=(self.pool,))
        self.chunks: dict[str, list[int]] = {}  # history chunk numbers per session
        self.kv: dict[str, list[float]] = {}  # KV tokens per session
        self.next_id = 0
        self.next_chunk = 0

    def _id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def _chunk(self) -> int:
        self.next_chunk += 1
        return self.next_chunk

    def _grow(self, state: SessionState, sid: str, value: float) -> SessionState:
        chunk = self._chunk()
        history = state.object("history", LatentBuffer).commit(torch.full((1, 2), float(chunk)))
        kv = state.object("kv", KVCache).append(self.pool, torch.full((TOKENS,), value))
        self.chunks[sid] = [*self.chunks.get(sid, []), chunk]
        self.kv[sid] = [*self.kv.get(sid, []), *[value] * TOKENS]
        return state.with_values({"history": history, "kv": kv})

    @rule(target=sessions, value=st.floats(-4, 4, width=16))
    def create(self, value: float) -> str:
        sid = self._id()
        empty = SessionState(
            objects={
                "history": LatentBuffer(name="history", dim=0).allocate(),
                "kv": KVCache(name="kv").allocate(),
            }
        )
        self.chunks[sid], self.kv[sid] = [], []
        self.m.put(sid, self._grow(empty, sid, value))
        return sid

    @rule(target=sessions, source=sessions)
    def fork(self, source: str) -> str:
        if source not in self.chunks:
            return source
        sid = self._id()
        self.m.fork(source, sid)
        self.chunks[sid] = list(self.chunks[source])
        self.kv[sid] = list(self.kv[source])
        return sid

    @rule(sid=sessions, value=st.floats(-4, 4, width=16))
    def step(self, sid: str, value: float) -> None:
        if sid not in self.chunks:
            return
        self.m.step(sid, lambda s: (self._grow(s, sid, value), None), new=SessionState)

    @rule(sid=sessions)
    def park_kv(self, sid: str) -> None:
        if sid not in self.chunks:
            return
        others = [o for o in self.chunks if o != sid]
        self.m.park_until(lambda: False, frees=self.pool.owns_entry, keep=others)

    @rule(sid=sessions)
    def read(self, sid: str) -> None:
        if sid in self.chunks:
            state = self.m.get(sid)  # unparked, if parked
            assert state is not None
            assert state.object("kv", KVCache).read().tolist() == self.kv[sid]

    @rule(sid=consumes(sessions))
    def drop(self, sid: str) -> None:
        if sid in self.chunks:
            self.m.drop(sid)
            del self.chunks[sid], self.kv[sid]

    @rule(data=st.data())
    def family_snapshot(self, data: st.DataObject) -> None:
        held = sorted(self.chunks)
        if not held:
            return
        ids = data.draw(st.lists(st.sampled_from(held), min_size=1, unique=True))
        path = self.folder / "family.safetensors"
        self.m.snapshot_many(ids, path)
        other_pool = KVPool(64, block_tokens=TOKENS, token_shape=(), name="kv")
        other: SessionStateManager[SessionState] = SessionStateManager(pools=(other_pool,))
        other.restore_many(path)
        for sid in ids:
            got = other.peek(sid)
            assert got is not None
            assert got.object("kv", KVCache).view().read().tolist() == self.kv[sid]
            # The family's sharing comes back with it.
            want = {o for o in ids if o != sid and set(self.chunks[o]) & set(self.chunks[sid])}
            assert set(other.session_stats(sid)["shared_with"]) == want

    @invariant()
    def the_sharing_graph_is_the_models(self) -> None:
        for sid, chunks in self.chunks.items():
            want = {o for o, c in self.chunks.items() if o != sid and set(c) & set(chunks)}
            assert set(self.m.session_stats(sid)["shared_with"]) == want, sid

    @invariant()
    def every_kv_reads_as_the_model_says(self) -> None:
        for sid, tokens in self.kv.items():
            state = self.m.peek(sid, on_host=True)
            assert state is not None
            assert state.object("kv", KVCache).view().read().tolist() == tokens, sid

    @invariant()
    def the_pool_holds_each_resident_chunks_block_once(self) -> None:
        held: set[int] = set()
        chunks: set[int] = set()
        for sid in self.chunks:
            state = self.m.peek(sid)
            assert state is not None
            if "kv" in state.parked:
                continue
            held.update(state.object("kv", KVCache).view().blocks)
            chunks.update(self.chunks[sid])
        assert self.pool.free_blocks == self.pool.num_blocks - len(held)
        assert len(held) == len(chunks)  # one block per chunk: siblings share theirs
        assert_stats_equal_a_recount(self.m)


TestForkKVMachine = ForkKVMachine.TestCase
